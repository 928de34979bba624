"""Converters between arrayckpt and torch.save files, Hugging Face safetensors and PyTorch DCP.

Every converter streams: the source's index (safetensors header, DCP ``.metadata``, the pickle of a
torch.save file) gives the structure first, then tensors are read one at a time and written by
:func:`arrayckpt._stream.write_streaming` (into arrayckpt) or appended to the target file (out of it).
Bit patterns are kept exactly (bfloat16 and float8 included); nothing is cast.

Limits: safetensors holds tensors only, so plain values are left out (and listed in the result); tensors that
share storage (tied weights) are stored separately.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, StateError
from .._format.manifest import ArrayEntry, PerRankEntry
from .._read.checkpoint import Checkpoint, open_checkpoint
from .._torch.state import walk
from .._write.stream import write_streaming

__all__ = ["FORMATS", "ConvertResult", "convert", "detect_format"]

FORMATS = ("arrayckpt", "dcp", "safetensors", "torch")
SAFETENSORS_HEADER_LIMIT = 100 << 20  # the safetensors library's own limit on the JSON header
SAFETENSORS_INDEX = "model.safetensors.index.json"
ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote, and the entries of the source the target format could not hold."""

    source_format: str
    target_format: str
    tensors: int
    bytes: int
    files: tuple[str, ...]
    skipped: tuple[str, ...] = ()  # keys left out (e.g. plain values going to safetensors)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "files": list(self.files), "skipped": list(self.skipped)}


# ------------------------------------------------------------------------------------------ detection


def detect_format(path: str | os.PathLike[str]) -> str | None:
    """The format of an existing checkpoint at ``path`` (``None`` when it cannot tell)."""
    p = Path(path)
    if p.is_dir():
        if (p / "zarr.json").is_file():
            return "arrayckpt"
        if (p / ".metadata").is_file():
            return "dcp"
        if list(p.glob("*.safetensors.index.json")) or list(p.glob("*.safetensors")):
            return "safetensors"
        return None
    if p.name.endswith((".safetensors", ".safetensors.index.json")):
        return "safetensors"
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(2)
        if magic == b"PK" or magic[:1] == b"\x80":  # torch.save's zip format, or its legacy pickle format
            return "torch"
    return None


def _target_format(path: str | os.PathLike[str]) -> str | None:
    """The format a target path's name implies (``None``: ambiguous, say it with ``to=``)."""
    name = Path(path).name
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "torch"
    return None


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, from_format: str | None = None,
            to_format: str | None = None, overwrite: bool = False, allow_pickle: bool = False,
            max_shard_bytes: int | None = None, progress: Progress | None = None) -> ConvertResult:
    """Convert the checkpoint at ``src`` into ``dst``; one side is arrayckpt, the other torch, safetensors or dcp.

    Formats are detected from ``src`` (and from ``dst``'s suffix: ``.safetensors``, ``.pt``) unless given.
    ``max_shard_bytes`` splits safetensors output into shards with a ``model.safetensors.index.json``.

    >>> import arrayckpt, torch, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> torch.save({"w": torch.ones(2, 3), "step": 4}, os.path.join(d, "model.pt"))
    >>> arrayckpt.convert(os.path.join(d, "model.pt"), os.path.join(d, "ckpt")).tensors
    1
    >>> arrayckpt.open(os.path.join(d, "ckpt")).plain_values["step"]
    4
    """
    source = from_format or detect_format(src)
    if source is None:
        if not os.path.exists(src):
            raise CheckpointNotFoundError(f"{src}: nothing here to convert")
        raise FormatError(f"{src}: cannot tell its format; say it with --from ({', '.join(FORMATS)})")
    target = to_format or ("arrayckpt" if source != "arrayckpt" else _target_format(dst))
    if target is None:
        raise FormatError(f"{dst}: cannot tell which format to write; say it with --to (dcp, safetensors, torch)")
    for name in (source, target):
        if name not in FORMATS:
            raise FormatError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    if (source == "arrayckpt") == (target == "arrayckpt"):
        raise FormatError(f"converting {source} to {target}: one side must be arrayckpt (convert in two steps)")
    if target == "arrayckpt":
        return _INTO[source](src, dst, overwrite=overwrite, allow_pickle=allow_pickle, progress=progress)
    checkpoint = open_checkpoint(src, allow_pickle=allow_pickle)
    if target == "safetensors":
        return to_safetensors(checkpoint, dst, overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                              progress=progress)
    return _OUT_OF[target](checkpoint, dst, overwrite=overwrite, progress=progress)


