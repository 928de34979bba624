"""PyTorch Distributed Checkpoint (DCP: ``.metadata`` + ``*.distcp``) to and from arrayckpt, one tensor at a time.

DCP's ``.metadata`` is a pickle, and ``FileSystemReader.read_metadata`` unpickles it with no restriction:
opening a DCP checkpoint from elsewhere could run code. Here it is read by :class:`MetadataUnpickler`,
which admits only DCP's metadata classes and the few torch and builtin types they hold. DCP's default
planner also loads non-tensor values with ``torch.load(weights_only=False)``; ours uses
``weights_only=True``. Megatron's ``torch_dist`` format is DCP underneath and converts the same way.

Reading: each tensor's saved chunks are read straight into their place in the whole tensor
(``dcp_payload.py``); payloads that reader does not recognise are read through DCP itself (``no_dist``), one
tensor at a time.

Writing gives DCP a state of meta tensors and a planner that reads each tensor from arrayckpt only when
DCP writes it, and a ``FileSystemWriter`` whose ``write_data`` appends each item to one ``__0_0.distcp`` (as
DCP groups a rank's items) and drops it before reading the next (DCP's own holds the previous tensor while
reading the next one).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

import torch

from .._errors import ArrayckptError, FormatError, PickleNotAllowedError, warn_unpickling
from .._format.manifest import PickleEntry
from .._format.marker import is_marker
from .._io.smallfiles import read_regular_file
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._read.checkpoint import Checkpoint, stored_of
from .._write.options import SaveOptions
from .._write.stream import write_streaming
from .common import ConvertResult, Progress, nested_state, refusal_reason, refuse_existing, write_failure
from .dcp_payload import append_payload, check_chunks, check_data_files, read_in_place, storage_index
from .switch import held_temporary, switch_directory, switch_files, switched_path

if TYPE_CHECKING:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner, WriteItem
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

__all__ = ["MetadataUnpickler", "dcp_file", "flat_dcp_state", "from_dcp", "meta_tensor", "new_directory",
           "read_dcp_metadata", "refuse_pickles", "stream_into_dcp", "to_dcp"]

_Loaded = TypeVar("_Loaded")  # what a state given to DCP's load holds: tensors loaded in place, or plain values

METADATA_FILE = ".metadata"
DISTCP_FILE = re.compile(r"__\d+_\d+\.distcp")  # the data files of DCP's FileSystemWriter
_DCP = "torch.distributed.checkpoint"
# (module, name) pairs a DCP .metadata pickle may name; nothing else is ever imported.
ALLOWED_GLOBALS = frozenset({
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    (f"{_DCP}.planner", name) for name in (  # Megatron-Core stores its save plans too (``all_local_plans``)
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
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

    def find_class(self, module: str, name: str) -> object:
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type; refusing to load it")


def read_dcp_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint in directory ``path``, unpickled with :class:`MetadataUnpickler`."""
    file = Path(path) / METADATA_FILE
    try:  # a regular file of bounded size (not a FIFO, which would block; not /dev/zero)
        data = read_regular_file(file, str(file))
        if is_marker(data):
            raise FormatError(f"{path}: an arrayckpt checkpoint (its {METADATA_FILE} is arrayckpt's DCP marker, spec "
                              "§2.1), not a DCP one: open it with arrayckpt.open, or convert from it as arrayckpt")
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
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


def _reader(path: str | os.PathLike[str], metadata: Metadata) -> FileSystemReader:
    """A ``FileSystemReader`` that hands out the safely read metadata instead of unpickling it again."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
            assert metadata.storage_meta is not None  # read_dcp_metadata sets it
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(os.fspath(path))


def _planner(trusted: bool = False) -> DefaultLoadPlanner:
    """A load planner for flat ``{fqn: target}`` dicts that loads non-tensor values with ``weights_only=True``
    (``trusted``: with full unpickling, for a source the caller trusts)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            # into the caller's dict: with flatten_state_dict=False, self.state_dict may be a copy of it
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=not trusted)

    return SafeLoadPlanner(flatten_state_dict=False, allow_partial_load=True)


