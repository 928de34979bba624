"""Decoding a stored chunk file from its bytes, for checks of chunks held in memory (a copy verifying what it
streams, ``_tools/copy.py``).

The bytes are put in a TensorStore in-memory store under their chunk key and read back through the zarr3 driver
with the array's own metadata: every codec and every crc32c (of the chunk, its inner chunks, its shard index) is
applied exactly as a read of the file would apply it, for any pipeline the reader accepts.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from .._errors import CorruptCheckpointError
from .._format.jsontypes import JSON
from .arrays import array_spec

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["ChunkDecoder"]


class ChunkDecoder:
    """Decodes the stored chunk files of one array (its metadata as in the root document); thread-safe. Decoders of
    several arrays may share one ``context`` (its in-memory store) under different ``path`` prefixes."""

    def __init__(self, metadata: JSON, context: ts.Context | None = None, path: str = "chunks/") -> None:
        import tensorstore as ts  # on first use (CLI start-up)
        context = context if context is not None else ts.Context()  # a store nothing else reads or writes
        kvstore: JSON = {"driver": "memory", "path": path}
        self._array = ts.open(array_spec(kvstore, metadata), context=context, open=True,
                              assume_metadata=True).result()
        self._store = ts.KvStore.open(kvstore, context=context).result()
        self._lock = threading.Lock()  # keys in flight (two copies of one key would race)
        self._busy: set[str] = set()

    def decode(self, name: str, data: bytes, index: tuple[slice, ...], file: str) -> np.ndarray:
        """The in-bounds part ``index`` of the chunk stored under key ``name`` whose file holds ``data``, decoded;
        ``CorruptCheckpointError`` naming ``file`` when a checksum fails or the bytes do not decode."""
        with self._lock:
            if name in self._busy:
                raise RuntimeError(f"{file}: decoded twice at once")
            self._busy.add(name)
        try:
            self._store.write(name, data).result()
            try:
                return np.asarray(self._array[index].read().result())
            except Exception as e:  # the bytes are in memory: any failure is theirs
                raise CorruptCheckpointError(f"{file}: cannot be decoded: {e}") from None
            finally:
                self._store.write(name, None).result()
        finally:
            with self._lock:
                self._busy.discard(name)
