"""Pure pieces of the format: key escaping, typed JSON values, manifest parsing, chunk planning."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arrayckpt._errors import FormatError
from arrayckpt._format.dtypes import DTYPES
from arrayckpt._format.keys import _SEGMENT, array_path, parse_array_path
from arrayckpt._format.manifest import Manifest
from arrayckpt._format.values import NotJSONable, decode_value, encode_value
from arrayckpt._layout.chunking import DEFAULT_CHUNKING, choose_chunks


@pytest.mark.parametrize(
    ("key", "path"),
    [
        ("model.layers.0.weight", "model/layers/0/weight"),
        ("a..b", "a/%/b"),
        ("../../etc/passwd", "%/%/%2F%2F/%/%2Fetc%2Fpasswd".replace("%2F%2F", "%2F")),
        ("__meta", "%5F_meta"),
        ("ü", "%C3%BC"),
        ("with space", "with%20space"),
    ],
)
def test_array_path_escaping(key, path):
    assert array_path(key) == path
    assert parse_array_path(path, key) == path


@pytest.mark.slow
@given(st.text(max_size=30))
def test_array_paths_are_safe_and_injective(key):
    path = array_path(key)
    segments = path.split("/")
    assert all(_SEGMENT.fullmatch(s) for s in segments)
    assert ".." not in segments and not path.startswith("/")
    assert len(segments) == key.count(".") + 1


@given(st.text(max_size=12), st.text(max_size=12))
def test_distinct_keys_get_distinct_paths(a, b):
    if a != b:
        assert array_path(a) != array_path(b)


@pytest.mark.parametrize("path", ["../x", "a/../b", "/abs", "a//b", "a/./b", "a/%zz", "a/b.c"])
def test_unsafe_array_paths_are_refused(path):
    with pytest.raises(FormatError):
        parse_array_path(path, "a")


_plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4)
    | st.tuples(inner, inner)
    | st.dictionaries(st.text() | st.integers(), inner, max_size=4),
    max_leaves=20,
)


@given(_plain)
@settings(max_examples=200)
def test_values_round_trip_through_json(value):
    assert decode_value(json.loads(json.dumps(encode_value(value)))) == value


def test_non_finite_floats_and_types_survive():
    out = decode_value(json.loads(json.dumps(encode_value([float("nan"), float("inf"), 1.0, 1, True]))))
    assert math.isnan(out[0]) and out[1] == float("inf")
    assert [type(v) for v in out[2:]] == [float, int, bool]


def test_objects_need_pickle():
    with pytest.raises(NotJSONable):
        encode_value(object())
    with pytest.raises(NotJSONable):
        encode_value({1.5: "float keys are fine"} | {"x": set()})


def _manifest(**entries) -> dict:
    return {"format_version": 1, "step": None, "entries": entries}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ("not a dict", "must be a JSON object"),
        ({"entries": {}}, "no valid format_version"),
        ({"format_version": 5, "entries": {}}, "format version 5 is not supported"),
        ({"format_version": 1, "entries": [], "step": None}, "'entries' must be a JSON object"),
        ({"format_version": 1, "entries": {}, "step": "7"}, "'step' must be an integer"),
        (_manifest(w={"kind": "tensor", "keys": ["w"], "path": "../w", "dtype": "float32", "shape": [1]}),
         "array path"),
        (_manifest(w={"kind": "tensor", "keys": ["w"], "path": "x", "dtype": "float32", "shape": [1]}),
         "should be 'w'"),
        (_manifest(w={"kind": "tensor", "keys": ["w"], "path": "w", "dtype": "float99", "shape": [1]}),
         "unknown dtype"),
        (_manifest(w={"kind": "tensor", "keys": ["w"], "path": "w", "dtype": "float32", "shape": [-1]}),
         "shape"),
        (_manifest(w={"kind": "tensor", "keys": ["w"], "path": "w", "dtype": "float32", "shape": [1] * 65}),
         "shape"),
        (_manifest(w={"kind": "tensor", "keys": ["v"], "path": "w", "dtype": "float32", "shape": [1]}), "do not join"),
        (_manifest(w={"kind": "tensor", "keys": [], "path": "w", "dtype": "float32", "shape": [1]}), "non-empty list"),
        (_manifest(w={"kind": "code", "keys": ["w"]}), "unknown kind 'code'"),
        (_manifest(w={"kind": "value", "keys": ["w"]}), "has no 'value'"),
        (_manifest(w={"kind": "pickle", "keys": ["w"], "path": "w", "nbytes": -1}), "nbytes"),
        (_manifest(w=[]), "must be a JSON object"),
    ],
)
def test_hostile_manifests_are_refused_with_a_reason(data, match):
    with pytest.raises(FormatError, match=match):
        Manifest.from_dict(data)


def test_manifest_round_trips():
    data = _manifest(
        w={"kind": "tensor", "keys": ["m", "w"], "path": "m/w", "dtype": "bfloat16", "shape": [2, 3]},
        v={"kind": "value", "keys": ["v"], "value": {"$tuple": [1, 2]}},
    )
    data["entries"] = {"m.w": data["entries"]["w"], "v": data["entries"]["v"]}
    data.update(containers={}, created={"library": "x"})
    assert Manifest.from_dict(data).to_dict() == data


@given(
    st.lists(st.integers(0, 5000), min_size=0, max_size=4),
    st.sampled_from(sorted({dt.itemsize for dt in DTYPES.values()})),
)
@settings(max_examples=300)
def test_chunk_plan_is_valid_for_the_sharding_codec(shape, itemsize):
    outer, inner = choose_chunks(tuple(shape), itemsize)
    assert len(outer) == len(inner) == len(shape)
    assert all(o >= 1 and i >= 1 and o % i == 0 for o, i in zip(outer, inner, strict=True))
    assert all(i <= max(1, n) for i, n in zip(inner, shape, strict=True))
    unit_row = itemsize * math.prod(inner[1:]) if inner else itemsize
    # the inner chunk stays within its target unless a single index of the last split dimension is larger
    assert math.prod(inner) * itemsize <= max(DEFAULT_CHUNKING.inner_chunk_bytes, unit_row)
    assert math.prod(outer) * itemsize <= max(DEFAULT_CHUNKING.outer_chunk_bytes, math.prod(inner) * itemsize)


def test_chunk_plan_examples():
    assert choose_chunks((8192, 8192), 4) == ((2048, 8192), (128, 8192))
    assert choose_chunks((10,), 4) == ((10,), (10,))
    assert choose_chunks((), 4) == ((), ())
    assert choose_chunks((0, 3), 4) == ((1, 3), (1, 3))


def test_arrays_split_across_ranks_get_smaller_inner_chunks_than_whole_ones():
    """A 1 MiB float32 array: whole (one process), inner chunks of MIN_INNER (256 KiB, 4 of them: a whole read
    pays per inner chunk); split over 4 ranks (256 KiB shards), 16 inner chunks of MIN_SPLIT_INNER (64 KiB) per
    shard, so that a load at 3 ranks reads little more than it needs."""
    assert choose_chunks((1024, 256), 4) == ((1024, 256), (256, 256))
    assert choose_chunks((1024, 256), 4, (256, None)) == ((256, 256), (64, 256))


def test_writer_runs_round_trip_and_malformed_records_are_ignored():
    import numpy as np

    from arrayckpt._format.writers import expand_runs, writer_runs

    rng = np.random.default_rng(0)
    for ranks in ([], [5], [0, 1, 2, 3], [0, 8, 16, 3, 3, 3, 7, 5], list(rng.integers(0, 6, 50))):
        runs = writer_runs([int(r) for r in ranks])
        assert expand_runs(runs, len(ranks)) == [int(r) for r in ranks]
        assert sum(n * each for _, _, n, each in runs) == len(ranks)
    assert writer_runs(list(range(0, 16384, 8))) == [[0, 8, 2048, 1]]  # one run however many ranks
    assert writer_runs([r for r in range(0, 64, 8) for _ in range(3)]) == [[0, 8, 8, 3]]  # 3 chunks per shard
    assert writer_runs([2, 2, 5, 5, 5]) == [[2, 0, 1, 2], [5, 0, 1, 3]]
    for bad in (None, {}, [[0, 1, 1]], [[0, 1, 0, 1]], [[-1, 0, 2, 1]], [[3, -2, 3, 1]], [[0, 0, 3, 1]],
                [[0, 0, True, 1]], [[0, 0, 1, 0]]):
        assert expand_runs(bad, 2) is None, bad
