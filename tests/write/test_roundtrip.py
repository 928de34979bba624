"""Save/load/open round trips: every dtype, odd shapes and layouts, nested state, real torch objects."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import ALL_DTYPES, assert_bit_equal, bits, random_tensor, stored_chunks
from policies import small_chunks

import arrayckpt

pytestmark = pytest.mark.usefixtures("storage_layout")  # every test holds in both layouts (spec §2, §16)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(ckpt, chunking, dtype):
    shapes = {"matrix": (37, 5), "scalar": (), "empty": (0, 4), "vector": (129,)}
    state = {name: random_tensor(shape, dtype, seed=i) for i, (name, shape) in enumerate(shapes.items())}
    chunking.save(state, ckpt)
    loaded = {name: torch.full(shape, 0, dtype=dtype) if math.prod(shape) else torch.empty(shape, dtype=dtype)
              for name, shape in shapes.items()}
    arrayckpt.load(loaded, ckpt)
    for name in shapes:
        assert_bit_equal(loaded[name], state[name])
    opened = arrayckpt.open(ckpt)
    for name in shapes:
        assert opened[name].dtype == dtype
        assert opened[name].shape == shapes[name]
        assert_bit_equal(opened[name].torch(), state[name])


def test_open_returns_numpy_with_ml_dtypes_and_slices(ckpt, chunking):
    w = torch.randn(40, 6).to(torch.bfloat16)
    chunking.save({"w": w}, ckpt)
    arr = arrayckpt.open(ckpt)["w"]
    part = arr[3:17:2, 1:4]
    assert isinstance(part, np.ndarray)
    assert part.dtype == ml_dtypes.bfloat16
    expected = w.view(torch.int16).numpy().view(ml_dtypes.bfloat16)[3:17:2, 1:4]
    np.testing.assert_array_equal(part.view(np.int16), expected.view(np.int16))
    assert arr.nbytes == 40 * 6 * 2
    assert np.asarray(arr).shape == (40, 6)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.t(),
        lambda t: t[::2, 1:],
        lambda t: t.unsqueeze(0).expand(3, -1, -1),
        lambda t: torch.view_as_complex(t[:, :2].contiguous()).conj(),
        lambda t: t.to(torch.bfloat16)[:, ::3],
    ],
    ids=["transposed", "strided", "expanded", "lazy-conj", "bf16-strided"],
)
def test_non_contiguous_inputs_save_their_values(ckpt, make):
    source = make(torch.randn(8, 6))
    arrayckpt.save({"x": source}, ckpt)
    assert_bit_equal(arrayckpt.open(ckpt)["x"].torch(), source.resolve_conj().contiguous())


def test_load_into_non_contiguous_target_fills_its_view(ckpt):
    value = torch.randn(4, 6)
    arrayckpt.save({"x": value}, ckpt)
    base = torch.zeros(6, 4)
    target = base.t()  # non-contiguous view of base
    arrayckpt.load({"x": target}, ckpt)
    assert torch.equal(base.t(), value)


def test_nested_containers_and_plain_values(ckpt):
    state = {
        "a": {"b": {"c": torch.arange(3)}, "n": 1, "f": 2.5, "s": "text", "t": True, "none": None},
        "layers": [torch.ones(2), {"w": torch.zeros(1)}],
        "betas": (0.9, 0.999),
        "weird": {"nan": float("nan"), "inf": float("-inf"), "bytes": b"\x00\xff", 3: "int key"},
        "empty": {},
        "big": 2**62,
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
    }
    arrayckpt.save(state, ckpt, step=12)
    ckpt_view = arrayckpt.open(ckpt)
    assert ckpt_view.step == 12
    assert sorted(ckpt_view) == ["a.b.c", "layers.0", "layers.1.w", "np"]
    values = dict(ckpt_view.plain_values)
    assert values["a.n"] == 1 and isinstance(values["a.n"], int)
    assert values["a.f"] == 2.5 and values["a.s"] == "text" and values["a.t"] is True and values["a.none"] is None
    assert values["betas"] == (0.9, 0.999) and isinstance(values["betas"], tuple)
    assert math.isnan(values["weird.nan"]) and values["weird.inf"] == float("-inf")
    assert values["weird.bytes"] == b"\x00\xff" and values["weird.3"] == "int key"
    assert values["empty"] == {} and values["big"] == 2**62

    target = {
        "a": {"b": {"c": torch.zeros(3, dtype=torch.int64)}, "n": 0, "f": 0.0, "s": "", "t": False, "none": 1},
        "layers": [torch.zeros(2), {"w": torch.ones(1)}],
        "betas": None,
        "weird": {"nan": 0.0, "inf": 0.0, "bytes": b"", 3: ""},
        "empty": {},
        "big": 0,
        "np": np.zeros((2, 3), np.int32),
    }
    result = arrayckpt.load(target, ckpt)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(target["a"]["b"]["c"], torch.arange(3))
    assert target["a"]["n"] == 1 and target["a"]["s"] == "text" and target["a"]["none"] is None
    assert target["betas"] == (0.9, 0.999)
    assert torch.equal(target["layers"][0], torch.ones(2)) and torch.equal(target["layers"][1]["w"], torch.zeros(1))
    assert target["weird"][3] == "int key" and target["weird"]["bytes"] == b"\x00\xff"
    np.testing.assert_array_equal(target["np"], state["np"])


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))


def test_module_optimizer_scheduler_resume_into_fresh_objects(ckpt):
    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(4, 5)).square().mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    arrayckpt.save({"model": model, "optim": optim, "sched": sched}, ckpt)

    torch.manual_seed(1)
    model2 = _model()
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, step_size=2, gamma=0.5)
    assert optim2.state_dict()["state"] == {}
    result = arrayckpt.load({"model": model2, "optim": optim2, "sched": sched2}, ckpt)
    assert result.missing_keys == [] and result.unexpected_keys == []

    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    s1, s2 = optim.state_dict(), optim2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for index, per_param in s1["state"].items():
        for name, value in per_param.items():
            assert torch.equal(value, s2["state"][index][name]), (index, name)
    assert sched.state_dict() == sched2.state_dict()
    # and training continues identically
    x = torch.randn(4, 5)
    for m, o in ((model, optim), (model2, optim2)):
        m(x).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("codec", [None, "zstd", "blosc", arrayckpt.Codec("blosc", level=3, shuffle="shuffle"),
                                   arrayckpt.Codec("zstd", level=9)], ids=str)
def test_codecs_round_trip_and_compress_compressible_data(ckpt, chunking, codec):
    compressible = torch.zeros(256, 64).bfloat16()
    compressible[::7] = 1.5
    noise = random_tensor((100, 3), torch.float32)
    chunking.save({"c": compressible, "n": noise}, ckpt, codec=codec)
    opened = arrayckpt.open(ckpt)
    assert_bit_equal(opened["c"].torch(), compressible)
    assert_bit_equal(opened["n"].torch(), noise)
    stored = sum(stored_chunks(ckpt, "c").values())
    if codec is None:
        assert stored >= compressible.nbytes
    elif chunking.name == "whole":  # 16-byte test chunks are all overhead; compression shows on real chunks
        assert stored < compressible.nbytes / 4


def test_per_key_codec_choice(ckpt):
    state = {"model": {"w": torch.zeros(64, 64)}, "optim": {"m": torch.zeros(64, 64)}}
    arrayckpt.save(state, ckpt, codec={"optim.*": "zstd"})
    from arrayckpt._cli.info import codec_name

    opened = arrayckpt.open(ckpt)
    assert codec_name(opened["model.w"]) == "none"
    assert codec_name(opened["optim.m"]) == "zstd(3)"
    arrayckpt.save(state, ckpt, codec=lambda key: "blosc" if key.startswith("model") else None, overwrite=True)
    opened = arrayckpt.open(ckpt)
    assert codec_name(opened["model.w"]).startswith("blosc(") and codec_name(opened["optim.m"]) == "none"


def test_sharded_layout_is_used_for_big_tensors(ckpt):
    value = torch.arange(40 * 4, dtype=torch.float32).reshape(40, 4)
    small_chunks(64, 256).save({"w": value}, ckpt)
    arr = arrayckpt.open(ckpt)["w"]
    assert arr.metadata["codecs"][0]["name"] == "sharding_indexed"
    assert arr.metadata["chunk_grid"]["configuration"]["chunk_shape"] == [16, 4]
    assert arr.metadata["codecs"][0]["configuration"]["chunk_shape"] == [4, 4]
    assert sorted(stored_chunks(ckpt, "w")) == ["c.0.0", "c.1.0", "c.2.0"]  # 40 rows / 16
    assert torch.equal(arr.torch(), value)
    assert torch.equal(torch.from_numpy(arr[13:27, 2]), value[13:27, 2])


def test_loads_into_tensor_requiring_grad_and_other_dtype_bits(ckpt):
    p = torch.nn.Parameter(torch.randn(3, 3))
    arrayckpt.save({"p": p}, ckpt)
    q = torch.nn.Parameter(torch.zeros(3, 3))
    arrayckpt.load({"p": q}, ckpt)
    assert torch.equal(q.detach(), p.detach())
    assert q.requires_grad
    assert torch.equal(bits(q.detach()), bits(p.detach()))


@pytest.mark.parametrize("delta", [False, True])
def test_lazy_arrays_index_like_numpy(tmp_path, delta):
    """Negative positions, clipped slices, steps (also negative), ``...``, index arrays and ``None`` all select
    what numpy selects, for stored arrays and through a delta chain; out-of-range positions are IndexError."""
    w = torch.arange(60.0).reshape(10, 6)
    arrayckpt.save({"w": w}, tmp_path / "a")
    if delta:
        w[3] = -1
        arrayckpt.save({"w": w}, tmp_path / "b", base=tmp_path / "a")
    array = arrayckpt.open(tmp_path / ("b" if delta else "a"))["w"]
    expected = w.numpy()
    for index in [-1, (slice(-3, None),), slice(None, None, -1), slice(8, 20), (..., -2), [1, 3],
                  (np.array([0, 9]), slice(None)), (None, 2), (slice(None), slice(None, None, 2)), (2, -6)]:
        got = array[index]
        assert got.shape == expected[index].shape and np.array_equal(got, expected[index]), index
    for index in [10, -11, (0, 6), (1, 2, 3)]:
        with pytest.raises(IndexError):
            array[index]
