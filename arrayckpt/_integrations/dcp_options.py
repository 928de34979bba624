"""What arrayckpt's DCP storage classes make of the arguments of DCP's own, so that code switching over changes a
class name and nothing else (no IO).

``ArrayckptWriter`` takes every keyword argument of DCP's ``FileSystemWriter`` (torch 2.4-2.13) and
``ArrayckptReader`` every keyword argument of ``FileSystemReader``; each is accepted or refused here, in one
table, by what it would mean for an arrayckpt checkpoint:

==========================  ================================================================================
``overwrite``               ``True`` by default, as DCP's: saving to a path that holds a checkpoint replaces it,
                            atomically; in a directory that also holds other files only where ``overwrite=True``
                            is given (the writer's own argument, ``dcp_storage.py``)
``cache_staged_state_dict`` ``dcp.async_save`` stages through the writer, as through ``FileSystemWriter``
                            (the writer's own argument, ``dcp_storage.py``)
``single_file_per_rank``,   accepted, no effect: the layout is arrayckpt's (a Zarr array per tensor, chunks
``thread_count``,           aligned with the shards, every rank's written concurrently from its tensors' memory,
``per_thread_copy_ahead``   through TensorStore)
``sync_files``              accepted, no effect: a save is always made durable before its commit
``_extensions``             ``[ZStandard()]`` is ``codec="zstd"`` (Zarr's zstd codec, which zarr-python and
                            TensorStore decode; an explicit ``codec=`` wins); any other stream transform is refused:
                            its bytes would be readable only through DCP with that extension registered, and a
                            transform silently left out (encryption) would store in the clear what was meant not to
``serialization_format``    ``TORCH_SAVE`` (DCP's default) only: arrayckpt writes Zarr v3 arrays whatever it is
                            asked; ``SAFETENSORS`` is refused
``_extension_registry``     (reader) accepted, no effect: the codecs are recorded in the checkpoint
==========================  ================================================================================

Anything else is a ``TypeError``, as for any Python function. FsspecWriter's extra ``**kwargs`` (fsspec options)
are ``storage_options=`` here, with arrayckpt's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["accelerator_available", "check_reader_options", "check_writer_options"]

#: FileSystemWriter's arguments accepted with no effect, and why (for the docs and the error messages).
WRITER_NO_EFFECT: Mapping[str, str] = {
    "single_file_per_rank": "arrayckpt writes a Zarr array per tensor",
    "thread_count": "every rank writes its chunks concurrently through TensorStore",
    "per_thread_copy_ahead": "every rank writes straight from its tensors' host memory",
    "sync_files": "a save is always made durable before its commit",
}
READER_NO_EFFECT: Mapping[str, str] = {
    "_extension_registry": "an arrayckpt checkpoint records its codecs, which the reader decodes",
}
WRITER_REFUSED = ("_extensions", "serialization_format")
ZSTD_EXTENSION = "stream.zstd"  # DCP's ``ZStandard().registry_name()``


def check_writer_options(options: Mapping[str, Any]) -> str | None:
    """Accept or refuse ``FileSystemWriter``'s arguments given to ``ArrayckptWriter`` (see the module docstring);
    returns the codec they ask for (``"zstd"`` for DCP's ``ZStandard`` extension), else None."""
    codec = None
    for name, value in options.items():
        if name in WRITER_NO_EFFECT:
            continue
        if name == "_extensions":
            others = [e for e in value or () if _registry_name(e) != ZSTD_EXTENSION]
            if others:
                names = [type(e).__name__ for e in others]
                raise ValueError(f"ArrayckptWriter(_extensions=...): {names}: DCP's stream transforms other than "
                                 "ZStandard do not apply to arrayckpt's Zarr chunks (zarr-python and TensorStore could "
                                 "not read them); leave them out, and compress with codec='zstd' (or 'blosc')")
            codec = "zstd" if value else None
        elif name == "serialization_format":
            if value is not None and getattr(value, "value", value) != "torch_save":
                raise ValueError(f"ArrayckptWriter(serialization_format={value!r}): arrayckpt writes Zarr v3 arrays "
                                 "(readable by zarr-python and TensorStore), not DCP's files; leave it out")
        else:
            raise _unexpected("ArrayckptWriter", name, [*WRITER_NO_EFFECT, *WRITER_REFUSED])
    return codec


def _registry_name(extension: object) -> object:
    """An extension's ``registry_name()`` (DCP's ``Extension`` interface), or None for anything else."""
    method = getattr(extension, "registry_name", None)
    try:
        return method() if callable(method) else None
    except Exception:  # noqa: BLE001 - not one of DCP's extensions
        return None


def check_reader_options(options: Mapping[str, Any]) -> None:
    """Accept or refuse ``FileSystemReader``'s arguments given to ``ArrayckptReader``."""
    for name in options:
        if name not in READER_NO_EFFECT:
            raise _unexpected("ArrayckptReader", name, list(READER_NO_EFFECT))


def _unexpected(cls: str, name: str, known: list[str]) -> TypeError:
    return TypeError(f"{cls}() got an unexpected keyword argument {name!r} (of DCP's arguments it takes "
                     f"{', '.join(sorted(known))}; fsspec options go in storage_options=)")


def accelerator_available() -> bool:
    """Whether torch has an accelerator to pin staging memory for (``torch.accelerator`` from torch 2.6)."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())
