"""Every arrayckpt checkpoint opens in every Zarr reader (issue 14): a corpus of real-shaped checkpoints read by
zarr-python (consolidated and not), TensorStore, dask and xarray, each array bit for bit what arrayckpt reads.

The corpus: the key structure of Hugging Face BERT (with the ``embeddings.position_ids`` buffer older versions
save beside ``embeddings.LayerNorm``) and GPT-2 (bfloat16, with the ``attn.bias`` mask older versions save beside
``attn.c_attn``), built tiny from ``transformers`` configs; a model with its AdamW state through
``get_state_dict``; nested lists and dicts with plain values, per-rank and pickled values and unusual dtypes; a
delta checkpoint (a rows delta, a quantized rows delta, chunks deltas) and its base; its ``compact`` output; a
converted safetensors file. Readers that need zarr-python run in a fresh interpreter that never imports arrayckpt's
reading code (or torch): one with bfloat16/float8 registered (``import arrayckpt._zarr_dtypes``), one without.

What a foreign reader sees of a delta: the row arrays of a rows delta (``rows``, ``values`` / ``codes``, ``scale``,
``offset``) and the arrays stored whole are complete; an array of a chunks delta holds only its changed chunks,
and zarr-python, dask, xarray and TensorStore (unless ``fill_missing_data_reads`` is false) read the fill value
(zeros) for the others: the base's data is not there.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
import torch
from helpers import random_tensor
from policies import small_chunks

import arrayckpt
import arrayckpt._write.exchange as exchange_module
from arrayckpt._format.manifest import ArrayEntry, PerRankEntry, PickleEntry, per_rank_path
from arrayckpt._format.quant import QuantizedRows, dequantize_rows
from arrayckpt._format.zarr import GROUP_METADATA, check_array_metadata, node_documents
from arrayckpt._layout import saveplan
from arrayckpt._read.checkpoint import stored_of

REPO = Path(__file__).resolve().parents[2]
CHUNKS = small_chunks(1024, 4096)  # a few KiB per tensor: several outer chunks of several inner chunks
FOREIGN_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}  # not Zarr core types: zarr-python needs them registered


def _record(array: Any) -> list[Any]:
    """dtype, shape and a digest of the bytes: what every reader must agree on, bit for bit."""
    data = np.ascontiguousarray(np.asarray(array))
    return [data.dtype.name, list(data.shape), hashlib.sha256(data.tobytes()).hexdigest()]


@dataclass(frozen=True)
class Item:
    """One checkpoint of the corpus and, per array node, what a foreign reader must read there."""

    path: Path
    expected: dict[str, list[Any]]  # array path -> _record
    partial: frozenset[str]  # arrays of chunks deltas: only their changed chunks are stored


def _with_missing_chunks_as_fill(data: np.ndarray, metadata: dict[str, Any], present: set[int]) -> np.ndarray:
    """What a reader that takes missing chunks for the fill value (zero) reads of a chunks-delta array."""
    out = data.copy()
    chunk = metadata["chunk_grid"]["configuration"]["chunk_shape"]
    counts = [-(-n // c) for n, c in zip(data.shape, chunk, strict=True)]
    for flat, index in enumerate(np.ndindex(*counts)):
        if flat not in present:
            out[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunk, strict=True))] = 0
    return out


def _strict(path: Path, node: str) -> np.ndarray:
    """A whole array read by TensorStore with missing chunks as errors: proof that it is complete."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/{node}/"},
            "fill_missing_data_reads": False}
    return ts.open(spec, open=True).result().read().result()


