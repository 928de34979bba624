"""Hugging Face safetensors files (one file, or shards with an index JSON) to and from arrayckpt.

safetensors holds tensors only, so plain values are left out (and listed in the result); tensors that share
storage (tied weights) are stored separately. Writing safetensors needs no torch (arrays are read as numpy);
reading it into arrayckpt does (the streaming writer describes the state with meta tensors).

Reading goes through the ``safetensors`` library (``safe_open``), so a file is accepted exactly when Hugging
Face's own loader accepts it (header, dtypes, offsets that tile the data with no overlap, gap or excess), and
each tensor is a view of the library's memory map whose pages are dropped once written. ``framework="pt"``:
numpy has no bfloat16 or float8, and the torch view keeps every bit pattern. When the library refuses a file,
the header is looked at here only to say which tensor is wrong and how (:func:`_explain_refusal`).

Writing streams (header first, then each tensor's bytes as read): the library's writers (``save_file``,
``serialize_file``) need every tensor in memory at once. The files written are tested to open with
``safe_open``. The source's metadata (a file's ``__metadata__``, an index's ``metadata``) is what
:func:`source_record` returns, for the manifest's ``created["source"]``; :func:`to_safetensors` carries it
back out.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .._errors import ArrayckptError, CheckpointExistsError, FormatError, StateError
from .._format.dtypes import DTYPES, DType
from .._format.jsontypes import JSON
from .._io.smallfiles import USER_FILE_LIMIT, read_regular_file
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._read.checkpoint import Checkpoint
from .common import ConvertResult, Progress, refuse_existing, replaced_atomically
from .switch import held_temporary, switch_files

if TYPE_CHECKING:
    from safetensors import safe_open

__all__ = ["DEFAULT_FILE_METADATA", "SAFETENSORS_INDEX", "ST_DTYPES", "ST_NAMES", "WEIGHTS", "check_storable",
           "cut_shards", "earlier_weights", "from_safetensors", "safetensors_names", "shard_files", "source_record",
           "to_safetensors", "write_file"]

SAFETENSORS_HEADER_LIMIT = 100 << 20  # the safetensors library's own limit on the JSON header
SAFETENSORS_INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"  # a one-file export in a directory; from_pretrained looks for it first
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")  # the weight files of an export
DEFAULT_FILE_METADATA = {"format": "pt"}  # what transformers expects in __metadata__ to load a file
ST_DTYPES: dict[str, DType] = {st: DTYPES[name] for st, name in {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32", "U32": "uint32",
    "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}.items()}
ST_NAMES = {dtype.name: st for st, dtype in ST_DTYPES.items()}  # arrayckpt dtype name -> safetensors dtype


@dataclass(frozen=True)
class _StTensor:
    """One tensor of a safetensors file, as the library's header describes it."""

    name: str
    file: Path
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _StSource:
    """A safetensors checkpoint: its files, and the index's ``metadata`` when it came with an index."""

    files: list[Path]
    index_metadata: JSON | None = None


class _NoSafetensorsError(ArrayckptError, ModuleNotFoundError):
    """Reading safetensors needs the ``safetensors`` package (an ArrayckptError: one line from the CLI)."""


