"""Reading the chunks of a DCP checkpoint straight into their place in the whole tensor.

DCP's ``storage_data`` says where each saved chunk of a tensor is: a ``torch.save`` payload at (offset, length)
of a ``.distcp`` file — a small zip whose ``data.pkl`` describes the tensor and whose ``data/<key>`` record,
stored uncompressed, holds its bytes. Each chunk's ``data.pkl`` is read with an allow-list unpickler
(:class:`_PayloadUnpickler`, which builds nothing), and its bytes are read straight into their place, so a
tensor is in memory once (DCP's reader ``torch.load``s each chunk into a tensor of its own and copies it over:
twice the memory). Payloads this does not recognise (DCP's stream extensions such as compression,
non-contiguous strides, big-endian files) make :func:`read_in_place` return ``None``: the caller reads that
tensor through DCP itself.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import sys
import zipfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, cast

import numpy as np
import numpy.typing as npt
import torch

from .._errors import FormatError
from .torch_save import LEGACY_STORAGES

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["append_payload", "check_chunks", "check_data_files", "read_in_place", "storage_index"]

_READ_BUFFER = 16 << 20  # bounce buffer for a chunk whose place in the whole tensor is not contiguous


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype | None  # None: untyped (bytes)


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype | None
    key: str
    numel: int  # in elements of ``dtype``, in bytes when untyped


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _rebuild_v2(storage: object, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *rest: object) \
        -> _TensorRef:
    if not isinstance(storage, _StorageRef) or storage.dtype is None:
        raise pickle.UnpicklingError("_rebuild_tensor_v2 of something other than a typed storage")
    return _TensorRef(storage, int(offset), tuple(map(int, size)), tuple(map(int, stride)), storage.dtype)


def _rebuild_v3(storage: object, offset: int, size: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool,
                hooks: object, dtype: object, *rest: object) -> _TensorRef:
    if not isinstance(storage, _StorageRef) or storage.dtype is not None or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("_rebuild_tensor_v3 of something other than an untyped storage")
    return _TensorRef(storage, int(offset), tuple(map(int, size)), tuple(map(int, stride)), dtype)


class _PayloadUnpickler(pickle.Unpickler):
    """Reads the ``data.pkl`` of a ``torch.save``d plain tensor into a :class:`_TensorRef`, allocating nothing.

    Only torch's tensor-rebuilding functions (replaced by stand-ins), storage classes, dtypes and
    ``OrderedDict`` are admitted; anything else is refused (and the payload is then read through DCP).
    """

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in LEGACY_STORAGES:
            return _StorageType(LEGACY_STORAGES[name])
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor payload")

    def persistent_load(self, pid: object) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[4], int)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return _StorageRef(pid[1].dtype, str(pid[2]), pid[4])


class _FileView(io.RawIOBase):
    """The bytes ``[start, start + length)`` of an open binary file, as a seekable file of their own."""

    def __init__(self, file: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise OSError("seek before the start of the payload")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        got = os.preadv(self._file.fileno(), [view[:n]], self._start + self._pos) if n else 0
        self._pos += got
        return got


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride), strict=True):
        if n > 1 and s != expected:
            return False
        expected *= n
    return True


def _payload_start(file: BinaryIO, info: _StorageInfo, dtype: torch.dtype, sizes: tuple[int, ...]) -> int | None:
    """The file offset of the first byte of the chunk saved at ``info`` (a ``_StorageInfo``), or ``None`` when
    the payload is not a plain, uncompressed, little-endian, C-contiguous ``torch.save`` of that chunk."""
    if getattr(info, "transform_descriptors", None) or sys.byteorder != "little":
        return None
    try:
        archive = zipfile.ZipFile(_FileView(file, int(info.offset), int(info.length)))
        pickles = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pickles) != 1 or archive.getinfo(pickles[0]).file_size > 1 << 20:
            return None
        prefix = pickles[0][: -len("data.pkl")]
        if f"{prefix}byteorder" in archive.namelist() and archive.read(f"{prefix}byteorder") != b"little":
            return None
        ref = _PayloadUnpickler(io.BytesIO(archive.read(pickles[0]))).load()
        if not isinstance(ref, _TensorRef) or ref.dtype != dtype or ref.size != sizes or \
                not _contiguous(ref.size, ref.stride) or ref.offset < 0:
            return None
        itemsize = torch.empty((), dtype=dtype).element_size()
        storage_bytes = ref.storage.numel * (itemsize if ref.storage.dtype is not None else 1)
        needed = (ref.offset + math.prod(sizes)) * itemsize
        record = archive.getinfo(f"{prefix}data/{ref.storage.key}")
        if record.compress_type != zipfile.ZIP_STORED or needed > min(storage_bytes, record.file_size):
            return None
        header = os.pread(file.fileno(), 30, int(info.offset) + record.header_offset)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            return None
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        record_start = record.header_offset + 30 + name_length + extra_length
        if record_start + needed > int(info.length):
            return None
        return int(info.offset) + record_start + ref.offset * itemsize
    except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError,
            AttributeError, IndexError):
        return None


def check_chunks(src: str | os.PathLike[str], fqn: str, item: TensorStorageMetadata) -> None:
    """The saved chunks of a tensor lie inside it, do not overlap and cover it (else parts would be garbage)."""
    size = tuple(item.size)
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
    for offsets, sizes in chunks:
        if len(offsets) != len(size) or len(sizes) != len(size) or \
                any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
            raise FormatError(f"{src}: tensor {fqn!r} has a chunk at {list(offsets)} of size {list(sizes)}, "
                              f"outside its shape {list(size)}")
    chunks = [c for c in chunks if math.prod(c[1])]
    if sum(math.prod(sizes) for _, sizes in chunks) != math.prod(size) or \
            not (_tiling_grid(chunks, size) or not _overlap(chunks)):
        raise FormatError(f"{src}: the saved chunks of tensor {fqn!r} do not cover its shape {list(size)} "
                          "exactly once (gaps or overlaps)")


def _tiling_grid(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], size: tuple[int, ...]) -> bool:
    """Whether the chunks are exactly the grid that some partition of each dimension makes (what DTensor and
    sharded-tensor saves produce): then they tile the tensor, found in O(n log n) rather than pairwise."""
    counts = 1
    for d, extent in enumerate(size):
        position = 0
        for offset, length in sorted({(o[d], n[d]) for o, n in chunks}):
            if offset != position:
                return False
            position += length
        if position != extent:
            return False
        counts *= len({(o[d], n[d]) for o, n in chunks})
    return len(set(chunks)) == len(chunks) == counts


def _overlap(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two (non-empty) chunks overlap: pairwise, vectorised, for layouts that are not a grid."""
    if len(chunks) < 2:
        return False
    start = np.array([c[0] for c in chunks], dtype=np.int64).reshape(len(chunks), -1)
    end = start + np.array([c[1] for c in chunks], dtype=np.int64).reshape(len(chunks), -1)
    for i in range(0, len(chunks), 256):  # blocks of rows: bounded temporaries
        hit = (start[i:i + 256, None, :] < end[None, :, :]) & (start[None, :, :] < end[i:i + 256, None, :])
        hit = cast(np.ndarray, hit.all(-1))
        hit[np.arange(hit.shape[0]), np.arange(i, i + hit.shape[0])] = False
        if hit.any():
            return True
    return False


