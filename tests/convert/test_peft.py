"""A LoRA run's checkpoint exported as a PEFT adapter (``convert ckpt out --to peft``), judged by PEFT itself: the file
holds exactly what ``get_peft_model_state_dict`` returns, bit for bit, and ``PeftModel.from_pretrained`` on a fresh
base model computes the trained model's logits exactly; and the import back (``--from peft``) stores the adapter
under the ``PeftModel``'s own names, bit for bit, so that ``arrayckpt.load`` fills a fresh ``PeftModel``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import arrayckpt
from arrayckpt._convert.dispatch import detect_format
from arrayckpt.cli import main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])
CONFIGS = {  # a plain LoRA, and one that writes every other kind of entry: DoRA, a module trained whole, biases
    "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "dora": {"r": 2, "target_modules": ["q_proj", "v_proj"], "use_dora": True, "bias": "lora_only",
             "modules_to_save": ["lm_head"]},
}


def _base() -> torch.nn.Module:
    """The same tiny Llama every time (a fixed seed): the base model PEFT loads the adapter onto."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                                      intermediate_size=32, vocab_size=40, max_position_embeddings=16,
                                      attention_bias=True)
    return transformers.LlamaForCausalLM(config)


def _trained(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, peft.LoraConfig]:
    """A PeftModel after a few AdamW steps, so that lora_B (zero at first) and the rest are not their initial values."""
    config = peft.LoraConfig(**CONFIGS[kind])
    model = peft.get_peft_model(_base(), config)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(3):
        model(IDS, labels=IDS).loss.backward()
        optim.step()
        optim.zero_grad()
    return model, optim, config


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("kind", CONFIGS)
def test_a_lora_checkpoint_exports_to_what_peft_model_from_pretrained_loads(tmp_path, kind):
    model, optim, config = _trained(kind)
    arrayckpt.save({"model": model, "optim": optim, "step": 3}, tmp_path / "ckpt")  # as a user saves a LoRA run

    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft", config=config)

    expected = peft.get_peft_model_state_dict(model)
    written = safetensors_torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(written) == set(expected) and result.tensors == len(expected) and result.selected == "model."
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    assert any("lora_B" in name and tensor.any() for name, tensor in written.items())  # trained: not zero
    assert "optim.param_groups" in result.skipped and "step" in result.skipped
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == config.r and saved["inference_mode"] is True
    assert sorted(saved["target_modules"]) == sorted(config.target_modules)

    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "adapter")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)


@pytest.mark.parametrize("kind", CONFIGS)
def test_the_import_stores_the_adapter_under_the_peft_models_names_bit_for_bit(tmp_path, kind):
    model, _, config = _trained(kind)
    arrayckpt.save({"model": model}, tmp_path / "ckpt")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft", config=config)
    assert detect_format(tmp_path / "adapter") == "peft"

    result = arrayckpt.convert(tmp_path / "adapter", tmp_path / "back", key_prefix="model")

    assert result.source_format == "peft" and result.tensors == len(peft.get_peft_model_state_dict(model))
    original, back = arrayckpt.open(tmp_path / "ckpt"), arrayckpt.open(tmp_path / "back")
    assert len(back) == result.tensors
    for key in back:  # the same keys as the saved PeftModel's, the same bits
        assert torch.equal(back[key].torch(), original[key].torch()), key
    fresh = peft.get_peft_model(_base(), peft.LoraConfig(**CONFIGS[kind]))
    loaded = arrayckpt.load({"model": fresh}, tmp_path / "back", strict=False)  # the base weights are the base's
    assert loaded.missing_keys and all("lora_" not in key for key in loaded.missing_keys)
    torch.testing.assert_close(_logits(fresh), _logits(model), rtol=0, atol=0)
    # exported again with the config it recorded: the same adapter
    arrayckpt.convert(tmp_path / "back", tmp_path / "again", to_format="peft")
    for name in ("adapter_config.json",):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "adapter" / name).read_bytes()
    again = safetensors_torch.load_file(tmp_path / "again" / "adapter_model.safetensors")
    first = safetensors_torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_a_config_saved_with_the_model_is_the_one_written(tmp_path):
    model, _, config = _trained("lora")
    recorded = json.loads(json.dumps(config.to_dict(), default=sorted))  # plain JSON: sets as lists
    arrayckpt.save({"model": model, "adapter_config": recorded}, tmp_path / "ckpt")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()) == recorded | {"inference_mode": True}
    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "adapter")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)
    # the CLI, with the config as a file
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--to", "peft", "--config",
                 str(tmp_path / "adapter" / "adapter_config.json")]) == 0
    assert sorted(os.listdir(tmp_path / "cli")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_refusals_name_what_the_checkpoint_holds_and_the_fix(tmp_path):
    base = _base()
    arrayckpt.save({"model": base, "optim": torch.optim.AdamW(base.parameters()), "step": 1}, tmp_path / "base")
    with pytest.raises(arrayckpt.StateError, match=r"holds no LoRA adapter: none of the 29 tensor\(s\) under "
                                                   r"'model\.' has lora_A or lora_B in its name \(model\.model\."
                                                   r"embed_tokens\.weight, .*top-level keys: model, optim, step\); "
                                                   "save the PeftModel"):
        arrayckpt.convert(tmp_path / "base", tmp_path / "adapter", to_format="peft", config={"peft_type": "LORA"})

    model, _, config = _trained("lora")
    arrayckpt.save({"model": model}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.FormatError, match="no adapter config to write: it records none; pass config="):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft")
    with pytest.raises(arrayckpt.FormatError, match=r"says r=8, but 'model\.base_model.*lora_A\.default\.weight' has "
                                                    "rank 4"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft",
                          config={**config.to_dict(), "r": 8})
    with pytest.raises(arrayckpt.FormatError, match="peft_type 'IA3'; only LoRA adapters"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft", config={"peft_type": "IA3"})
    with pytest.raises(arrayckpt.StateError, match="no adapter 'other'; its LoRA tensors are of 'default'"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft", config=config, adapter="other")
    with pytest.raises(arrayckpt.FormatError, match="key_prefix is for a conversion into arrayckpt"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft", config=config, key_prefix="m")
    assert not (tmp_path / "adapter").exists()

    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft", config=config)
    with pytest.raises(arrayckpt.CheckpointExistsError, match="already holds adapter_config.json, "
                                                              "adapter_model.safetensors; pass overwrite=True"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft", config=config)
    (tmp_path / "adapter" / "README.md").write_text("the user's")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "adapter", to_format="peft", config=config, overwrite=True)
    assert sorted(os.listdir(tmp_path / "adapter")) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]


def test_an_adapter_saved_by_peft_itself_imports(tmp_path):
    model, _, _ = _trained("lora")
    model.save_pretrained(tmp_path / "saved")  # PEFT's own writer (and a README.md beside)
    arrayckpt.convert(tmp_path / "saved", tmp_path / "ckpt", adapter="mine")
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        state = model.state_dict()
        for key in ckpt:
            assert torch.equal(ckpt[key].torch(), state[key.replace(".mine.", ".default.")]), key
        assert ckpt.plain_values["adapter_config.peft_type"] == "LORA"
    Path(tmp_path / "saved" / "adapter_model.safetensors").unlink()
    with pytest.raises(arrayckpt.FormatError, match="no adapter_model.safetensors"):
        arrayckpt.convert(tmp_path / "saved", tmp_path / "ckpt2")