def _open(file: Path, stack: contextlib.ExitStack[bool | None]) -> safe_open:
    """``safe_open`` (torch views of a memory map), kept open by ``stack``; the library's refusal becomes a
    :class:`FormatError` naming the file and the tensor at fault."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise _NoSafetensorsError(f"{file}: reading safetensors needs the safetensors package: "
                                  "pip install safetensors", name="safetensors") from None
    try:
        return stack.enter_context(safe_open(file, framework="pt"))
    except SafetensorError as e:
        raise FormatError(f"{file}: {_explain_refusal(file) or _library_reason(e)}") from None


_HINTS = {  # what the library's terse reasons mean for a file
    "invalid offset": "the tensors' data must follow one another with no gap or overlap",
    "incomplete metadata": "the header's data_offsets do not end where the file does",
}


def _library_reason(error: BaseException) -> str:
    reason = str(error).removeprefix("Error while deserializing header: ")
    hint = next((f": {text}" for start, text in _HINTS.items() if reason.startswith(start)), "")
    return (f"not a valid safetensors file ({reason}{hint}); it is truncated or damaged, or was not written by "
            "a safetensors writer")


def _tensors_of(file: Path, handle: safe_open) -> list[_StTensor]:
    """The tensors of an opened file, each with a dtype arrayckpt stores (the library knows a few more)."""
    out = []
    for name in handle.keys():
        view = handle.get_slice(name)
        st, shape = view.get_dtype(), tuple(view.get_shape())
        if st not in ST_DTYPES:
            raise FormatError(f"{file}: tensor {name!r} has dtype {st!r}, which arrayckpt cannot store; "
                              f"supported: {', '.join(ST_DTYPES)}")
        out.append(_StTensor(name, file, ST_DTYPES[st], shape))
    return out


# ------------------------------------------------------------ why the library refused a file (messages only)


def _explain_refusal(file: Path) -> str | None:
    """What is wrong with a file the library refused, naming the tensor, or ``None`` if these checks find
    nothing (the library's own reason is then given). Never used to accept a file."""
    try:
        header, base, size = _raw_header(file)
        for name, info in header.items():
            if name != "__metadata__":
                _check_entry(name, info, base, size)
        _check_disjoint(header)
    except FormatError as e:
        return str(e)
    return None


def _raw_header(file: Path) -> tuple[JSON, int, int]:
    """The JSON header, where the data starts, and the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError("too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > min(SAFETENSORS_HEADER_LIMIT, size - 8):
            raise FormatError(f"safetensors header length {length} is impossible for a {size}-byte file")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError) as e:  # not JSON, nested too deep, integers of too many digits
            raise FormatError(f"safetensors header is not usable JSON: {_brief(e)}") from None
    if not isinstance(header, dict):
        raise FormatError("safetensors header must be a JSON object")
    return header, 8 + length, size


def _brief(error: BaseException) -> str:
    return str(error) if isinstance(error, ValueError) else "nested too deeply"


def _check_entry(name: str, info: object, base: int, size: int) -> None:
    if not isinstance(info, dict) or info.get("dtype") not in ST_DTYPES:
        dtype = info.get("dtype") if isinstance(info, dict) else info
        raise FormatError(f"tensor {name!r} has dtype {dtype!r}; supported: {', '.join(ST_DTYPES)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(_count(n) for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
        raise FormatError(f"tensor {name!r} has a malformed shape {shape!r} or data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * ST_DTYPES[info["dtype"]].itemsize or base + end > size:
        raise FormatError(f"tensor {name!r} data_offsets {offsets} do not fit its {info['dtype']}{shape} "
                          f"or the file's {size} bytes")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _check_disjoint(header: JSON) -> None:
    """Two tensors whose byte ranges overlap would read each other's data (entries already checked)."""
    spans: list[tuple[list[int], str]] = []
    for name, info in header.items():
        offsets = info.get("data_offsets") if name != "__metadata__" and isinstance(info, dict) else None
        if isinstance(offsets, list) and offsets[0] < offsets[1]:
            spans.append((offsets, name))
    spans.sort()
    for (before, first), (after, second) in zip(spans, spans[1:], strict=False):
        if after[0] < before[1]:
            raise FormatError(f"tensors {first!r} and {second!r} have overlapping data_offsets; the safetensors "
                              "file is damaged or was not written by a safetensors writer")


# ------------------------------------------------------------------------------------ safetensors -> arrayckpt


def _safetensors_source(src: Path) -> _StSource:
    """The files of a safetensors checkpoint: one file, an index JSON's shards, or a directory of either."""
    if src.is_dir():
        indexes = sorted(src.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise FormatError(f"{src}: several index files ({', '.join(p.name for p in indexes)}); name one")
        if indexes:
            return _safetensors_source(indexes[0])
        files = sorted(src.glob("*.safetensors"))
        if len(files) != 1:
            raise FormatError(f"{src}: {len(files)} .safetensors files and no index JSON; name the file to convert")
        shard = re.fullmatch(r".*-\d{5}-of-(\d{5})\.safetensors", files[0].name)
        if shard and int(shard.group(1)) > 1:  # what a killed export or a partial download leaves
            raise FormatError(f"{files[0]}: one shard of {int(shard.group(1))}, and no index JSON beside it; the "
                              "export is incomplete: export it again (or name the file to convert just it)")
        return _StSource(files)
    if src.name.endswith(".json"):
        try:
            index = json.loads(read_regular_file(src, str(src), limit=USER_FILE_LIMIT))  # not /dev/zero, a FIFO
            weight_map = index["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise FormatError(f"{src}: not a safetensors index (needs a 'weight_map' object): {e}") from None
        if not all(isinstance(n, str) and "/" not in n and "\x00" not in n and n not in ("", ".", "..") for n in names):
            raise FormatError(f"{src}: weight_map names files outside its directory: {names!r}")
        metadata = index.get("metadata")
        return _StSource([src.parent / n for n in names], metadata if isinstance(metadata, dict) else {})
    return _StSource([src])


def source_record(index_metadata: Mapping[str, object] | None, file_metadata: list[dict[str, str]]) -> JSON:
    """The source's own metadata, for the manifest's ``created["source"]``: the ``__metadata__`` entries every
    file shares (``{"format": "pt"}``) and, for shards, the index's ``metadata``. :func:`to_safetensors` writes
    them back out (recounting ``total_size`` and ``total_parameters``).

    >>> source_record(None, [{"format": "pt", "note": "x"}, {"format": "pt"}])
    {'format': 'safetensors', 'metadata': {'format': 'pt'}}
    """
    shared = dict(file_metadata[0]) if file_metadata else {}
    for other in file_metadata[1:]:
        shared = {k: v for k, v in shared.items() if other.get(k) == v}
    record: JSON = {"format": "safetensors", "metadata": shared}
    if index_metadata is not None:
        record["index_metadata"] = dict(index_metadata)
    return record


def from_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
                     allow_pickle: bool = False, progress: Progress | None = None,
                     chunking: ChunkPolicy = DEFAULT_CHUNKING, key_prefix: str = "",
                     names: Mapping[str, str] | None = None, values: Mapping[str, object] | None = None,
                     label: str = "safetensors") -> ConvertResult:
    """One safetensors file, or a sharded set with its index JSON, into arrayckpt (keys are the tensor names).

    Every file is opened (and so checked) by the safetensors library before anything is written. Tensors are
    views of its memory map, written one batch at a time, their pages dropped once written, so resident memory
    stays near one tensor. Needs torch. For formats built on safetensors (a PEFT adapter, ``peft.py``): ``names``
    gives tensors other keys (name in the file -> key), ``values`` adds plain values beside them, ``label`` names
    the source format.
    """
    import torch  # the skeleton is meta tensors (dispatch.py checks that torch is there)

    from .._torch.dtypes import torch_dtype
    from .._write.options import SaveOptions
    from .._write.stream import write_streaming
    from .torch_save import _release_pages

    del allow_pickle  # safetensors holds no values
    source = _safetensors_source(Path(src))
    with contextlib.ExitStack() as stack:
        handles = {file: _open(file, stack) for file in source.files}
        tensors = _all_tensors(Path(src), handles)
        stored = {(names or {}).get(name, name): name for name in tensors}  # key -> name in the file
        held: dict[str, torch.Tensor] = {}

        def fetch(key: str) -> torch.Tensor:
            held[key] = handles[tensors[stored[key]].file].get_tensor(stored[key])
            return held[key]

        skeleton: dict[str, object] = {key: torch.empty(tensors[name].shape, dtype=torch_dtype(tensors[name].dtype),
                                                        device="meta") for key, name in stored.items()}
        skeleton.update(values or {})
        write_streaming(skeleton, fetch, dst, SaveOptions(overwrite=overwrite), chunking=chunking,
                        source=f"{label}: {Path(src).name}", progress=progress, key_prefix=key_prefix,
                        release=lambda key: _release_pages(held.pop(key)) if key in held else None,
                        created={"source": source_record(source.index_metadata,
                                                         [dict(h.metadata() or {}) for h in handles.values()])})
    return ConvertResult(label, "arrayckpt", len(tensors), sum(t.nbytes for t in tensors.values()), (str(dst),))


def safetensors_names(file: Path) -> list[str]:
    """The names of the tensors of one safetensors file (opened, and so checked, by the library)."""
    with contextlib.ExitStack() as stack:
        return list(_open(file, stack).keys())


def _all_tensors(src: Path, handles: Mapping[Path, safe_open]) -> dict[str, _StTensor]:
    """Every tensor of every file by name; a name in two files is refused (which one would be meant?)."""
    tensors: dict[str, _StTensor] = {}
    for file, handle in handles.items():
        for t in _tensors_of(file, handle):
            if t.name in tensors:
                raise FormatError(f"{src}: tensor {t.name!r} is in both {tensors[t.name].file.name} and {file.name}")
            tensors[t.name] = t
    return tensors


# ------------------------------------------------------------------------------------ arrayckpt -> safetensors


def to_safetensors(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
                   max_shard_bytes: int | None = None, progress: Progress | None = None) -> ConvertResult:
    """The checkpoint's tensors into one safetensors file, or shards plus ``model.safetensors.index.json``.

    ``dst`` is the file (``model.safetensors``); with shards (``max_shard_bytes`` exceeded) it is a directory,
    where an earlier export's weight files are replaced (``overwrite``) as a Hugging Face export replaces them
    (``hf.py``: a kill leaves the old export, the new one, or none that loads; stale shards are removed).
    Tensors are written one at a time, read as numpy (no torch needed). Plain values have no place in
    safetensors and are skipped. safetensors cannot alias, so a tensor stored once under two keys (tied weights)
    is written under both, its bytes twice: every key of the state is in the file, for any reader and for
    ``load_state_dict(strict=True)`` of a model that does not tie them (an export for a library that re-ties them
    itself, as Hugging Face's ``from_pretrained`` does, can leave out ``checkpoint.aliases()``' keys).
    """
    manifest = checkpoint.manifest
    keys = [k for k in manifest.entries if (e := manifest.array_entry(k)) is not None and e.kind == "tensor"]
    skipped = tuple(k for k in checkpoint.manifest.entries if k not in keys)
    check_storable(checkpoint, keys)
    shards = cut_shards({k: checkpoint[k].nbytes for k in keys}, max_shard_bytes)
    target = Path(dst)
    total = sum(checkpoint[k].nbytes for k in keys)
    file_metadata, index_metadata = _carried_metadata(checkpoint)
    if len(shards) == 1 and not target.is_dir():  # one file, replaced atomically
        refuse_existing(target, overwrite)
        write_file(checkpoint, {k: k for k in shards[0]}, target, file_metadata, 0, total, progress)
        return ConvertResult("arrayckpt", "safetensors", len(keys), total, (str(target),), skipped)
    files = shard_files(target, len(shards))
    found = earlier_weights(target)
    if found and not overwrite:
        raise CheckpointExistsError(f"{target}: already holds {', '.join(p.name for p in found)}; pass "
                                    "overwrite=True (--overwrite) to replace an earlier export")
    written = [str(f) for f in files]
    with held_temporary(target, WEIGHTS) as temporary:  # switched in as a Hugging Face export is (hf.py)
        done = 0
        for file, names in zip(files, shards, strict=True):
            done = write_file(checkpoint, {k: k for k in names}, temporary / file.name, file_metadata, done, total,
                              progress)
        if len(files) > 1:
            totals = {"total_size": total, "total_parameters": sum(math.prod(checkpoint[k].shape) for k in keys)}
            index = {"metadata": index_metadata | totals,
                     "weight_map": {k: f.name for f, names in zip(files, shards, strict=True) for k in names}}
            (temporary / SAFETENSORS_INDEX).write_bytes(json.dumps(index, indent=2).encode())
            written.append(str(target / SAFETENSORS_INDEX))
        switch_files(temporary, target, SAFETENSORS_INDEX if len(files) > 1 else WEIGHTS, (WEIGHTS, SAFETENSORS_INDEX),
                     [p.name for p in found])
    return ConvertResult("arrayckpt", "safetensors", len(keys), total, tuple(written), skipped)


def earlier_weights(target: Path) -> list[Path]:
    """The weight files and index of an earlier export in the directory ``target`` (what ``from_pretrained``
    would load: ``model.safetensors``, ``model-00001-of-00003.safetensors``, the index)."""
    if not target.is_dir():
        return []
    return sorted(p for p in target.iterdir() if WEIGHT_FILE.fullmatch(p.name) or p.name == SAFETENSORS_INDEX)


def check_storable(checkpoint: Checkpoint, keys: list[str]) -> None:
    """Refuse, before anything is written, a tensor whose dtype safetensors has no name for."""
    for key in keys:
        if checkpoint[key].entry.dtype.name not in ST_NAMES:
            raise StateError(f"{checkpoint.location}: tensor {key!r} is {checkpoint[key].entry.dtype.name}, which "
                             f"safetensors cannot store ({', '.join(ST_DTYPES)})")


def shard_files(directory: Path, count: int) -> list[Path]:
    """The files of ``count`` shards as transformers names them: ``model.safetensors`` alone, else
    ``model-00001-of-00003.safetensors`` ..."""
    if count == 1:
        return [directory / "model.safetensors"]
    return [directory / f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def cut_shards(sizes: Mapping[str, int], limit: int | None) -> list[list[str]]:
    """Names in order (``sizes``: name -> bytes), cut into shards of at most ``limit`` bytes (a bigger tensor gets
    a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, nbytes in sizes.items():
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _carried_metadata(checkpoint: Checkpoint) -> tuple[dict[str, str], JSON]:
    """The ``__metadata__`` for every file and the index's ``metadata``: ``{"format": "pt"}`` overlaid with what
    a safetensors source recorded in ``created["source"]`` (:func:`source_record`). That record is
    informational: anything malformed in it is ignored, never an error."""
    record = checkpoint.manifest.created.get("source")
    if not isinstance(record, dict) or record.get("format") != "safetensors":
        return dict(DEFAULT_FILE_METADATA), {}
    files, index = record.get("metadata"), record.get("index_metadata")
    strings = {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(files, dict) else {}
    return DEFAULT_FILE_METADATA | strings, dict(index) if isinstance(index, dict) else {}


def write_file(checkpoint: Checkpoint, tensors: Mapping[str, str], file: Path, metadata: Mapping[str, str],
               done: int, total: int, progress: Progress | None) -> int:
    """Write ``tensors`` (name in the file -> key in the checkpoint, in file order) as one safetensors file,
    replaced atomically: header first (every offset is known from the metadata), then each tensor's bytes as it
    is read, one tensor in memory at a time. ``done`` bytes were written before (of ``total``, for
    ``progress``); returns the count after this file."""
    header: JSON = {"__metadata__": dict(metadata)}
    offset = 0
    for name, key in tensors.items():
        array = checkpoint[key]
        header[name] = {"dtype": ST_NAMES[array.entry.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    with replaced_atomically(file) as temp, open(temp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key in tensors.values():
            data = np.ascontiguousarray(checkpoint[key].numpy())
            f.write(data.reshape(-1).view(np.uint8).data if data.size else b"")
            done += data.nbytes
            del data
            if progress is not None:
                progress(done, total)
    return done
