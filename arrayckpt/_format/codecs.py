"""Compression choices and the Zarr v3 codec pipelines they become.

Every chunk ends in a ``crc32c`` checksum whatever the compression, so damage is always detected.
A codec can be chosen for the whole checkpoint or per key (e.g. compress the optimizer state, not the
weights); see :func:`resolve_codec`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, cast

from .._errors import FormatError, StateError
from .jsontypes import JSON, json_object, member

__all__ = ["Codec", "CodecChoice", "CodecLike", "codec_pipeline", "resolve_codec", "sharded_pipeline"]

DEFAULT_ZSTD_LEVEL = 3
DEFAULT_BLOSC_LEVEL = 1  # with bit-shuffle, level 1 compresses weights almost as well as 5 at far less CPU
DEFAULT_BLOSC_CNAME = "zstd"
BLOSC_COMPRESSORS = ("blosclz", "lz4", "lz4hc", "zlib", "zstd")

Compression = Literal["none", "zstd", "blosc"]
Shuffle = Literal["noshuffle", "shuffle", "bitshuffle"]
SHUFFLES: tuple[Shuffle, ...] = ("noshuffle", "shuffle", "bitshuffle")


@dataclass(frozen=True)
class Codec:
    """How to compress a tensor's chunks.

    ``Codec()`` is no compression. A crc32c checksum is always added.

    Args:
        name: ``"none"``, ``"zstd"`` or ``"blosc"``.
        level: the compression level (zstd: -7..22, blosc: 0..9; ``None``: the library's default).
        shuffle: for blosc: ``"noshuffle"``, ``"shuffle"`` or ``"bitshuffle"`` (byte or bit shuffling groups the
            bytes of floats by significance, which is what makes weights compress).
        cname: for blosc: its inner compressor (``"zstd"``, ``"lz4"``, ...).

    Raises:
        StateError: an unknown name, shuffle or compressor, or a level out of range.

    Examples:
        >>> Codec("blosc", shuffle="shuffle")
        Codec(name='blosc', level=None, shuffle='shuffle', cname='zstd')
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.zeros(64)}, path, codec=Codec("zstd", level=3))
    """

    name: Compression = "none"
    level: int | None = None
    shuffle: Shuffle = "bitshuffle"
    cname: str = DEFAULT_BLOSC_CNAME

    def __post_init__(self) -> None:
        if self.name not in ("none", "zstd", "blosc"):
            raise StateError(f"unknown codec {self.name!r}; use 'none', 'zstd' or 'blosc'")
        if self.shuffle not in SHUFFLES:
            raise StateError(f"unknown shuffle {self.shuffle!r}; use 'noshuffle', 'shuffle' or 'bitshuffle'")
        low, high = (0, 9) if self.name == "blosc" else (-7, 22)
        if self.level is not None and (
            not isinstance(self.level, int) or isinstance(self.level, bool) or not low <= self.level <= high
        ):
            raise StateError(f"{self.name} level {self.level!r} is out of range {low}..{high}")
        if self.cname not in BLOSC_COMPRESSORS:
            raise StateError(f"unknown blosc compressor {self.cname!r}; use one of {', '.join(BLOSC_COMPRESSORS)}")


CodecLike = None | str | Codec
CodecChoice = CodecLike | Mapping[str, CodecLike] | Callable[[str], CodecLike]


def _as_codec(value: CodecLike) -> Codec:
    if value is None:
        return Codec()
    if isinstance(value, Codec):
        return value
    if isinstance(value, str):
        return Codec(value)  # type: ignore[arg-type]
    raise StateError(f"codec must be None, a name or an arrayckpt.Codec, got {value!r}")


def resolve_codec(choice: CodecChoice, key: str) -> Codec:
    """The codec for ``key``.

    ``choice`` is one codec for everything; or a mapping from glob patterns on dotted keys to codecs
    (first match wins, unmatched keys are uncompressed: ``{"optim.*": "zstd"}``); or a function of the
    key.
    """
    if isinstance(choice, Mapping):
        for pattern, codec in choice.items():
            if fnmatch.fnmatchcase(key, pattern):
                return _as_codec(codec)
        return Codec()
    if callable(choice) and not isinstance(choice, Codec):
        return _as_codec(choice(key))
    return _as_codec(choice)


def _bytes_codec(itemsize: int) -> JSON:
    if itemsize == 1:  # endianness is meaningless for one-byte types and zarr-python omits it
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}


_CRC32C: JSON = {"name": "crc32c"}


def codec_pipeline(codec: Codec, itemsize: int) -> list[JSON]:
    """The Zarr v3 codec list for one chunk: bytes, optional compression, crc32c."""
    pipeline = [_bytes_codec(itemsize)]
    if codec.name == "zstd":
        level = DEFAULT_ZSTD_LEVEL if codec.level is None else codec.level
        pipeline.append({"name": "zstd", "configuration": {"level": level, "checksum": False}})
    elif codec.name == "blosc":
        level = DEFAULT_BLOSC_LEVEL if codec.level is None else codec.level
        pipeline.append(
            {
                "name": "blosc",
                "configuration": {
                    "cname": codec.cname,
                    "clevel": level,
                    "shuffle": codec.shuffle if itemsize > 1 else "noshuffle",
                    "typesize": itemsize,
                    "blocksize": 0,
                },
            }
        )
    pipeline.append(_CRC32C)
    return pipeline


def check_checksummed(metadata: JSON, where: str) -> None:
    """Refuse arrays whose chunks carry no crc32c: damage (or a planted file) would read back unnoticed."""
    codecs = metadata.get("codecs")
    if isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict) \
            and codecs[0].get("name") == "sharding_indexed":
        config = codecs[0].get("configuration") or {}
        ok = _ends_with_crc(config.get("codecs")) and _ends_with_crc(config.get("index_codecs"))
    else:
        ok = _ends_with_crc(codecs)
    if not ok:
        raise FormatError(f"{where}: array codecs {codecs!r} do not end with a crc32c checksum")


def _ends_with_crc(codecs: object) -> bool:
    return isinstance(codecs, list) and bool(codecs) and codecs[-1] == _CRC32C


def sharded_pipeline(inner_chunk: list[int], inner: list[JSON]) -> list[JSON]:
    """Wrap a chunk pipeline in ``sharding_indexed``: one file per outer chunk, inner chunks inside."""
    return [
        {
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": inner_chunk,
                "codecs": inner,
                "index_codecs": [_bytes_codec(8), _CRC32C],
                "index_location": "end",
            },
        }
    ]


def codec_of_metadata(metadata: JSON) -> Codec:
    """The :class:`Codec` an array's ``zarr.json`` was written with (for rewriting it the same way, e.g. when a
    delta chain is compacted); anything unrecognised reads as no compression."""
    codecs = metadata.get("codecs")
    if isinstance(codecs, list) and codecs and json_object(codecs[0]).get("name") == "sharding_indexed":
        codecs = member(codecs[0], "configuration", "codecs")
    for codec in codecs if isinstance(codecs, list) else []:
        codec = json_object(codec)
        config = json_object(codec.get("configuration"))
        # A level is an int or None by the time Codec() has checked it, which it does on construction.
        level = cast("int | None", config.get("level" if codec.get("name") == "zstd" else "clevel"))
        if codec.get("name") == "zstd":
            return Codec("zstd", level=level)
        cname = config.get("cname")
        if codec.get("name") == "blosc" and isinstance(cname, str) and cname in BLOSC_COMPRESSORS:
            shuffle: Shuffle = next((s for s in SHUFFLES if s == config.get("shuffle", "bitshuffle")), "bitshuffle")
            return Codec("blosc", level=level, cname=cname, shuffle=shuffle)
    return Codec()
