"""PyTorch Distributed Checkpoint (DCP: ``.metadata`` + ``*.distcp``) to and from arrayckpt, one tensor at a time.

DCP's ``.metadata`` is a pickle, and ``FileSystemReader.read_metadata`` unpickles it with no restriction:
opening a DCP checkpoint from elsewhere could run code. Here it is read by :class:`MetadataUnpickler`,
which admits only DCP's metadata classes and the few torch and builtin types they hold. DCP's default
planner also loads non-tensor values with ``torch.load(weights_only=False)``; ours uses
``weights_only=True``. Megatron's ``torch_dist`` format is DCP underneath and converts the same way.

Reading: the metadata's ``storage_data`` says where each saved chunk of a tensor is, a ``torch.save``
payload at (offset, length) of a ``.distcp`` file: a small zip whose ``data.pkl`` describes the tensor
and whose ``data/<key>`` record, stored uncompressed, holds its bytes. Each chunk's ``data.pkl`` is read
with an allow-list unpickler (:class:`_PayloadUnpickler`, which builds nothing), and its bytes are read
straight into their place in the whole tensor, so a tensor is in memory once (DCP's reader ``torch.load``s
each chunk into a tensor of its own and copies it over, twice the memory). Payloads this does not
recognise (DCP's stream extensions such as compression, non-contiguous strides, big-endian files) are
read through DCP itself (``no_dist``), one tensor at a time.

Writing gives DCP a state of meta tensors and a planner that reads each tensor from arrayckpt only when
DCP writes it, and a ``FileSystemWriter`` whose ``write_data`` writes each item to a ``.distcp`` file of its
own and drops it before reading the next (DCP's own holds the previous tensor while reading the next one).
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import sys
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._convert.common import ConvertResult, Progress, _nested_state, _refuse_existing
from .._errors import FormatError, PickleNotAllowedError
from .._format.manifest import ArrayEntry, PickleEntry
from .._read.checkpoint import Checkpoint
from .._write.stream import write_streaming

__all__ = ["MetadataUnpickler", "from_dcp", "read_dcp_metadata", "to_dcp"]

METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint"
# (module, name) pairs a DCP .metadata pickle may name; nothing else is ever imported.
ALLOWED_GLOBALS = frozenset({
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
})


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``, refusing every global but DCP's metadata classes and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type; refusing to load it")


def read_dcp_metadata(path: str | os.PathLike[str]) -> Any:
    """The ``Metadata`` of the DCP checkpoint in directory ``path``, unpickled with :class:`MetadataUnpickler`."""
    file = Path(path) / METADATA_FILE
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise FormatError(f"{path}: no {METADATA_FILE}; not a DCP checkpoint (or its save did not finish)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise FormatError(f"{file}: not a readable DCP metadata file: {e}") from e
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    if not isinstance(metadata, Metadata):
        raise FormatError(f"{file}: holds a {type(metadata).__name__}, not DCP Metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _reader(path: str | os.PathLike[str], metadata: Any) -> Any:
    """A ``FileSystemReader`` that hands out the safely read metadata instead of unpickling it again."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(os.fspath(path))


def _planner() -> Any:
    """A load planner for flat ``{fqn: target}`` dicts that loads non-tensor values with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # into the caller's dict: with flatten_state_dict=False, self.state_dict may be a copy of it
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return SafeLoadPlanner(flatten_state_dict=False, allow_partial_load=True)


def _dcp_load(state: dict[str, Any], path: str | os.PathLike[str], metadata: Any) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=_reader(path, metadata), planner=_planner(), no_dist=True)


def _set_path(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    """Place ``value`` at ``path``, creating dicts for str keys and lists for int keys, as DCP's unflatten does."""
    node: Any = root
    for part, following in zip(path[:-1], path[1:], strict=True):
        fresh: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (part + 1 - len(node)))
            if node[part] is None:
                node[part] = fresh
            node = node[part]
        else:
            node = node.setdefault(part, fresh)
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


# ------------------------------------------------------------------------------ reading chunks in place

_READ_BUFFER = 16 << 20  # bounce buffer for a chunk whose place in the whole tensor is not contiguous
# torch.save's legacy storage classes (``torch.FloatStorage``...) by name; newer dtypes are saved as an
# ``UntypedStorage`` with the dtype given to ``_rebuild_tensor_v3``.
_LEGACY_STORAGES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16, "CharStorage": torch.int8,
    "ByteStorage": torch.uint8, "BoolStorage": torch.bool, "BFloat16Storage": torch.bfloat16,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}


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


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _TensorRef:
    if not isinstance(storage, _StorageRef) or storage.dtype is None:
        raise pickle.UnpicklingError("_rebuild_tensor_v2 of something other than a typed storage")
    return _TensorRef(storage, int(offset), tuple(map(int, size)), tuple(map(int, stride)), storage.dtype)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
                *rest: Any) -> _TensorRef:
    if not isinstance(storage, _StorageRef) or storage.dtype is not None or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("_rebuild_tensor_v3 of something other than an untyped storage")
    return _TensorRef(storage, int(offset), tuple(map(int, size)), tuple(map(int, stride)), dtype)


