"""``convert --to deepspeed``: DeepSpeed Universal Checkpoints, written from checkpoints that came from DeepSpeed
(ZeRO) and from plain PyTorch training, resumed by DeepSpeed's own ``engine.load_checkpoint`` (``"load_universal":
true``) at other data-parallel degrees and ZeRO stages; compared file by file with DeepSpeed's ``ds_to_universal.py``
on the same checkpoint, and read back (both) into the keys a ZeRO checkpoint converts to.

The DeepSpeed jobs are ``tests/universal_worker.py``'s (one 2-rank training job, one resume job at 1 and at 3 ranks;
a DeepSpeed process costs ~18 s of CPU to start). The global batch is the same at every world size, so the losses
after a resume differ from the uninterrupted run's only by the order of the gradient reduction's sums.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import deepspeed_worker as dw
import pytest
import torch
import universal_worker

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
              pytest.mark.slow]  # runs a foreign training stack, spawns processes

LOSS_ATOL = 1e-5  # resumed vs uninterrupted (the bound); fp32 reduction order alone: ~1e-7
TRAINABLE = ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # the worker's model; frozen.* are not
TAG = f"global_step{dw.TRAIN_STEPS}_universal"


def _plain_train(module: torch.nn.Module, optim: torch.optim.Optimizer, first: int, steps: int) -> list[float]:
    """Plain PyTorch on deepspeed_worker.train's global batches; each step's loss before the step."""
    losses = []
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(100 + step)
        x, y = torch.randint(0, 11, (dw.GLOBAL_BATCH, 4), generator=generator), torch.randn(dw.GLOBAL_BATCH, 3,
                                                                                             generator=generator)
        loss = ((module(x) - y) ** 2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("universal")


@pytest.fixture(scope="module")
def trained(root: Path) -> dict[str, Any]:
    """The 2-rank ZeRO-2 job (checkpoint, DeepSpeed's view, ds_to_universal's output, reference losses) and a plain
    PyTorch run of the same model (saved as {"model", "optim", "epoch"}, its state and next losses kept)."""
    import arrayckpt

    results = universal_worker.torchrun(2, "train", root)
    module = dw.model()
    optim = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    _plain_train(module, optim, 0, dw.TRAIN_STEPS)
    arrayckpt.save({"model": module, "optim": optim, "epoch": 3}, root / "plain.arrayckpt")
    names = {id(p): n for n, p in module.named_parameters()}
    full = {f"model.{n}": p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    full |= {f"optim.state.{names[id(p)]}.{k}": v.clone() for p, s in optim.state.items() for k, v in s.items()
             if k != "step"}
    torch.save(full, root / "plain_full.pt")
    results["plain"] = _plain_train(module, optim, dw.TRAIN_STEPS, dw.NEXT_STEPS)
    return results


@pytest.fixture(scope="module")
def converted(root: Path, trained: dict[str, Any]) -> Path:
    """zero2 -> arrayckpt; zero2 -> universal by the command line (through arrayckpt, in its own process: DeepSpeed's
    import logs to stdout, which must not spoil --json); the plain run -> universal with --param-names."""
    import arrayckpt
    from arrayckpt import cli

    arrayckpt.convert(root / "zero2", root / "zero2.arrayckpt")
    exe = shutil.which("arrayckpt")
    assert exe, "the arrayckpt console script is not installed (pip install -e .)"
    done = subprocess.run([exe, "convert", str(root / "zero2"), str(root / "zero2.universal"), "--to", "deepspeed",
                           "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["target_format"] == "deepspeed"
    (root / "names.txt").write_text("\n".join(TRAINABLE) + "\n")
    assert cli.main(["convert", str(root / "plain.arrayckpt"), str(root / "plain.universal"), "--to", "deepspeed",
                     "--param-names", str(root / "names.txt")]) == 0
    assert (root / "plain.universal" / "latest_universal").read_text() == TAG
    return root


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):  # in order where the order means something (param_shapes, module)
        same_keys = list(a) == list(b) if isinstance(a, collections.OrderedDict) else set(a) == set(b)
        return isinstance(b, dict) and same_keys and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or repr(a) == repr(b)  # DeepSpeed's loss scaler has no __eq__; its repr is its attributes


def test_the_files_are_what_ds_to_universal_writes(converted):
    """Same files with the same contents, bit for bit, but for the differences the module docstring of
    deepspeed_universal.py names."""
    ours, theirs = converted / "zero2.universal", converted / "ds_universal"
    assert (ours / "latest_universal").read_text() == (theirs / "latest_universal").read_text() == TAG
    ours, theirs = ours / TAG, theirs / TAG
    mine = {str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file()}
    ds = {str(p.relative_to(theirs)) for p in theirs.rglob("*") if p.is_file()}
    assert mine - ds == {"zero_pp_rank_0_mp_rank_00_model_states.pt"}  # for ZeRO-3 engines
    assert ds - mine == {"zero/counter/fp32.pt"}  # a buffer cast to float, which nothing reads
    for file in sorted(mine & ds):
        a, b = torch.load(ours / file, weights_only=False), torch.load(theirs / file, weights_only=False)
        if file == "mp_rank_00_model_states.pt":
            assert set(b) - set(a) == {"frozen_param_fragments"} and set(a) <= set(b)
            for name, tensor in b.pop("module").items():  # ours: buffers whole, placeholders for the rest
                placeholder = a["module"].pop(name)
                assert _same(placeholder, tensor) if name == "counter" else placeholder.shape == (0,), name
            assert not a.pop("module")
            b.pop("frozen_param_fragments")
        elif file == "zero/optimizer_state.pt":  # ours: no partitioning of the source; what ZeRO 3 reads
            assert set(b) - set(a) == {"group_paddings", "param_alignment_paddings", "partition_count"}
            assert _same(a.pop("optimizer_state_dict"), {"state": {0: {"step": torch.tensor(float(dw.TRAIN_STEPS))}},
                                                         "param_groups": a["param_groups"]})
            b = {k: v for k, v in b.items() if k in a}
        assert _same(a, b), file
    assert _same(torch.load(ours / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False),
                 torch.load(ours / "mp_rank_00_model_states.pt", weights_only=False))


def _arrays_and_values(path: Path) -> dict[str, Any]:
    import arrayckpt

    with arrayckpt.open(path) as ckpt:
        return {k: ckpt[k].torch() if k in ckpt else ckpt.plain_values[k] for k in ckpt.manifest.entries}


def test_universal_checkpoints_read_back_as_the_zero_checkpoint_converts(converted, tmp_path):
    """Ours and DeepSpeed's universal checkpoints, converted back, hold what the ZeRO checkpoint converts to,
    every tensor bit for bit (the tag names the universal one)."""
    import arrayckpt

    expected = _arrays_and_values(converted / "zero2.arrayckpt")
    expected["deepspeed.tag"] = TAG
    for name in ("zero2.universal", "ds_universal"):
        done = arrayckpt.convert(converted / name, tmp_path / name)
        assert done.source_format == "deepspeed" and not done.skipped and not done.notes
        got = _arrays_and_values(tmp_path / name)
        assert list(got) == list(expected), name
        for key, value in expected.items():
            assert _same(got[key], value), (name, key)


@pytest.mark.parametrize("ranks", [1, 3])
def test_deepspeed_resumes_from_the_universal_checkpoints(converted, trained, ranks):
    """engine.load_checkpoint at 1 and 3 ranks, ZeRO-2 and ZeRO-3 engines: DeepSpeed's own view of the masters and
    moments is the saved one bit for bit, counters and client state are back, training goes on as it did."""
    results = universal_worker.torchrun(ranks, "resume", converted)
    for name, reference in (("zero2", "zero2"), ("zero2->zero3", "zero2"), ("plain", "plain")):
        got = results[name]
        assert got["loaded"] == TAG and got["epoch"] == 3 and got["global_steps"] == dw.TRAIN_STEPS, name
        assert got["differences"] == [], name
        assert got["steps"] == [["Tensor", float(dw.TRAIN_STEPS)]], name
        assert got["scheduler"] == (dw.TRAIN_STEPS - 1 if reference == "zero2" else None), name
        assert got["losses"] == pytest.approx(trained[reference], abs=LOSS_ATOL, rel=0), name


# ------------------------------------------------------------------------------------------------ plain PyTorch


def test_numbered_parameters_that_cannot_be_told_apart_are_refused(converted, tmp_path, capsys):
    """The plain run's optimizer numbers its 5 parameters; the module has 7 floating-point tensors (a frozen
    layer): which is which is not in the checkpoint."""
    import arrayckpt
    from arrayckpt import cli

    assert cli.main(["convert", str(converted / "plain.arrayckpt"), str(tmp_path / "out"), "--to", "deepspeed"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass param_names (--param-names FILE)" in err

    with pytest.raises(arrayckpt.ArrayckptError, match="numbers its 5 parameters \\(in 1 param group\\) and the "
                       "module has 7 floating-point tensors.*pass param_names"):
        arrayckpt.convert(converted / "plain.arrayckpt", tmp_path / "out", to_format="deepspeed")
    with pytest.raises(arrayckpt.ArrayckptError, match="param_names gives 4 names, the optimizer holds 5"):
        arrayckpt.convert(converted / "plain.arrayckpt", tmp_path / "out", to_format="deepspeed",
                          param_names=TRAINABLE[:4])
    with pytest.raises(arrayckpt.ArrayckptError, match="optim.state.2.exp_avg is \\[9\\], not a tensor of "
                       "frozen.weight's shape"):
        arrayckpt.convert(converted / "plain.arrayckpt", tmp_path / "out", to_format="deepspeed",
                          param_names=["emb.weight", "fc1.weight", "frozen.weight", "fc2.weight", "fc2.bias"])
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_an_unambiguous_module_maps_in_order_and_reads_back(tmp_path):
    """One param group over all of a module's tensors maps in order (and says so); a parameter that never had a
    gradient gets zero moments and its group's step, as DeepSpeed's flat partition holds it. No DeepSpeed needed."""
    import arrayckpt

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    optim = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for _ in range(2):
        module[1](module[0](torch.randn(5, 3))).sum().backward()  # module[2] never used: no state
        optim.step()
    arrayckpt.save({"model": module, "optim": optim, "step": 2}, tmp_path / "ckpt")
    done = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "ds", to_format="deepspeed")
    assert "taken as the module's floating-point tensors in order" in done.notes[0]
    assert "no optimizer state (exp_avg, exp_avg_sq) for 2.weight, 2.bias" in done.notes[1]
    assert (tmp_path / "ds" / "latest_universal").read_text() == "global_step2_universal"
    arrayckpt.convert(tmp_path / "ds", tmp_path / "back")
    got = _arrays_and_values(tmp_path / "back")
    names = [n for n, _ in module.named_parameters()]
    for i, (name, param) in enumerate(module.named_parameters()):
        assert torch.equal(got[f"model.{name}"], param.detach()), name
        for key in ("exp_avg", "exp_avg_sq"):
            expected = optim.state[param][key] if i < 4 else torch.zeros_like(param)
            assert torch.equal(got[f"optim.state.{name}.{key}"], expected), (name, key)
        assert got[f"optim.state.{name}.step"].item() == 2
    assert got["optim.param_groups"][0]["params"] == names and got["optim.param_groups"][0]["lr"] == 1e-3
    assert got["client.step"] == 2 and got["deepspeed.global_steps"] == 2


def test_bf16_weights_and_moments_are_widened_exactly_in_blocks(tmp_path, monkeypatch, tuned):
    """DeepSpeed's masters and moments are fp32: bf16 ones are widened (exactly), read in row blocks into the fp32
    tensor (blocks of 3 rows here) so the bf16 copy is never held whole beside it."""
    import arrayckpt

    tuned(widen_block_bytes=3 * 5 * 2)
    torch.manual_seed(0)
    module = torch.nn.Linear(5, 7).to(torch.bfloat16)
    optim = torch.optim.AdamW(module.parameters())
    module(torch.randn(2, 5, dtype=torch.bfloat16)).sum().backward()
    optim.step()
    arrayckpt.save({"model": module, "optim": optim}, tmp_path / "ckpt")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "ds", to_format="deepspeed")
    tag = tmp_path / "ds" / "global_step1_universal" / "zero"
    for name, param in module.named_parameters():
        fp32 = torch.load(tag / name / "fp32.pt", weights_only=True)["param"]
        assert fp32.dtype == torch.float32 and torch.equal(fp32, param.detach().float()), name
        moment = torch.load(tag / name / "exp_avg.pt", weights_only=True)["param"]
        assert torch.equal(moment, optim.state[param]["exp_avg"].float()), name


def test_differing_steps_in_one_group_are_refused(tmp_path):
    import arrayckpt

    module = torch.nn.Linear(2, 2)
    optim = torch.optim.AdamW(module.parameters())
    module(torch.ones(1, 2)).sum().backward()
    optim.step()
    optim.state[module.bias]["step"] += 1
    arrayckpt.save({"model": module, "optim": optim}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.ArrayckptError, match="param group 0 have different steps.*one step per param group"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "ds", to_format="deepspeed")
    arrayckpt.save({"model": module}, tmp_path / "weights")
    with pytest.raises(arrayckpt.ArrayckptError, match="no optimizer"):
        arrayckpt.convert(tmp_path / "weights", tmp_path / "ds", to_format="deepspeed")


# ------------------------------------------------------------------------------------------------ targets, bad input


def test_an_existing_target_is_refused_or_added_to(converted, tmp_path):
    """Without overwrite nothing is touched; with it, the tag goes beside what a DeepSpeed checkpoint directory holds
    (its other tags and 'latest' are left alone) and latest_universal names it."""
    import arrayckpt

    target = tmp_path / "ckpts"
    shutil.copytree(converted / "zero2", target)
    before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    with pytest.raises(arrayckpt.ArrayckptError, match="already exists; pass overwrite=True"):
        arrayckpt.convert(converted / "zero2.arrayckpt", target, to_format="deepspeed")
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before
    arrayckpt.convert(converted / "zero2.arrayckpt", target, to_format="deepspeed", overwrite=True)
    assert (target / "latest").read_text().strip() == f"global_step{dw.TRAIN_STEPS}"
    assert (target / "latest_universal").read_text() == TAG and (target / TAG / "zero" / "optimizer_state.pt").is_file()
    assert set(before) <= {str(p.relative_to(target)) for p in target.rglob("*")}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _copy_tag(converted: Path, tmp_path: Path) -> Path:
    tag = tmp_path / TAG
    shutil.copytree(converted / "zero2.universal" / TAG, tag)
    return tag


def test_bad_universal_checkpoints_are_refused_naming_the_file(converted, tmp_path):
    import arrayckpt

    tag = _copy_tag(converted, tmp_path)
    file = tag / "zero" / "fc1.bias" / "exp_avg.pt"
    torch.save({"param": torch.zeros(4), "cat_dim": 0}, file)
    with pytest.raises(arrayckpt.ArrayckptError, match="fc1.bias/exp_avg.pt: holds torch.float32\\[4\\], not a "
                       "tensor of \\[9\\]"):
        arrayckpt.convert(tag, tmp_path / "out")
    file.unlink()
    (tag / "zero" / "fc1.bias" / "fp32.pt").unlink()
    with pytest.raises(arrayckpt.ArrayckptError, match="fc1.bias/fp32.pt: missing"):
        arrayckpt.convert(tag, tmp_path / "out")
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(arrayckpt.ArrayckptError, match="tensor-parallel model states"):
        arrayckpt.convert(tag, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_parameter_names_never_leave_zero(converted, tmp_path):
    """A name from the checkpoint is a directory name under zero/, never a path."""
    import arrayckpt

    tag = _copy_tag(converted, tmp_path)
    for file in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        states = torch.load(tag / file, weights_only=False)
        states["param_shapes"][0]["../../evil"] = torch.Size([9])
        torch.save(states, tag / file)
    with pytest.raises(arrayckpt.ArrayckptError, match="parameter name '../../evil' cannot be a directory name"):
        arrayckpt.convert(tag, tmp_path / "out")
