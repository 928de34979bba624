"""Partial reads of packed shards (spec §16.3): a read needing a few inner chunks of a shard fetches its index and
only those inner chunks (a 4→3 reshard then reads about what it needs), every byte still checked; a damaged inner
chunk or a crafted shard index is an error naming the array, never another chunk's bytes."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from policies import small_chunks

import arrayckpt
from arrayckpt._io.shards import fixed_inner_size
from arrayckpt._read.checkpoint import stored_of
from arrayckpt._read.packed import PackedChunks

INNER, OUTER = 64, 1024  # bytes: inner chunks of 2 rows of 8 float32, shards of 32 rows


def _saved(codec: str | None = None) -> tuple[str, torch.Tensor]:
    url = f"memory://partial/{uuid.uuid4().hex}"
    w = torch.arange(128 * 8, dtype=torch.float32).reshape(128, 8)
    small_chunks(INNER, OUTER).save({"w": w}, url, packed=True, codec=codec)
    return url, w


def _counting(checkpoint: arrayckpt.Checkpoint) -> list[int]:
    """The byte counts of every range the checkpoint's packs are read in, from now on."""
    packed = stored_of(checkpoint).packed
    assert packed is not None
    sizes: list[int] = []
    real = packed._read

    def read(name, ranges):
        sizes.extend(length for _, length in ranges)
        return real(name, ranges)
    packed._read = read
    return sizes


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_a_slice_of_a_packed_shard_reads_about_what_it_needs(codec):
    url, w = _saved(codec)
    with arrayckpt.open(url) as ckpt:
        assert ckpt["w"].metadata["codecs"][0]["name"] == "sharding_indexed"
        stored_of(ckpt).packed.rows(["w"])  # the array's section of the pack index, read once per open
        sizes = _counting(ckpt)
        assert np.array_equal(ckpt["w"][35:38], w[35:38].numpy())  # 2 inner chunks of 16 in shard 1
        needed = 2 * (2 * 8 * 4 + 4)  # the two inner chunks touched (rows and crc32c)
        index = 16 * 16 + 4  # the shard's index
        assert sizes[0] == index and len(sizes) == 3, sizes
        assert sum(sizes[1:]) <= 1.1 * needed + (32 if codec else 0), sizes
        sizes.clear()
        assert np.array_equal(ckpt["w"].numpy(), w.numpy())  # a whole read fetches whole shards, once each
        assert len(sizes) == 4  # the four shards


def test_a_reshard_of_a_packed_save_reads_at_most_a_tenth_more_than_it_needs():
    """Three readers each reading their third of the rows (a 4→3 reshard of a tensor saved in 4 row blocks)."""
    url, w = _saved("zstd")
    with arrayckpt.open(url) as ckpt:
        stored_of(ckpt).packed.rows(["w"])
        sizes = _counting(ckpt)
        bounds = [0, 43, 86, 128]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            assert np.array_equal(ckpt["w"][lo:hi], w[lo:hi].numpy())
        whole = sum(sizes)
    with arrayckpt.open(url) as ckpt:
        stored_of(ckpt).packed.rows(["w"])
        sizes = _counting(ckpt)
        ckpt["w"].numpy()
        once = sum(sizes)
    assert whole <= 1.1 * once + 3 * (16 * 16 + 4), (whole, once)  # (a shard index read per partial shard)


def test_a_damaged_inner_chunk_of_a_partly_read_shard_is_an_error():
    url, w = _saved()
    with arrayckpt.open(url) as ckpt:
        packed = stored_of(ckpt).packed
        pack, offset, _ = (int(v) for v in packed.rows(["w"])["w"][1])  # shard 1
        name = packed.layout.packs[pack].name
    from arrayckpt._storage import parse_location
    store = parse_location(url).open_store()
    data = bytearray(store.read(name).result().value)
    data[offset + 70] ^= 0x01  # in its second inner chunk (rows 34-35)
    store.write(name, bytes(data)).result()
    with arrayckpt.open(url) as ckpt:
        assert np.array_equal(ckpt["w"][40:42], w[40:42].numpy())  # another inner chunk of that shard reads fine
        with pytest.raises(arrayckpt.CorruptCheckpointError, match="'w'"):
            ckpt["w"][34:36]


