"""Tied weights (issue 24, item 6): one tensor saved under two keys is stored once; the second key is an alias.

A tiny GPT-2 from ``transformers`` (``tie_word_embeddings=True``: ``lm_head.weight`` is ``transformer.wte.weight``)
saved by one process and by 2 FSDP2 ranks (spawned, gloo) stores the embedding once and loads bit for bit into a
fresh tied model (the tie kept) and into an untied one; ``open``, ``verify``, zarr-python (one array, the alias in
its attributes), DCP's ``ArrayckptReader``, the tools and the converters all see the alias; delta chains read an
alias, and a key tied in one layer but not in another, right. What is one tensor is decided exactly (same memory,
same view): partial views are not aliases, and a key tied on one rank but not on another is stored twice. Crafted
aliases (of a missing key, a value, itself, another alias) are refused naming the key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import run_ranks
from helpers import assert_bit_equal, nodes_of, write_root, zarr_group
from thread_ranks import run_thread_ranks
from torch import nn

import arrayckpt
from arrayckpt._read import load as load_module
from arrayckpt._read.checkpoint import stored_of

WTE, HEAD = "model.transformer.wte.weight", "model.lm_head.weight"
TINY = {"n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 34, "n_positions": 8, "bos_token_id": 0,
        "eos_token_id": 0}

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning"),
              pytest.mark.usefixtures("storage_layout")]  # every test holds in both layouts (spec §2, §16)


def _gpt2(tied: bool = True, seed: int = 0) -> nn.Module:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**TINY, tie_word_embeddings=tied))


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "zarr.json").read_text())["attributes"]["arrayckpt"]


def _arrays(path: Path) -> list[str]:
    nodes = nodes_of(json.loads((path / "zarr.json").read_text()))
    return sorted(p for p, node in nodes.items() if node["node_type"] == "array")


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys ``load`` asks the read path for, one per read request."""
    asked: list[str] = []
    real = load_module.read

    def recording(checkpoint: Any, requests: Any, **kwargs: Any) -> Any:
        asked.extend(r.key for r in requests)
        return real(checkpoint, requests, **kwargs)

    monkeypatch.setattr(load_module, "read", recording)
    return asked


# --- one process ---------------------------------------------------------------------------------------------


