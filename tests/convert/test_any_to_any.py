"""Any stack to any stack (issue 28): every readable source format converted into every writable destination.

One small model and its AdamW state after one step (``deepspeed_worker.model()``: an embedding, two linear layers,
a frozen one, an int64 buffer; plus a bfloat16 buffer of random bits, NaN patterns included) is written by each
source's own tool: ``arrayckpt.save``, ``torch.save``, safetensors' ``save_file``, huggingface_hub's
``save_torch_state_dict`` (a Hugging Face model directory), DCP's ``dcp.save``, Megatron-Core's
``dist_checkpointing.save`` (ShardedTensors, a ShardedObject, ``common.pt``) and a DeepSpeed ZeRO-2 engine's
``save_checkpoint``. Each is converted with ``arrayckpt.convert`` into each destination, and the destination is
read back by its own loader: ``arrayckpt.open``, ``torch.load``, safetensors' ``load_file`` (also for the
Hugging Face export's weight files), DCP's ``dcp_to_torch_save``, Megatron-Core's ``dist_checkpointing.load`` and,
for the DeepSpeed Universal Checkpoint, a fresh DeepSpeed engine's ``load_checkpoint`` (:func:`_check_universal`
says what that restores and is held against the source).

What is checked, pair by pair, against the source as arrayckpt reads it (each importer's fidelity to its format
is the business of that format's own tests): every tensor is in the destination bit for bit under the same name
(dtype kept), or tied to one that is, or named in the result's ``skipped``; every value likewise (equal); nothing
appears that the source did not hold (but what a format adds itself: Megatron's ``metadata.json``); and a pair
that is not supported is an explicit refusal with a clear error (:data:`REFUSED`), asserted, never a skip.

Megatron-Core and DeepSpeed need ``torch.distributed``: one spawned 1-rank gloo job (shared by the module) makes
their sources and also converts every source into the destinations marked ``in_job`` and reads them there with
their own loader (the DeepSpeed engines that load the Universal Checkpoints too: ~0.5 s in all, DeepSpeed being
imported there already). A new destination is one more entry in :data:`DESTINATIONS`: its ``to_format``, the name
of its output, its reader; ``in_job=True`` if the reader needs the job's process group.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from deepspeed_worker import config, full_states, model, steps, train
from dist_helpers import run_ranks
from helpers import assert_bit_equal, random_tensor
from universal_worker import universal_engine

import arrayckpt

pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("megatron", "deepspeed")),
                                reason="megatron-core and deepspeed are needed for every source")

Flat = dict[str, Any]  # a state flattened to dotted names: {"model.fc1.weight": tensor, "step": 1, ...}


# ------------------------------------------------------------------------------------------ the state and the sources


def _module() -> torch.nn.Module:
    module = model()
    module.register_buffer("table", random_tensor((4, 3), torch.bfloat16, 9))
    return module


TRAINABLE = [n for n, p in _module().named_parameters() if p.requires_grad]  # the optimizer's, in its order


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its AdamW optimizer after one step."""
    module = _module()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    module(torch.randint(0, 11, (6, 4), generator=torch.Generator().manual_seed(1))).square().mean().backward()
    optimizer.step()
    return module, optimizer


def _state() -> dict[str, Any]:
    module, optimizer = _trained()
    return {"model": module.state_dict(), "optim": optimizer.state_dict(), "step": 1, "note": "tiny"}


def _flat(obj: Any, prefix: str = "") -> Flat:
    """``obj`` flattened to dotted names through dicts, lists and tuples (an empty one is a leaf)."""
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, (list, tuple)) else None
    if items is None or not obj:
        return {prefix: ({} if isinstance(obj, Mapping) else [] if isinstance(obj, (list, tuple)) else obj)}
    out: Flat = {}
    for key, value in items:
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _make_arrayckpt(path: Path) -> None:
    module, optimizer = _trained()
    arrayckpt.save({"model": module, "optim": optimizer, "step": 1, "note": "tiny"}, path)


def _make_torch(path: Path) -> None:
    torch.save(_state(), path)


def _make_safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in _flat(_state()).items() if isinstance(v, torch.Tensor)}, path)