def _refuse_existing(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CheckpointExistsError(f"{path}: already exists; pass overwrite=True (--overwrite) to replace it")


# ------------------------------------------------------------------------------------------ torch.save


def from_torch(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
               allow_pickle: bool = False, progress: Progress | None = None) -> ConvertResult:
    """A ``torch.save`` file (a dict, nested) into arrayckpt, loaded with ``weights_only=True``.

    The file is memory-mapped; each tensor is written straight from the mapping and its pages released
    before the next, so resident memory stays near one tensor (legacy non-zip files cannot be mapped and
    load whole).
    """
    try:
        state = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "zip" not in str(e).lower():
            raise
        state = torch.load(src, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise StateError(f"{src}: holds a {type(state).__name__}, not a dict; load it and save "
                         "{'name': obj} with arrayckpt.save instead")
    skeleton, real = _meta_skeleton(state)
    leaves = walk(skeleton).leaves

    def fetch(key: str) -> torch.Tensor:
        return real[id(leaves[key].value)]

    def release(key: str) -> None:
        _release_pages(real[id(leaves[key].value)])

    write_streaming(skeleton, fetch, dst, overwrite=overwrite, allow_pickle=allow_pickle,
                    source=f"torch.save: {Path(src).name}", progress=progress, release=release)
    return _into_result("torch", dst, leaves)


def _meta_skeleton(obj: Any) -> tuple[Any, dict[int, torch.Tensor]]:
    """A copy of nested dicts/lists/tuples with every tensor replaced by a meta tensor (and a map back)."""
    real: dict[int, torch.Tensor] = {}

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
            real[id(meta)] = value
            return meta
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copy(v) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(copy(v) for v in value)
        return value

    return copy(obj), real


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4


def _release_pages(tensor: torch.Tensor) -> None:
    """Drop a memory-mapped tensor's resident pages (they are re-read from the file if touched again).

    Without this, every page of a mapped file stays counted in the process's memory once read, and
    converting a big file would look (and, under memory limits, be charged) like loading it whole.
    """
    if sys.platform != "linux" or not tensor.is_contiguous() or tensor.nbytes < _PAGE:
        return
    start = tensor.data_ptr()
    first = (start + _PAGE - 1) // _PAGE * _PAGE  # whole pages inside the tensor only
    last = (start + tensor.nbytes) // _PAGE * _PAGE
    if last > first:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def to_torch(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
             progress: Progress | None = None) -> ConvertResult:
    """An arrayckpt checkpoint into one ``torch.save`` file (nested as saved), one tensor at a time.

    The file is written as ``torch.save`` writes it (a zip of ``data.pkl`` and one record per tensor, see
    :func:`_write_torch_file`), but each tensor is read from arrayckpt only when its record is written, so
    memory stays near the largest tensor. Pickled values holding tensors of other kinds (parameters,
    subclasses, sparse) fall back to ``torch.save`` of the whole state, in memory at once.
    """
    target = Path(dst)
    _refuse_existing(target, overwrite)
    state, skipped = _nested_state(checkpoint, lambda key: _Deferred(checkpoint, key))
    temp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        try:
            _write_torch_file(state, temp, progress)
        except _NotStreamable:
            temp.unlink(missing_ok=True)
            torch.save(_nested_state(checkpoint, lambda key: checkpoint[key].torch())[0], temp)
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    return ConvertResult("arrayckpt", "torch", len(checkpoint), checkpoint.nbytes, (str(target),), skipped)


class _Deferred:
    """Stands for an arrayckpt tensor in the state being pickled; its bytes are read when its record is written."""

    def __init__(self, checkpoint: Checkpoint, key: str) -> None:
        array = checkpoint[key]
        self.dtype, self.shape, self.nbytes = array.dtype, tuple(array.shape), array.nbytes
        self.read: Callable[[], torch.Tensor] = array.torch


class _NotStreamable(Exception):
    """The state holds something :func:`_write_torch_file` does not write the way ``torch.save`` would."""


class _StorageStub:
    def __init__(self, tensor: _Deferred) -> None:
        self.tensor = tensor


def _write_torch_file(state: Any, path: Path, progress: Progress | None) -> None:
    """``torch.save(state, path)`` where the tensors are :class:`_Deferred`, reading one at a time.

    ``torch.save`` pickles the whole object first, storages by reference (a persistent id naming the
    record ``data/<key>``), then writes each storage as a record: the same is done here, with each
    tensor pickled as torch pickles a contiguous CPU tensor (``_rebuild_tensor_v2`` of a typed storage, or
    ``_rebuild_tensor_v3`` of an untyped storage for dtypes without a legacy storage class) and its
    record written from the tensor read just then. The zip container is torch's own writer
    (alignment, crc32, ``byteorder``), so ``torch.load`` (``weights_only``, ``mmap``) reads the file as
    any other. Plain tensors in pickled values are written the same way.
    """
    import collections
    import io
    import pickle

    from torch._utils import _rebuild_tensor_v2, _rebuild_tensor_v3
    from torch.serialization import _open_zipfile_writer

    storage_alignment = getattr(torch.serialization, "_get_storage_alignment", None)
    if storage_alignment is None:  # a torch older than this writer's model of torch.save
        raise _NotStreamable("torch.serialization has no _get_storage_alignment")
    records: list[tuple[str, Callable[[], torch.Tensor], int]] = []

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, _Deferred):
                deferred = obj
            elif type(obj) is torch.Tensor:
                if obj.layout != torch.strided or obj.is_quantized or obj.requires_grad or obj.is_conj() or \
                        obj.is_neg() or obj.device.type == "meta":
                    raise _NotStreamable(f"a {obj.layout} tensor on {obj.device}")
                deferred = _Deferred.__new__(_Deferred)
                deferred.dtype, deferred.shape, deferred.nbytes = obj.dtype, tuple(obj.shape), obj.nbytes
                deferred.read = lambda tensor=obj: tensor  # type: ignore[misc]
            elif isinstance(obj, (torch.Tensor, torch.storage.TypedStorage)) or torch.is_storage(obj):
                raise _NotStreamable(f"a {type(obj).__name__}")
            else:
                return NotImplemented
            stride = tuple(math.prod(deferred.shape[d + 1:]) for d in range(len(deferred.shape)))
            args = (_StorageStub(deferred), 0, deferred.shape, stride, False, collections.OrderedDict())
            if deferred.dtype in _LEGACY_STORAGE_NAMES:
                return _rebuild_tensor_v2, args
            return _rebuild_tensor_v3, (*args, deferred.dtype)

        def persistent_id(self, obj: Any) -> Any:
            if not isinstance(obj, _StorageStub):
                return None
            tensor, key = obj.tensor, str(len(records))
            records.append((key, tensor.read, tensor.nbytes))
            name = _LEGACY_STORAGE_NAMES.get(tensor.dtype)
            if name is not None:
                itemsize = torch.empty((), dtype=tensor.dtype).element_size()
                return ("storage", getattr(torch, name), key, "cpu", tensor.nbytes // itemsize)
            return ("storage", torch.UntypedStorage, key, "cpu", tensor.nbytes)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(state)  # torch.save's default protocol
    data = buffer.getvalue()
    total = sum(n for _, _, n in records)
    done = 0
    with open(path, "wb") as file, _open_zipfile_writer(file) as archive:  # a file object: archive name "archive"
        archive.write_record("data.pkl", data, len(data))
        archive.write_record(".format_version", "1", 1)
        alignment = str(storage_alignment())
        archive.write_record(".storage_alignment", alignment, len(alignment))
        archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, read, nbytes in records:
            tensor = read().detach().cpu()
            if not tensor.is_contiguous() or tensor.storage_offset() or tensor.untyped_storage().nbytes() != nbytes:
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            if tensor.nbytes != nbytes:
                raise StateError(f"a tensor read back has {tensor.nbytes} bytes where {nbytes} were expected")
            archive.write_record(f"data/{key}", tensor.untyped_storage(), nbytes)
            del tensor
            done += nbytes
            if progress is not None:
                progress(done, total)


_LEGACY_STORAGE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.int64: "LongStorage", torch.int32: "IntStorage", torch.int16: "ShortStorage", torch.int8: "CharStorage",
    torch.uint8: "ByteStorage", torch.bool: "BoolStorage", torch.bfloat16: "BFloat16Storage",
    torch.complex128: "ComplexDoubleStorage", torch.complex64: "ComplexFloatStorage",
}


def _nested_state(checkpoint: Checkpoint, tensor: Callable[[str], Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The checkpoint's state rebuilt as nested dicts/lists/tuples; ``tensor(key)`` gives each array leaf.

    Per-rank entries have no place in a single-process format and are skipped (returned).
    """
    root: dict[Any, Any] = {}
    skipped = []
    for key, entry in checkpoint.manifest.entries.items():
        if isinstance(entry, PerRankEntry):
            skipped.append(key)
            continue
        value = tensor(key) if isinstance(entry, ArrayEntry) else checkpoint.value(key)
        node = root
        for part in entry.parts[:-1]:
            node = node.setdefault(part, {})
        node[entry.parts[-1]] = value
    containers = checkpoint.manifest.containers
    return _restore_containers(root, (), containers), tuple(skipped)


def _restore_containers(node: Any, parts: tuple, containers: Mapping[str, str]) -> Any:
    """Turn the dicts that stood for lists and tuples back into them (children first)."""
    if not isinstance(node, dict):
        return node
    out = {k: _restore_containers(v, (*parts, k), containers) for k, v in node.items()}
    kind = containers.get(".".join(str(p) for p in parts)) if parts else None
    if kind is None:
        return out
    items = [out[i] for i in sorted(out)]
    return items if kind == "list" else tuple(items)


def _into_result(source: str, dst: str | os.PathLike[str], leaves: Mapping[str, Any]) -> ConvertResult:
    tensors = [leaf.value for leaf in leaves.values() if isinstance(leaf.value, torch.Tensor)]
    return ConvertResult(source, "arrayckpt", len(tensors),
                         sum(math.prod(t.shape) * t.element_size() for t in tensors), (str(dst),))


# ------------------------------------------------------------------------------------------ safetensors


@dataclass(frozen=True)
class _StTensor:
    """One tensor of a safetensors file: where its bytes are."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset
    nbytes: int


def read_safetensors_header(file: Path) -> list[_StTensor]:
    """The tensors of one safetensors file, from its JSON header, checked against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{file}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > min(SAFETENSORS_HEADER_LIMIT, size - 8):
            raise FormatError(f"{file}: safetensors header length {length} is impossible for a {size}-byte file")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{file}: safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{file}: safetensors header must be a JSON object")
    base = 8 + length
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out.append(_parse_st_tensor(file, name, info, base, size))
    return out


def _parse_st_tensor(file: Path, name: str, info: object, base: int, size: int) -> _StTensor:
    if not isinstance(info, dict) or info.get("dtype") not in ST_DTYPES:
        dtype = info.get("dtype") if isinstance(info, dict) else info
        raise FormatError(f"{file}: tensor {name!r} has dtype {dtype!r}; supported: {', '.join(ST_DTYPES)}")
    dtype = ST_DTYPES[info["dtype"]]
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise FormatError(f"{file}: tensor {name!r} has a malformed shape {shape!r} or data_offsets {offsets!r}")
    begin, end = offsets
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= end or end - begin != nbytes or base + end > size:
        raise FormatError(f"{file}: tensor {name!r} data_offsets {offsets} do not fit its {info['dtype']}{shape} "
                          f"or the file's {size} bytes")
    return _StTensor(name, file, dtype, tuple(shape), base + begin, nbytes)


def _safetensors_files(src: Path) -> list[Path]:
    """The files of a safetensors checkpoint: one file, an index JSON's shards, or a directory of either."""
    if src.is_dir():
        indexes = sorted(src.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise FormatError(f"{src}: several index files ({', '.join(p.name for p in indexes)}); name one")
        if indexes:
            return _safetensors_files(indexes[0])
        files = sorted(src.glob("*.safetensors"))
        if len(files) != 1:
            raise FormatError(f"{src}: {len(files)} .safetensors files and no index JSON; name the file to convert")
        return files
    if src.name.endswith(".json"):
        try:
            index = json.loads(src.read_text())
            weight_map = index["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise FormatError(f"{src}: not a safetensors index (needs a 'weight_map' object): {e}") from None
        if not all(isinstance(n, str) and "/" not in n and n not in ("", ".", "..") for n in names):
            raise FormatError(f"{src}: weight_map names files outside its directory: {names!r}")
        return [src.parent / n for n in names]
    return [src]


def _read_st_tensor(t: _StTensor) -> torch.Tensor:
    """Read one tensor's bytes straight into a new tensor (no mapping of the file)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    with open(t.file, "rb") as f:
        f.seek(t.start)
        got = f.readinto(view) if t.nbytes else 0
    if got != t.nbytes:
        raise FormatError(f"{t.file}: tensor {t.name!r} is truncated ({got} of {t.nbytes} bytes)")
    return out


def from_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
                     allow_pickle: bool = False, progress: Progress | None = None) -> ConvertResult:
    """One safetensors file, or a sharded set with its index JSON, into arrayckpt (keys are the tensor names).

    Tensors are read one at a time with positioned reads, so memory stays near one tensor.
    """
    del allow_pickle  # safetensors holds no values
    tensors: dict[str, _StTensor] = {}
    for file in _safetensors_files(Path(src)):
        for t in read_safetensors_header(file):
            if t.name in tensors:
                raise FormatError(f"{src}: tensor {t.name!r} is in both {tensors[t.name].file.name} and {file.name}")
            tensors[t.name] = t
    skeleton = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in tensors.items()}
    write_streaming(skeleton, lambda key: _read_st_tensor(tensors[key]), dst, overwrite=overwrite,
                    source=f"safetensors: {Path(src).name}", progress=progress)
    return ConvertResult("safetensors", "arrayckpt", len(tensors), sum(t.nbytes for t in tensors.values()),
                         (str(dst),))


def to_safetensors(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
                   max_shard_bytes: int | None = None, progress: Progress | None = None) -> ConvertResult:
    """The checkpoint's tensors into one safetensors file, or shards plus ``model.safetensors.index.json``.

    ``dst`` is the file (``model.safetensors``); with shards (``max_shard_bytes`` exceeded) it is a directory.
    Tensors are written one at a time. Plain values have no place in safetensors and are skipped.
    """
    keys = [k for k, e in checkpoint.manifest.entries.items() if isinstance(e, ArrayEntry) and e.kind == "tensor"]
    skipped = tuple(k for k in checkpoint.manifest.entries if k not in keys)
    for key in keys:
        if checkpoint[key].dtype not in ST_NAMES:
            raise StateError(f"{checkpoint.location}: tensor {key!r} is {checkpoint[key].entry.dtype.name}, which "
                             f"safetensors cannot store ({', '.join(ST_DTYPES)})")
    shards = _shard(keys, checkpoint, max_shard_bytes)
    target = Path(dst)
    if len(shards) == 1 and not target.is_dir():
        files = [target]
    else:
        target.mkdir(parents=True, exist_ok=True)
        files = [target / (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                           else "model.safetensors") for i in range(len(shards))]
    for file in files:
        _refuse_existing(file, overwrite)
    total = sum(checkpoint[k].nbytes for k in keys)
    done = [0]
    for file, names in zip(files, shards, strict=True):
        _write_safetensors(checkpoint, names, file, done, total, progress)
    written = [str(f) for f in files]
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: f.name for f, names in zip(files, shards, strict=True) for k in names}}
        index_path = target / SAFETENSORS_INDEX
        _refuse_existing(index_path, overwrite)
        _atomic_write(index_path, json.dumps(index, indent=2).encode())
        written.append(str(index_path))
    return ConvertResult("arrayckpt", "safetensors", len(keys), total, tuple(written), skipped)


def _shard(keys: list[str], checkpoint: Checkpoint, limit: int | None) -> list[list[str]]:
    """Keys in order, cut into shards of at most ``limit`` bytes (a bigger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key in keys:
        nbytes = checkpoint[key].nbytes
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _write_safetensors(checkpoint: Checkpoint, keys: list[str], file: Path, done: list[int], total: int,
                       progress: Progress | None) -> None:
    """Header first (every offset is known from the metadata), then each tensor's bytes as it is read."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in keys:
        array = checkpoint[key]
        header[key] = {"dtype": ST_NAMES[array.dtype], "shape": list(array.shape),
                       "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    temp = file.with_name(f".{file.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(temp, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for key in keys:
                tensor = checkpoint[key].torch()
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b"")
                done[0] += tensor.nbytes
                del tensor
                if progress is not None:
                    progress(done[0], total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, file)
    finally:
        temp.unlink(missing_ok=True)


def _atomic_write(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    temp.write_bytes(data)
    os.replace(temp, path)


def _dcp_into(*args: Any, **kwargs: Any) -> ConvertResult:
    from .._convert.dcp import from_dcp

    return from_dcp(*args, **kwargs)


def _dcp_out_of(*args: Any, **kwargs: Any) -> ConvertResult:
    from .._convert.dcp import to_dcp

    return to_dcp(*args, **kwargs)


_INTO: dict[str, Callable[..., ConvertResult]] = {"torch": from_torch, "safetensors": from_safetensors,
                                                   "dcp": _dcp_into}
_OUT_OF: dict[str, Callable[..., ConvertResult]] = {"torch": to_torch, "dcp": _dcp_out_of}
