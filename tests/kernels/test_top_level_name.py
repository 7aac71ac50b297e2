"""The repository's ``kernels/`` folder (installed as ``radixkv.kernels``) must not shadow the
``kernels`` distribution (Hugging Face hub kernels) when the repository root is on ``sys.path``,
as it is for ``python -m pytest`` run from it: transformers >= 5.25 requires that distribution
and imports it at import time, so the shadowing broke every test module importing transformers.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_top_level_kernels_import_from_the_repository_root() -> None:
    # `python -c` puts the working directory first on sys.path: the shadowing case.
    proc = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        # Not installed: a clear error naming what the folder is, not radixkv's module.
        assert proc.returncode == 1, proc.stdout
        assert "radixkv's kernels/ source folder" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    loaded = Path(proc.stdout.strip()).resolve()
    # the distribution's package (a virtualenv may sit inside the repository), not this folder
    assert loaded.parent.name == "kernels" and "site-packages" in loaded.parts, loaded
    assert loaded != ROOT / "kernels" / "__init__.py"


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
        # not installed: no redirection; the usual finders then see the first folder on the path
        assert Path(origin).resolve() == ROOT / "bench" / "kernels.py", origin
        return
    assert "site-packages" in Path(origin).parts and Path(origin).parent.name == "kernels", origin
