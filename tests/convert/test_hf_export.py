"""The Hugging Face export (``convert SRC OUT_DIR --to hf``), judged by transformers' own loader with its default
configuration: ``from_pretrained`` reports no missing or unexpected keys and the loaded model's outputs are
``torch.equal`` to the trained model's, for GPT-2 (tied embeddings), Llama (bfloat16) and BERT, saved by one
rank and by two FSDP2 ranks; and the reverse, a transformers directory converted into arrayckpt."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import arrayckpt
from arrayckpt.cli import main

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])
MODELS = ("gpt2", "llama", "bert")


def _config(name: str) -> transformers.PretrainedConfig:
    """A tiny config of each family (no hub access): GPT-2 ties its embeddings, Llama does not."""
    if name == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=40, n_positions=16,
                                       bos_token_id=0, eos_token_id=0)
    if name == "llama":
        return transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        hidden_size=16, intermediate_size=32, vocab_size=40,
                                        max_position_embeddings=16)
    return transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                                   vocab_size=40, max_position_embeddings=16)


def _model(name: str, config: transformers.PretrainedConfig | None = None,
           dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A model as transformers users make one (in bfloat16 too: ``.to(torch.bfloat16)`` would also round the
    rotary buffers that transformers keeps in float32, and the model would compute something else)."""
    return _auto(name).from_config(config or _config(name), dtype=dtype)


def _auto(name: str) -> type:
    """The auto class a user loads each with: a causal LM, or (BERT) the bare encoder."""
    return transformers.AutoModel if name == "bert" else transformers.AutoModelForCausalLM


def _outputs(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(IDS)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") and out.last_hidden_state is not None \
        else out.logits


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int = 2) -> None:
    """A few AdamW steps, so that weights, moments and step counters are not their initial values."""
    model.train()
    for _ in range(steps):
        out = model(IDS)
        loss = (out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out.logits)
        loss.float().square().mean().backward()
        optim.step()
        optim.zero_grad()


def _write_config(config: transformers.PretrainedConfig, path: Path, dtype: torch.dtype) -> Path:
    """config.json as a training script writes it (``config.save_pretrained``: no ``architectures``)."""
    config.dtype = dtype
    config.save_pretrained(path)
    return path / "config.json"


def _load(name: str, out: Path) -> torch.nn.Module:
    """``from_pretrained`` with its defaults, asserting it found every key and no other."""
    loaded, info = _auto(name).from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    return loaded


def _header(file: Path) -> dict:
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


# ------------------------------------------------------------------------------------------- saved by one rank


@pytest.mark.parametrize("name", MODELS)
def test_export_of_model_and_optimizer_loads_with_from_pretrained(tmp_path, name):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if name == "llama" else torch.float32
    model = _model(name, dtype=dtype)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim)
    arrayckpt.save({"model": model, "optim": optim, "step": 2}, tmp_path / "ckpt")
    config = _write_config(model.config, tmp_path / "cfg", dtype)

    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf", config=config)

    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert (tmp_path / "hf" / "config.json").read_bytes() == config.read_bytes()
    header = _header(tmp_path / "hf" / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    tied = {"lm_head.weight": "transformer.wte.weight"} if name == "gpt2" else {}
    assert set(header) == set(model.state_dict()) - set(tied)  # no "model." prefix, no optimizer state, no copy
    assert {info["dtype"] for info in header.values()} == {"BF16" if name == "llama" else "F32"}
    assert result.selected == "model." and result.tied == tied and result.notes == ()
    assert result.tensors == len(header) and "step" in result.skipped
    assert all(k.startswith("optim.") for k in result.skipped if k != "step")

    loaded = _load(name, tmp_path / "hf")
    assert next(loaded.parameters()).dtype == dtype
    assert torch.equal(_outputs(loaded), _outputs(model))


def test_without_the_export_from_pretrained_gets_random_weights(tmp_path):
    """Why the export exists: the plain safetensors conversion keeps ``model.`` and the optimizer, and
    transformers then initialises every weight randomly (reported only as a table of keys)."""
    torch.manual_seed(0)
    model = _model("gpt2")
    optim = torch.optim.AdamW(model.parameters())
    _train(model, optim)
    arrayckpt.save({"model": model, "optim": optim}, tmp_path / "ckpt")
    (tmp_path / "plain").mkdir()
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "plain" / "model.safetensors")
    _write_config(model.config, tmp_path / "plain", torch.float32)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", output_loading_info=True)
    assert "transformer.wte.weight" in info["missing_keys"] and "model.transformer.wte.weight" in \
        info["unexpected_keys"]
    assert not torch.equal(_outputs(loaded), _outputs(model))