def _expected(path: Path) -> Item:
    """Per array node: arrayckpt's data; for a chunks delta, that with the unstored chunks zero; for the arrays of a
    rows delta, their complete contents, checked to rebuild (with the base) exactly what arrayckpt reads."""
    ckpt = arrayckpt.open(path, allow_pickle=True)
    held = stored_of(ckpt)
    expected: dict[str, list[Any]] = {}
    partial = set()
    for key, entry in ckpt.manifest.entries.items():
        if isinstance(entry, PickleEntry):
            expected[entry.path] = _record(np.frombuffer(held.pickle_bytes(key), np.uint8))
        elif isinstance(entry, PerRankEntry):
            for rank, value in enumerate(ckpt.per_rank(key)):
                if isinstance(entry.items[rank], ArrayEntry):
                    expected[per_rank_path(key, rank)] = _record(np.asarray(value.numpy() if isinstance(
                        value, torch.Tensor) else value))
        elif isinstance(entry, ArrayEntry):
            data = np.asarray(ckpt[key][...])
            if entry.delta is None:
                expected[entry.path] = _record(data)
            elif entry.delta.mode == "chunks":
                foreign = _with_missing_chunks_as_fill(data, held.nodes[entry.path], set(entry.delta.present))
                expected[entry.path] = _record(foreign)
                partial.add(entry.path)
            else:
                names = sorted(n.rsplit("/", 1)[1] for n in held.nodes if n.startswith(entry.path + "/"))
                stored = {name: _strict(path, f"{entry.path}/{name}") for name in names}
                expected.update({f"{entry.path}/{name}": _record(a) for name, a in stored.items()})
                rebuilt = np.asarray(ckpt.base[key][...]).copy()
                keep = stored["rows"] != -1  # padding
                if "values" in stored:
                    rebuilt[stored["rows"][keep]] = stored["values"][keep]
                else:
                    q = QuantizedRows(stored["codes"], stored["scale"], stored["offset"],
                                      entry.delta.quantized.bits, int(np.prod(entry.shape[1:])))  # type: ignore[union-attr]
                    rebuilt[stored["rows"][keep]] = dequantize_rows(q, data.dtype).reshape(-1, *entry.shape[1:])[keep]
                assert _record(rebuilt) == _record(data), f"{path}: rows delta of {key!r} does not rebuild it"
    ckpt.close()
    return Item(path, expected, frozenset(partial))


# --- the corpus ------------------------------------------------------------------------------------------------


def _bert() -> dict[str, Any]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                        vocab_size=99, max_position_embeddings=40)
    state = dict(BertModel(config).state_dict())
    # saved by transformers < 4.31 (and in most BERT checkpoints): an array beside the subgroups of `embeddings`
    state["embeddings.position_ids"] = torch.arange(40).unsqueeze(0)
    return state


def _gpt2() -> dict[str, Any]:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(1)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=24, bos_token_id=0,
                        eos_token_id=0)
    state = {k: v.to(torch.bfloat16) for k, v in GPT2Model(config).state_dict().items()}
    for layer in range(2):  # saved by older transformers: the causal mask beside `attn.c_attn` and `attn.c_proj`
        state[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(24, 24, dtype=torch.bool)).view(1, 1, 24, 24)
        state[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    return state


def _model_and_adamw() -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)  # FSDP2's keys ("0.weight"), here without a process group
    return {"model": model_sd, "optim": optim_sd, "step": 1}


def _nested() -> dict[str, Any]:
    t = torch.arange(6.0)
    return {
        "a": {"sub": {"x": t}, "y": t.reshape(2, 3)}, "b": {"sub": {"z": t[:4]}},  # arrays beside deeper groups
        "layers": [{"w": torch.ones(3, 2), "b": torch.zeros(3)}, {"w": torch.full((5,), 2.0)}],
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "names": ["x", "y"], "none": None}, "step": 7,
        "bf16": random_tensor((33, 7), torch.bfloat16, seed=3), "fp8": random_tensor((9,), torch.float8_e4m3fn),
        "f32": random_tensor((40, 9), torch.float32, seed=4), "mask": random_tensor((6, 5), torch.bool),
        "half": random_tensor((4,), torch.float16), "cplx": random_tensor((3,), torch.complex64),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "np": np.arange(12, dtype=np.int16).reshape(3, 4),
        "rng": arrayckpt.PerRank(torch.get_rng_state()), "obj": {1, 2, 3},
        "weird key/é": torch.ones(2), "__dunder": torch.ones(1),
    }


def _delta(base: Path, delta: Path) -> None:
    g = torch.Generator().manual_seed(5)
    state = {"emb": torch.randn(64, 8, generator=g), "qemb": torch.randn(48, 12, generator=g),
             "dense": torch.randn(64, 32, generator=g), "frozen": torch.randn(16, 16, generator=g).bfloat16(),
             "bias": torch.randn(5, generator=g), "step": 1}
    CHUNKS.save(state, base, step=1)
    state["emb"][[3, 40, 41]] += 1  # a rows delta
    state["qemb"][[0, 7, 47]] -= 2  # a quantized rows delta
    state["dense"][:8, :2] *= 2  # a chunks delta: one of its 8 chunks (of 8 rows) changed
    state["bias"] += 1  # stored whole: a delta would not be smaller; `frozen`: a chunks delta of no chunks
    state["step"] = 2
    CHUNKS.save(state, delta, step=2, base=base, changed_rows={"emb": torch.tensor([3, 40, 41])},
                quantize={"qemb": 8})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Item]:
    root = tmp_path_factory.mktemp("corpus")
    CHUNKS.save({"model": _bert()}, root / "bert", step=1)
    CHUNKS.save({"model": _gpt2()}, root / "gpt2")
    CHUNKS.save(_model_and_adamw(), root / "model_adamw", step=1)
    CHUNKS.save(_nested(), root / "nested", allow_pickle=True)
    _delta(root / "delta_base", root / "delta")
    arrayckpt.compact(root / "delta", root / "compact")
    from safetensors.torch import save_file

    save_file(_bert(), str(root / "model.safetensors"))
    arrayckpt.convert(root / "model.safetensors", root / "safetensors")
    names = ("bert", "gpt2", "model_adamw", "nested", "delta_base", "delta", "compact", "safetensors")
    return {name: _expected(root / name) for name in names}


