"""Loading checks everything before touching the state, and says what does not fit and how to fix it."""

from __future__ import annotations

import fractions

import pytest
import torch

import arrayckpt

pytestmark = pytest.mark.usefixtures("storage_layout")  # every test holds in both layouts (spec §2, §16)


def test_shape_and_dtype_mismatch_are_errors_and_state_is_untouched(ckpt):
    arrayckpt.save({"a": torch.ones(3), "b": torch.ones(2, 2)}, ckpt)
    target = {"a": torch.zeros(3), "b": torch.zeros(2, 3)}
    with pytest.raises(arrayckpt.StateError, match=r"'b' is float32\[2, 2\] in the checkpoint but float32\[2, 3\]"):
        arrayckpt.load(target, ckpt)
    assert torch.equal(target["a"], torch.zeros(3))  # nothing was loaded
    with pytest.raises(arrayckpt.StateError, match=r"'a' is float32\[3\] in the checkpoint but bfloat16\[3\]"):
        arrayckpt.load({"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2, 2)}, ckpt)


def test_missing_keys_raise_unless_not_strict(ckpt):
    arrayckpt.save({"a": torch.ones(3), "old": torch.ones(1)}, ckpt)
    with pytest.raises(arrayckpt.KeyMismatchError, match=r"'new'.*other key\(s\): 'old'.*strict=False"):
        arrayckpt.load({"a": torch.zeros(3), "new": torch.zeros(1)}, ckpt)
    target = {"a": torch.zeros(3), "new": torch.zeros(1)}
    result = arrayckpt.load(target, ckpt, strict=False)
    assert result.missing_keys == ["new"] and result.unexpected_keys == ["old"]
    assert torch.equal(target["a"], torch.ones(3)) and torch.equal(target["new"], torch.zeros(1))


def test_unexpected_keys_are_reported_in_strict_mode(ckpt):
    arrayckpt.save({"a": torch.ones(3), "extra": 5}, ckpt)
    result = arrayckpt.load({"a": torch.zeros(3)}, ckpt)
    assert result.unexpected_keys == ["extra"] and result.missing_keys == []


def test_module_with_extra_checkpoint_keys_reports_them(ckpt):
    big = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    arrayckpt.save({"m": big}, ckpt)
    small = torch.nn.Sequential(torch.nn.Linear(2, 2))
    result = arrayckpt.load({"m": small}, ckpt)
    assert result.unexpected_keys == ["m.1.weight", "m.1.bias"]
    assert torch.equal(small[0].weight, big[0].weight)


def test_value_where_state_has_tensor_is_an_error(ckpt):
    arrayckpt.save({"x": 3}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="'x' is a plain value in the checkpoint but an array"):
        arrayckpt.load({"x": torch.zeros(1)}, ckpt)


def test_plain_value_slot_receives_a_tensor(ckpt):
    arrayckpt.save({"x": torch.arange(4)}, ckpt)
    state = {"x": None}
    arrayckpt.load(state, ckpt)
    assert torch.equal(state["x"], torch.arange(4))


def test_pickle_is_opt_in_on_save_and_on_load(ckpt):
    state = {"frac": fractions.Fraction(1, 3), "w": torch.ones(2)}
    with pytest.raises(arrayckpt.PickleNotAllowedError, match=r"'frac' of type Fraction.*allow_pickle=True"):
        arrayckpt.save(state, ckpt)
    assert not ckpt.exists()
    arrayckpt.save(state, ckpt, allow_pickle=True)
    target = {"frac": None, "w": torch.zeros(2)}
    with pytest.raises(arrayckpt.PickleNotAllowedError, match="'frac' is pickled"):
        arrayckpt.load(target, ckpt)
    assert target["frac"] is None and torch.equal(target["w"], torch.zeros(2))
    opened = arrayckpt.open(ckpt)
    with pytest.raises(arrayckpt.PickleNotAllowedError):
        opened.plain_values["frac"]
    arrayckpt.load(target, ckpt, allow_pickle=True)
    assert target["frac"] == fractions.Fraction(1, 3)
    assert arrayckpt.open(ckpt, allow_pickle=True).plain_values["frac"] == fractions.Fraction(1, 3)


def test_bad_state_is_refused_with_the_fix(ckpt):
    with pytest.raises(arrayckpt.StateError, match="state must be a dict"):
        arrayckpt.save([torch.ones(1)], ckpt)
    with pytest.raises(arrayckpt.StateError, match="same key 'a.b'"):
        arrayckpt.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="'a' is a tensor and also the prefix of tensor 'a.b'"):
        arrayckpt.save({"a": torch.ones(1), "a.b": torch.ones(1)}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="complex32.*cannot store"):
        arrayckpt.save({"c": torch.zeros(2, dtype=torch.complex32)}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="to_dense"):
        arrayckpt.save({"s": torch.eye(2).to_sparse()}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="unknown codec 'lz77'"):
        arrayckpt.save({"x": torch.ones(1)}, ckpt, codec="lz77")
    assert not ckpt.exists()


def test_odd_keys_are_escaped_and_round_trip(ckpt):
    state = {"../../etc": torch.ones(1), "/abs": torch.ones(2), "ü nicode": torch.ones(3), "__x": torch.ones(4),
             "a..b": torch.ones(6), "x.": torch.ones(7)}
    arrayckpt.save(state, ckpt)
    opened = arrayckpt.open(ckpt)
    assert sorted(opened) == sorted(state)
    for key, value in state.items():
        assert torch.equal(opened[key].torch(), value)
    inside = {p.resolve() for p in ckpt.rglob("*")}
    assert all(str(p).startswith(str(ckpt.resolve())) for p in inside)
    assert [p.name for p in ckpt.parent.iterdir()] == ["ckpt"]


def test_keys_filesystems_cannot_hold_are_refused(ckpt):
    with pytest.raises(arrayckpt.StateError, match="differ only in letter case"):
        arrayckpt.save({"W": torch.ones(1), "w": torch.ones(1)}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="longer than 255 bytes"):
        arrayckpt.save({"x" * 300: torch.ones(1)}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="key True"):
        arrayckpt.save({True: torch.ones(1)}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="must have str or int keys"):
        arrayckpt.save({"m": {None: torch.ones(1)}}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="not valid Unicode"):
        arrayckpt.save({"\ud800": torch.ones(1)}, ckpt)
    assert not ckpt.exists()


def test_codec_limits():
    with pytest.raises(arrayckpt.StateError, match=r"blosc level 12 is out of range 0\.\.9"):
        arrayckpt.Codec("blosc", level=12)
    with pytest.raises(arrayckpt.StateError, match="unknown blosc compressor 'lzma'"):
        arrayckpt.Codec("blosc", cname="lzma")
    with pytest.raises(arrayckpt.StateError, match=r"zstd level 23"):
        arrayckpt.Codec("zstd", level=23)


def test_too_many_dimensions_and_unpicklable_per_rank_values_are_refused(ckpt):
    with pytest.raises(arrayckpt.StateError, match="33 dimensions; at most 32"):
        arrayckpt.save({"t": torch.zeros((1,) * 33)}, ckpt)
    with pytest.raises(arrayckpt.StateError, match="per-rank value 'p' of type set .*never pickled"):
        arrayckpt.save({"p": arrayckpt.PerRank({1, 2})}, ckpt, allow_pickle=True)
    with pytest.raises(arrayckpt.StateError, match="zstd level True"):
        arrayckpt.Codec("zstd", level=True)
    assert not ckpt.exists()


def test_per_rank_values_round_trip_in_a_single_process(ckpt):
    arrayckpt.save({"rng": arrayckpt.PerRank(torch.arange(4, dtype=torch.uint8)), "pos": arrayckpt.PerRank(7)}, ckpt)
    opened = arrayckpt.open(ckpt)
    assert opened.per_rank("pos") == [7] and torch.equal(opened.per_rank("rng")[0], torch.arange(4, dtype=torch.uint8))
    target = {"rng": arrayckpt.PerRank(torch.zeros(4, dtype=torch.uint8)), "pos": arrayckpt.PerRank(0)}
    arrayckpt.load(target, ckpt)
    assert target["pos"].value == 7 and torch.equal(target["rng"].value, torch.arange(4, dtype=torch.uint8))
    plain = {"pos": 0}  # a plain target takes its rank's plain value as well (as for a value that differed by rank)
    arrayckpt.load(plain, ckpt, strict=False)
    assert plain == {"pos": 7}
    with pytest.raises(arrayckpt.StateError, match="'rng' is per-rank in the checkpoint but not a PerRank"):
        arrayckpt.load({"rng": torch.zeros(4, dtype=torch.uint8)}, ckpt, strict=False)