class _PayloadUnpickler(pickle.Unpickler):
    """Reads the ``data.pkl`` of a ``torch.save``d plain tensor into a :class:`_TensorRef`, allocating nothing.

    Only torch's tensor-rebuilding functions (replaced by stand-ins), storage classes, dtypes and
    ``OrderedDict`` are admitted; anything else is refused (and the payload is then read through DCP).
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _LEGACY_STORAGES:
            return _StorageType(_LEGACY_STORAGES[name])
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor payload")

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[4], int)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return _StorageRef(pid[1].dtype, str(pid[2]), pid[4])


class _FileView(io.RawIOBase):
    """The bytes ``[start, start + length)`` of an open binary file, as a seekable file of their own."""

    def __init__(self, file: Any, start: int, length: int) -> None:
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

    def readinto(self, buffer: Any) -> int:
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


def _payload_start(file: Any, info: Any, dtype: torch.dtype, sizes: tuple[int, ...]) -> int | None:
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


def _check_chunks(src: Any, fqn: str, item: Any) -> None:
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
    import numpy as np

    start = np.array([c[0] for c in chunks], dtype=np.int64).reshape(len(chunks), -1)
    end = start + np.array([c[1] for c in chunks], dtype=np.int64).reshape(len(chunks), -1)
    for i in range(0, len(chunks), 256):  # blocks of rows: bounded temporaries
        hit = ((start[i:i + 256, None, :] < end[None, :, :]) & (start[None, :, :] < end[i:i + 256, None, :])).all(-1)
        hit[np.arange(hit.shape[0]), np.arange(i, i + hit.shape[0])] = False
        if hit.any():
            return True
    return False


def _payload_file(src: Path, relative: Any) -> Path:
    """The ``.distcp`` file a ``_StorageInfo`` names, which must lie inside the checkpoint directory."""
    if not isinstance(relative, str) or not relative or os.path.isabs(relative) or \
            os.path.normpath(relative).split(os.sep)[0] == "..":
        raise FormatError(f"{src}: the metadata names a data file outside the checkpoint: {relative!r}")
    return src / relative


def _read_in_place(src: Path, fqn: str, item: Any, storage: Mapping[tuple[str, tuple[int, ...]], Any]) \
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
    import numpy as np

    whole = out.reshape(-1).view(torch.uint8).numpy()
    itemsize = out.element_size()
    strides = [itemsize * math.prod(size[d + 1:]) for d in range(len(size))]
    buffer: list[np.ndarray] = []
    for offsets, sizes, file, start in located:
        first = sum(o * s for o, s in zip(offsets, strides, strict=True))
        region = np.lib.stride_tricks.as_strided(whole[first:], (*sizes, itemsize), (*strides, 1), writeable=True)
        with open(file, "rb") as f:
            _read_region(f.fileno(), start, region, buffer, f"{file.name} (tensor {fqn!r})")
    return out


def _read_region(fd: int, offset: int, region: Any, buffer: list[Any], where: str) -> None:
    """Fill ``region`` (a uint8 view of part of a tensor, last axis the element's bytes) from ``fd`` at ``offset``,
    where its elements are stored contiguously in C order; non-contiguous regions go through a bounded buffer."""
    import numpy as np

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


def _pread_into(fd: int, target: Any, offset: int, where: str) -> None:
    view = memoryview(target).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise FormatError(f"{where}: the data file ends {len(view) - done} bytes early")
        done += got


def _storage_index(metadata: Any) -> dict[tuple[str, tuple[int, ...]], Any]:
    """``storage_data`` by (fqn, chunk offsets)."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return {}
    return {(index.fqn, tuple(index.offset or ())): info for index, info in storage.items()
            if hasattr(index, "fqn")}


def from_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
             allow_pickle: bool = False, progress: Progress | None = None) -> ConvertResult:
    """A DCP checkpoint (saved by any number of ranks) into arrayckpt, one whole tensor at a time.

    The nesting of the saved state dict is rebuilt from DCP's planner data, so keys, lists and plain values
    come out as ``arrayckpt.save`` would have written the original state (``{"model": ..., "optim": ...}``).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = read_dcp_metadata(src)
    entries = metadata.state_dict_metadata
    storage = _storage_index(metadata)
    values: dict[str, Any] = {fqn: None for fqn, m in entries.items() if isinstance(m, BytesStorageMetadata)}
    if values:
        _dcp_load(values, src, metadata)  # small: the plain values, with weights_only=True
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    skeleton: dict[Any, Any] = {}
    tensors: dict[str, Any] = {}
    for fqn, item in entries.items():
        path = tuple(paths.get(fqn, (fqn,))) or (fqn,)
        if isinstance(item, TensorStorageMetadata):
            _check_chunks(src, fqn, item)
            tensors[".".join(str(p) for p in path)] = (fqn, item)
            _set_path(skeleton, path, torch.empty(tuple(item.size), dtype=item.properties.dtype, device="meta"))
        else:
            _set_path(skeleton, path, values[fqn])

    def fetch(key: str) -> torch.Tensor:
        fqn, item = tensors[key]
        tensor = _read_in_place(Path(src), fqn, item, storage)
        if tensor is not None:
            return tensor
        target = {fqn: torch.empty(tuple(item.size), dtype=item.properties.dtype)}
        _dcp_load(target, src, metadata)
        return target[fqn]

    write_streaming(skeleton, fetch, dst, overwrite=overwrite, allow_pickle=allow_pickle,
                    source=f"dcp: {Path(src).name}", progress=progress)
    nbytes = sum(torch.empty((), dtype=i.properties.dtype).element_size() * i.size.numel() for _, i in tensors.values())
    return ConvertResult("dcp", "arrayckpt", len(tensors), nbytes, (str(dst),))


def to_dcp(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
           progress: Progress | None = None) -> ConvertResult:
    """An arrayckpt checkpoint into a single-rank DCP checkpoint (loadable by DCP on any number of ranks).

    DCP is given the nested state with meta tensors; each tensor is read from arrayckpt only when DCP's
    writer asks for it and goes to a ``.distcp`` file of its own, so memory stays near one tensor.
    Per-rank entries are skipped (DCP has no such notion); pickled values need the checkpoint opened with
    ``allow_pickle=True``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    target = Path(dst)
    if target.exists() and any(target.iterdir()):
        _refuse_existing(target, overwrite)
    for key, entry in checkpoint.manifest.entries.items():
        if isinstance(entry, PickleEntry) and not checkpoint.allow_pickle:
            raise PickleNotAllowedError(f"{checkpoint.location}: value {key!r} is pickled; converting it needs "
                                        "allow_pickle=True (--allow-pickle), only for checkpoints you trust")
    state, skipped = _nested_state(checkpoint, lambda key: torch.empty(checkpoint[key].shape,
                                                                       dtype=checkpoint[key].dtype, device="meta"))
    keys = {k for k, e in checkpoint.manifest.entries.items() if isinstance(e, ArrayEntry)}
    total = sum(checkpoint[k].nbytes for k in keys)
    done = [0]

    class StreamingPlanner(DefaultSavePlanner):
        """Resolves each tensor from arrayckpt when DCP's writer reaches it (and not before)."""

        def resolve_data(self, write_item: Any) -> Any:
            fqn = write_item.index.fqn
            if fqn not in keys:
                return super().resolve_data(write_item)
            tensor = checkpoint[fqn].torch()
            done[0] += tensor.nbytes
            if progress is not None:
                progress(done[0], total)
            return tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        writer = _writer(target, overwrite)
        dcp.save(state, storage_writer=writer, planner=StreamingPlanner(), no_dist=True)
    files = tuple(sorted(str(p) for p in target.iterdir()))
    return ConvertResult("arrayckpt", "dcp", len(keys), total, files, skipped)