def test_corpus_has_what_it_claims(corpus: dict[str, Item]) -> None:
    entries = arrayckpt.open(corpus["delta"].path).manifest.entries
    modes = {key: e.delta.mode for key, e in entries.items() if isinstance(e, ArrayEntry) and e.delta is not None}
    assert modes == {"emb": "rows", "qemb": "rows", "dense": "chunks", "frozen": "chunks"}
    assert entries["qemb"].delta.quantized is not None and entries["bias"].delta is None  # type: ignore[union-attr]
    assert corpus["delta"].partial == {"dense", "frozen"}
    bert = corpus["bert"].expected
    assert "model/embeddings/position_ids" in bert and "model/embeddings/LayerNorm/weight" in bert
    assert "model/h/0/attn/bias" in corpus["gpt2"].expected and "model/h/0/attn/c_attn/bias" in corpus["gpt2"].expected
    assert {"optim/state/0/weight/exp_avg", "rng/%r0", "obj"} <= set(corpus["model_adamw"].expected) | set(
        corpus["nested"].expected)
    for item in corpus.values():  # every array names its dimensions, unique in the checkpoint but for a delta's rows
        nodes = stored_of(arrayckpt.open(item.path)).nodes
        names = [n for path in item.expected for n in nodes[path]["dimension_names"]]
        assert all(n.endswith(".rows") for n in names if names.count(n) > 1), item.path


# --- the readers ------------------------------------------------------------------------------------------------

_PRELUDE = """
import hashlib, json, sys, warnings
import numpy as np
warnings.simplefilter("ignore")

def record(array):
    data = np.ascontiguousarray(np.asarray(array))
    return [data.dtype.name, list(data.shape), hashlib.sha256(data.tobytes()).hexdigest()]

def attempt(function):
    try:
        return {"arrays": function()}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:500]}

items = json.loads(sys.argv[1])
out = {}
"""

# zarr-python, dask and xarray with arrayckpt's bfloat16/float8 registered: the one line a reader adds
_REGISTERED = _PRELUDE + """
import arrayckpt._zarr_dtypes
import dask.array as da
import xarray as xr
import zarr

def members(path, consolidated):
    group = zarr.open_group(path, mode="r", use_consolidated=consolidated)
    return {name: record(node[...]) for name, node in group.members(max_depth=None) if isinstance(node, zarr.Array)}

def with_dask(path):
    group = zarr.open_group(path, mode="r")
    return {name: record(da.from_zarr(node).compute()) for name, node in group.members(max_depth=None)
            if isinstance(node, zarr.Array)}

def with_open_zarr(path, arrays):
    found = {}
    for group in sorted({a.rpartition("/")[0] for a in arrays}):
        with xr.open_zarr(path, group=group or None) as ds:
            found.update({f"{group}/{name}".lstrip("/"): record(v.values) for name, v in ds.data_vars.items()})
    return found

def with_datatree(path):
    found = {}
    with xr.open_datatree(path, engine="zarr") as tree:
        for node in tree.subtree:
            ds = node.to_dataset(inherit=False)
            found.update({f"{node.path}/{name}".strip("/"): record(v.values) for name, v in ds.variables.items()})
    return found

for name, item in items.items():
    path = item["path"]
    out[name] = {
        "zarr": attempt(lambda: members(path, True)),
        "zarr (use_consolidated=False)": attempt(lambda: members(path, False)),
        "dask": attempt(lambda: with_dask(path)),
        "xarray.open_zarr": attempt(lambda: with_open_zarr(path, item["arrays"])),
        "xarray.open_datatree": attempt(lambda: with_datatree(path)),
    }
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("arrayckpt."))
print(json.dumps({"results": out, "imported": heavy}))
"""

