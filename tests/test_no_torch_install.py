"""``pip install arrayckpt`` without torch: the read side works, the torch side says what to install.

A fresh virtual environment (no system site-packages, so no torch) gets a regular, non-editable install of this
package from a copy of the source tree, its dependencies resolved from the package index (pip's cache makes this
about 20 s). A checkpoint saved here, with torch, is then read there through ``arrayckpt.open`` and through
zarr-python alone (bfloat16 and float8 included), compared bit for bit against hashes of the saved tensors; the
command line's read commands run; and the torch-only API and commands fail with one clear error naming the
``arrayckpt[torch]`` extra. Nothing is skipped: when the environment cannot be built, the tests fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import arrayckpt

pytestmark = pytest.mark.slow  # spawns processes, starts a server or runs a foreign stack

REPO = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT = 600  # seconds for creating the venv and installing into it (about 20 s with a warm pip cache)
RUN_TIMEOUT = 120
EXTRA = "pip install 'arrayckpt[torch]'"
# what a copy of the source tree leaves out: build outputs and caches (a stale build/ could leak into the wheel)
NOT_COPIED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    ".ruff_cache", ".hypothesis", ".venv", ".whl", ".gl")


def _environ() -> dict[str, str]:
    """This process's environment without what would let the venv see this source tree or other packages."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "ARRAYCKPT_NO_ZARR_HOOK"}
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PYTHONNOUSERSITE": "1"}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a fresh venv with arrayckpt installed from this source tree, and no torch."""
    root = tmp_path_factory.mktemp("no-torch")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=NOT_COPIED)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=INSTALL_TIMEOUT)
    bin_dir = root / "venv" / ("Scripts" if os.name == "nt" else "bin")
    done = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           str(source)], capture_output=True, text=True, cwd=root, env=_environ(),
                          timeout=INSTALL_TIMEOUT)
    assert done.returncode == 0, f"pip install {source} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    print(f"venv created and arrayckpt installed in {time.monotonic() - started:.1f} s")
    return bin_dir


def _run(venv: Path, program: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / program), *args], capture_output=True, text=True, cwd=cwd, env=_environ(),
                          timeout=RUN_TIMEOUT)