def test_tied_gpt2_is_stored_once_and_loads_into_tied_and_untied_models(tmp_path, monkeypatch):
    model = _gpt2()
    state_dict = model.state_dict()
    # what the walker is given: two tensor objects, one memory (keep_vars: the same Parameter twice)
    assert state_dict["lm_head.weight"] is not state_dict["transformer.wte.weight"]
    assert state_dict["lm_head.weight"].data_ptr() == state_dict["transformer.wte.weight"].data_ptr()
    assert model.state_dict(keep_vars=True)["lm_head.weight"] is model.state_dict(keep_vars=True)[
        "transformer.wte.weight"]
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # not the initial values
    path = tmp_path / "tied"
    arrayckpt.save({"model": model, "step": 1}, path)

    manifest = _manifest(path)
    assert manifest["entries"][HEAD] == {"kind": "alias", "keys": ["model", "lm_head.weight"], "target": WTE}
    assert len(_arrays(path)) == len(state_dict) - 1 and "model/lm_head/weight" not in _arrays(path)
    assert not (path / "model" / "lm_head").exists()
    total = sum(t.nbytes for t in state_dict.values())
    assert manifest["stored_bytes"] == total - state_dict["lm_head.weight"].nbytes

    with arrayckpt.open(path) as ckpt:
        assert ckpt.aliases() == ckpt.manifest.aliases == {HEAD: WTE}
        assert ckpt[HEAD] is ckpt[WTE] and HEAD in ckpt and HEAD in list(ckpt)
        assert_bit_equal(ckpt[HEAD].torch(), model.lm_head.weight.detach())
        assert ckpt.nbytes == manifest["stored_bytes"]
    assert arrayckpt.verify(path).ok

    asked = _reads(monkeypatch)
    tied = _gpt2(seed=1)
    assert arrayckpt.load({"model": tied, "step": 0}, path).unexpected_keys == []
    assert asked.count(WTE) == 1 and HEAD not in asked  # the tie is one tensor: read once
    assert tied.lm_head.weight.data_ptr() == tied.transformer.wte.weight.data_ptr()
    for key, value in tied.state_dict().items():
        assert_bit_equal(value, state_dict[key])

    asked.clear()
    untied = _gpt2(tied=False, seed=2)
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()
    arrayckpt.load({"model": untied, "step": 0}, path)
    assert sorted(asked).count(HEAD) == 1  # two tensors: both filled, each from the one stored array
    for key, value in untied.state_dict().items():
        assert_bit_equal(value, state_dict[key])

    only_head = {"model": {"lm_head.weight": torch.zeros_like(state_dict["lm_head.weight"])}}
    result = arrayckpt.load(only_head, path, strict=True)  # an alias key is a key of the checkpoint
    assert result.missing_keys == [] and HEAD not in result.unexpected_keys
    assert_bit_equal(only_head["model"]["lm_head.weight"], state_dict["lm_head.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("storage_layout", ["files"], indirect=True)  # zarr-python opening the directory itself
def test_zarr_python_sees_one_array_and_the_alias_as_an_attribute(tmp_path):
    model = _gpt2()
    path = tmp_path / "tied"
    arrayckpt.save({"model": model}, path)
    script = f"""
import json, sys, zarr
root = zarr.open_group({str(path)!r}, mode="r")
arrays = sorted(name for name, node in root.members(max_depth=None) if isinstance(node, zarr.Array))
wte = root["model/transformer/wte/weight"]
entry = root.attrs["arrayckpt"]["entries"]["model.lm_head.weight"]
assert "torch" not in sys.modules
print(json.dumps({{"arrays": arrays, "attrs": wte.attrs["arrayckpt"], "entry": entry,
                   "data": wte[...].reshape(-1).tolist()}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "model/transformer/wte/weight" in out["arrays"] and not any("lm_head" in a for a in out["arrays"])
    assert len(out["arrays"]) == len(model.state_dict()) - 1
    assert out["attrs"] == {"key": WTE, "aliases": [HEAD]}
    assert out["entry"]["kind"] == "alias" and out["entry"]["target"] == WTE
    assert out["data"] == model.lm_head.weight.detach().reshape(-1).tolist()


def test_what_is_one_tensor_is_exact(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    c = torch.complex(torch.arange(4.0), torch.ones(4))
    e = torch.empty(0)
    state = {"w": w, "same": w.detach(), "again": w.view(3, 4), "head": w[:2], "tail": w[1:], "t": w.t(),
             "flat": w.view(-1), "bits": w.view(torch.int32), "copy": w.clone(), "c": c, "conj": c.conj(),
             "e": e, "other_empty": torch.empty(0), "e_again": e,
             "shard": arrayckpt.Shard(w, (3, 4), (0, 0)), "shard_again": arrayckpt.Shard(w.detach(), (3, 4), (0, 0))}
    path = tmp_path / "views"
    arrayckpt.save(state, path)
    with arrayckpt.open(path) as ckpt:
        # the same view of the same memory (or, without memory, the same object): aliases of the first key; partial
        # views, transposes, other dtypes, copies, lazy conjugates, other empty tensors: arrays of their own
        assert ckpt.aliases() == {"same": "w", "again": "w", "e_again": "e", "shard_again": "shard"}
        for key in ("head", "tail", "t", "flat", "bits", "copy", "conj", "other_empty"):
            assert ckpt.manifest.entries[key].to_dict()["kind"] == "tensor", key
        for key, value in state.items():
            expected = value.tensor if isinstance(value, arrayckpt.Shard) else value.resolve_conj()
            assert_bit_equal(ckpt[key].torch(), expected)


def test_crafted_aliases_are_refused_naming_the_key(tmp_path):
    import copy
    import re

    path = tmp_path / "ckpt"
    arrayckpt.save({"t": torch.ones(2), "v": 1, "rng": arrayckpt.PerRank(torch.zeros(1))}, path)
    original = json.loads((path / "zarr.json").read_text())

    def craft(**aliases: Any) -> None:
        document = copy.deepcopy(original)
        for key, target in aliases.items():
            document["attributes"]["arrayckpt"]["entries"][key] = {"kind": "alias", "keys": [key], "target": target}
        write_root(path, document)

    craft(a="t")  # well formed: read as its target
    with arrayckpt.open(path) as ckpt:
        assert ckpt.aliases() == {"a": "t"} and ckpt["a"].numpy().tolist() == [1.0, 1.0]
    bad = [({"a": "nope"}, "entry 'a' is an alias of 'nope', which is not an entry of the checkpoint"),
           ({"a": "v"}, "entry 'a' is an alias of 'v', a value entry"),
           ({"a": "rng"}, "entry 'a' is an alias of 'rng', a per_rank entry"),
           ({"a": "a"}, "entry 'a' is an alias of itself"),
           ({"a": "b", "b": "t"}, "entry 'a' is an alias of 'b', another alias (of 't')"),
           ({"a": "b", "b": "a"}, "entry 'a' is an alias of 'b', another alias (of 'a')"),
           ({"a": 5}, "entry 'a': an alias's 'target' must be the dotted key of a tensor entry, got 5")]
    for aliases, message in bad:
        craft(**aliases)
        with pytest.raises(arrayckpt.FormatError, match=re.escape(message)):
            arrayckpt.open(path)


def test_info_show_diff_report_copy_and_compact_see_the_alias(tmp_path, capsys):
    from arrayckpt._tools.report.build import collect
    from arrayckpt.cli import main

    model = _gpt2()
    tied, untied = tmp_path / "tied", tmp_path / "untied"
    arrayckpt.save({"model": model}, tied)
    arrayckpt.save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, untied)  # the same, untied
    assert _manifest(untied)["entries"][HEAD]["kind"] == "tensor"

    assert main(["info", "--json", str(tied)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["aliases"] == {HEAD: WTE} and HEAD not in info["tensors"] and WTE in info["tensors"]
    assert main(["info", str(tied)]) == 0
    assert f"{HEAD} -> {WTE}" in capsys.readouterr().out
    assert arrayckpt.show(tied, HEAD, "0").values == model.lm_head.weight[0].tolist()

    report = arrayckpt.diff(tied, untied)
    assert report.identical and HEAD in {t.key for t in report.tensors}
    with arrayckpt.open(tied) as a, arrayckpt.open(untied) as b:
        data = collect(a, b)
    assert [k for k, _ in data.values] == [HEAD] and HEAD not in {t.key for t in data.tensors}

    copied, compacted = tmp_path / "copied", tmp_path / "compacted"
    arrayckpt.copy(tied, copied)
    arrayckpt.compact(tied, compacted)
    for path in (copied, compacted):
        assert _manifest(path)["entries"][HEAD]["kind"] == "alias" and _arrays(path) == _arrays(tied)
        with arrayckpt.open(path) as ckpt:  # (its node metadata: a packed checkpoint has no node documents)
            attributes = stored_of(ckpt).nodes["model/transformer/wte/weight"]["attributes"]
        assert attributes["arrayckpt"]["aliases"] == [HEAD]
        assert arrayckpt.verify(path).ok and arrayckpt.diff(path, untied).identical


def test_converters_write_the_tie_each_as_it_can(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    model = _gpt2()
    src = tmp_path / "tied"
    arrayckpt.save({"model": model}, src)
    expected = model.lm_head.weight.detach()

    arrayckpt.convert(src, tmp_path / "model.pt")  # torch.save shares storages: stored once, loads tied
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)["model"]
    assert loaded["lm_head.weight"].data_ptr() == loaded["transformer.wte.weight"].data_ptr()
    assert_bit_equal(loaded["lm_head.weight"], expected)
    arrayckpt.convert(tmp_path / "model.pt", tmp_path / "back")  # and back: the tie found again
    with arrayckpt.open(tmp_path / "back") as back:
        assert back.aliases() == {HEAD: WTE}

    result = arrayckpt.convert(src, tmp_path / "model.safetensors")  # safetensors cannot alias: both keys
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert HEAD in tensors and WTE in tensors and result.skipped == ()
    assert_bit_equal(tensors[HEAD], expected)
    assert_bit_equal(tensors[WTE], expected)

    arrayckpt.convert(src, tmp_path / "dcp", to_format="dcp")  # DCP writes every key it is given
    untied = _gpt2(tied=False, seed=3)
    state = {"model": untied.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_bit_equal(state["model"]["lm_head.weight"], expected)
    assert_bit_equal(state["model"]["transformer.wte.weight"], expected)


def test_dcp_reader_serves_the_alias_key(tmp_path):
    import torch.distributed.checkpoint as dcp

    from arrayckpt.dcp import ArrayckptReader

    model = _gpt2()
    path = tmp_path / "tied"
    arrayckpt.save({"model": model}, path)
    assert _manifest(path)["entries"][HEAD]["kind"] == "alias"  # stored once: DCP asks for a key with no array
    for tied in (False, True):
        target = _gpt2(tied=tied, seed=4)
        state = {"model": target.state_dict()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=ArrayckptReader(path), no_dist=True)
        target.load_state_dict(state["model"])
        for key, value in model.state_dict().items():
            assert_bit_equal(target.state_dict()[key], value)


def test_dcp_writer_stores_the_tie_once(tmp_path, storage_layout):
    import torch.distributed.checkpoint as dcp
    import zarr

    from arrayckpt.dcp import ArrayckptReader, ArrayckptWriter

    model = _gpt2()
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "step": 1}, storage_writer=ArrayckptWriter(path), no_dist=True)
    manifest = _manifest(path)
    assert manifest["entries"][HEAD] == {"kind": "alias", "keys": ["model", "lm_head.weight"], "target": WTE}
    assert _arrays(path) == _arrays_of_save(model, tmp_path / "save") and not (path / "model" / "lm_head").exists()
    root = zarr_group(path)  # zarr-python: one array, its alias in its attributes
    if storage_layout == "files":  # (through a packed one's references zarr-python lists no members below the root)
        arrays = [name for name, node in root.members(max_depth=None) if isinstance(node, zarr.Array)]
        assert len(arrays) == len(model.state_dict()) - 1 and not any("lm_head" in a for a in arrays)
    with pytest.raises(KeyError):
        root["model/lm_head/weight"]
    assert root["model/transformer/wte/weight"].attrs["arrayckpt"]["aliases"] == [HEAD]
    assert arrayckpt.verify(path).ok
    for tied in (True, False):
        target = _gpt2(tied=tied, seed=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"model": target}, storage_reader=ArrayckptReader(path), no_dist=True)
        assert (target.lm_head.weight.data_ptr() == target.transformer.wte.weight.data_ptr()) is tied
        for key, value in model.state_dict().items():
            assert_bit_equal(target.state_dict()[key], value)


def _arrays_of_save(model: nn.Module, path: Path) -> list[str]:
    arrayckpt.save({"model": model, "step": 1}, path)
    return _arrays(path)


def test_dcp_writer_fails_where_a_rank_left_out_a_tie_others_do_not_share():
    from arrayckpt._integrations.dcp_ties import TiesOnRank, agreed_ties

    both = frozenset({"a", "b"})
    tied = TiesOnRank(both, {"b": "a"}, frozenset())
    assert agreed_ties([tied, tied], "ckpt") == {"b": "a"}
    assert agreed_ties([tied, TiesOnRank(both, {}, frozenset())], "ckpt") == {}  # rank 1 wrote its own `b`
    assert agreed_ties([tied, TiesOnRank(frozenset({"a"}), {}, frozenset())], "ckpt") == {}
    with pytest.raises(arrayckpt.StateError, match=r"ckpt: tensor 'b' is one tensor with 'a' on rank 1 but not on "
                                                   r"rank\(s\) \[0\]"):
        agreed_ties([TiesOnRank(both, {}, frozenset()), TiesOnRank(both, {"b": "a"}, frozenset({"b"}))], "ckpt")


def test_lightning_checkpoint_io_hands_back_the_tie(tmp_path):
    from arrayckpt.lightning import ArrayckptIO

    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    io = ArrayckptIO()
    io.save_checkpoint({"state_dict": {"wte": w, "head": w, "b": torch.ones(2)}, "epoch": 1}, tmp_path / "c")
    with arrayckpt.open(tmp_path / "c") as ckpt:
        assert ckpt.aliases() == {"state_dict.head": "state_dict.wte"}
    state_dict = io.load_checkpoint(tmp_path / "c")["state_dict"]
    assert list(state_dict) == ["wte", "head", "b"] and state_dict["head"] is state_dict["wte"]
    assert_bit_equal(state_dict["head"], w)


# --- deltas --------------------------------------------------------------------------------------------------


def test_deltas_read_aliases_and_ties_that_change_along_the_chain(tmp_path, monkeypatch):
    import arrayckpt._write.changes as changes

    g = torch.Generator().manual_seed(0)
    w, other = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    base, d1, d2, d3 = (tmp_path / name for name in ("base", "d1", "d2", "d3"))
    arrayckpt.save({"emb": w, "head": w, "x": other}, base)  # tied
    with arrayckpt.open(base) as ckpt:
        assert ckpt.aliases() == {"head": "emb"}

    compared: list[str] = []
    real = changes.read_box
    monkeypatch.setattr(changes, "read_box", lambda stored, key, box, out: (compared.append(key),
                                                                              real(stored, key, box, out))[1])
    w[5] += 1  # the target changes: an alias in a delta, its target a delta of its own
    arrayckpt.save({"emb": w, "head": w, "x": other}, d1, base=base)
    assert sorted(compared) == ["emb", "x"]  # only the target is compared with the base, not its alias
    m1 = _manifest(d1)
    assert m1["entries"]["head"] == {"kind": "alias", "keys": ["head"], "target": "emb"}
    assert m1["entries"]["emb"]["delta"]["mode"] == "rows" and m1["stored_bytes"] == 8 + 8 * 4

    head = w.clone()
    head[7] = -1  # untied: `head` now differs from `emb`, a delta against the base's alias
    arrayckpt.save({"emb": w, "head": head, "x": other}, d2, base=d1)
    assert _manifest(d2)["entries"]["head"]["delta"]["mode"] == "rows"

    arrayckpt.save({"emb": head, "head": head, "x": other}, d3, base=d2)  # tied again, to what `head` was
    for path, (emb, hd) in {base: (None, None), d1: (w, w), d2: (w, head), d3: (head, head)}.items():
        with arrayckpt.open(path) as ckpt:
            if emb is not None:
                assert_bit_equal(ckpt["emb"].torch(), emb)
                assert_bit_equal(ckpt["head"].torch(), hd)
                assert_bit_equal(torch.from_numpy(ckpt["head"][6:9, 1:3]), hd[6:9, 1:3])
        assert arrayckpt.verify(path).ok
    arrayckpt.compact(d3, tmp_path / "full")
    with arrayckpt.open(tmp_path / "full") as ckpt:
        assert ckpt.aliases() == {"head": "emb"} and ckpt.manifest.base is None
        assert_bit_equal(ckpt["head"].torch(), head)


# --- several ranks -------------------------------------------------------------------------------------------


def test_only_ties_every_rank_agrees_on_become_aliases(tmp_path):
    w = torch.arange(24.0).reshape(6, 4)

    def save(states: list[dict[str, Any]], path: Path) -> dict[str, str]:
        def rank(r: int, group: Any) -> None:
            arrayckpt.save(states[r], path, process_group=group)

        run_thread_ranks(len(states), rank)
        with arrayckpt.open(path) as ckpt:
            for key in ("a", "b"):
                assert_bit_equal(ckpt[key].torch(), w)
            return dict(ckpt.aliases())

    def rows(r: int, tensor: torch.Tensor) -> arrayckpt.Shard:
        return arrayckpt.Shard(tensor, (6, 4), (3 * r, 0))

    halves = [w[:3].clone(), w[3:].clone()]
    assert save([{"a": w, "b": w}, {"a": w.clone(), "b": w.clone()}], tmp_path / "one") == {}  # tied on rank 0 only
    assert save([{"a": w, "b": w}, {"a": w}], tmp_path / "two") == {}  # rank 1 does not hold `b`
    assert save([{"a": w, "b": w}, {"a": w.clone(), "b": w.clone(), "c": w.clone()}],
                tmp_path / "three") == {}
    sharded = [{"a": rows(r, halves[r]), "b": rows(r, halves[r])} for r in range(2)]
    assert save(sharded, tmp_path / "sharded") == {"b": "a"}  # every rank: one memory, one box
    mixed = [{"a": rows(0, halves[0]), "b": rows(0, halves[0])}, {"a": rows(1, halves[1]), "b": rows(1, halves[1])}]
    mixed[1]["b"] = rows(1, halves[1].clone())
    assert save(mixed, tmp_path / "mixed") == {}
    assert save([{"a": w, "b": w}, {"a": w, "b": w}], tmp_path / "both") == {"b": "a"}


def _fsdp2_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """On each rank: a tied GPT-2 under FSDP2 after an AdamW step, saved through ``get_state_dict`` with
    ``arrayckpt.save`` and with ``dcp.save`` + ``ArrayckptWriter``; each loaded back into a fresh FSDP2 model with
    ``arrayckpt.load`` and with DCP's reader. Then a plain (replicated) tied GPT-2 through DCP's writer and reader,
    and keys tied on rank 0 only. Returns the full tensors saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from arrayckpt.dcp import ArrayckptReader, ArrayckptWriter

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _gpt2(seed=seed)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optim = build(0)
    ids = torch.randint(0, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).loss.backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    head, wte = model_sd["lm_head.weight"], model_sd["transformer.wte.weight"]
    assert isinstance(head, DTensor) and head.to_local().data_ptr() == wte.to_local().data_ptr()
    arrayckpt.save({"model": model_sd, "optim": optim_sd}, f"{root}/fsdp")
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=ArrayckptWriter(f"{root}/fsdp-dcp"))

    def full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}

    saved = full(model_sd)
    for how in ("arrayckpt", "dcp", "dcp-written"):
        fresh, fresh_optim = build(1)
        msd, osd = get_state_dict(fresh, fresh_optim)
        if how == "arrayckpt":
            arrayckpt.load({"model": msd, "optim": osd}, f"{root}/fsdp")
        elif how == "dcp":
            dcp.load({"model": msd}, storage_reader=ArrayckptReader(f"{root}/fsdp"))
        else:
            dcp.load({"model": msd, "optim": osd}, storage_reader=ArrayckptReader(f"{root}/fsdp-dcp"))
        set_state_dict(fresh, fresh_optim, model_state_dict=msd, optim_state_dict=osd)
        assert fresh.lm_head.weight.to_local().data_ptr() == fresh.transformer.wte.weight.to_local().data_ptr()
        for key, value in full(get_state_dict(fresh, fresh_optim)[0]).items():
            assert_bit_equal(value, saved[key])

    plain = _gpt2(seed=7)  # replicated: DCP gives each key to one rank, lm_head.weight maybe not to wte's
    dcp.save({"model": plain}, storage_writer=ArrayckptWriter(f"{root}/plain"))
    fresh = _gpt2(seed=8)
    dcp.load({"model": fresh}, storage_reader=ArrayckptReader(f"{root}/plain"))
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()
    for key, value in fresh.state_dict().items():
        assert_bit_equal(value, plain.state_dict()[key])
    w = torch.arange(24.0).reshape(6, 4)  # tied on rank 0 only: stored twice (rank 1 writes its own `b`)
    dcp.save({"a": w, "b": w} if rank == 0 else {"a": w.clone(), "b": w.clone()},
             storage_writer=ArrayckptWriter(f"{root}/rank0"))
    return {key: value.numpy() for key, value in saved.items()}  # numpy: torch tensors would travel as shared memory


