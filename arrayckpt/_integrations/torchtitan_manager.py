"""TorchTitan's checkpoint manager with arrayckpt as DCP's storage: :class:`ArrayckptCheckpointManager`.

TorchTitan's ``CheckpointManager`` (``torchtitan/components/checkpointer/dcp.py``) calls
``dcp.save(state, checkpoint_id=step_dir)`` and ``dcp.load(state, checkpoint_id=step_dir)`` with no way to name a
storage writer or reader, so DCP always picks its ``FileSystemWriter``. This subclass overrides exactly those two
calls (``dcp_save``, ``dcp_load``), passing :class:`~arrayckpt.dcp.ArrayckptWriter` and
:class:`~arrayckpt.dcp.ArrayckptReader`; everything else is TorchTitan's own: the ``step-N`` directories, the
interval, ``keep_latest_k`` purging, async modes, model-only last steps, exclusion lists, and the Hugging Face paths
(``last_save_in_hf``, ``initial_load_in_hf``), which stay DCP's safetensors writer and reader.

Resuming works because the writer leaves its DCP marker (spec §2.1) in every step directory: TorchTitan's
``_find_load_step`` keeps a ``step-N`` directory only when it holds ``.metadata``. Without it a run switched to
arrayckpt would log "fresh start", train from step 1 and overwrite the ignored step at its next interval.

Switching is one change of the trainer's configuration (``Trainer.Config.checkpoint``)::

    from arrayckpt.torchtitan import ArrayckptCheckpointManager
    config.checkpoint = ArrayckptCheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

Steps saved by DCP's own writer before the switch are loaded too: a step directory holding DCP's files is read
with DCP's reader, so a run resumes across the switch (and the next save at that step replaces DCP's files).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from .._format.marker import MARKER_NAME
from .._format.zarr import ROOT_METADATA
from .dcp_reader import ArrayckptReader
from .dcp_storage import ArrayckptWriter

if TYPE_CHECKING:
    from torch.distributed.checkpoint.storage import StorageReader

__all__ = ["ArrayckptCheckpointManager"]


class ArrayckptCheckpointManager(CheckpointManager):
    """TorchTitan's ``CheckpointManager``, saving and loading every step as an arrayckpt checkpoint.

    Configured as TorchTitan's manager is (its ``Config``), plus how arrayckpt stores the steps:
    ``storage_options`` (object storage: endpoint, credentials, as for :func:`arrayckpt.save`), ``codec``
    (``"zstd"``, ``"blosc"`` or none), ``packed`` (one pack file per rank per step, spec §16; by default from two
    ranks up) and ``allow_pickle`` (values that are neither plain nor tensors, pickled; off by default, as in
    arrayckpt).

    Examples:
        >>> from arrayckpt.torchtitan import ArrayckptCheckpointManager
        >>> ArrayckptCheckpointManager.Config(enable=True, folder="checkpoint", interval=100).codec is None
        True
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        storage_options: dict[str, str] | None = None
        """Object storage options (endpoint, credentials), as for arrayckpt.save."""

        codec: str | None = None
        """Compression of the arrays: None (raw), "zstd" or "blosc"."""

        packed: bool | None = None
        """One pack file per rank per step (True), one file per chunk (False), or by the number of ranks (None)."""

        allow_pickle: bool = False
        """Store (and load) values that are neither plain nor tensors by pickling them."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.storage_options = config.storage_options
        self.codec = config.codec
        self.packed = config.packed
        self.allow_pickle = config.allow_pickle

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False,
                 to_hf: bool = False) -> Future[Any] | AsyncSaveResponse | None:
        """DCP's save of TorchTitan, with :class:`ArrayckptWriter` as the storage (Hugging Face exports: as
        TorchTitan writes them)."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = ArrayckptWriter(checkpoint_id, codec=self.codec, allow_pickle=self.allow_pickle,
                                 storage_options=self.storage_options, packed=self.packed)
        result: Future[Any] | AsyncSaveResponse | None
        if async_mode == AsyncMode.ASYNC:
            result = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                    process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            result = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                    process_group=self.pg, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                    async_stager=self.stager)
        else:
            result = dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """DCP's load of TorchTitan, with :class:`ArrayckptReader` for an arrayckpt step and DCP's own reader for a
        step DCP's writer saved (before the switch); Hugging Face imports as TorchTitan reads them."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, storage_reader=self._reader(checkpoint_id), checkpoint_id=checkpoint_id)
        if MODEL in self.states:  # (TorchTitan flattens the model's state into the top level: it loads it itself)
            self.states[MODEL].load_state_dict(state_dict)

    def _reader(self, checkpoint_id: str) -> StorageReader:
        """arrayckpt's reader, but for a local step directory holding DCP's files and no arrayckpt checkpoint (a
        step saved before the switch to arrayckpt), which DCP's ``FileSystemReader`` reads."""
        local = "://" not in checkpoint_id
        if local and not os.path.lexists(os.path.join(checkpoint_id, ROOT_METADATA)) and os.path.isfile(
                os.path.join(checkpoint_id, MARKER_NAME)):
            return dcp.FileSystemReader(checkpoint_id)
        return ArrayckptReader(checkpoint_id, allow_pickle=self.allow_pickle, storage_options=self.storage_options)