def test_the_partial_shards_of_a_load_are_read_together_whatever_their_array(monkeypatch):
    """A reshard's load of many arrays, each needing part of some shards: the shard indexes of all of them in one
    round of reads, their inner chunks in a second (two reads of the pack, not two per array), and about the bytes
    it needs; each value still exact."""
    url = f"memory://partial/{uuid.uuid4().hex}"
    state = {f"w{i}": torch.arange(128 * 8, dtype=torch.float32).reshape(128, 8) + 1000 * i for i in range(6)}
    small_chunks(INNER, OUTER).save(state, url, packed=True, codec="zstd")
    calls: list[tuple[str, int]] = []
    real_init = PackedChunks.__init__

    def counting_init(self, layout, nodes, present, read_ranges, *args, **kwargs):
        def read(name, ranges):
            calls.append((name, sum(length for _, length in ranges)))
            return read_ranges(name, ranges)
        real_init(self, layout, nodes, present, read, *args, **kwargs)
    monkeypatch.setattr(PackedChunks, "__init__", counting_init)
    out = {key: torch.zeros(43, 8) for key in state}
    arrayckpt.load({key: arrayckpt.Shard(t, global_shape=(128, 8), global_offset=(43, 0)) for key, t in out.items()},
                   url)
    for key, value in state.items():
        assert torch.equal(out[key], value[43:86]), key
    packs = [size for name, size in calls if name.endswith(".pack")]
    assert len(packs) == 2, calls  # one pack: the indexes of all partly read shards, then their inner chunks
    needed = 6 * 22 * (2 * 8 * 4 + 4)  # 22 inner chunks of 2 rows (rows 42..85) per array, compressed at most
    assert sum(packs) <= 1.1 * needed + 6 * 2 * (16 * 16 + 4), calls  # plus two shard indexes per array


def _relaid_shard(url: str, shard: int, order: list[int]) -> None:
    """Rewrite shard ``shard`` of ``w`` (uncompressed) holding its inner chunks in ``order`` (those left out not
    stored), its index saying so: a valid shard, though not laid out as arrayckpt lays shards out."""
    import struct

    import crc32c

    from arrayckpt._storage import parse_location
    with arrayckpt.open(url) as ckpt:
        packed = stored_of(ckpt).packed
        pack, offset, length = (int(v) for v in packed.rows(["w"])["w"][shard])
        name = packed.layout.packs[pack].name
    store = parse_location(url).open_store()
    data = bytearray(store.read(name).result().value)
    chunk = bytes(data[offset:offset + length])
    count = 16
    index = np.frombuffer(chunk[-(count * 16 + 4):-4], "<u8").reshape(count, 2).copy()
    pieces = [chunk[int(o):int(o) + int(n)] for o, n in index]
    index[:] = 2**64 - 1  # not stored, unless placed below
    body, position = b"", 0
    for j in order:
        index[j] = (position, len(pieces[j]))
        body += pieces[j]
        position += len(pieces[j])
    raw = index.tobytes()
    data[offset:offset + length] = body + raw + struct.pack("<I", crc32c.crc32c(raw))
    store.write(name, bytes(data)).result()


def test_an_uncompressed_partial_read_is_one_round_and_a_shard_laid_out_otherwise_still_reads_right():
    """Uncompressed inner chunks lie where arrayckpt puts them, so a partial read fetches them with the shard index
    in one round; the index (crc32c-checked) confirms each one, and a shard laid out otherwise (two inner chunks
    swapped, its index saying so: valid Zarr) is read right in a second round, never from the predicted bytes."""
    url, w = _saved()
    with arrayckpt.open(url) as ckpt:
        stored_of(ckpt).packed.rows(["w"])
        sizes = _counting(ckpt)
        assert np.array_equal(ckpt["w"][42:44], w[42:44].numpy())  # inner chunk 5 of shard 1
        assert len(sizes) == 2 and sizes == [16 * 16 + 4, 2 * 8 * 4 + 4], sizes  # one call: index, chunk
    _relaid_shard(url, 1, [0, 1, 2, 3, 4, 6, 5, *range(7, 16)])
    with arrayckpt.open(url) as ckpt:
        stored_of(ckpt).packed.rows(["w"])
        sizes = _counting(ckpt)
        assert np.array_equal(ckpt["w"][42:46], w[42:46].numpy())  # inner chunks 5 and 6, swapped on storage
        assert np.array_equal(ckpt["w"][40:42], w[40:42].numpy())  # chunk 4, where it was predicted
        assert np.array_equal(ckpt["w"].numpy(), w.numpy())
    assert len(sizes) > 2


def test_inner_chunks_are_guessed_only_where_the_shard_is_laid_out_whole():
    """Offsets are guessed only for an uncompressed shard of exactly the length arrayckpt's layout gives it (every
    inner chunk stored, at full size, then the index): a valid shorter one (an inner chunk not stored) or a compressed
    one is read index first, so a guess can never reach past a chunk file and read as damage."""
    url, _ = _saved()
    with arrayckpt.open(url) as ckpt:
        metadata = ckpt["w"].metadata
        length = int(stored_of(ckpt).packed.rows(["w"])["w"][1][2])
    whole = 16 * (2 * 8 * 4 + 4) + 16 * 16 + 4
    assert length == whole
    assert fixed_inner_size(metadata, (1, 0), whole) == 2 * 8 * 4 + 4
    assert fixed_inner_size(metadata, (1, 0), whole - (2 * 8 * 4 + 4)) is None  # an inner chunk not stored
    zstd_url, _ = _saved("zstd")
    with arrayckpt.open(zstd_url) as ckpt:
        assert fixed_inner_size(ckpt["w"].metadata, (1, 0), whole) is None