def _make_hf(path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    path.mkdir()
    save_torch_state_dict(_module().state_dict(), path)


def _make_dcp(path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_state(), checkpoint_id=path, no_dist=True)


def _make_megatron(path: Path) -> None:
    """In the job: the model's ShardedTensors under its module names, Adam's moments as Megatron's optimizer names
    them, the RNG state a ShardedObject, the rest ``common.pt``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    module, optimizer = _trained()
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    state = optimizer.state_dict()
    sharded: dict[str, Any] = {
        "model": {k: ShardedTensor.from_rank_offsets(k, v) for k, v in module.state_dict().items()},
        "optimizer": {"param_groups": state["param_groups"]}, "iteration": 1,
        "rng_state": ShardedObject("rng_state", {"seed": 5}, (1,), (0,)), "note": "tiny"}
    for moment in ("exp_avg", "exp_avg_sq"):
        sharded["optimizer"][moment] = {n: ShardedTensor.from_rank_offsets(f"optimizer.state.{moment}.{n}",
                                                                           state["state"][i][moment])
                                        for i, n in enumerate(names)}
    path.mkdir()
    dist_checkpointing.save(sharded, str(path))


def _make_deepspeed(path: Path) -> None:
    """In the job: a ZeRO-2 engine (torch's AdamW, nothing to compile) after one step."""
    import deepspeed

    module = _module()
    engine = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
                                  config=config(2, 1))[0]
    train(engine, 0, 1)
    engine.save_checkpoint(str(path), client_state={"note": "tiny"})


@dataclass(frozen=True)
class Source:
    """A source format: how its tool writes the state, where, and the key prefix of the model's weights (for
    the Hugging Face export's ``select``: ``""`` where no prefix holds the model alone)."""

    make: Callable[[Path], None]
    name: str
    model_prefix: str = "model."
    in_job: bool = False  # made in the spawned job (it needs torch.distributed)


SOURCES = {
    "arrayckpt": Source(_make_arrayckpt, "ckpt"),
    "torch": Source(_make_torch, "state.pt"),
    "safetensors": Source(_make_safetensors, "state.safetensors"),
    "hf": Source(_make_hf, "hf-model", model_prefix=""),
    "dcp": Source(_make_dcp, "dcp"),
    "megatron": Source(_make_megatron, "megatron", model_prefix="", in_job=True),
    "deepspeed": Source(_make_deepspeed, "deepspeed", in_job=True),
}


# ------------------------------------------------------------------------------------- the destinations and readers


def _read_arrayckpt(path: Path) -> Flat:
    from arrayckpt._format.manifest import ArrayEntry

    out: Flat = {}
    with arrayckpt.open(path, allow_pickle=True) as ckpt:
        for key, entry in ckpt.manifest.entries.items():
            if isinstance(entry, ArrayEntry):
                out[key] = ckpt[key].torch()
            else:
                out.update(_flat(ckpt.plain_values[key], key))
    return out


def _read_torch(path: Path) -> Flat:
    return _flat(torch.load(path))


def _read_safetensors(path: Path) -> Flat:
    from safetensors.torch import load_file

    return dict(load_file(path))


def _read_hf(path: Path) -> Flat:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    return {k: v for f in files for k, v in load_file(path / f).items()}


def _read_dcp(path: Path) -> Flat:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.with_name(path.name + ".pt"))
    return _flat(torch.load(path.with_name(path.name + ".pt"), weights_only=False))