def test_shards_with_an_index_and_an_explicit_tie_from_the_command_line(tmp_path, capsys):
    torch.manual_seed(0)
    model = _model("gpt2")
    optim = torch.optim.AdamW(model.parameters())
    _train(model, optim)
    arrayckpt.save({"model": model, "optim": optim, "step": 2}, tmp_path / "ckpt")
    config = _write_config(model.config, tmp_path / "cfg", torch.float32)

    code = main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf", "--max-shard-size", "8KB",
                 "--tie", "lm_head.weight=transformer.wte.weight", "--config", str(config)])

    out, err = capsys.readouterr()
    assert code == 0, err
    assert "(model.* with the prefix stripped)" in out and "lm_head.weight (= transformer.wte.weight)" in out
    assert "not converted (not the model's weights): optim." in err
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    count = len(files)
    assert count > 2 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    names = set(model.state_dict()) - {"lm_head.weight"}
    assert set(index["weight_map"]) == names and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(model.state_dict()[n].nbytes for n in names)
    for file in files:
        header = _header(tmp_path / "hf" / file)
        assert header.pop("__metadata__") == {"format": "pt"}
        assert sum(info["data_offsets"][1] - info["data_offsets"][0] for info in header.values()) <= 8000 or \
            len(header) == 1
    assert torch.equal(_outputs(_load("gpt2", tmp_path / "hf")), _outputs(model))
    _assert_dcp_reads(tmp_path / "hf", {n: model.state_dict()[n] for n in names})

    # a second export over the first: refused, then with --overwrite its shards and index go, and one file stays
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert "already holds model-00001-of-" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf", "--overwrite",
                 "--tie", "lm_head.weight=transformer.wte.weight"]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(_outputs(_load("gpt2", tmp_path / "hf")), _outputs(model))


def _assert_dcp_reads(directory: Path, expected: dict[str, torch.Tensor]) -> None:
    """PyTorch DCP's own reader of Hugging Face directories (``HuggingFaceStorageReader``) reads the export too."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    target = {name: torch.zeros_like(tensor) for name, tensor in expected.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group": a single-process load
        dcp.load(target, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=True)
    for name, tensor in expected.items():
        assert torch.equal(target[name], tensor), name


# ------------------------------------------------------------------------------------- saved by two FSDP2 ranks


def _train_fsdp2_and_save(rank: int, world: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """On each rank: every model sharded with FSDP2, trained, saved as ``{"model": ..., "optim": ...}`` from
    ``get_state_dict``; returns (rank 0) each model's gathered weights, the trained model's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in MODELS:
        torch.manual_seed(0)
        model = _model(name)
        fully_shard(model, mesh=mesh)  # every parameter split over the two ranks (one group: few collectives)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, optim, steps=1)
        model_sd, optim_sd = get_state_dict(model, optim)
        arrayckpt.save({"model": model_sd, "optim": optim_sd, "step": 2}, f"{root}/{name}")
        # as numpy: pickled by value (a tensor would travel as shared memory the exiting rank takes with it)
        out[name] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
                     for k, v in model_sd.items()}
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def fsdp2_saves(tmp_path_factory):
    """One spawn of 2 gloo ranks for every model: their checkpoints and the trained weights."""
    from dist_helpers import run_ranks

    root = tmp_path_factory.mktemp("fsdp2")
    trained = run_ranks(2, _train_fsdp2_and_save, str(root))[0]
    return root, {name: {k: torch.from_numpy(v) for k, v in weights.items()} for name, weights in trained.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_export_of_an_fsdp2_checkpoint_loads_with_from_pretrained(tmp_path, fsdp2_saves, name):
    root, trained = fsdp2_saves
    opened = arrayckpt.open(root / name)
    assert any(k.startswith("optim.state.") for k in opened) and opened.manifest.created.get("world_size", 2) == 2
    config = _write_config(_config(name), tmp_path / "cfg", torch.float32)

    result = arrayckpt.convert(root / name, tmp_path / "hf", to_format="hf", config=config)

    assert result.selected == "model." and result.notes == ()
    assert result.tied == ({"lm_head.weight": "transformer.wte.weight"} if name == "gpt2" else {})
    reference = _model(name)
    reference.load_state_dict(trained[name])  # the trained model, gathered from its two ranks
    loaded = _load(name, tmp_path / "hf")
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name][key]), key
    assert torch.equal(_outputs(loaded), _outputs(reference))