def _writer(path: Path, overwrite: bool) -> Any:
    """A ``FileSystemWriter`` that writes each item to a file of its own and holds one item at a time.

    DCP's ``write_data`` keeps the last tensor written (its ``tensor_dict``, and the loop variable) while it
    resolves the next one, so converting held two tensors at once. Here each item is resolved, written
    with ``torch.save`` (exactly what DCP writes: its reader ``torch.load``s the bytes at (offset, length) of
    a ``.distcp`` file), made durable and dropped before the next; the planning, the ``.metadata`` and its
    commit stay DCP's own.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class OneItemAtATimeWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            prefix = plan.storage_data.prefix
            results = []
            for i, item in enumerate(plan.items):
                name = f"{prefix}{i}.distcp"
                data = planner.resolve_data(item)
                with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        tensor = data.detach().cpu()
                        if tensor.untyped_storage().nbytes() != tensor.nbytes:
                            tensor = tensor.clone()  # torch.save writes a view's whole storage
                        torch.save(tensor, stream)
                        del tensor
                    del data
                    stream.flush()
                    length = stream.tell()
                    if self.sync_files:
                        os.fsync(stream.fileno())
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, 0, length)))
            future: Any = Future()
            future.set_result(results)
            return future

    return OneItemAtATimeWriter(os.fspath(path), single_file_per_rank=False, thread_count=1, overwrite=overwrite)
