"""The DCP marker (spec §2.1): a file ``.metadata`` at the root of a checkpoint, for tools that find PyTorch DCP
checkpoints by that name, and that DCP's own reader cannot misread.

Trainers built on DCP find their last checkpoint by listing ``step-N`` directories and keeping those that hold a
``.metadata`` file (TorchTitan's ``CheckpointManager._find_load_step``; DCP writes that file last, as its commit).
An arrayckpt checkpoint has none, so such a trainer switched to :class:`arrayckpt.dcp.ArrayckptWriter` would find
no checkpoint, log "fresh start" and train from step 1, overwriting the step it ignored at its next interval.

The marker makes the directory recognisable without pretending to be DCP's format. Its bytes are fixed: a pickle
(DCP's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with ``pickle.load``) whose only effect is to
raise, while it is unpickled, ``KeyError`` with :data:`MESSAGE`: a DCP reader pointed at an arrayckpt checkpoint
stops there and says what to use instead, never reading a wrong state. It is the pickle of ``operator.getitem({},
MESSAGE)`` — standard-library names only, nothing of arrayckpt's is imported by whoever unpickles it — and arrayckpt
never unpickles it: it recognises it by comparing bytes (:func:`is_marker`).
"""

from __future__ import annotations

import struct

__all__ = ["MARKER", "MARKER_NAME", "MESSAGE", "is_marker"]

MARKER_NAME = ".metadata"  # the name DCP's FileSystemWriter gives its metadata file, and DCP-based tools look for

MESSAGE = ("this directory is an arrayckpt checkpoint, not a DCP FileSystemWriter one (its .metadata is arrayckpt's "
           "marker): load it with torch.distributed.checkpoint.load(state, storage_reader="
           "arrayckpt.dcp.ArrayckptReader(path)) or arrayckpt.load(state, path)")


def _marker() -> bytes:
    """The pickle (protocol 2) of the call ``operator.getitem({}, MESSAGE)``, opcode by opcode, so that every writer
    makes the same bytes whatever its Python: PROTO 2, GLOBAL, EMPTY_DICT, BINUNICODE, TUPLE2, REDUCE, STOP."""
    text = MESSAGE.encode()
    return b"\x80\x02coperator\ngetitem\n}X" + struct.pack("<I", len(text)) + text + b"\x86R."


MARKER: bytes = _marker()


def is_marker(data: bytes) -> bool:
    """Whether ``data`` is arrayckpt's marker (a comparison of bytes: nothing is unpickled)."""
    return data == MARKER