# ------------------------------------------------------------------------------------ the reverse: hf -> arrayckpt


@pytest.mark.parametrize("name", MODELS)
def test_a_transformers_directory_converts_into_arrayckpt_and_back(tmp_path, name):
    torch.manual_seed(0)
    model = _model(name)
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.save_pretrained(tmp_path / "pretrained")  # transformers' own writer

    result = arrayckpt.convert(tmp_path / "pretrained", tmp_path / "ckpt")

    assert result.source_format == "safetensors"
    said = arrayckpt.convert(tmp_path / "pretrained", tmp_path / "ckpt-from-hf", from_format="hf")  # the same
    assert said.source_format == "safetensors" and said.tensors == result.tensors
    opened = arrayckpt.open(tmp_path / "ckpt")
    written = _header(tmp_path / "pretrained" / "model.safetensors")
    assert set(opened) == set(written) - {"__metadata__"}
    for key in opened:
        assert torch.equal(opened[key].torch(), model.state_dict()[key]), key
    # and out again: the whole state is the model (several top-level keys, nothing but tensors)
    again = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "again", to_format="hf",
                              config=tmp_path / "pretrained" / "config.json")
    assert again.selected == "" and again.tied == {} and again.notes == ()
    assert torch.equal(_outputs(_load(name, tmp_path / "again")), _outputs(model))


# ------------------------------------------------------------------------------------- choices, notes, refusals


