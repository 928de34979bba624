"""Chunk files sent between ranks over ``torch.distributed`` point-to-point calls on the job's process group.

Both ends know every transfer in advance (who sends which files to whom, and their sizes: from the step's record),
so each pair of ranks exchanges one message of exactly known length, posted with ``isend``/``irecv`` all at once
(no rank waits for another's turn). The receiver checks every file's crc32c against the record before it is used;
a sender whose file changed since it was checked sends what it has (padded or cut to the agreed length), which the
receiver then refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._errors import CollectiveError, CorruptCheckpointError
from .._torch.dist import Group
from .record import FileSum, file_sum

__all__ = ["FileRef", "Transfer", "exchange_files"]


@dataclass(frozen=True)
class FileRef:
    """One chunk file of a memory step, with what its bytes must be."""

    array_path: str
    key: str
    sum: FileSum

    def __str__(self) -> str:
        return f"{self.array_path}/{self.key}"


@dataclass(frozen=True)
class Transfer:
    """Files that rank ``src`` sends to rank ``dst``."""

    src: int
    dst: int
    files: tuple[FileRef, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.sum.size for f in self.files)


def exchange_files(group: Group, transfers: Sequence[Transfer], read: Callable[[FileRef], bytes],
                   write: Callable[[FileRef, memoryview], None], where: str) -> int:
    """Run this rank's part of ``transfers`` (every rank passes the same list): send the files it is the source of
    (``read`` gives their bytes), receive those it is the destination of, check each against its record and hand it
    to ``write``. Returns the bytes received. Raises ``CorruptCheckpointError`` naming the first file that arrived
    damaged, ``CollectiveError`` when a peer is gone."""
    import torch
    import torch.distributed as dist

    me = group.rank
    pending = []
    incoming: list[tuple[Transfer, torch.Tensor]] = []
    try:
        for transfer in transfers:
            if transfer.nbytes == 0 or me not in (transfer.src, transfer.dst) or transfer.src == transfer.dst:
                continue
            if transfer.src == me:
                payload = bytearray()
                for ref in transfer.files:
                    data = read(ref)
                    payload += data[:ref.sum.size].ljust(ref.sum.size, b"\0")
                tensor = torch.frombuffer(payload, dtype=torch.uint8)
                pending.append(dist.isend(tensor, dst=group.global_rank(transfer.dst),
                                          group=group.cpu_pg))
            else:
                buffer = torch.empty(transfer.nbytes, dtype=torch.uint8)
                pending.append(dist.irecv(buffer, src=group.global_rank(transfer.src),
                                          group=group.cpu_pg))
                incoming.append((transfer, buffer))
        for work in pending:
            assert work is not None  # (None only on a rank outside the group)
            work.wait()
    except RuntimeError as e:
        raise CollectiveError(f"{where}: rank {me}: sending chunk files to or from a peer failed (a rank died or hung "
                              f"past the process group's timeout): {e}") from e
    received = 0
    for transfer, buffer in incoming:
        view = buffer.numpy().data.cast("B")
        offset = 0
        for ref in transfer.files:
            piece = view[offset:offset + ref.sum.size]
            offset += ref.sum.size
            if file_sum(piece) != ref.sum:
                raise CorruptCheckpointError(f"{where}: chunk file {ref} from rank {transfer.src} does not match the "
                                             "step's record (size or crc32c): refused")
            write(ref, piece)
            received += ref.sum.size
    return received