def _payload_file(src: Path, relative: object) -> Path:
    """The ``.distcp`` file a ``_StorageInfo`` names, which must lie inside the checkpoint directory."""
    if not isinstance(relative, str) or not relative or os.path.isabs(relative) or "\x00" in relative or \
            os.path.normpath(relative).split(os.sep)[0] == "..":
        raise FormatError(f"{src}: the metadata names a data file outside the checkpoint: {relative!r}")
    return src / relative


def read_in_place(src: Path, fqn: str, item: TensorStorageMetadata,
                  storage: Mapping[tuple[str, tuple[int, ...]], _StorageInfo]) \
        -> torch.Tensor | None:
    """The whole tensor ``fqn``, each saved chunk read straight into its place (``None``: some chunk's payload
    is not one this reader recognises; read the tensor through DCP)."""
    dtype, size = item.properties.dtype, tuple(item.size)
    parts = []
    for chunk in item.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if not math.prod(sizes):
            continue
        info = storage.get((fqn, offsets))
        if info is None:
            return None
        parts.append((offsets, sizes, _payload_file(src, getattr(info, "relative_path", None)), info))
    located = []
    for offsets, sizes, file, info in parts:
        try:
            with open(file, "rb") as f:
                start = _payload_start(f, info, dtype, sizes)
        except FileNotFoundError:
            raise FormatError(f"{src}: data file {file.name} of tensor {fqn!r} is missing") from None
        if start is None:
            return None
        located.append((offsets, sizes, file, start))
    out = torch.empty(size, dtype=dtype)
    if not out.numel():
        return out
    whole = out.reshape(-1).view(torch.uint8).numpy()
    itemsize = out.element_size()
    strides = [itemsize * math.prod(size[d + 1:]) for d in range(len(size))]
    buffer: list[npt.NDArray[np.uint8]] = []
    for offsets, sizes, file, start in located:
        first = sum(o * s for o, s in zip(offsets, strides, strict=True))
        region = np.lib.stride_tricks.as_strided(whole[first:], (*sizes, itemsize), (*strides, 1), writeable=True)
        with open(file, "rb") as f:
            _read_region(f.fileno(), start, region, buffer, f"{file.name} (tensor {fqn!r})")
    return out