def test_selection_is_refused_where_it_is_ambiguous_or_the_optimizer(tmp_path):
    torch.manual_seed(0)
    model, ema = _model("gpt2"), _model("gpt2")
    optim = torch.optim.AdamW(model.parameters())
    _train(model, optim, steps=1)
    arrayckpt.save({"model": model, "ema": ema, "optim": optim, "step": 1}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.StateError, match=r"several modules \(model\., ema\.\); choose with --select"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf")
    with pytest.raises(arrayckpt.StateError, match="holds optimizer state at 'optim'"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf", select="optim")
    with pytest.raises(arrayckpt.StateError, match="holds optimizer state at 'optim'"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf", select="")
    with pytest.raises(arrayckpt.StateError, match="no tensors under 'modle.'; the top-level keys are model, ema"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf", select="modle.")
    with pytest.raises(arrayckpt.FormatError, match="select, tie and config are for a Hugging Face export"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out.safetensors", select="ema.")
    assert not (tmp_path / "hf").exists()
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf", select="ema")
    # the checkpoint stored GPT-2's tied lm_head.weight once (an alias): left out, as save_pretrained does
    assert result.selected == "ema." and set(_header(tmp_path / "hf" / "model.safetensors")) - {"__metadata__"} == \
        set(ema.state_dict()) - {"lm_head.weight"}
    assert result.tied == {"lm_head.weight": "transformer.wte.weight"} and len(result.notes) == 1
    assert result.notes[0].startswith("no config.json given")


def test_a_tie_that_does_not_hold_is_refused_before_anything_is_written(tmp_path):
    torch.manual_seed(0)
    model = _model("llama")  # untied: lm_head and the embeddings differ
    arrayckpt.save({"model": model}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.StateError, match=r"tie lm_head.weight=model.embed_tokens.weight: their values "
                                                   r"differ \(first in rows 0\.\."):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf",
                          tie={"lm_head.weight": "model.embed_tokens.weight"})
    with pytest.raises(arrayckpt.StateError, match="lm_head.weight=embed.weight: embed.weight is not in the export"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf", tie={"lm_head.weight": "embed.weight"})
    assert not (tmp_path / "hf").exists()


def test_notes_say_where_from_pretrained_would_not_get_the_trained_model(tmp_path):
    torch.manual_seed(0)
    untied = _config("gpt2")
    untied.tie_word_embeddings = False  # trained with its own lm_head ...
    model = _model("gpt2", untied, torch.bfloat16)
    arrayckpt.save({"model": model}, tmp_path / "ckpt")
    config = _config("gpt2")  # ... published with a config that ties it, says float32 and names its architecture
    config.architectures = ["GPT2LMHeadModel"]
    path = _write_config(config, tmp_path / "cfg", torch.float32)

    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf", config=path)
    assert result.tied == {} and len(result.notes) == 2
    assert "the model ties lm_head.weight to transformer.wte.weight, but their values differ" in result.notes[0]
    assert "config.json says dtype float32 but the weights are bfloat16" in result.notes[1]

    wrong = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "wrong", to_format="hf", config=path,
                              select="model.transformer.")  # a selection one level too deep
    assert "GPT2LMHeadModel has 29 weight(s) the export lacks (lm_head.weight, transformer.h.0" in wrong.notes[0]
    assert "from_pretrained would initialise them randomly" in wrong.notes[0]
    assert "28 tensor(s) of the export are not weights of GPT2LMHeadModel (h.0.attn.c_attn.bias" in wrong.notes[1]


def test_ties_are_compared_in_blocks_and_tensors_written_one_at_a_time(tmp_path, monkeypatch, tuned):
    import weakref

    import numpy as np

    from arrayckpt._read.lazy import LazyArray

    torch.manual_seed(0)
    model = _model("gpt2")
    # copies, so that the tied pair is stored twice (as a checkpoint from another writer may store it) and compared
    arrayckpt.save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, tmp_path / "ckpt")
    tuned(tie_compare_bytes=2 * 16 * 4)  # two rows of the 40x16 float32 embeddings
    reads: list[tuple[str, int]] = []
    alive: list[weakref.ref] = []
    getitem = LazyArray.__getitem__

    def watched(self, index):
        held = [r for r in alive if r() is not None]
        assert not held, f"reading {self.key!r} while {len(held)} array(s) read before are still referenced"
        out = getitem(self, index)
        reads.append((self.key, out.nbytes))
        copy = np.empty_like(out)  # memory we can watch: it lives as long as the caller keeps the result
        copy[...] = out
        alive.append(weakref.ref(copy))
        return copy

    monkeypatch.setattr(LazyArray, "__getitem__", watched)
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf",
                               tie={"lm_head.weight": "transformer.wte.weight"})
    assert result.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert [n for key, n in reads if key == "model.lm_head.weight"] == [128] * 20
    assert len([key for key, _ in reads if key != "model.lm_head.weight"]) == 20 + len(model.state_dict()) - 1


@pytest.mark.slow
@pytest.mark.parametrize("source", ["torch", "dcp"])
def test_torch_save_and_dcp_sources_export_through_a_temporary_checkpoint(tmp_path, source):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = _model("gpt2")
    optim = torch.optim.AdamW(model.parameters())
    _train(model, optim, steps=1)
    if source == "torch":
        src = tmp_path / "train.pt"
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 3}, src)
    else:
        src = tmp_path / "dcp"
        model_sd, optim_sd = get_state_dict(model, optim)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": model_sd, "optim": optim_sd, "epoch": 3}, checkpoint_id=src, no_dist=True)
    config = _write_config(model.config, tmp_path / "cfg", torch.float32)
    result = arrayckpt.convert(src, tmp_path / "hf", to_format="hf", config=config.parent)
    assert result.source_format == source and result.selected == "model." and "epoch" in result.skipped
    assert result.tied == {"lm_head.weight": "transformer.wte.weight"} and result.notes == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["cfg", "hf", src.name])  # no temporary left
    assert torch.equal(_outputs(_load("gpt2", tmp_path / "hf")), _outputs(model))


@pytest.mark.parametrize(("args", "said"), [
    (["--to", "hf", "--config", "{bad_json}"], "not a readable config.json"),
    (["--to", "hf", "--select", "optim."], "holds optimizer state at 'optim'"),
    (["--to", "hf", "--tie", "a.weight=b.weight"], "tie a.weight=b.weight: a.weight and b.weight are not in"),
    (["--to", "dcp", "--select", "model."], "select, tie and config are for a Hugging Face export"),
])
def test_bad_hf_options_get_one_line_and_write_nothing(tmp_path, capsys, args, said):
    arrayckpt.save({"model": {"w": torch.ones(2)}, "optim": {"state": {"0": torch.ones(1)}, "param_groups": [1]}},
                   tmp_path / "ckpt")
    (tmp_path / "bad.json").write_text("{not json")
    out = tmp_path / "out"
    code = main(["convert", str(tmp_path / "ckpt"), str(out), *[a.format(bad_json=tmp_path / "bad.json")
                                                                for a in args]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("arrayckpt: error: ") and said in err[0], err
    assert not out.exists()


def test_a_tie_that_is_not_alias_equals_target_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--to", "hf", "--tie", "lm_head.weight"])
    assert exited.value.code == 2 and "is not ALIAS=TARGET" in capsys.readouterr().err
