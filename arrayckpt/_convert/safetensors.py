"""Hugging Face safetensors files (one file, or shards with an index JSON) to and from arrayckpt.

safetensors holds tensors only, so plain values are left out (and listed in the result); tensors that share
storage (tied weights) are stored separately. Writing safetensors needs no torch (arrays are read as numpy);
reading it into arrayckpt does (the streaming writer describes the state with meta tensors).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import FormatError, StateError
from .._format.dtypes import DTYPES, DType
from .._format.manifest import ArrayEntry
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._read.checkpoint import Checkpoint
from .common import ConvertResult, Progress, refuse_existing, replaced_atomically

__all__ = ["ST_DTYPES", "ST_NAMES", "from_safetensors", "read_safetensors_header", "to_safetensors"]

SAFETENSORS_HEADER_LIMIT = 100 << 20  # the safetensors library's own limit on the JSON header
SAFETENSORS_INDEX = "model.safetensors.index.json"
ST_DTYPES: dict[str, DType] = {st: DTYPES[name] for st, name in {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32", "U32": "uint32",
    "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}.items()}
ST_NAMES = {dtype.name: st for st, dtype in ST_DTYPES.items()}  # arrayckpt dtype name -> safetensors dtype


@dataclass(frozen=True)
class _StTensor:
    """One tensor of a safetensors file: where its bytes are."""

    name: str
    file: Path
    dtype: DType
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
        except (ValueError, RecursionError) as e:  # not JSON, nested too deep, integers of too many digits
            raise FormatError(f"{file}: safetensors header is not usable JSON: {_brief(e)}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{file}: safetensors header must be a JSON object")
    base = 8 + length
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out.append(_parse_st_tensor(file, name, info, base, size))
    _check_disjoint(file, out)
    return out


def _brief(error: BaseException) -> str:
    return str(error) if isinstance(error, ValueError) else "nested too deeply"


def _check_disjoint(file: Path, tensors: list[_StTensor]) -> None:
    """Every tensor's bytes must be its own: two tensors whose byte ranges overlap would read each other's data."""
    previous: _StTensor | None = None
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: t.start):
        if previous is not None and t.start < previous.start + previous.nbytes:
            raise FormatError(f"{file}: tensors {previous.name!r} and {t.name!r} have overlapping data_offsets; "
                              "the safetensors file is damaged or was not written by a safetensors writer")
        previous = t


def _parse_st_tensor(file: Path, name: str, info: object, base: int, size: int) -> _StTensor:
    if not isinstance(info, dict) or info.get("dtype") not in ST_DTYPES:
        dtype = info.get("dtype") if isinstance(info, dict) else info
        raise FormatError(f"{file}: tensor {name!r} has dtype {dtype!r}; supported: {', '.join(ST_DTYPES)}")
    dtype = ST_DTYPES[info["dtype"]]
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(_count(n) for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
        raise FormatError(f"{file}: tensor {name!r} has a malformed shape {shape!r} or data_offsets {offsets!r}")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= begin <= end or end - begin != nbytes or base + end > size:
        raise FormatError(f"{file}: tensor {name!r} data_offsets {offsets} do not fit its {info['dtype']}{shape} "
                          f"or the file's {size} bytes")
    return _StTensor(name, file, dtype, tuple(shape), base + begin, nbytes)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


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
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise FormatError(f"{src}: not a safetensors index (needs a 'weight_map' object): {e}") from None
        if not all(isinstance(n, str) and "/" not in n and n not in ("", ".", "..") for n in names):
            raise FormatError(f"{src}: weight_map names files outside its directory: {names!r}")
        return [src.parent / n for n in names]
    return [src]


def _read_st_tensor(t: _StTensor) -> np.ndarray:
    """Read one tensor's bytes straight into a new array (no mapping of the file)."""
    out = np.empty(t.shape, dtype=t.dtype.numpy)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(t.file, "rb") as f:
        f.seek(t.start)
        got = f.readinto(view) if t.nbytes else 0
    if got != t.nbytes:
        raise FormatError(f"{t.file}: tensor {t.name!r} is truncated ({got} of {t.nbytes} bytes)")
    return out


def from_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
                     allow_pickle: bool = False, progress: Progress | None = None,
                     chunking: ChunkPolicy = DEFAULT_CHUNKING) -> ConvertResult:
    """One safetensors file, or a sharded set with its index JSON, into arrayckpt (keys are the tensor names).

    Tensors are read one at a time with positioned reads, so memory stays near one tensor. Needs torch.
    """
    import torch  # the skeleton is meta tensors (dispatch.py checks that torch is there)

    from .._torch.dtypes import torch_dtype
    from .._write.options import SaveOptions
    from .._write.stream import write_streaming

    del allow_pickle  # safetensors holds no values
    tensors: dict[str, _StTensor] = {}
    for file in _safetensors_files(Path(src)):
        for t in read_safetensors_header(file):
            if t.name in tensors:
                raise FormatError(f"{src}: tensor {t.name!r} is in both {tensors[t.name].file.name} and {file.name}")
            tensors[t.name] = t
    skeleton = {name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for name, t in tensors.items()}
    write_streaming(skeleton, lambda key: _read_st_tensor(tensors[key]), dst,
                    SaveOptions(overwrite=overwrite, chunking=chunking), source=f"safetensors: {Path(src).name}",
                    progress=progress)
    return ConvertResult("safetensors", "arrayckpt", len(tensors), sum(t.nbytes for t in tensors.values()),
                         (str(dst),))


def to_safetensors(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
                   max_shard_bytes: int | None = None, progress: Progress | None = None) -> ConvertResult:
    """The checkpoint's tensors into one safetensors file, or shards plus ``model.safetensors.index.json``.

    ``dst`` is the file (``model.safetensors``); with shards (``max_shard_bytes`` exceeded) it is a directory.
    Tensors are written one at a time, read as numpy (no torch needed). Plain values have no place in
    safetensors and are skipped.
    """
    keys = [k for k, e in checkpoint.manifest.entries.items() if isinstance(e, ArrayEntry) and e.kind == "tensor"]
    skipped = tuple(k for k in checkpoint.manifest.entries if k not in keys)
    for key in keys:
        if checkpoint[key].entry.dtype.name not in ST_NAMES:
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
        refuse_existing(file, overwrite)
    total = sum(checkpoint[k].nbytes for k in keys)
    done = [0]
    for file, names in zip(files, shards, strict=True):
        _write_safetensors(checkpoint, names, file, done, total, progress)
    written = [str(f) for f in files]
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: f.name for f, names in zip(files, shards, strict=True) for k in names}}
        index_path = target / SAFETENSORS_INDEX
        refuse_existing(index_path, overwrite)
        with replaced_atomically(index_path) as temp:
            temp.write_bytes(json.dumps(index, indent=2).encode())
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
        header[key] = {"dtype": ST_NAMES[array.entry.dtype.name], "shape": list(array.shape),
                       "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    with replaced_atomically(file) as temp, open(temp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key in keys:
            data = np.ascontiguousarray(checkpoint[key].numpy())
            f.write(memoryview(data.reshape(-1).view(np.uint8)) if data.size else b"")
            done[0] += data.nbytes
            del data
            if progress is not None:
                progress(done[0], total)
