"""An export replacing an earlier one (``convert --overwrite`` to hf, megatron, deepspeed), killed at every step.

A process runs the export over an earlier one and SIGKILLs itself right before its k-th rename, replace, unlink or
``shutil.rmtree`` (``renameat2``, the exchange, counts too), for k = 1, 2, ... until an export runs to its end (a
``python -c`` child imports once and forks one such process for each k). After each kill the target must load
entirely as the old export or entirely as the new one, or (Hugging Face, where a file name changes hands) refuse to
load; the user's files beside a Hugging Face export are untouched; then an export in this process succeeds and
leaves nothing hidden behind. A Hugging Face directory is loaded by the rules of transformers' ``from_pretrained``
(``model.safetensors`` first, else the index's ``weight_map``) and by arrayckpt's own reader, which looks for the
index first.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import arrayckpt
from arrayckpt._convert.safetensors import _safetensors_source

pytestmark = pytest.mark.slow  # every test here kills an export at each of its steps (a process per kill)

ROOT = Path(__file__).resolve().parents[2]
USER_FILES = {"tokenizer.json": '{"vocab": {}}', "README.md": "# my model\n"}
# One interpreter imports everything once, then for each k it forks a process (before any thread was started) that
# runs the export, counting its steps, and SIGKILLs itself at the k-th; it reports how that process ended.
CHILD = """
import os, shutil, signal, sys
import tensorstore  # imported (~1 s), not used: TensorStore refuses a fork once its threads run
import arrayckpt, arrayckpt._convert.dispatch, arrayckpt._convert.hf
from arrayckpt._storage import renames
src, dst, to_format, options, steps = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4]), sys.argv[5]
if to_format not in ("hf", "safetensors"):
    import arrayckpt._convert.megatron, arrayckpt._convert.deepspeed_universal
def run(k):
    calls = [0]
    def counted(fn):
        def step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return step
    for name in steps.split(","):
        setattr(os, name, counted(getattr(os, name)))
    shutil.rmtree = counted(shutil.rmtree)
    renames._renameat2 = counted(renames._renameat2)
    arrayckpt.convert(src, dst, to_format=to_format, overwrite=True, **options)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            run(int(line))
        finally:
            sys.stdout.flush()
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status), flush=True)
"""

Weights = dict[str, np.ndarray]


def _kill_at_every_step(src: Path, dst: Path, to_format: str, options: dict[str, int], steps: str,
                        reset: Callable[[], None], check: Callable[[], None]) -> int:
    """Reset the old export, run the export killed at its k-th step, ``check`` the target; for every k. Returns
    how many kills there were."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(dst), to_format, repr(options), steps],
                          env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            for k in range(1, 200):
                reset()
                child.stdin.write(f"{k}\n")
                child.stdin.flush()
                code = int(child.stdout.readline())
                if code == 0:
                    return k - 1
                assert code == -signal.SIGKILL, f"the export failed at k={k} (exit status {code})"
                check()
        finally:
            child.stdin.close()
    raise AssertionError("the export never finished")


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------------------ Hugging Face


def _weights(seed: int) -> Weights:
    """Six float32 tensors of 64 bytes each, their values telling the exports apart."""
    return {f"layer{i}.weight": np.full((4, 4), seed * 10 + i, np.float32) for i in range(6)}


def _by_transformers(directory: Path) -> Weights:
    """What ``from_pretrained`` would load: ``model.safetensors`` if there, else the index's shards (each shard's
    tensors that the index places there); no entry point is an error, as a missing shard is."""
    if (directory / "model.safetensors").is_file():
        return load_file(directory / "model.safetensors")
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    out: Weights = {}
    for file in sorted(set(index.values())):
        out |= {name: array for name, array in load_file(directory / file).items() if index.get(name) == file}
    return out


def _by_arrayckpt(directory: Path) -> Weights:
    """What ``convert DIR ...`` would read (the index first, else the one ``.safetensors`` file)."""
    out: Weights = {}
    for file in _safetensors_source(directory).files:
        out |= load_file(file)
    return out


