"""With arrayckpt installed, zarr-python reads its bfloat16/float8 arrays in an interpreter that never
imports arrayckpt: ``arrayckpt-zarr-dtypes.pth`` arms ``_arrayckpt_zarr_hook`` at start-up, which
registers the types once ``zarr`` is imported.

Every check runs in a fresh interpreter whose working directory is a temporary one, so only the
*installed* package (``pip install -e .`` or ``pip install .``) can provide the hook and arrayckpt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REINSTALL = "the start-up hook is not installed: run `pip install -e .` (or `pip install .`) again"


def _run(code: str, cwd: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter in ``cwd``; return the JSON object it prints last."""
    environ = {k: v for k, v in os.environ.items() if k != "ARRAYCKPT_NO_ZARR_HOOK"}
    proc = subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**environ, **(env or {})},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_startup_is_cheap_and_armed(tmp_path: Path) -> None:
    out = _run(
        """
        import json, sys
        from importlib.machinery import PathFinder
        hook = sys.modules.get("_arrayckpt_zarr_hook")
        armed = hook is not None and hook.installed()
        print(json.dumps({
            "armed": armed,
            "before_path_finder": armed and sys.meta_path.index(hook._FINDER) < sys.meta_path.index(PathFinder),
            "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("arrayckpt", "zarr", "numpy", "torch")),
        }))
        """,
        tmp_path,
    )
    assert out["armed"], REINSTALL
    assert out["before_path_finder"]
    assert out["heavy"] == []
    disabled = _run(
        'import json, sys; print(json.dumps(sys.modules["_arrayckpt_zarr_hook"].installed()))',
        tmp_path,
        env={"ARRAYCKPT_NO_ZARR_HOOK": "1"},
    )
    assert disabled is False


_READ_WITHOUT_ARRAYCKPT = """
    import json, sys
    import ml_dtypes
    import numpy as np
    import tensorstore as ts

    hook = sys.modules.get("_arrayckpt_zarr_hook")
    assert hook is not None and hook.installed(), "no start-up hook"
    assert not any(m.split(".")[0] in ("arrayckpt", "zarr") for m in sys.modules)

    CASES = {
        "bfloat16": (
            [0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x0001, 0x4049, 0xC2F7],
            [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        ),
        "float8_e4m3fn": (
            [0x00, 0x80, 0x38, 0xB8, 0x7E, 0xFE, 0x7F, 0xFF, 0x01, 0x81, 0x40, 0x5A],
            [{"name": "bytes"}, {"name": "crc32c"}],
        ),
    }

    def write(name):
        bits, codecs = CASES[name]
        uint = np.uint16 if name == "bfloat16" else np.uint8
        data = np.array(bits, dtype=uint).reshape(3, 4).view(getattr(ml_dtypes, name))
        store = ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": name},
                "metadata": {
                    "shape": [3, 4],
                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 4]}},
                    "data_type": name,
                    "codecs": codecs,
                },
            },
            create=True,
        ).result()
        store.write(data).result()
        return data.view(uint)

    expected = {name: write(name) for name in CASES}
    assert "zarr" not in sys.modules

    import zarr

    def read():
        result = {}
        for name, bits in expected.items():
            got = zarr.open_array(name, mode="r")[...]
            result[name] = [str(got.dtype), got.view(bits.dtype).tolist() == bits.tolist()]
        return result

    loader = zarr.__loader__
    out = {
        "disarmed": not hook.installed(),
        "real_loader": type(loader).__name__ != "_RegisteringLoader" and zarr.__spec__.loader is loader,
        "read": read(),
    }
    from zarr.core.dtype import data_type_registry

    dtypes = sys.modules["arrayckpt._zarr_dtypes"]
    out["registered"] = all(data_type_registry.get(c._zarr_v3_name) is c for c in dtypes.SUPPORTED_DTYPES)
    data_type_registry._lazy_load()  # what a later zarr may do by itself: must change nothing
    dtypes.register()
    out["registered_twice"] = all(data_type_registry.get(c._zarr_v3_name) is c for c in dtypes.SUPPORTED_DTYPES)
    out["read_again"] = read()
    out["files"] = [hook.__file__, dtypes.__file__]
    out["torch"] = "torch" in sys.modules
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_zarr_reads_bf16_and_float8_without_importing_arrayckpt(tmp_path: Path) -> None:
    out = _run(_READ_WITHOUT_ARRAYCKPT, tmp_path, "-W", "error")
    expected = {"bfloat16": ["bfloat16", True], "float8_e4m3fn": ["float8_e4m3fn", True]}
    assert out["read"] == expected
    assert out["read_again"] == expected
    assert out["disarmed"] and out["real_loader"]
    assert out["registered"] and out["registered_twice"]
    assert not any(str(tmp_path) in f for f in out["files"])
    assert out["torch"] is False


@pytest.mark.slow
def test_importing_arrayckpt_first_registers_once_without_warnings(tmp_path: Path) -> None:
    # arrayckpt._zarr_dtypes imports zarr itself, so the hook fires while that module is half imported
    out = _run(
        """
        import json, sys
        import arrayckpt
        from zarr.core.dtype import data_type_registry
        dtypes = sys.modules["arrayckpt._zarr_dtypes"]
        print(json.dumps({
            "disarmed": not sys.modules["_arrayckpt_zarr_hook"].installed(),
            "registered": all(data_type_registry.get(c._zarr_v3_name) is c for c in dtypes.SUPPORTED_DTYPES),
            "torch": "torch" in sys.modules,
        }))
        """,
        tmp_path,
        "-W",
        "error",
    )
    assert out == {"disarmed": True, "registered": True, "torch": False}


@pytest.mark.slow
@pytest.mark.parametrize("warnings_filter", ["default", "error"])
def test_registration_failure_never_breaks_zarr_import(tmp_path: Path, warnings_filter: str) -> None:
    out = _run(
        """
        import json, sys, warnings
        hook = sys.modules["_arrayckpt_zarr_hook"]
        hook.TARGET = "arrayckpt._no_such_module"
        with warnings.catch_warnings(record=True) as caught:
            import zarr  # must import whatever the hook does, even under -W error
        with warnings.catch_warnings(record=True) as direct:
            warnings.simplefilter("always")
            hook.register()
        print(json.dumps({
            "zarr": zarr.__name__,
            "disarmed": not hook.installed(),
            "caught": [str(w.message) for w in caught],
            "direct": [(w.category.__name__, str(w.message)) for w in direct],
        }))
        """,
        tmp_path,
        "-W",
        warnings_filter,
    )
    assert out["zarr"] == "zarr" and out["disarmed"]
    if warnings_filter == "default":
        assert any("could not register" in m for m in out["caught"]), out["caught"]
    else:
        assert out["caught"] == []  # the warning became an error inside the hook, and was dropped
    assert len(out["direct"]) == 1
    category, message = out["direct"][0]
    assert category == "RuntimeWarning" and "arrayckpt._no_such_module" in message
