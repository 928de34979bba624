"""Saving with chunk targets other than the default, so that small tensors get the layout big ones get.

The public ``save`` and ``async_save`` always plan with the default chunk policy; tests pass another one through
the write layer's internal entry points (``save_with``, ``async_save_with``), which take a ``SaveSetup``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from arrayckpt._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from arrayckpt._write.asynchronous import SaveHandle, async_save_with
from arrayckpt._write.options import SaveOptions, SaveSetup
from arrayckpt._write.save import save_with


@dataclass(frozen=True)
class Chunking:
    """A chunk policy for a test's saves, with a name for conditions on it (``"whole"``, ``"sharded"``)."""

    name: str
    policy: ChunkPolicy

    @property
    def setup(self) -> SaveSetup:
        """A ``SaveSetup`` with this policy."""
        return SaveSetup(chunking=self.policy)

    def save(self, state: Mapping[str, Any], path: str | os.PathLike[str], **options: Any) -> None:
        """``arrayckpt.save(state, path, **options)``, planned with this policy."""
        save_with(state, path, SaveOptions(**options), self.setup)

    def async_save(self, state: Any, path: str | os.PathLike[str], *, if_busy: Any = "wait", keep_copy: bool = False,
                   **options: Any) -> SaveHandle:
        """``arrayckpt.async_save(state, path, **options)``, planned with this policy."""
        return async_save_with(state, path, SaveOptions(**options), if_busy=if_busy, keep_copy=keep_copy,
                               setup=self.setup)


def small_chunks(inner: int, outer: int) -> Chunking:
    """Inner chunks of about ``inner`` bytes in outer chunks of about ``outer`` bytes (the other limits of the
    default policy stay), and only replicated scalars (at most 8 bytes) gathered on one writer: small tensors get the
    layout and the writers big ones get."""
    return Chunking(f"{inner}/{outer}", ChunkPolicy(inner_chunk_bytes=inner, outer_chunk_bytes=outer,
                                                    gather_piece_bytes=8))


WHOLE = Chunking("whole", DEFAULT_CHUNKING)  # small tensors are one chunk each
SHARDED = Chunking("sharded", small_chunks(16, 64).policy)  # every non-trivial tensor split, and sharded