def _read_megatron(path: Path) -> Flat:
    """In the job: Megatron's ``load`` of everything the checkpoint holds (its own ``load_sharded_metadata``); a
    ShardedObject shard comes back as the list Megatron stores (``load`` hands out its one item), and
    ``metadata.json`` as ``megatron.metadata``, where the Megatron import puts it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    loaded = dist_checkpointing.load(load_sharded_metadata(str(path)), str(path))
    objects = {k for k in loaded if re.fullmatch(r".+/shard_[\d.]*_[\d.]*", k)}
    return _flat({k: [v] if k in objects else v for k, v in loaded.items()}) | \
        _flat({"megatron": {"metadata": json.loads((path / "metadata.json").read_text())}})


def _read_universal(path: Path) -> Flat:
    """In the job: a fresh ZeRO-2 engine (``universal_worker.universal_engine``: the same model, no LR scheduler,
    ``"load_universal": true``) resumes with ``engine.load_checkpoint(path)``, every argument its default; what it
    holds then: its fp32 master weights and Adam moments under the source's names (``deepspeed_worker.full_states``),
    its optimizer steps, ``global_steps`` and the client state it hands back. Beyond these DeepSpeed restores only
    the hyper-parameters (here the engine's own config's), never the module: frozen parameters and buffers stay as
    the engine built them."""
    engine = universal_engine(2, 1, scheduler=False)
    loaded, client = engine.load_checkpoint(str(path))
    assert loaded is not None, f"DeepSpeed loaded nothing from {path}"
    return full_states(engine) | {"steps": steps(engine), "global_steps": engine.global_steps} | \
        _flat(client, "client")


@dataclass(frozen=True)
class Destination:
    """A destination format: ``convert``'s ``to_format``, the output's name, and its own loader (flattened);
    ``options``: ``convert``'s keyword arguments for a source (by name); ``check``: how what the loader read is
    held against the source (:func:`_check`, or :func:`_check_universal`)."""

    to_format: str
    name: str
    read: Callable[[Path], Flat]
    holds_values: bool = True
    adds: tuple[str, ...] = ()  # names the format holds of itself, whatever the source
    in_job: bool = False  # converted and read in the spawned job (its loader needs torch.distributed)
    options: Callable[[str], dict[str, Any]] = lambda source: {}
    check: Callable[[Flat, Outcome, Destination], None] = lambda reference, outcome, dest: _check(reference, outcome,
                                                                                                   dest)


DESTINATIONS = {
    "arrayckpt": Destination("arrayckpt", "ckpt", _read_arrayckpt),
    "torch": Destination("torch", "out.pt", _read_torch),
    "safetensors": Destination("safetensors", "out.safetensors", _read_safetensors, holds_values=False),
    "hf": Destination("hf", "hf", _read_hf, holds_values=False,
                      options=lambda source: {"select": SOURCES[source].model_prefix}),
    "dcp": Destination("dcp", "dcp", _read_dcp),
    "megatron": Destination("megatron", "megatron", _read_megatron, adds=("megatron.metadata",), in_job=True),
    # Every source's optimizer but DeepSpeed's numbers its parameters; the module's frozen layer and float buffer
    # leave the numbers ambiguous, so they are named (--param-names).
    "deepspeed-universal": Destination("deepspeed", "universal", _read_universal, in_job=True,
                                       options=lambda source: {} if source == "deepspeed" else
                                       {"param_names": TRAINABLE}, check=lambda r, o, d: _check_universal(r, o)),
}

# Pairs refused on purpose, with the error that says why (it names the source checkpoint, asserted too). A Universal
# Checkpoint resumes an optimizer: safetensors and a Hugging Face directory hold none (no param groups, so no
# hyper-parameters; zero moments would be a guess at the optimizer, and weights alone go into the module before
# deepspeed.initialize); a Megatron-Core checkpoint's module and moments are not laid out as a module under 'model'.
NO_OPTIMIZER = (arrayckpt.FormatError, "no optimizer (no <key>.param_groups)")
REFUSED = {("arrayckpt", "arrayckpt"): (arrayckpt.FormatError, "is already an arrayckpt checkpoint"),
           ("safetensors", "deepspeed-universal"): NO_OPTIMIZER, ("hf", "deepspeed-universal"): NO_OPTIMIZER,
           ("megatron", "deepspeed-universal"): (arrayckpt.FormatError, "no module under 'model'")}


@dataclass(frozen=True)
class Outcome:
    """One conversion: what ``convert`` returned and what the destination's loader read, or the error raised."""

    result: Any = None  # ConvertResult
    got: Flat = field(default_factory=dict)
    error: tuple[type, str] | None = None


def _convert(source: str, path: Path, destination: str, out: Path) -> Outcome:
    """``source`` at ``path`` into ``destination`` at ``out``, read back by the destination's loader."""
    dest = DESTINATIONS[destination]
    try:
        result = arrayckpt.convert(path, out, from_format=source, to_format=dest.to_format, **dest.options(source))
    except arrayckpt.ArrayckptError as e:
        return Outcome(error=(type(e), str(e)))
    return Outcome(result, dest.read(out))