def _dcp_load(state: dict[str, _Loaded], path: str | os.PathLike[str], metadata: Metadata, trusted: bool = False) \
        -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, storage_reader=_reader(path, metadata), planner=_planner(trusted), no_dist=True)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            cause = _dcp_cause(e)
            if isinstance(cause, pickle.UnpicklingError):
                raise PickleNotAllowedError(f"{path}: a saved value holds pickled content that weights_only loading "
                                            f"refuses ({refusal_reason(cause)}); it needs allow_pickle=True "
                                            "(--allow-pickle), only for checkpoints you trust") from None
            if isinstance(cause, (RuntimeError, EOFError, ValueError)) and not isinstance(cause, ArrayckptError):
                # torch's reader on a truncated or damaged .distcp ("PytorchStreamReader failed reading zip archive")
                reason = str(cause).splitlines()[0].split(". ")[0].strip() if str(cause) else type(cause).__name__
                raise FormatError(f"{path}: DCP could not read its data ({reason}){_short_files(path, metadata)}: "
                                  "the DCP checkpoint is damaged or truncated") from None
            if cause is e:
                raise
            raise cause from None


def _short_files(path: str | os.PathLike[str], metadata: Metadata) -> str:
    """`` (__0_0.distcp has 100 bytes, its items reach 4000)`` for every data file shorter than its items reach
    (or missing), from ``.metadata``'s storage data: which file a failed read was cut short in."""
    reach: dict[str, int] = {}
    storage = getattr(metadata, "storage_data", None)
    for info in (storage.values() if isinstance(storage, dict) else ()):
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            reach[name] = max(reach.get(name, 0), offset + length)
    short = []
    for name, end in sorted(reach.items()):
        try:
            size = os.path.getsize(os.path.join(path, name))
        except OSError:
            short.append(f"{name} is missing")
            continue
        if size < end:
            short.append(f"{name} has {size} bytes, its items reach {end}")
    return f" ({'; '.join(short)})" if short else ""


