"""``radixkv serve --kv-store …``: bad values and an unreachable Mooncake master are refused
before the model loads, in one line, exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from radixkv.cli import build_parser
from tests.mooncake_harness import free_port, require_mooncake

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("value,message", [
    ("host:0", "kv_store (host capacity in GiB): must be a positive number"),
    ("host:1?policy=bogus", "kv_store: host tier policy: unknown policy 'bogus'"),
    ("host:1?policy=belady", "offline oracle"),
    ("redis://x", "kv_store: expected host:GIB or mooncake://"),
])
def test_bad_kv_store_values_are_refused_at_parsing(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--kv-store", value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unreachable_master_is_reported_before_the_model_loads():
    require_mooncake()
    dead = free_port()
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "radixkv.cli", "serve", "--port", str(free_port()), "--kv-store",
         f"mooncake://127.0.0.1:{dead}?metadata=http://127.0.0.1:{free_port()}/metadata"
         f"&local=127.0.0.1:{free_port()}", "--kv-store-connect-timeout", "0"],
        capture_output=True, text=True, env=ENV, timeout=120)
    elapsed_s = time.monotonic() - started
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("radixkv serve:")]
    assert lines == [f"radixkv serve: kv_store mooncake: master unreachable (master "
                     f"127.0.0.1:{dead}, metadata " + lines[0].split("metadata ", 1)[1]]
    assert lines[0].endswith("); start mooncake_master first, or wait longer with "
                             "--kv-store-connect-timeout")
    assert "Traceback" not in proc.stderr and "model_loaded" not in proc.stderr
    assert elapsed_s < 30