def _job(rank: int, world: int, root: str, made: dict[str, str]) -> None:
    """Make the sources that need torch.distributed, then convert every source into the ``in_job`` destinations
    and read them there; the outcomes go to ``in_job.pt``."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))  # DeepSpeed on CPU, in a process group made here
    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # see tests/deepspeed_worker.py
    import functools

    import cpuinfo

    cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)  # once for the job's engines (universal_worker.py)
    torch.cuda.synchronize = lambda *args, **kwargs: None  # Megatron's save on CPU: see tests/convert/test_megatron.py
    torch.cuda.current_device = lambda: "cpu"
    base = Path(root)
    for name, source in SOURCES.items():
        if source.in_job:
            source.make(base / source.name)
            made[name] = str(base / source.name)
    torch.save({(s, d): _convert(s, Path(made[s]), d, base / "out" / f"{s}-{DESTINATIONS[d].name}")
                for s in SOURCES for d, dest in DESTINATIONS.items() if dest.in_job}, base / "in_job.pt")


@dataclass(frozen=True)
class Matrix:
    root: Path
    sources: dict[str, Path]
    in_job: dict[tuple[str, str], Outcome]
    references: dict[str, Flat]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    """Every source made; the job's conversions done; each source as arrayckpt reads it."""
    root = tmp_path_factory.mktemp("any_to_any")
    (root / "out").mkdir()
    made = {}
    for name, source in SOURCES.items():
        if not source.in_job:
            source.make(root / source.name)
            made[name] = str(root / source.name)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(1, _job, str(root), made)
    in_job = torch.load(root / "in_job.pt", weights_only=False)  # the job's Outcomes: trusted, made by this test
    sources = {name: root / source.name for name, source in SOURCES.items()}
    references = {}
    for name, path in sources.items():
        if name != "arrayckpt":
            arrayckpt.convert(path, root / f"reference-{name}", from_format=name)
        references[name] = _read_arrayckpt(path if name == "arrayckpt" else root / f"reference-{name}")
    return Matrix(root, sources, in_job, references)


# ----------------------------------------------------------------------------------------------------- the checks