def _read_region(fd: int, offset: int, region: npt.NDArray[np.uint8], buffer: list[npt.NDArray[np.uint8]], where: str) \
        -> None:
    """Fill ``region`` (a uint8 view of part of a tensor, last axis the element's bytes) from ``fd`` at ``offset``,
    where its elements are stored contiguously in C order; non-contiguous regions go through a bounded buffer."""
    if region.flags.c_contiguous:
        _pread_into(fd, region.reshape(-1), offset, where)
        return
    if region.nbytes <= _READ_BUFFER:
        if not buffer:
            buffer.append(np.empty(_READ_BUFFER, dtype=np.uint8))
        staged = buffer[0][:region.nbytes]
        _pread_into(fd, staged, offset, where)
        region[...] = staged.reshape(region.shape)
        return
    row = region.nbytes // region.shape[0]
    if row > _READ_BUFFER:
        for i in range(region.shape[0]):
            _read_region(fd, offset + i * row, region[i], buffer, where)
        return
    step = _READ_BUFFER // row
    for i in range(0, region.shape[0], step):
        _read_region(fd, offset + i * row, region[i:i + step], buffer, where)


def _pread_into(fd: int, target: npt.NDArray[np.uint8], offset: int, where: str) -> None:
    view = target.data.cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise FormatError(f"{where}: the data file ends {len(view) - done} bytes early")
        done += got


def check_data_files(src: Path, storage: Mapping[tuple[str, tuple[int, ...]], _StorageInfo],
                     tensors: Collection[str]) -> None:
    """Every data file the metadata names is there: else the first item it holds is named (one of ``tensors``
    first), before anything is read (a save's rank whose ``__<rank>_0.distcp`` was not copied)."""
    held: dict[str, list[str]] = collections.defaultdict(list)
    for (fqn, _), info in storage.items():
        held[str(getattr(info, "relative_path", ""))].append(f"{'tensor' if fqn in tensors else 'value'} {fqn!r}")
    for name, items in sorted(held.items()):
        if name and not _payload_file(src, name).exists():
            items.sort(key=lambda item: not item.startswith("tensor"))
            more = f" and {len(items) - 1} more items" if len(items) > 1 else ""
            raise FormatError(f"{src}: data file {name} is missing, which holds {items[0]}{more}; the DCP checkpoint "
                              "is incomplete (a rank's file not copied, or a save cut short)")


def storage_index(metadata: Metadata) -> dict[tuple[str, tuple[int, ...]], _StorageInfo]:
    """``storage_data`` by (fqn, chunk offsets)."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return {}
    return {(index.fqn, tuple(index.offset or ())): info for index, info in storage.items()
            if hasattr(index, "fqn")}


def append_payload(stream: BinaryIO, data: torch.Tensor | io.BytesIO) -> tuple[int, int]:
    """``data`` appended to ``stream`` as torch's ``FileSystemWriter`` writes an item (its default
    ``torch_save`` format, no stream extensions): a plain value's bytes as they are, a tensor as a
    ``torch.save`` of it, which DCP's reader ``torch.load``s from (offset, length) and :func:`read_in_place`
    reads in place. Returns (offset, length) of what was appended."""
    offset = stream.tell()
    if isinstance(data, io.BytesIO):
        stream.write(data.getbuffer())
    else:
        tensor = data.detach().cpu()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # torch.save writes a view's whole storage
        torch.save(tensor, stream)
        del tensor
    return offset, stream.tell() - offset
