"""arrayckpt as the storage of PyTorch Distributed Checkpoint (DCP): one argument switches a DCP user over::

    import torch.distributed.checkpoint as dcp
    from arrayckpt.dcp import ArrayckptReader, ArrayckptWriter

    dcp.save(state, storage_writer=ArrayckptWriter("ckpt/step-100"))
    dcp.load(state, storage_reader=ArrayckptReader("ckpt/step-100"))

Every checkpoint :class:`ArrayckptWriter` writes is a normal arrayckpt checkpoint: ``arrayckpt.open``,
``arrayckpt.load`` (at any world size), ``arrayckpt verify``, zarr-python and TensorStore all read it. DCP still
plans (flattening, deduplication of replicated data, one writer per shard; ``dcp.async_save`` with DCP's own staging
works too); arrayckpt lays out the arrays with their chunks aligned to the shards, writes every rank's chunks
concurrently with checksums, and commits the root document last, so a failed save commits nothing and leaves the
previous checkpoint at the path whole. As with DCP's ``FileSystemWriter``, saving again to a path replaces the
checkpoint there (``overwrite=True`` by default), atomically; DCP's storage arguments and options are accepted or
refused as ``_integrations/dcp_options.py`` and the DCP guide's table say. :class:`ArrayckptReader` loads any arrayckpt
checkpoint (saved by ``arrayckpt.save`` or the writer, converted, a delta chain, on object storage) into any
DCP-planned state, each rank reading only the slices it needs. Both take the path as an argument or as DCP's
``checkpoint_id`` (torch cannot pick them by the id alone: ``dcp.save(state, checkpoint_id=p)`` without a
``storage_writer`` always chooses DCP's ``FileSystemWriter`` or its fsspec writer).

The implementation is in ``arrayckpt/_integrations/`` (``dcp_storage.py``, ``dcp_reader.py``, ``dcp_keys.py``,
``dcp_values.py``, ``dcp_options.py``), whose docstrings give the design: the call order, how DCP's keys map to
arrayckpt's, and what a failure leaves.
"""

from __future__ import annotations

from ._integrations.dcp_reader import ArrayckptReader
from ._integrations.dcp_storage import ArrayckptWriter

__all__ = ["ArrayckptReader", "ArrayckptWriter"]