def _same(got: Any, expected: Any, name: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{name}: a tensor became {got!r}"
        assert_bit_equal(got, expected)
    else:
        assert not isinstance(got, torch.Tensor) and got == expected, f"{name}: {got!r} != {expected!r}"


def _check(reference: Flat, outcome: Outcome, dest: Destination) -> None:
    """Everything the source holds is carried (bit for bit, under its name) or named as left out; nothing else
    appears."""
    result = outcome.result
    prefix = result.selected or ""
    got = {prefix + name: value for name, value in outcome.got.items()}
    tied = {prefix + alias: prefix + target for alias, target in result.tied.items()}
    left_out = set(result.skipped)

    def reported(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in left_out)

    for name, expected in reference.items():
        if name in got:
            _same(got[name], expected, name)
            assert not reported(name), f"{name} is carried but reported as left out"
        elif name in tied:
            _same(got[tied[name]], expected, f"{name} (tied to {tied[name]})")
        else:
            assert reported(name), f"{name} is neither in the {dest.to_format} output nor reported as left out"
    extra = [n for n in got if n not in reference and not any(n == a or n.startswith(a + ".") for a in dest.adds)]
    assert not extra, f"the output holds names the source did not: {extra}"
    assert all(any(n == s or n.startswith(s + ".") for n in reference) for s in left_out), left_out
    if not dest.holds_values:
        assert not any(not isinstance(v, torch.Tensor) for v in got.values())


def _check_universal(reference: Flat, outcome: Outcome) -> None:
    """What DeepSpeed restored from the Universal Checkpoint is the source's: every trainable parameter's weights
    and both Adam moments bit for bit (the source's optimizer numbers them in ``TRAINABLE``'s order or names them),
    its step, ``global_steps`` (a DeepSpeed source's, or the step saved beside the state), and every value outside
    the module and optimizer (a DeepSpeed source's client state) as the client state. The rest of the files
    (frozen parameters and buffers, which DeepSpeed does not read; hyper-parameters, the same as the engine's
    config here) ``test_deepspeed_universal.py`` holds against ``ds_to_universal.py``'s."""
    got = outcome.got
    for number, name in enumerate(TRAINABLE):
        _same(got[f"model.{name}"], reference[f"model.{name}"], name)
        for moment in ("exp_avg", "exp_avg_sq"):
            key = next(k for k in (f"optim.state.{name}.{moment}", f"optim.state.{number}.{moment}") if k in reference)
            _same(got[f"optim.state.{name}.{moment}"], reference[key], key)
    saved_steps = {float(v) for k, v in reference.items() if re.fullmatch(r"optim\.state\.[^.]+(\.[^.]+)*\.step", k)}
    assert len(saved_steps) == 1 and got["steps"] == [["Tensor", *saved_steps]], (got["steps"], saved_steps)
    assert got["global_steps"] == reference.get("deepspeed.global_steps", reference.get("step")), got["global_steps"]
    from_deepspeed = any(k.startswith("deepspeed.") for k in reference)
    client = {k.removeprefix("client."): v for k, v in reference.items() if k.startswith("client.")} if \
        from_deepspeed else {k: v for k, v in reference.items() if k.split(".")[0] not in ("model", "optim")}
    assert client, "the source holds values beside the module and optimizer"
    for name, value in client.items():
        assert f"client.{name}" in got, f"{name} is not in the client state DeepSpeed hands back"
        _same(got[f"client.{name}"], value, name)


@pytest.mark.slow
@pytest.mark.parametrize("destination", list(DESTINATIONS))
@pytest.mark.parametrize("source", list(SOURCES))
def test_any_source_into_any_destination(matrix, source, destination):
    dest = DESTINATIONS[destination]
    if dest.in_job:
        outcome = matrix.in_job[source, destination]
    else:
        outcome = _convert(source, matrix.sources[source], destination,
                           matrix.root / "out" / f"{source}-{dest.name}")
    if (source, destination) in REFUSED:
        kind, message = REFUSED[source, destination]
        assert outcome.error is not None and issubclass(outcome.error[0], kind) and message in outcome.error[1], \
            outcome
        assert outcome.error[1].startswith(f"{matrix.sources[source]}"), outcome.error  # the user's, not a temporary
        return
    assert outcome.error is None, f"{source} -> {destination} failed: {outcome.error}"
    assert (outcome.result.source_format, outcome.result.target_format) == (source if source != "hf" else
                                                                             "safetensors", dest.to_format)
    dest.check(matrix.references[source], outcome, dest)


def test_the_sources_hold_the_state(matrix):
    """The references are the state each tool wrote (checked where the test wrote the state itself): the model's
    tensors bit for bit wherever a source holds them, the optimizer's moments where it holds them."""
    state = _flat(_state())
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    for name in ("arrayckpt", "torch", "safetensors", "dcp"):
        reference = matrix.references[name]
        for key, tensor in tensors.items():
            _same(reference[key], tensor, f"{name}: {key}")
    for key, tensor in _flat(_module().state_dict()).items():
        _same(matrix.references["hf"][key], tensor, f"hf: {key}")
        _same(matrix.references["megatron"][key], matrix.references["arrayckpt"][f"model.{key}"], f"megatron: {key}")
    assert matrix.references["megatron"]["rng_state/shard_0_1.0.seed"] == 5
    assert {"model.fc1.weight", "optim.state.fc1.weight.exp_avg"} <= set(matrix.references["deepspeed"])


def test_the_command_line_refuses_a_universal_checkpoint_of_weights_only(matrix, tmp_path, capsys):
    """safetensors into a DeepSpeed Universal Checkpoint: one line naming the file and what it lacks, exit 2, and
    nothing left behind (neither the output nor the temporary arrayckpt checkpoint)."""
    from arrayckpt import cli

    source = matrix.sources["safetensors"]
    assert cli.main(["convert", str(source), str(tmp_path / "universal"), "--to", "deepspeed"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(source) in err and "no optimizer (no <key>.param_groups)" in err, err
    assert "load them into the module before deepspeed.initialize" in err
    assert not list(tmp_path.iterdir())
