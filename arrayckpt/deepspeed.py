"""Resume DeepSpeed at any data-parallel degree from an arrayckpt checkpoint, with no conversion pass in between::

    # once: a ZeRO checkpoint saved by N ranks (engine.save_checkpoint) into arrayckpt
    arrayckpt.convert("checkpoints/", "ckpt/step-100")        # or: arrayckpt convert checkpoints/ ckpt/step-100

    # then on any number of ranks (M != N too), after deepspeed.initialize:
    import arrayckpt.deepspeed
    client_state = arrayckpt.deepspeed.load(engine, "ckpt/step-100")

:func:`load` is what ``engine.load_checkpoint`` does with DeepSpeed's Universal Checkpoint
(``"checkpoint": {"load_universal": true}``), without its offline ``ds_to_universal.py`` pass: every rank reads
only the slices of the global arrays that its ZeRO partitions cover. The implementation and the DeepSpeed
internals it follows are described in ``arrayckpt/_integrations/deepspeed_engine.py``.

Where DeepSpeed's own loader must do it, ``arrayckpt.convert(src, "uc/", to_format="deepspeed")`` writes a
Universal Checkpoint for ``engine.load_checkpoint("uc/")`` (``_convert/deepspeed_universal.py``), also from plain
PyTorch training.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ._integrations.deepspeed_engine import load_engine

__all__ = ["load"]


def load(engine: Any, path: str | os.PathLike[str], *, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False, strict: bool = True,
         allow_pickle: bool = False, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Fill an initialised DeepSpeed ZeRO (stage 1, 2 or 3) engine from the arrayckpt checkpoint at ``path``;
    returns the client state saved with it (``client_state`` of ``engine.save_checkpoint``).

    Every rank calls it (DeepSpeed all-gathers the module weights at the end). Each rank reads, of every
    parameter and optimizer moment, only the slice its partition covers: the fp32 master weights, the optimizer
    state (``exp_avg`` and ``exp_avg_sq``, or whatever the optimizer keeps), the step and hyper-parameters of each
    param group, the module's frozen parameters and buffers, DeepSpeed's step counters, loss scaler and
    learning-rate scheduler. Every optimizer DeepSpeed builds works: FusedAdam (its default), torch's Adam/AdamW
    (``torch_adam``), DeepSpeedCPUAdam (ZeRO-Offload); the step is restored as the engine's optimizer keeps it (an
    int for DeepSpeed's, a tensor for torch's), also when the checkpoint was saved with the other kind. Names and
    shapes are checked against the engine before anything changes (``strict``: no parameter of the checkpoint
    left over).

    The checkpoint is one converted from a DeepSpeed ZeRO checkpoint saved at any data-parallel degree
    (``arrayckpt convert``): the next steps then match an uninterrupted run's (bit for bit at the same degree;
    at another degree up to the reordering of the gradient reduction's floating-point sums).

    Args:
        engine: the engine ``deepspeed.initialize`` returned, ZeRO stage 1, 2 or 3.
        path: the arrayckpt checkpoint (a directory or a URL).
        load_optimizer_states: ``engine.load_checkpoint``'s: ``False`` keeps the engine's optimizer as it is (a
            fresh engine's starts fresh) and restores the rest.
        load_lr_scheduler_states: ``False`` keeps the LR scheduler.
        load_module_only: restore the module only (weights, frozen parameters, buffers; not the step counters, the
            LR scheduler or the optimizer), to warm-start a new run. Unlike DeepSpeed, which then sets the fp32
            master weights from the bf16/fp16 module weights, the masters are always the checkpoint's fp32 ones.
        strict: no parameter of the checkpoint may be left over.
        allow_pickle: needed when the client state holds pickled values (converted with ``allow_pickle=True``).
        storage_options: as for :func:`arrayckpt.open` (``s3://`` paths).

    Returns:
        The client state saved with the checkpoint.

    Raises:
        StateError: a shape does not match the checkpoint's, or the engine is not ZeRO stage 1-3 (nothing changed).
        KeyMismatchError: the checkpoint lacks tensors the engine has (or, with ``strict``, holds parameters the
            engine lacks).
        PickleNotAllowedError: the client state needs pickle and ``allow_pickle`` was not given.

    Examples:
        Not run here: an engine needs a launched DeepSpeed job (``tests/integrations/test_deepspeed.py`` runs this
        for real)::

            import arrayckpt.deepspeed
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
            client_state = arrayckpt.deepspeed.load(engine, "ckpt/step-100")
    """
    return load_engine(engine, path, load_optimizer_states=load_optimizer_states,
                       load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                       strict=strict, allow_pickle=allow_pickle, storage_options=storage_options)
