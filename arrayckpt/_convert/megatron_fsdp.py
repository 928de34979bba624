"""Megatron-LM's ``--ckpt-format fsdp_dtensor`` checkpoints (Megatron-FSDP) to and from arrayckpt.

What Megatron-LM writes and reads (``megatron/training/checkpointing.py``, read at tag ``core_v0.16.1``, the
Megatron-LM of the installed megatron-core 0.16.1, and at main of 2026-08; the training driver is not in the pip
package). ``save_checkpoint`` builds the state with ``generate_state_dict``::

    args                     Megatron-LM's argparse.Namespace
    checkpoint_version       3.0
    iteration                the step
    model                    model.state_dict_for_save_checkpoint(): Megatron-FSDP's DTensors by parameter name
                             (decoder.layers.0.mlp.linear_fc1.weight; no "module." of the wrapper)
    optimizer                DistributedOptimizer.sharded_state_dict -> sharded_param_state_fsdp_dtensor (megatron-core
                             optimizer/distrib_optimizer.py): {"state": {"module.<name>": {"exp_avg": DTensor,
                             "exp_avg_sq": DTensor, ...}}, "param_to_group_meta": {"module.<name>": {"lr": ..., ...}}}
    opt_param_scheduler      its state_dict()
    rng_state                {"(<pp rank>, <tp rank>)": [RNG states: random's and numpy's tuples, torch's tensor...]}
    rerun_state_machine, num_floating_point_operations_so_far

then ``preprocess_fsdp_dtensor_state_dict`` (Megatron-LM) applies megatron-core's ``handle_fp8_extra_state_case``
(drops ``._extra_state``), ``handle_swiglu_in_state_dict`` (``--swiglu``: each ``linear_fc1`` weight and bias, and its
optimizer state, split into ``<key>_w`` and ``<key>_v``), ``handle_experts_in_state_dict`` (``--num-experts``: local
expert numbers made global) and ``preprocess_state_dict_for_uneven_dtensor`` (each DTensor's DCP chunk is the rank's
uneven Megatron-FSDP shard, rows of dim 0; a rank with none writes nothing), and saves with plain
``torch.distributed.checkpoint.save(state_dict, FileSystemWriter(<save>/iter_0000100))``. So the directory is a DCP
checkpoint (``.metadata``, ``__<rank>_0.distcp``) of the state flattened by DCP's default planner: dotted keys
(``model.decoder.layers.0.mlp.linear_fc1.weight``, ``optimizer.state.module.<name>.exp_avg``,
``rng_state.(0, 0).0.torch_rng_state``), values as ``torch.save`` bytes. There is no ``metadata.json`` and no
``common.pt``; after a barrier rank 0 writes ``<save>/latest_checkpointed_iteration.txt`` (``100``, or ``release``).
The load (``_load_base_checkpoint``) builds the same state for loading (``generate_state_dict`` with
``is_loading=True``), runs ``preprocess_fsdp_dtensor_state_dict`` on it, and calls
``torch.distributed.checkpoint.load_state_dict`` with a ``FileSystemReader`` and
``DefaultLoadPlanner(allow_partial_load=not --strict-fsdp-dtensor-load)``; Megatron-LM's main first loads
``{"args", "iteration", "checkpoint_version"}`` alone with ``dcp.load`` (``--use-checkpoint-args``). Megatron tells
this format from ``--ckpt-format torch_dcp`` (the same layout with plain tensors) only by ``--use-megatron-fsdp``.

Recognised here (:func:`is_fsdp_dtensor`) as a DCP directory without ``metadata.json`` whose DCP entries hold
``checkpoint_version`` (every Megatron-LM save does; a ``torch_dist`` save keeps it in ``common.pt``).
The mapping into arrayckpt (:func:`from_fsdp_dtensor`) is DCP's (``dcp.py``): every DTensor is one global array
under its DCP key, its ranks' uneven shards joined; every other tensor (``step``, the RNG tensors) an array too; every
value a value under its dotted key (JSON where it is; Megatron-LM's ``args`` Namespace and numpy's RNG tuple need
``allow_pickle``); the manifest's ``created["source"]`` is ``{"format": "megatron", "ckpt_format": "fsdp_dtensor"}``.

And back (:func:`to_fsdp_dtensor`): the arrayckpt checkpoint as DCP saves it flattened (``dcp.py::flat_dcp_state``),
every array one whole DCP chunk under its key, values as DCP's bytes, written as ``to_dcp`` writes (one tensor in
memory at a time; switched into place whole). What checks it (``tests/convert/test_megatron_fsdp.py``):
megatron-core's own ``make_fsdp_dtensor`` builds each rank's uneven DTensors, the test applies the megatron-core
functions Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` applies (``handle_fp8_extra_state_case``,
``preprocess_state_dict_for_uneven_dtensor``), and ``torch.distributed.checkpoint.load_state_dict`` with
``FileSystemReader`` and ``DefaultLoadPlanner`` loads it, as ``_load_base_checkpoint`` does.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._errors import PickleNotAllowedError
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._read.checkpoint import Checkpoint
from .common import ConvertResult, Progress, refuse_existing
from .dcp import (
    METADATA_FILE,
    dcp_file,
    flat_dcp_state,
    from_dcp,
    new_directory,
    read_dcp_metadata,
    refuse_pickles,
    stream_into_dcp,
)

__all__ = ["CKPT_FORMAT", "MARKER", "from_fsdp_dtensor", "is_fsdp_dtensor", "to_fsdp_dtensor"]

CKPT_FORMAT = "fsdp_dtensor"
MARKER = "checkpoint_version"  # a DCP entry of every Megatron-LM save (generate_state_dict); torch_dist: in common.pt
MODEL = "model"  # where Megatron-LM's load asks for the model's parameters (model.<parameter name>)


def is_fsdp_dtensor(directory: Path) -> bool:
    """Whether ``directory`` is a Megatron-LM DCP save (``fsdp_dtensor``, or ``torch_dcp``): DCP's ``.metadata``
    with a ``checkpoint_version`` entry and no ``metadata.json`` of ``dist_checkpointing``."""
    if (directory / "metadata.json").exists() or not (directory / METADATA_FILE).is_file():
        return False
    return MARKER in read_dcp_metadata(directory).state_dict_metadata


def from_fsdp_dtensor(directory: Path, dst: str | os.PathLike[str], *, overwrite: bool = False,
                      allow_pickle: bool = False, progress: Progress | None = None,
                      chunking: ChunkPolicy = DEFAULT_CHUNKING, key_prefix: str = "") -> ConvertResult:
    """A Megatron-LM ``fsdp_dtensor`` checkpoint directory (one iteration's) into arrayckpt (the mapping is this
    module's docstring)."""
    try:
        return from_dcp(directory, dst, overwrite=overwrite, allow_pickle=allow_pickle, progress=progress,
                        chunking=chunking, label="megatron", trusted_values=allow_pickle,
                        created={"source": {"format": "megatron", "ckpt_format": CKPT_FORMAT}},
                        key_prefix=key_prefix)
    except PickleNotAllowedError as e:
        raise PickleNotAllowedError(f"{e} (a Megatron-LM {CKPT_FORMAT} save holds Megatron-LM's args, an "
                                    "argparse.Namespace, and numpy's RNG state, which need it)") from None


def to_fsdp_dtensor(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
                    progress: Progress | None = None) -> ConvertResult:
    """An arrayckpt checkpoint into a Megatron-LM ``fsdp_dtensor`` checkpoint directory (the mapping is this
    module's docstring): DCP's own save of the state flattened, each tensor read only when DCP's writer reaches it
    and appended to one ``__0_0.distcp``, ``.metadata`` last; written into a hidden directory beside ``dst`` and
    switched into place whole (``dcp.py::new_directory``). Per-rank entries are skipped and named, as are empty
    dicts (DCP saves nothing for them). ``notes`` say when there is no ``model`` entry, where Megatron's load
    looks for the model (it loads partially by default: it would keep its own weights, silently)."""
    target = Path(dst)
    if target.exists() and any(target.iterdir()):
        refuse_existing(target, overwrite)
    refuse_pickles(checkpoint)
    state, keys, skipped = flat_dcp_state(checkpoint)
    notes = []
    if not isinstance(state.get(MODEL), dict):
        notes.append(f"no {MODEL!r} entry: Megatron-LM's {CKPT_FORMAT} load looks for the model's parameters under "
                     f"{MODEL}.<parameter name> and skips what it does not find (unless --strict-fsdp-dtensor-load)")
    with new_directory(target, dcp_file, [METADATA_FILE]) as temporary:
        total = stream_into_dcp(checkpoint, state, keys, temporary, flatten=True, progress=progress)
    tensors = sum(checkpoint.manifest.array_entry(k) is not None for k in checkpoint.manifest.entries)
    files = tuple(sorted(str(p) for p in target.iterdir()))
    return ConvertResult("arrayckpt", "megatron", tensors, total, files, skipped, notes=tuple(notes))