# zarr-python alone, no arrayckpt at all: every array of a Zarr core type opens with zarr.open_array
_BARE = _PRELUDE + """
import zarr

def arrays(path, names):
    found = {}
    for name in names:
        try:
            found[name] = record(zarr.open_array(f"{path}/{name}", mode="r")[...])
        except Exception as e:
            found[name] = f"{type(e).__name__}: {e}"[:300]
    return found

def whole_group(path):
    zarr.open_group(path, mode="r")  # parses every node's metadata
    return {}

for name, item in items.items():
    out[name] = {"zarr.open_array": attempt(lambda: arrays(item["path"], item["arrays"])),
                 "zarr.open_group": attempt(lambda: whole_group(item["path"]))}
print(json.dumps({"results": out, "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("arrayckpt",
                                                                                                     "torch"))}))
"""


def _run(script: str, corpus: dict[str, Item], tmp: Path, registered: bool) -> dict[str, Any]:
    """Run a reader script in a fresh interpreter in an empty directory: with the repository importable only when
    ``registered`` (for ``arrayckpt._zarr_dtypes``), and never with arrayckpt's zarr start-up hook."""
    items = {name: {"path": str(item.path), "arrays": sorted(item.expected)} for name, item in corpus.items()}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"ARRAYCKPT_NO_ZARR_HOOK": "1", **({"PYTHONPATH": str(REPO)} if registered else {})})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), json.dumps(items)], capture_output=True,
                          text=True, cwd=tmp, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def registered(corpus: dict[str, Item], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = _run(_REGISTERED, corpus, tmp_path_factory.mktemp("registered"), registered=True)
    assert set(out["imported"]) <= {"arrayckpt._version", "arrayckpt._zarr_dtypes"}  # no torch, no reading code
    return out["results"]


@pytest.fixture(scope="module")
def bare(corpus: dict[str, Item], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = _run(_BARE, corpus, tmp_path_factory.mktemp("bare"), registered=False)
    assert out["imported"] == []
    return out["results"]


ITEMS = ("bert", "gpt2", "model_adamw", "nested", "delta_base", "delta", "compact", "safetensors")
READERS = ("zarr", "zarr (use_consolidated=False)", "dask", "xarray.open_zarr", "xarray.open_datatree")


@pytest.mark.slow
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", ITEMS)
def test_zarr_dask_and_xarray_read_every_array_as_arrayckpt_does(corpus, registered, name, reader):
    result = registered[name][reader]
    assert "error" not in result, result
    assert result["arrays"] == corpus[name].expected


@pytest.mark.parametrize("name", ITEMS)
def test_tensorstore_reads_every_array_as_arrayckpt_does(corpus, name):
    item = corpus[name]
    found = {}
    for node in item.expected:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{item.path}/{node}/"}}
        found[node] = _record(ts.open(spec, open=True).result().read().result())
    assert found == item.expected
    for node in item.partial:  # with missing chunks as errors, a chunks delta's array does not read whole
        with pytest.raises(ValueError, match="not found|missing"):
            _strict(item.path, node)


@pytest.mark.parametrize("name", ITEMS)
def test_zarr_alone_reads_every_array_of_a_core_type(corpus, bare, name):
    """Without arrayckpt installed, zarr-python reads every array of a Zarr core data type; bfloat16/float8 arrays
    (and so the whole group, whose consolidated metadata names their types) need the types registered."""
    item = corpus[name]
    result = bare[name]["zarr.open_array"]["arrays"]
    foreign = {node for node, (dtype, _, _) in item.expected.items() if dtype in FOREIGN_DTYPES}
    assert {k: v for k, v in result.items() if k not in foreign} == {
        k: v for k, v in item.expected.items() if k not in foreign}
    for node in foreign:  # a zarr-python that loads the `zarr.data_type` entry points itself reads them right
        assert result[node] == item.expected[node] or "No Zarr data type found" in result[node]
    group = bare[name]["zarr.open_group"]
    assert ("error" in group) == (bool(foreign) and any(isinstance(result[n], str) for n in foreign)), group


# --- the rules behind it: node order, dimension names, older checkpoints ------------------------------------------


def _random_tree(rng: random.Random) -> list[str]:
    """Array paths of a random hierarchy: groups holding arrays beside deeper groups, at any depth."""
    paths: set[str] = set()
    for _ in range(rng.randint(1, 12)):
        depth = rng.randint(1, 4)
        paths.add("/".join(rng.choice(["a", "b", "ab", "a-b", "B", "0", "10", "%r0", "x_y"]) for _ in range(depth)))
    return [p for p in paths if not any(q.startswith(p + "/") for q in paths)]  # an array has no children


def test_consolidated_node_order_is_what_zarr_python_needs():
    """zarr-python 3 (``ConsolidatedMetadata._flat_to_nested``, unchanged from 3.0.0 to 3.1.6) sorts the nodes by
    depth, keeping their order within a depth, and takes each run of nodes with one parent as all of that
    parent's members: a later run of the same parent replaces the earlier one, and a node of the lost run is then
    missing when its own members are placed (``KeyError``, reported as ``GroupNotFoundError``)."""
    from zarr.core.group import ConsolidatedMetadata

    document = {"zarr_format": 3, "node_type": "array", "shape": [1], "data_type": "uint8",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
                "chunk_key_encoding": {"name": "default"}, "fill_value": 0, "codecs": [{"name": "bytes"}],
                "attributes": {}}
    rng = random.Random(0)
    for paths in [["a/sub/x", "a/y", "b/sub/z"], *(_random_tree(rng) for _ in range(300))]:
        rng.shuffle(paths)
        nodes = node_documents(dict.fromkeys(paths, document))
        order = list(nodes)
        depths = [p.count("/") for p in order]
        assert depths == sorted(depths)  # every group before its members
        parents = [p.rpartition("/")[0] for p in order]
        runs = [parent for i, parent in enumerate(parents) if i == 0 or parents[i - 1] != parent]
        assert len(runs) == len(set(runs))  # the members of one group are listed together
        nested = ConsolidatedMetadata.from_dict({"kind": "inline", "must_understand": False, "metadata": nodes})
        assert set(nested.flattened_metadata) == set(nodes), paths
        assert all(nodes[p] == GROUP_METADATA for p in nodes if p not in paths)


def _older_writer(arrays: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What format versions 1 and 2 wrote: every group first, then the arrays in the order of the state, and no
    ``dimension_names``."""
    groups = sorted({p.rsplit("/", i)[0] for p in arrays for i in range(1, p.count("/") + 1)})
    old = {path: GROUP_METADATA for path in groups}
    old.update({path: {k: v for k, v in doc.items() if k != "dimension_names"} for path, doc in arrays.items()})
    return old


def test_checkpoints_of_older_writers_still_open(tmp_path, monkeypatch):
    """arrayckpt reads the consolidated metadata by path, whatever its order, with or without dimension names."""
    monkeypatch.setattr(saveplan, "node_documents", _older_writer)
    monkeypatch.setattr(exchange_module, "_PLAN_CACHES", {})  # plan afresh, and leave no such layout to later saves
    state = {"a": {"sub": {"x": torch.arange(4.0)}, "y": torch.ones(2, 3)}, "b": {"sub": {"z": torch.zeros(3)}},
             "bf16": random_tensor((5, 3), torch.bfloat16)}
    CHUNKS.save(state, tmp_path / "old")
    nodes = json.loads((tmp_path / "old" / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    assert list(nodes) == ["a", "a/sub", "b", "b/sub", "a/sub/x", "a/y", "b/sub/z", "bf16"]
    assert not any("dimension_names" in doc for doc in nodes.values())
    ckpt = arrayckpt.open(tmp_path / "old")
    for key, tensor in {"a.sub.x": state["a"]["sub"]["x"], "a.y": state["a"]["y"], "b.sub.z": state["b"]["sub"]["z"],
                        "bf16": state["bf16"]}.items():
        assert torch.equal(ckpt[key].torch().view(torch.uint8), tensor.view(torch.uint8)), key
    assert arrayckpt.verify(tmp_path / "old").ok


def _metadata(**changes: Any) -> dict[str, Any]:
    metadata = {"zarr_format": 3, "node_type": "array", "shape": [2, 3], "data_type": "float32",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 3]}},
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}}, "fill_value": 0.0,
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "attributes": {}, **changes}
    return {k: v for k, v in metadata.items() if v is not ...}


@pytest.mark.parametrize("names", [..., ["w.dim_0", "w.dim_1"], [None, "x"], [None, None], ["", ""]])
def test_dimension_names_are_optional(names):
    metadata = _metadata(dimension_names=names)
    assert check_array_metadata(metadata, (2, 3), "float32", "entry 'w'") is metadata


@pytest.mark.parametrize(("names", "error"), [
    (None, "not a list"), ("x", "not a list"), (["x"], "not a list of 2"), (["x", "y", "z"], "not a list of 2"),
    (["x", 1], "strings or nulls"), (["x", "x"], "name a dimension twice"),
])
def test_malformed_dimension_names_are_refused(names, error):
    with pytest.raises(arrayckpt.FormatError, match=f"entry 'w'.*dimension_names.*{error}"):
        check_array_metadata(_metadata(dimension_names=names), (2, 3), "float32", "entry 'w'")