def _same(a: Weights, b: Weights) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def _export_hf(src: Path, dst: Path, shards: int, to_format: str = "hf") -> None:
    arrayckpt.convert(src, dst, to_format=to_format, overwrite=True, max_shard_bytes=6 * 64 // shards)


@pytest.mark.parametrize(("old_shards", "new_shards", "to_format"),
                         [(3, 2, "hf"), (2, 2, "hf"), (1, 3, "hf"), (3, 1, "hf"), (2, 2, "safetensors")],
                         ids=["other-count", "same-names", "one-to-shards", "shards-to-one", "safetensors"])
def test_a_killed_hf_export_leaves_the_old_or_the_new_export_or_none(tmp_path, old_shards, new_shards, to_format):
    """(``--to safetensors`` into a directory replaces an earlier export the same way.)"""
    import torch

    old, new = _weights(1), _weights(2)
    arrayckpt.save({k: torch.from_numpy(v) for k, v in old.items()}, tmp_path / "old")
    arrayckpt.save({k: torch.from_numpy(v) for k, v in new.items()}, tmp_path / "new")
    out, pristine = tmp_path / "deep" / "er" / "hf", tmp_path / "pristine"
    _export_hf(tmp_path / "old", pristine, old_shards, to_format)  # missing parents are made
    for name, text in USER_FILES.items():
        (pristine / name).write_text(text)
    seen: dict[str, set[str]] = {"transformers": set(), "arrayckpt": set()}
    collected: list[Path] = []

    def reset() -> None:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(pristine, out)

    def check() -> None:
        assert {name: (out / name).read_text() for name in USER_FILES} == USER_FILES
        for reader, load in (("transformers", _by_transformers), ("arrayckpt", _by_arrayckpt)):
            try:
                got = load(out)
            except (OSError, arrayckpt.FormatError):
                seen[reader].add("none")
                continue
            assert _same(got, old) or _same(got, new), f"{reader} loads a mix: {sorted(os.listdir(out))}"
            seen[reader].add("old" if _same(got, old) else "new")
        if _hidden(out) and not collected and "tmp-new-" not in _hidden(out)[0]:  # what the kill left, gc removes
            collected.extend(Path(p) for p in arrayckpt.gc(out, min_age_s=0))
            assert collected and not _hidden(out)
        _export_hf(tmp_path / "new", out, new_shards, to_format)  # a rerun
        assert _same(_by_transformers(out), new) and _same(_by_arrayckpt(out), new)
        assert not _hidden(out) and {name: (out / name).read_text() for name in USER_FILES} == USER_FILES
        count = len(list(out.glob("*.safetensors")))
        assert count == new_shards and (out / "model.safetensors.index.json").exists() == (new_shards > 1)

    kills = _kill_at_every_step(tmp_path / "new", out, to_format, {"max_shard_bytes": 6 * 64 // new_shards},
                                "replace,rename,unlink", reset, check)
    assert kills > 5 and collected
    assert {"old", "new"} <= seen["transformers"] and {"old", "new"} <= seen["arrayckpt"]
    if old_shards == 3 and new_shards == 2:  # no name changes hands: never unloadable
        assert "none" not in seen["transformers"] | seen["arrayckpt"]


# ------------------------------------------------------------------------------------------- Megatron, DeepSpeed


def test_a_killed_megatron_export_leaves_the_old_or_the_new_export(tmp_path):
    import torch

    for name, value in (("old", 1.0), ("new", 2.0)):
        arrayckpt.save({"w": torch.full((3,), value), "step": int(value)}, tmp_path / name)
    out, pristine = tmp_path / "out", tmp_path / "pristine"
    arrayckpt.convert(tmp_path / "old", pristine, to_format="megatron")
    seen = set()

    def reset() -> None:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(pristine, out)

    def loaded() -> tuple[float, int]:
        import torch.distributed.checkpoint as dcp

        state = {"w": torch.zeros(3)}
        dcp.load(state, checkpoint_id=out, no_dist=True)
        common = torch.load(out / "common.pt", weights_only=True)
        assert json.loads((out / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        assert len(set(state["w"].tolist())) == 1
        return state["w"][0].item(), common["step"]

    def check() -> None:
        value, step = loaded()
        assert (value, step) in ((1.0, 1), (2.0, 2)), (value, step)
        seen.add(step)
        arrayckpt.convert(tmp_path / "new", out, to_format="megatron", overwrite=True)
        assert loaded() == (2.0, 2) and not _hidden(tmp_path)

    assert _kill_at_every_step(tmp_path / "new", out, "megatron", {}, "replace,rename", reset, check) >= 3
    assert seen == {1, 2}
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")  # through a temporary arrayckpt checkpoint: parents made
    arrayckpt.convert(tmp_path / "w.pt", tmp_path / "a" / "b" / "made", to_format="megatron")
    assert os.listdir(tmp_path / "a" / "b") == ["made"]


@pytest.mark.parametrize("to_format", ["megatron", "dcp"])
def test_an_export_beside_user_files_keeps_them_and_a_kill_never_leaves_a_mix(tmp_path, to_format):
    """A directory holding a checkpoint and a file of the user's: the export cannot swap the directory (the file
    would go), so it moves its files in one by one, the entry points first out and last in; after a kill at any
    step the directory loads as the old export, the new one, or not at all, and the user's file is there."""
    import torch

    for name, value in (("old", 1.0), ("new", 2.0)):
        arrayckpt.save({"w": torch.full((3,), value), "step": int(value)}, tmp_path / name)
    out, pristine = tmp_path / "out", tmp_path / "pristine"
    arrayckpt.convert(tmp_path / "old", pristine, to_format=to_format)
    (pristine / "notes.txt").write_text("mine")
    seen = set()

    def reset() -> None:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(pristine, out)

    def loaded() -> float | None:
        import torch.distributed.checkpoint as dcp

        if to_format == "megatron" and not (out / "metadata.json").is_file():
            return None  # Megatron's loader finds no checkpoint here
        from torch.distributed.checkpoint.api import CheckpointException

        state = {"w": torch.zeros(3)}
        try:
            dcp.load(state, checkpoint_id=out, no_dist=True)
        except (Exception, CheckpointException):  # any refusal to load counts: what matters is that no mix loads
            return None
        assert len(set(state["w"].tolist())) == 1, state  # never a mix of the two
        return state["w"][0].item()

    def check() -> None:
        value = loaded()
        assert value in (1.0, 2.0, None), value
        seen.add(value)
        assert (out / "notes.txt").read_text() == "mine"
        arrayckpt.convert(tmp_path / "new", out, to_format=to_format, overwrite=True)
        assert loaded() == 2.0 and (out / "notes.txt").read_text() == "mine" and not _hidden(tmp_path)

    assert _kill_at_every_step(tmp_path / "new", out, to_format, {}, "replace,rename,unlink", reset, check) >= 3
    assert 1.0 in seen and None in seen


def _trained(step: int, scale: float) -> tuple[dict[str, object], float]:
    """A module and its optimizer after one step from weights all ``scale`` (so all of them equal after it too),
    and that weight."""
    import torch

    module = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(scale)
    optim = torch.optim.AdamW(module.parameters(), lr=1e-3)
    module(torch.ones(1, 3)).sum().backward()
    optim.step()
    return {"model": module, "optim": optim, "step": step}, module.weight.flatten()[0].item()


@pytest.mark.parametrize("steps", [(1, 2), (2, 2)], ids=["other-tag", "same-tag"])
def test_a_killed_deepspeed_export_leaves_the_old_or_the_new_export(tmp_path, steps):
    """Beside another tag and DeepSpeed's own ``latest``, which stay."""
    import torch

    (old, old_value), (new, new_value) = _trained(steps[0], 1.0), _trained(steps[1], 5.0)
    arrayckpt.save(old, tmp_path / "old")
    arrayckpt.save(new, tmp_path / "new")
    out, pristine = tmp_path / "out", tmp_path / "pristine"
    (pristine / "global_step0").mkdir(parents=True)
    (pristine / "latest").write_text("global_step0")
    arrayckpt.convert(tmp_path / "old", pristine, to_format="deepspeed", overwrite=True)
    seen = set()

    def reset() -> None:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(pristine, out)

    def loaded() -> float:
        tag = out / (out / "latest_universal").read_text()
        values = {torch.load(tag / "zero" / name / "fp32.pt", weights_only=True)["param"].flatten()[0].item()
                  for name in ("weight", "bias")}
        assert len(values) == 1, values
        return values.pop()

    def check() -> None:
        assert (out / "latest").read_text() == "global_step0" and (out / "global_step0").is_dir()
        value = loaded()
        assert value in (old_value, new_value)
        seen.add(value)
        arrayckpt.convert(tmp_path / "new", out, to_format="deepspeed", overwrite=True)
        assert loaded() == new_value and not _hidden(tmp_path) and not _hidden(out)

    assert _kill_at_every_step(tmp_path / "new", out, "deepspeed", {}, "replace,rename", reset, check) >= 3
    assert seen == {old_value, new_value}
    arrayckpt.convert(tmp_path / "new", tmp_path / "x" / "y" / "ds", to_format="deepspeed")  # parents made
