"""The repository's ``kernels/`` folder (installed as ``radixkv.kernels``) must not shadow the
``kernels`` distribution (Hugging Face hub kernels) when the repository root is on ``sys.path``,
as it is for ``python -m pytest`` or a server started from it: transformers >= 5.25 requires
that distribution and imports it at import time, so the shadowing broke every test module
importing transformers; older transformers imports a ``kernels`` it finds without metadata to
read its version, so where the distribution is absent the folder must import, empty.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_top_level_kernels_import_from_the_repository_root() -> None:
    # `python -c` puts the working directory first on sys.path: the shadowing case.
    proc = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__); "
                           "print(hasattr(kernels, '__version__'), hasattr(kernels, 'extend_attention'))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        # Not installed: the folder's module stays empty (no version, none of radixkv's functions),
        # which transformers' availability check reads as "not installed".
        assert proc.stdout.split() == [str(ROOT / "kernels" / "__init__.py"), "False", "False"], proc.stdout
        return
    loaded = Path(proc.stdout.split()[0]).resolve()
    # the distribution's package (a virtualenv may sit inside the repository), not this folder
    assert loaded.parent.name == "kernels" and "site-packages" in loaded.parts, loaded
    assert loaded != ROOT / "kernels" / "__init__.py"


def test_transformers_kernels_check_from_the_repository_root() -> None:
    # What a server started from the repository root runs (and vLLM's, beside it, without
    # radixkv imported): transformers' hub-kernels integration checks for the distribution at
    # import; an ImportError from this folder there stopped both servers.
    code = ("import transformers.integrations.hub_kernels as h; "
            "from transformers.utils.import_utils import is_kernels_available; print(is_kernels_available())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert proc.stdout.split()[-1] == "False", proc.stdout


def test_radixkv_kernels_is_still_this_folder() -> None:
    import radixkv.kernels

    assert Path(radixkv.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert radixkv.kernels.__all__ == ["paged_kv_write", "extend_attention", "decode_attention"]


def test_bench_on_sys_path_does_not_shadow_the_distribution() -> None:
    # A bench driver puts bench/ first on sys.path; bench/kernels.py must not then be what
    # `import kernels` (transformers' import of the distribution) finds.
    code = ("import sys, radixkv; sys.path[:0] = ['bench', '.']; import importlib.util; "
            "spec = importlib.util.find_spec('kernels'); print(spec.origin if spec else None)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    origin = proc.stdout.strip()
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        # not installed: an empty stand-in with no file, not bench/kernels.py run as `kernels`
        assert origin == "None", origin
        code = ("import sys, radixkv; sys.path[:0] = ['bench', '.']; import kernels; "
                "from transformers.utils.import_utils import _is_package_available as a; "
                "print(sorted(k for k in vars(kernels) if not k.startswith('__')), a('kernels', return_version=True))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "[] (False, 'N/A')", proc.stdout
        return
    assert "site-packages" in Path(origin).parts and Path(origin).parent.name == "kernels", origin