@pytest.mark.slow
def test_fsdp2_tied_gpt2_on_two_ranks_is_stored_once(tmp_path):
    saved = {key: torch.from_numpy(value) for key, value in run_ranks(2, _fsdp2_rank, str(tmp_path))[0].items()}
    path = tmp_path / "fsdp"
    manifest = _manifest(path)
    assert manifest["entries"][HEAD]["kind"] == "alias" and manifest["entries"][HEAD]["target"] == WTE
    assert not any(a.startswith("model/lm_head") for a in _arrays(path))
    assert manifest["created"]["world_size"] == 2
    assert arrayckpt.verify(path).ok
    for name in ("fsdp-dcp", "plain"):  # DCP's writer stores the tie once too (issue 24, item 3 and 6)
        written = _manifest(tmp_path / name)
        assert written["entries"][HEAD] == {"kind": "alias", "keys": ["model", "lm_head.weight"], "target": WTE}
        assert written["created"]["writer"] == "arrayckpt.dcp.ArrayckptWriter"
        assert not any("lm_head" in a for a in _arrays(tmp_path / name)) and arrayckpt.verify(tmp_path / name).ok
    with arrayckpt.open(tmp_path / "fsdp-dcp") as ckpt:
        assert_bit_equal(ckpt[HEAD].torch(), saved["lm_head.weight"])
    with arrayckpt.open(tmp_path / "rank0") as ckpt:
        assert ckpt.aliases() == {} and _arrays(tmp_path / "rank0") == ["a", "b"]
        assert_bit_equal(ckpt["b"].torch(), torch.arange(24.0).reshape(6, 4))
    for tied in (True, False):  # one process, no FSDP: bit for bit, into a tied and an untied model
        model = _gpt2(tied=tied, seed=5)
        arrayckpt.load({"model": model}, path)
        for key, value in model.state_dict().items():
            assert_bit_equal(value, saved[key])
