"""torch.save files to and from arrayckpt, one tensor at a time (memory-mapped in, streamed out)."""

from __future__ import annotations

import ctypes
import errno
import math
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path

import torch

from .._errors import FormatError, PickleNotAllowedError, StateError
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._read.checkpoint import Checkpoint
from .._torch.aliases import tensor_identity
from .._torch.state import walk
from .._write.options import SaveOptions
from .._write.stream import write_streaming
from .common import ConvertResult, Progress, nested_state, refusal_reason, refuse_existing, replaced_atomically

__all__ = ["LEGACY_STORAGES", "LEGACY_STORAGE_NAMES", "from_torch", "to_torch"]

# torch.save's legacy storage classes (``torch.FloatStorage``...) by dtype; newer dtypes are saved as an
# ``UntypedStorage`` with the dtype given to ``_rebuild_tensor_v3``. (DCP's payloads use them too.)
LEGACY_STORAGE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.int64: "LongStorage", torch.int32: "IntStorage", torch.int16: "ShortStorage", torch.int8: "CharStorage",
    torch.uint8: "ByteStorage", torch.bool: "BoolStorage", torch.bfloat16: "BFloat16Storage",
    torch.complex128: "ComplexDoubleStorage", torch.complex64: "ComplexFloatStorage",
}
LEGACY_STORAGES: dict[str, torch.dtype] = {name: dtype for dtype, name in LEGACY_STORAGE_NAMES.items()}


def from_torch(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
               allow_pickle: bool = False, progress: Progress | None = None,
               chunking: ChunkPolicy = DEFAULT_CHUNKING, key_prefix: str = "") -> ConvertResult:
    """A ``torch.save`` file (a dict, nested) into arrayckpt, loaded with ``weights_only=True``.

    The file is memory-mapped; each tensor is written straight from the mapping and its pages released
    before the next, so resident memory stays near one tensor (legacy non-zip files cannot be mapped and
    load whole).
    """
    state = _load_weights_only(src)
    if not isinstance(state, dict):
        raise StateError(f"{src}: holds a {type(state).__name__}, not a dict; load it and save "
                         "{'name': obj} with arrayckpt.save instead")
    skeleton, real = _meta_skeleton(state)
    leaves = walk(skeleton).leaves

    def fetch(key: str) -> torch.Tensor:
        return real[id(leaves[key].value)]

    def release(key: str) -> None:
        _release_pages(real[id(leaves[key].value)])

    options = SaveOptions(overwrite=overwrite, allow_pickle=allow_pickle)
    write_streaming(skeleton, fetch, dst, options, chunking=chunking,
                    source=f"torch.save: {Path(src).name}", progress=progress, release=release,
                    key_prefix=key_prefix)
    tensors = [leaf.value for leaf in leaves.values() if isinstance(leaf.value, torch.Tensor)]
    return ConvertResult("torch", "arrayckpt", len(tensors), sum(_nbytes(t) for t in tensors), (str(dst),))


def _load_weights_only(src: str | os.PathLike[str]) -> object:
    """``torch.load(weights_only=True)``, memory-mapped where the file allows; a refused pickle (a global that is not
    plain data: code the file would run) or a damaged file is one line naming the file, never torch's paragraph."""
    try:
        with warnings.catch_warnings():  # a damaged file's "pickle protocol 242" warning says nothing more
            warnings.simplefilter("ignore", UserWarning)
            try:
                return torch.load(src, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "zip" not in str(e).lower():
                    raise
                return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = refusal_reason(e)
        if "global" not in reason.lower():
            raise FormatError(f"{src}: not a readable torch.save file: {reason}") from None
        raise PickleNotAllowedError(f"{src}: refused to unpickle it ({reason}): a torch.save file is read "
                                    "as plain data only (weights_only=True); re-save it with tensors and plain values "
                                    "only, from a process that can load it") from None
    except OSError as e:
        if e.filename is not None:
            raise
        if e.errno == errno.EINVAL:  # torch's zip reader seeking outside a truncated file
            raise FormatError(f"{src}: not a readable torch.save file: {e.strerror} (truncated or damaged)") from None
        raise OSError(e.errno, e.strerror, os.fspath(src)) from None  # torch's errors name no file
    except MemoryError:
        raise
    except Exception as e:  # whatever torch's unpickler trips over in a damaged file (struct, value, index errors)
        raise FormatError(f"{src}: not a readable torch.save file: {refusal_reason(e)}") from None


def _nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()


def _meta_skeleton(state: Mapping[str, object]) -> tuple[dict[str, object], dict[int, torch.Tensor]]:
    """A copy of nested dicts/lists/tuples with every tensor replaced by a meta tensor (and a map back); tensors
    that are one (tied weights, sharing their memory) get one meta tensor, which the save then stores once."""
    real: dict[int, torch.Tensor] = {}
    made: dict[Hashable, torch.Tensor] = {}

    def copy(value: object) -> object:
        if isinstance(value, torch.Tensor):
            identity = tensor_identity(value)
            meta = made.get(identity) if identity is not None else None
            if meta is None:
                meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
                real[id(meta)] = value
                if identity is not None:
                    made[identity] = meta
            return meta
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copy(v) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(copy(v) for v in value)
        return value

    return {k: copy(v) for k, v in state.items()}, real  # copy(state), typed as the dict it is


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
    refuse_existing(target, overwrite)
    state, skipped = nested_state(checkpoint, lambda key: _Deferred(checkpoint, key))
    with replaced_atomically(target) as temp:
        try:
            _write_torch_file(state, temp, progress)
        except _NotStreamable:
            temp.unlink(missing_ok=True)
            torch.save(nested_state(checkpoint, lambda key: checkpoint[key].torch())[0], temp)
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


def _write_torch_file(state: object, path: Path, progress: Progress | None) -> None:
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
        def reducer_override(self, obj: object) -> tuple[Callable[..., torch.Tensor], tuple[object, ...]]:
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
            args: tuple[object, ...] = (_StorageStub(deferred), 0, deferred.shape, stride, False,
                                     collections.OrderedDict())
            if deferred.dtype in LEGACY_STORAGE_NAMES:
                return _rebuild_tensor_v2, args
            return _rebuild_tensor_v3, (*args, deferred.dtype)

        def persistent_id(self, obj: object) -> object:
            if not isinstance(obj, _StorageStub):
                return None
            tensor, key = obj.tensor, str(len(records))
            records.append((key, tensor.read, tensor.nbytes))
            name = LEGACY_STORAGE_NAMES.get(tensor.dtype)
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