def _set_path(root: dict[str, object], path: tuple[str | int, ...], value: object) -> None:
    """Place ``value`` at ``path``, creating dicts for str keys and lists for int keys, as DCP's unflatten does."""
    node: Any = root  # Any: a dict or a list, indexed by the str or int part the path has at that depth
    for part, following in zip(path[:-1], path[1:], strict=True):
        fresh: list[object] | dict[str, object] = [] if isinstance(following, int) else {}
        if isinstance(node, list) and isinstance(part, int):
            node.extend([None] * (part + 1 - len(node)))
            if node[part] is None:
                node[part] = fresh
            node = node[part]
        else:
            node = node.setdefault(part, fresh)
    last = path[-1]
    if isinstance(node, list) and isinstance(last, int):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def from_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
             allow_pickle: bool = False, progress: Progress | None = None,
             chunking: ChunkPolicy = DEFAULT_CHUNKING, extra: Mapping[str, object] | None = None,
             label: str = "dcp", trusted_values: bool = False,
             created: dict[str, object] | None = None, key_prefix: str = "") -> ConvertResult:
    """A DCP checkpoint (saved by any number of ranks) into arrayckpt, one whole tensor at a time.

    The nesting of the saved state dict is rebuilt from DCP's planner data, so keys, lists and plain values
    come out as ``arrayckpt.save`` would have written the original state (``{"model": ..., "optim": ...}``).
    For formats built on DCP (Megatron's ``torch_dist``): ``extra`` top-level values are added (a key DCP has
    too is an error), ``label`` names the source format, ``trusted_values`` unpickles DCP's non-tensor
    values fully instead of with ``weights_only=True``, and ``created`` goes into the manifest's provenance (the
    source's own metadata, ``{"source": ...}``).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = read_dcp_metadata(src)
    entries = metadata.state_dict_metadata
    storage = storage_index(metadata)
    check_data_files(Path(src), storage, {f for f, m in entries.items() if isinstance(m, TensorStorageMetadata)})
    values: dict[str, object] = {fqn: None for fqn, m in entries.items() if isinstance(m, BytesStorageMetadata)}
    if values:
        if trusted_values:  # loaded with weights_only=False: say so, as torch.load does
            warn_unpickling(f"{src}: unpickling values {', '.join(map(repr, list(values)[:10]))} fully")
        _dcp_load(values, src, metadata, trusted_values)  # small: the plain values, with weights_only=True
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    skeleton: dict[str, object] = {}
    tensors: dict[str, tuple[str, TensorStorageMetadata]] = {}
    for fqn, item in entries.items():
        path = tuple(paths.get(fqn, (fqn,))) or (fqn,)
        if isinstance(item, TensorStorageMetadata):
            check_chunks(src, fqn, item)
            tensors[".".join(str(p) for p in path)] = (fqn, item)
            _set_path(skeleton, path, torch.empty(tuple(item.size), dtype=item.properties.dtype, device="meta"))
        else:
            _set_path(skeleton, path, values[fqn])
    for key, value in (extra or {}).items():
        if key in skeleton:
            raise FormatError(f"{src}: {key!r} is both a DCP entry and a {label} value; cannot convert both")
        skeleton[key] = value

    def fetch(key: str) -> torch.Tensor:
        fqn, item = tensors[key]
        tensor = read_in_place(Path(src), fqn, item, storage)
        if tensor is not None:
            return tensor
        target = {fqn: torch.empty(tuple(item.size), dtype=item.properties.dtype)}
        _dcp_load(target, src, metadata)
        return target[fqn]

    options = SaveOptions(overwrite=overwrite, allow_pickle=allow_pickle)
    write_streaming(skeleton, fetch, dst, options, chunking=chunking,
                    source=f"{label}: {Path(src).name}", progress=progress, created=created, key_prefix=key_prefix)
    nbytes = sum(torch.empty((), dtype=i.properties.dtype).element_size() * i.size.numel() for _, i in tensors.values())
    return ConvertResult(label, "arrayckpt", len(tensors), nbytes, (str(dst),))


def to_dcp(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
           progress: Progress | None = None) -> ConvertResult:
    """An arrayckpt checkpoint into a single-rank DCP checkpoint (loadable by DCP on any number of ranks).

    DCP is given the nested state with meta tensors; each tensor is read from arrayckpt only when DCP's
    writer asks for it and is appended to the one ``__0_0.distcp`` file, so memory stays near one tensor.
    Per-rank entries are skipped (DCP has no such notion), and so are empty dicts (DCP's save walks into dicts
    and saves nothing for an empty one); both are named in the result. Pickled values need the checkpoint
    opened with ``allow_pickle=True``. A tensor stored once under two keys (tied weights) is written under both
    (DCP's planner writes every key of the state it is given), so DCP loads it into tied and untied models alike.
    """
    target = Path(dst)
    if target.exists() and any(target.iterdir()):
        refuse_existing(target, overwrite)
    refuse_pickles(checkpoint)
    state, keys, skipped = flat_dcp_state(checkpoint)
    with new_directory(target, dcp_file, [METADATA_FILE]) as temporary:
        total = stream_into_dcp(checkpoint, state, keys, temporary, flatten=True, progress=progress)
    files = tuple(sorted(str(p) for p in target.iterdir()))
    tensors = sum(checkpoint.manifest.array_entry(k) is not None for k in checkpoint.manifest.entries)
    return ConvertResult("arrayckpt", "dcp", tensors, total, files, skipped)


def flat_dcp_state(checkpoint: Checkpoint) -> tuple[dict[str, object], frozenset[str], tuple[str, ...]]:
    """The nested state for DCP's flattening save (:func:`stream_into_dcp` with ``flatten=True``): meta tensors
    where DCP writes a tensor item, read when its writer reaches them; returned with the keys of those tensors and
    the entries left out (per-rank entries; empty dicts, which DCP's save walks into and saves nothing for). An
    array inside a value DCP saves whole (a tuple, a list of plain values: ``torch.save`` bytes; Megatron-LM's
    ``np_rng_state`` tuple holds one) is read now, as it is saved with the value: a meta tensor there would be saved
    as one, without its data."""
    planned: dict[int, str] = {}  # id of each meta tensor handed out -> its array's key

    def meta(key: str) -> torch.Tensor:
        tensor = meta_tensor(checkpoint, key)
        planned[id(tensor)] = key
        return tensor

    state, skipped = nested_state(checkpoint, meta)
    read: set[str] = set()

    def whole(value: object) -> object:
        if isinstance(value, torch.Tensor) and id(value) in planned:
            read.add(planned[id(value)])
            return checkpoint[planned[id(value)]].torch()
        if isinstance(value, (list, tuple)):
            return type(value)(whole(v) for v in value)
        if isinstance(value, dict):
            return {k: whole(v) for k, v in value.items()}
        return value

    def walk(value: object) -> object:  # as DCP's traverse_state_dict: into dicts, and lists not saved whole
        if isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list) and not _saved_whole(value):
            return [walk(v) for v in value]
        return value if isinstance(value, torch.Tensor) else whole(value)

    state = cast("dict[str, object]", walk(state))
    keys = frozenset(k for k in checkpoint.manifest.entries if checkpoint.manifest.array_entry(k) is not None)
    return state, keys - read, skipped + _left_out_by_dcp(state)


def _left_out_by_dcp(value: object, path: tuple[str | int, ...] = ()) -> tuple[str, ...]:
    """The dotted names of the empty dicts in ``value`` that DCP's flattening save leaves out: it walks into every
    dict, and into every list holding a dict or a tensor (``_traverse.traverse_state_dict``), and saves nothing
    for an empty dict it meets that way."""
    if isinstance(value, Mapping):
        if not value:
            return (".".join(map(str, path)),)
        return tuple(name for k, v in value.items() for name in _left_out_by_dcp(v, (*path, k)))
    if isinstance(value, list) and not _saved_whole(value):
        return tuple(name for i, v in enumerate(value) for name in _left_out_by_dcp(v, (*path, i)))
    return ()


def _saved_whole(value: list[object]) -> bool:
    """Whether DCP saves this list as one value (``_traverse``'s ``_is_terminal``): no dict, tensor, or such a
    list inside."""
    return not any(isinstance(v, (Mapping, torch.Tensor)) or (isinstance(v, list) and not _saved_whole(v))
                   for v in value)


def refuse_pickles(checkpoint: Checkpoint) -> None:
    """A pickled value can only be exported from a checkpoint opened with ``allow_pickle=True``: say so first."""
    for key, entry in checkpoint.manifest.entries.items():
        if isinstance(entry, PickleEntry) and not stored_of(checkpoint).allow_pickle:
            raise PickleNotAllowedError(f"{checkpoint.location}: value {key!r} is pickled; converting it needs "
                                        "allow_pickle=True (--allow-pickle), only for checkpoints you trust")


def meta_tensor(checkpoint: Checkpoint, key: str) -> torch.Tensor:
    """The shape and dtype of array ``key``, without its data: what DCP plans with."""
    return torch.empty(checkpoint[key].shape, dtype=checkpoint[key].dtype, device="meta")


def stream_into_dcp(checkpoint: Checkpoint, state: dict[str, object], keys: frozenset[str], directory: Path, *,
                    flatten: bool, progress: Progress | None = None) -> int:
    """DCP's own save of ``state`` into the new ``directory``, one rank: its meta tensors under ``keys`` (the
    arrayckpt keys, which are also DCP's names: dotted paths when ``flatten``, else the state's own keys) read
    from ``checkpoint`` only when DCP's writer reaches them, one at a time; other values saved as DCP saves
    them (``torch.save`` bytes). Returns the bytes of tensors written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    total = sum(checkpoint[k].nbytes for k in keys)
    done = [0]

    class StreamingPlanner(DefaultSavePlanner):
        """Resolves each tensor from arrayckpt when DCP's writer reaches it (and not before)."""

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
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
        dcp.save(state, storage_writer=_writer(directory, False), planner=StreamingPlanner(flatten_state_dict=flatten),
                 no_dist=True)
    return total


@contextlib.contextmanager
def new_directory(target: Path, owned: Callable[[str], bool], entries: Sequence[str]) -> Iterator[Path]:
    """A held temporary directory beside ``target`` to write a checkpoint into (``switch.py``: hidden, removed by a
    rerun or ``arrayckpt gc`` after a kill); once the block succeeds it is made durable and switched into place
    whole (exchanged with an earlier directory, which is then removed), so ``target`` holds the old checkpoint or
    the new one at every instant. Where ``target`` also holds files that are not ``owned`` (a user's notes beside
    the checkpoint), they stay: the new files are moved in one by one instead, the loader's ``entries`` (the first
    one last, as the commit) so that a kill leaves the old checkpoint, the new one, or one that does not load
    (``switch.py::switch_files``). On failure nothing partial is left, and DCP's wrapped error is raised as itself
    (:func:`_dcp_cause`)."""
    target = switched_path(target)
    old = [e.name for e in os.scandir(target)] if target.is_dir() else []
    keep_others = any(not owned(name) for name in old)
    try:
        with held_temporary(target.parent, target.name) as temporary:
            yield temporary
            if keep_others:
                switch_files(temporary, target, entries[0], entries, [name for name in old if owned(name)])
            else:
                switch_directory(temporary, target)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        cause = _dcp_cause(e)
        failure = write_failure(cause, target)  # a full disk: torch's zip writer says "unexpected pos"
        if failure is not None:
            raise failure from None
        if cause is e:
            raise
        raise cause from None


def dcp_file(name: str) -> bool:
    """A file DCP's save writes (``.metadata``, ``__<rank>_<n>.distcp``)."""
    return name == METADATA_FILE or DISTCP_FILE.fullmatch(name) is not None


def _dcp_cause(error: BaseException) -> BaseException:
    """The error that made DCP fail: DCP raises a ``CheckpointException`` (a ``BaseException``, missed by
    ``except Exception``) carrying each rank's failure as ``(exception, traceback)``; an arrayckpt error among
    them (e.g. a damaged chunk, naming the key) is the one to raise, else the first one. Any other error is
    itself."""
    failures = getattr(error, "failures", None)
    if type(error).__name__ != "CheckpointException" or not isinstance(failures, dict) or not failures:
        return error
    causes = [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    causes = [c for c in causes if isinstance(c, BaseException)]
    ours = [c for c in causes if isinstance(c, ArrayckptError)]
    return ours[0] if ours else causes[0] if causes else error


def _writer(path: Path, overwrite: bool) -> FileSystemWriter:
    """A ``FileSystemWriter`` that appends every item to one ``__0_0.distcp``, holding one item at a time.

    DCP groups a rank's items into ``thread_count`` files (one, by default) and records each item's place
    in ``.metadata``; a conversion is one writer, so one file, not one per tensor. DCP's own ``write_data``
    keeps every tensor of a file in its ``tensor_dict`` until the file is done (for its safetensors format), so
    converting with it would hold the whole model at once. Here each item is resolved, appended as DCP serialises it
    (:func:`append_payload`) and dropped before the next; the planning, the ``.metadata`` and its commit stay
    DCP's own.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
    from torch.futures import Future

    class OneFileWriter(FileSystemWriter):
        def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            results = _write_one_file(Path(self.path) / name, plan.items, planner, self.sync_files)
            future: Future[list[WriteResult]] = Future()
            future.set_result(results)
            return future

    return OneFileWriter(os.fspath(path), single_file_per_rank=True, thread_count=1, overwrite=overwrite)


def _write_one_file(file: Path, items: list[WriteItem], planner: SavePlanner, sync: bool) -> list[WriteResult]:
    """Every write item appended to ``file``, plain values first and then tensors in plan order (DCP's order
    with one file per rank), written under a temporary name and renamed into place once complete and (with
    ``sync``) durable, so a ``.distcp`` file that is there is whole. Returns DCP's ``WriteResult`` per item."""
    from torch.distributed.checkpoint.planner import WriteItemType

    partial = file.with_name(f".{file.name}.tmp")
    ordered = sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO)  # stable: plan order kept
    try:
        with open(partial, "wb") as stream:
            results = [_append_item(stream, item, planner, file.name) for item in ordered]
            stream.flush()
            if sync:
                os.fsync(stream.fileno())
        os.replace(partial, file)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return results


def _append_item(stream: BinaryIO, item: WriteItem, planner: SavePlanner, name: str) -> WriteResult:
    """One item resolved (a tensor read from arrayckpt only now), appended to ``stream`` and recorded as
    DCP's ``_StorageInfo(name, offset, length)``; the data is dropped on return, before the next is read."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    offset, length = append_payload(stream, planner.resolve_data(item))
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