def _python(venv: Path, code: str, *args: str, cwd: Path) -> Any:
    """Run ``code`` with the venv's Python in ``cwd`` (not the source tree); return the JSON it prints last."""
    done = _run(venv, "python", "-c", textwrap.dedent(code), *args, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _digest(tensor: torch.Tensor) -> dict[str, Any]:
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "sha256": hashlib.sha256(raw).hexdigest()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    """A checkpoint saved here with torch, and the dtype, shape and hash of each tensor's bytes (every bit pattern
    of bfloat16 and float8_e4m3fn is likely among them: NaN payloads, infinities, subnormals, -0)."""
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    generator = torch.Generator().manual_seed(14)
    tensors = {
        "model.bf16": torch.randint(-(2**15), 2**15, (64, 48), dtype=torch.int16, generator=generator)
        .view(torch.bfloat16),
        "model.fp8": torch.randint(0, 256, (32, 16), dtype=torch.uint8, generator=generator)
        .view(torch.float8_e4m3fn),
        "model.f32": torch.randn(16, 8, generator=generator),
        "ids": torch.tensor([0, -1, 2**62, -(2**63), 7], dtype=torch.int64),
    }
    state = {"model": {name.split(".")[1]: t for name, t in tensors.items() if name.startswith("model.")},
             "ids": tensors["ids"], "step": 3}
    arrayckpt.save(state, path, step=3, codec={"model.f32": "zstd"})
    return path, {key: _digest(t) for key, t in tensors.items()}


def test_torch_is_not_there(venv, tmp_path):
    done = _run(venv, "python", "-c", "import torch", cwd=tmp_path)
    assert done.returncode != 0 and "No module named 'torch'" in done.stderr
    location = _python(venv, "import json, arrayckpt; print(json.dumps(arrayckpt.__file__))", cwd=tmp_path)
    assert Path(location).is_relative_to(venv.parent) and "site-packages" in location  # the installed copy


_OPEN = """
    import hashlib, importlib.util, json, sys
    import numpy as np
    import arrayckpt

    path, expected = sys.argv[1], json.load(open(sys.argv[2]))
    checkpoint = arrayckpt.open(path)
    got = {}
    for key in checkpoint:
        array = checkpoint[key].numpy()
        got[key] = {"dtype": str(array.dtype), "shape": list(array.shape),
                    "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()}
    whole = checkpoint["model.bf16"].numpy()
    print(json.dumps({
        "tensors": got,
        "slice_exact": checkpoint["model.bf16"][3:9, ::5].tobytes() == whole[3:9, ::5].tobytes(),
        "step": checkpoint.plain_values["step"],
        "verify": arrayckpt.verify(path).ok,
        "show_max": arrayckpt.show(path, "ids").max,
        "identical": arrayckpt.diff(path, path).identical,
        "torch_findable": importlib.util.find_spec("torch") is not None,
        "torch_loaded": "torch" in sys.modules,
    }))
"""


def test_open_reads_every_tensor_bit_exactly(venv, saved, tmp_path):
    path, expected = saved
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    out = _python(venv, _OPEN, str(path), str(tmp_path / "expected.json"), cwd=tmp_path)
    assert out["tensors"] == expected
    assert out == {"tensors": expected, "slice_exact": True, "step": 3, "verify": True, "show_max": float(2**62),
                   "identical": True, "torch_findable": False, "torch_loaded": False}


_ZARR = """
    import hashlib, json, sys
    import numpy as np
    import zarr

    group = zarr.open_group(sys.argv[1], mode="r")
    got = {}
    for key in json.loads(sys.argv[2]):
        array = group[key.replace(".", "/")][...]
        got[key] = {"dtype": str(array.dtype), "shape": list(array.shape),
                    "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()}
    print(json.dumps({"tensors": got, "torch_loaded": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("first", ["", "import arrayckpt"], ids=["install-hook", "import-arrayckpt"])
def test_zarr_python_reads_bfloat16_and_float8_without_torch(venv, saved, tmp_path, first):
    """zarr-python alone (the installed start-up hook registers the types), or after ``import arrayckpt``."""
    path, expected = saved
    out = _python(venv, f"{first}\n{textwrap.dedent(_ZARR)}", str(path), json.dumps(sorted(expected)), cwd=tmp_path)
    assert out == {"tensors": expected, "torch_loaded": False}


def test_cli_read_commands_work(venv, saved, tmp_path):
    path, expected = saved
    listed = _run(venv, "arrayckpt", "--help", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    for command in ("info", "verify", "show", "diff", "convert", "compact", "gc", "estimate", "interval"):
        assert command in listed.stdout
    info = _run(venv, "arrayckpt", "info", str(path), cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert "model.bf16" in info.stdout and "float8_e4m3fn" in info.stdout and "step = 3" in info.stdout
    assert "note:" not in info.stdout  # installed: its start-up hook lets plain zarr-python read bfloat16 and float8
    as_json = json.loads(_run(venv, "arrayckpt", "info", "--json", str(path), cwd=tmp_path).stdout)
    assert {k: t["dtype"] for k, t in as_json["tensors"].items()} == {k: e["dtype"] for k, e in expected.items()}
    verify = _run(venv, "arrayckpt", "verify", str(path), cwd=tmp_path)
    assert verify.returncode == 0 and verify.stdout.startswith(f"OK {path}: 4 arrays"), verify.stdout + verify.stderr
    show = _run(venv, "arrayckpt", "show", str(path), "ids", "1:3", cwd=tmp_path)
    assert show.returncode == 0 and "max 4611686018427387904" in show.stdout, show.stdout + show.stderr
    diff = _run(venv, "arrayckpt", "diff", str(path), str(path), cwd=tmp_path)
    assert diff.returncode == 0 and diff.stdout.strip().endswith("identical"), diff.stdout + diff.stderr
    compact = _run(venv, "arrayckpt", "compact", str(path), str(tmp_path / "full"), cwd=tmp_path)
    assert compact.returncode == 0, compact.stderr
    assert arrayckpt.diff(path, tmp_path / "full").identical  # checked here, with torch


def test_export_to_safetensors_needs_no_torch(venv, saved, tmp_path):
    from safetensors.torch import load_file

    path, expected = saved
    target = tmp_path / "model.safetensors"
    done = _run(venv, "arrayckpt", "convert", str(path), str(target), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "not converted (safetensors cannot hold them): step" in done.stderr
    assert {key: _digest(t) for key, t in load_file(target).items()} == expected  # read back here, with torch


def test_hugging_face_export_needs_no_torch(venv, saved, tmp_path):
    from safetensors.torch import load_file

    path, expected = saved
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    done = _run(venv, "arrayckpt", "convert", str(path), str(tmp_path / "hf"), "--to", "hf", "--config",
                str(tmp_path / "config.json"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "(model.* with the prefix stripped)" in done.stdout and "note: transformers is not installed" in done.stderr
    written = load_file(tmp_path / "hf" / "model.safetensors")  # read back here, with torch
    assert {f"model.{key}": _digest(t) for key, t in written.items()} == \
        {key: digest for key, digest in expected.items() if key.startswith("model.")}
    assert (tmp_path / "hf" / "config.json").read_text() == '{"model_type": "llama"}'


def test_torch_only_api_says_which_extra_to_install(venv, saved, tmp_path):
    path, _ = saved
    out = _python(venv, """
        import json, sys
        import arrayckpt
        from arrayckpt import *  # every public name, the torch-only ones as stand-ins

        errors = {}
        for name, call in [("save", lambda: arrayckpt.save({}, "elsewhere")), ("load", lambda: load({}, sys.argv[1])),
                           ("async_save", lambda: async_save({}, "elsewhere")), ("Shard", lambda: Shard(None)),
                           ("CheckpointManager", lambda: CheckpointManager("elsewhere")),
                           ("convert", lambda: convert(sys.argv[1], "x.pt"))]:
            try:
                call()
                errors[name] = None
            except arrayckpt.TorchNotInstalledError as e:
                errors[name] = [str(e), isinstance(e, ImportError), isinstance(e, arrayckpt.ArrayckptError), e.name]
        print(json.dumps(errors))
        """, str(path), cwd=tmp_path)
    for name in ("save", "load", "async_save", "Shard", "CheckpointManager"):
        assert out[name] == [f"arrayckpt.{name} requires PyTorch: {EXTRA}", True, True, "torch"]
    assert out["convert"] == [f"converting arrayckpt to torch requires PyTorch: {EXTRA}", True, True, "torch"]
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize(("source", "target", "what"), [
    ("model.safetensors", "ckpt2", "converting safetensors to arrayckpt"),
    ("CKPT", "model.pt", "converting arrayckpt to torch"),
    ("CKPT", "dcp-out", "converting arrayckpt to dcp"),
])
def test_torch_only_commands_print_one_line(venv, saved, tmp_path, source, target, what):
    path, _ = saved
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the error comes first
    args = [str(path) if source == "CKPT" else str(tmp_path / source), str(tmp_path / target)]
    done = _run(venv, "arrayckpt", "convert", *args, *(["--to", "dcp"] if target == "dcp-out" else []), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == f"arrayckpt: error: {what} requires PyTorch: {EXTRA}\n"
    assert not (tmp_path / target).exists()
