"""A checkpoint whose keys lack (or carry) a prefix the state's have: a Hugging Face directory converted into
arrayckpt names the weights as the model does (``model.layers.0...``) while ``load({"model": model}, ...)`` looks
under ``model.``. ``convert(..., key_prefix="model")`` stores them under it, ``load(..., key_prefix="model")`` reads
them under it, and a KeyMismatchError that a prefix explains names it and the fix."""

from __future__ import annotations

import pytest
import torch

import arrayckpt
from arrayckpt._read.keyhint import find_prefix_match

pytestmark = pytest.mark.usefixtures("storage_layout")  # every test holds in both layouts (spec §2, §16)

transformers = pytest.importorskip("transformers")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16, intermediate_size=32,
        vocab_size=40, max_position_embeddings=16))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_hugging_face_import_loads_into_model_with_key_prefix_on_import_or_on_load(tmp_path):
    trained = _model(0)
    trained.save_pretrained(tmp_path / "hf")
    arrayckpt.convert(tmp_path / "hf", tmp_path / "plain")
    arrayckpt.convert(tmp_path / "hf", tmp_path / "prefixed", key_prefix="model")
    assert set(arrayckpt.open(tmp_path / "prefixed")) == {f"model.{k}" for k in trained.state_dict()}

    with pytest.raises(arrayckpt.KeyMismatchError,
                       match=r"all of them are in the checkpoint without the prefix 'model\.' \('model\."
                             r"embed_tokens\.weight' for the state's 'model\.model\.embed_tokens\.weight'\): "
                             "pass key_prefix='model'"):
        arrayckpt.load({"model": _model(1)}, tmp_path / "plain")

    for path, key_prefix in ((tmp_path / "plain", "model"), (tmp_path / "prefixed", "")):
        model = _model(1)
        assert arrayckpt.load({"model": model}, path, key_prefix=key_prefix) == arrayckpt.LoadResult([], [])
        assert _same(model, trained)


def test_key_prefix_on_load_reaches_optimizer_state_it_creates(tmp_path):
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    arrayckpt.save({"model": model, "optim": optim}, tmp_path / "ckpt")
    fresh = torch.nn.Linear(3, 2)
    fresh_optim = torch.optim.AdamW(fresh.parameters())  # no state yet: created from the checkpoint
    result = arrayckpt.load({"run": {"model": fresh, "optim": fresh_optim}}, tmp_path / "ckpt", key_prefix="run.")
    assert result == arrayckpt.LoadResult([], [])
    assert torch.equal(fresh_optim.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(fresh.weight, model.weight)
    partial = arrayckpt.load({"run": {"model": torch.nn.Linear(3, 2)}}, tmp_path / "ckpt", key_prefix="run")
    assert partial.missing_keys == [] and "optim.param_groups" in partial.unexpected_keys  # the checkpoint's names


def test_a_mismatch_a_prefix_explains_says_which_and_how_to_fix_it(tmp_path):
    model = _model(0)
    arrayckpt.save({"model": model}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.KeyMismatchError, match=r"under the prefix 'model\.', which the state's keys lack "
                                                         r"\(.*\): nest the state under it as it was saved "
                                                         r"\({'model': "):
        arrayckpt.load(dict(model.state_dict()), tmp_path / "ckpt")
    with pytest.raises(arrayckpt.KeyMismatchError, match=r"under the prefix 'model\.' where the state has 'net\.' "
                                                         r"\(.*\): name the state's entry as it was saved"):
        arrayckpt.load({"net": model}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.KeyMismatchError, match=r"as the state names them: load without key_prefix='model'"):
        arrayckpt.load({"model": model}, tmp_path / "ckpt", key_prefix="model")
    with pytest.raises(arrayckpt.KeyMismatchError) as caught:  # no prefix explains it: no hint
        arrayckpt.load({"other": torch.zeros(2)}, tmp_path / "ckpt")
    assert "key_prefix" not in str(caught.value) and "the prefix" not in str(caught.value)
    with pytest.raises(ValueError, match=r"key_prefix 'a\.\.b' has an empty part"):
        arrayckpt.load({"model": model}, tmp_path / "ckpt", key_prefix="a..b")


def test_a_prefix_match_needs_half_the_missing_keys():
    held = {"model.a", "model.b"}
    assert find_prefix_match(["a", "b", "c"], held) == (("", "model.", 2))
    assert find_prefix_match(["a", "c", "d"], held) is None
    assert find_prefix_match([], held) is None


def test_key_prefix_applies_to_every_source_format_into_arrayckpt(tmp_path):
    torch.save({"w": torch.arange(4.0), "sub": {"b": torch.ones(2)}, "step": 3}, tmp_path / "state.pt")
    arrayckpt.convert(tmp_path / "state.pt", tmp_path / "ckpt", key_prefix="run.state")
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert list(ckpt) == ["run.state.w", "run.state.sub.b"] and dict(ckpt.plain_values) == {"run.state.step": 3}
    with pytest.raises(arrayckpt.FormatError, match="key_prefix is for a conversion into arrayckpt"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out.safetensors", key_prefix="model")
