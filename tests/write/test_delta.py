"""Incremental (delta) checkpoints: exact change detection, chains read bit-exactly (also resharded on other
ranks), damage and missing bases detected, compaction equal to the chain, quantized rows, the manager's
intermittent policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helpers import run_ranks
from helpers import bits, nodes_of, stored_chunks, write_root
from policies import Chunking

import arrayckpt
from arrayckpt._format.manifest import ArrayEntry

pytestmark = pytest.mark.usefixtures("storage_layout")  # every test holds in both layouts (spec §2, §16)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _state(g: torch.Generator) -> dict:
    return {
        "emb": torch.randn(3000, 16, generator=g),
        "dense": torch.randn(256, 128, generator=g),
        "frozen": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "bias": torch.randn(7, generator=g),
        "count": torch.tensor(0),
        "step": 0,
    }


def _update(state: dict, g: torch.Generator, step: int) -> torch.Tensor:
    """Sparse rows of the embedding, some chunks of the dense layer, the scalar; ``frozen`` never changes."""
    rows = torch.randint(0, 3000, (30,), generator=g)
    state["emb"][rows] += torch.randn(30, 16, generator=g)
    start = int(torch.randint(0, 200, (1,), generator=g))
    state["dense"][start:start + 40, :64] -= 1.0
    state["count"] += 1
    state["step"] = step
    if step == 3:
        state["new"] = torch.arange(10.0)  # a key the base does not have
        state["bias"] = torch.randn(9, generator=g)  # a key whose shape changed
    return rows


def _assert_same(path: Path | str, state: dict) -> None:
    ckpt = arrayckpt.open(path)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert _bits_equal(ckpt[key].torch(), value), key
        else:
            assert ckpt.plain_values[key] == value
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    arrayckpt.load(target, path)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert _bits_equal(target[key], value), key


def test_chain_of_five_deltas_reads_bit_exact(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = _state(g)
    arrayckpt.save(state, tmp_path / "s0", step=0)
    full = arrayckpt.open(tmp_path / "s0").manifest.stored_bytes
    for step in range(1, 6):
        rows = _update(state, g, step)
        given = {"changed_rows": {"emb": rows}} if step % 2 else {}  # from the caller, or found by comparing
        arrayckpt.save(state, tmp_path / f"s{step}", base=tmp_path / f"s{step - 1}", step=step, **given)
        _assert_same(tmp_path / f"s{step}", state)
        ckpt = arrayckpt.open(tmp_path / f"s{step}")
        entries = ckpt.manifest.entries
        assert entries["frozen"].delta is not None and entries["frozen"].delta.present == ()  # unchanged: no bytes
        assert stored_chunks(tmp_path / f"s{step}", "frozen") == {}
        assert entries["emb"].delta is not None and entries["emb"].delta.mode == "rows"
        assert 0 < entries["emb"].delta.rows <= 30
        assert entries["dense"].delta is not None
        assert ckpt.manifest.stored_bytes < full / 4
        assert ckpt.manifest.format_version in (3, 4) and ckpt.manifest.base.step == step - 1
        if step == 3:
            assert entries["new"].delta is None and entries["bias"].delta is None
    # slices of the newest checkpoint read through all five layers
    ckpt = arrayckpt.open(tmp_path / "s5")
    assert len(ckpt.chain()) == 6
    assert np.array_equal(ckpt["emb"][100:2900:7, 3:9], state["emb"][100:2900:7, 3:9].numpy())
    assert np.array_equal(ckpt["dense"][-5, :], state["dense"][-5, :].numpy())
    assert np.array_equal(ckpt["count"][()], state["count"].numpy())
    # the earlier checkpoints still read as they were (each delta only adds)
    assert int(arrayckpt.open(tmp_path / "s2")["count"][()]) == 2


def test_detection_is_bitwise_exact(tmp_path: Path) -> None:
    """Changes no tolerance-based or float comparison would see: -0.0 vs 0.0, one NaN payload vs another."""
    w = torch.zeros(64, 8)
    w[5, 0] = float("nan")
    arrayckpt.save({"w": w}, tmp_path / "a")
    w2 = w.clone()
    w2[3, 1] = -0.0
    w2.view(torch.int32)[5, 0] = 0x7FC00001  # another NaN
    arrayckpt.save({"w": w2}, tmp_path / "b", base=tmp_path / "a")
    entry = arrayckpt.open(tmp_path / "b").manifest.entries["w"]
    assert entry.delta is not None and entry.delta.mode == "rows" and entry.delta.rows == 2
    assert _bits_equal(arrayckpt.open(tmp_path / "b")["w"].torch(), w2)


@pytest.mark.slow
def test_chunks_mode_for_column_sharded_changes(tmp_path: Path, chunking: Chunking) -> None:
    """Dense blocks changed: whole chunks stored, on the base's chunk grid (inner chunks when sharded)."""
    w = torch.randn(512, 256)
    chunking.save({"w": w}, tmp_path / "a")
    w[:, :3] += 1  # every row changes a little: rows would cost everything, chunks only some of it
    chunking.save({"w": w}, tmp_path / "b", base=tmp_path / "a")
    ckpt = arrayckpt.open(tmp_path / "b")
    entry = ckpt.manifest.entries["w"]
    assert _bits_equal(ckpt["w"].torch(), w)
    if chunking.name == "sharded":
        assert entry.delta is not None and entry.delta.mode == "chunks" and 0 < len(entry.delta.present)
        assert ckpt.manifest.stored_bytes < w.numel() * 4
    else:  # one chunk holds the whole tensor: a delta cannot be smaller, so it is stored whole
        assert entry.delta is None


def test_given_rows_outside_the_tensor_are_refused(tmp_path: Path) -> None:
    arrayckpt.save({"e": torch.zeros(10, 2)}, tmp_path / "a")
    with pytest.raises(arrayckpt.StateError, match=r"changed_rows\['e'\].*outside 0..9"):
        arrayckpt.save({"e": torch.zeros(10, 2)}, tmp_path / "b", base=tmp_path / "a", changed_rows={"e": [3, 10]})
    with pytest.raises(arrayckpt.StateError, match="the base of the delta being saved"):
        arrayckpt.save({"e": torch.zeros(10, 2)}, tmp_path / "a", base=tmp_path / "a", overwrite=True)
    with pytest.raises(arrayckpt.StateError, match="incremental saves only"):
        arrayckpt.save({"e": torch.zeros(10, 2)}, tmp_path / "c", changed_rows={"e": [1]})
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_rows_record_their_error(tmp_path: Path, bits: int) -> None:
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(2000, 64, generator=g)
    arrayckpt.save({"emb": emb, "ids": torch.arange(5)}, tmp_path / "a")
    rows = torch.randperm(2000, generator=g)[:100]
    emb[rows] = torch.randn(100, 64, generator=g) * 3
    arrayckpt.save({"emb": emb, "ids": torch.arange(5)}, tmp_path / "b", base=tmp_path / "a",
                   changed_rows={"emb": rows}, quantize={"emb": bits})
    ckpt = arrayckpt.open(tmp_path / "b")
    delta = ckpt.manifest.entries["emb"].delta
    assert delta is not None and delta.quantized is not None and delta.quantized.bits == bits
    back = ckpt["emb"].torch()
    error = (back - emb).abs().max().item()
    spread = (emb[rows].amax(1) - emb[rows].amin(1)).max().item()
    # at most half a step, or what clipping (at most 16% of a row's range, Check-N-Run/FBGEMM) gives up
    assert error == pytest.approx(delta.quantized.max_abs_error, rel=1e-6) and 0 < error <= 0.17 * spread
    untouched = torch.ones(2000, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(back[untouched], emb[untouched])  # rows not in the delta come from the base exactly
    assert ckpt.manifest.stored_bytes < 100 * (64 * bits // 8 + 16 + 8) + 1024
    with pytest.raises(arrayckpt.StateError, match="floating-point"):
        arrayckpt.save({"emb": emb, "ids": torch.arange(5) + 1}, tmp_path / "c", base=tmp_path / "a",
                       quantize={"ids": 8})


@pytest.mark.slow
@pytest.mark.parametrize("storage_layout", ["files"], indirect=True)  # damages a chunk file by hand
def test_damage_and_missing_or_replaced_bases_are_errors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    state = _state(g)
    arrayckpt.save(state, tmp_path / "s0")
    _update(state, g, 1)
    arrayckpt.save(state, tmp_path / "s1", base=tmp_path / "s0")
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}

    # damage a chunk of the base that the delta reads through
    chunk = next(p for p in (tmp_path / "s0" / "frozen").iterdir() if p.name.startswith("c"))
    original = chunk.read_bytes()
    chunk.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="'frozen'"):
        arrayckpt.load(target, tmp_path / "s1")
    report = arrayckpt.verify(tmp_path / "s1")
    assert not report.ok and "frozen" in report.damaged_keys and str(tmp_path / "s0") in report.damage[0].file
    chunk.write_bytes(original)

    # damage the delta's own row values
    values = tmp_path / "s1" / "emb" / "values"
    data_file = next(p for p in values.iterdir() if p.name.startswith("c"))
    data_file.write_bytes(b"\0" * data_file.stat().st_size)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="'emb'"):
        arrayckpt.open(tmp_path / "s1")["emb"].torch()

    # a replaced base: same path, another checkpoint
    os.rename(tmp_path / "s0", tmp_path / "moved")
    with pytest.raises(arrayckpt.CheckpointNotFoundError, match=r"base checkpoint .*s0"):
        arrayckpt.load(target, tmp_path / "s1")
    info = subprocess.run([sys.executable, "-m", "arrayckpt.cli", "info", "--json", str(tmp_path / "s1")],
                          capture_output=True, text=True, check=True)
    assert "error" in json.loads(info.stdout)["chain"][-1]
    arrayckpt.save(state, tmp_path / "s0")
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="was replaced"):
        arrayckpt.open(tmp_path / "s1")["dense"].torch()


@pytest.mark.slow
def test_compaction_equals_the_chain(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    state = _state(g)
    state["opt"] = {"lr": 0.1, "betas": (0.9, 0.99)}
    state["rng"] = arrayckpt.PerRank(torch.arange(4, dtype=torch.uint8))
    arrayckpt.save(state, tmp_path / "s0", codec={"dense": "zstd"})
    for step in range(1, 4):
        rows = _update(state, g, step)
        arrayckpt.save(state, tmp_path / f"s{step}", base=tmp_path / f"s{step - 1}", changed_rows={"emb": rows},
                       step=step)
    result = arrayckpt.compact(tmp_path / "s3", tmp_path / "full")
    assert result.chain == tuple(str(tmp_path / f"s{i}") for i in (3, 2, 1, 0))
    full, chain = arrayckpt.open(tmp_path / "full"), arrayckpt.open(tmp_path / "s3")
    assert full.manifest.base is None and full.manifest.format_version == 3 and full.step == 3
    assert sorted(full) == sorted(chain)
    for key in chain:
        assert _bits_equal(full[key].torch(), chain[key].torch()), key
        assert full.manifest.entries[key] == arrayckpt.open(tmp_path / "s3").manifest.entries[key].__class__(
            **{**chain.manifest.entries[key].__dict__, "delta": None})
    assert dict(full.plain_values) == dict(chain.plain_values)
    assert torch.equal(full.per_rank("rng")[0], torch.arange(4, dtype=torch.uint8))
    assert "zstd" in json.dumps(full["dense"].metadata["codecs"])  # each tensor keeps its compression
    assert arrayckpt.verify(tmp_path / "full").ok
    # the CLI does the same; the chain is then no longer needed
    out = subprocess.run([sys.executable, "-m", "arrayckpt.cli", "compact", str(tmp_path / "s3"),
                          str(tmp_path / "full2"), "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["arrays"] >= 6
    for i in range(4):
        os.rename(tmp_path / f"s{i}", tmp_path / f"gone{i}")
    _assert_same(tmp_path / "full2", {k: v for k, v in state.items() if k not in ("opt", "rng")})


@pytest.mark.slow
def test_cli_info_shows_the_chain(tmp_path: Path) -> None:
    w = torch.zeros(100, 4)
    arrayckpt.save({"w": w}, tmp_path / "a", step=1)
    w[7] = 1
    arrayckpt.save({"w": w}, tmp_path / "b", base=tmp_path / "a", step=2)
    # output into a pipe is not cut to a terminal's width (pytest's children inherit COLUMNS=80 from curses: unset)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "arrayckpt.cli", "info", str(tmp_path / "b")], capture_output=True,
                         text=True, check=True, env=env).stdout
    assert "1 rows" in out and "chain (newest first)" in out and str(tmp_path / "a") in out
    data = json.loads(subprocess.run([sys.executable, "-m", "arrayckpt.cli", "info", "--json", str(tmp_path / "b")],
                                     capture_output=True, text=True, check=True).stdout)
    assert [layer["step"] for layer in data["chain"]] == [2, 1] and data["tensors"]["w"]["stored"] == "1 rows"


def test_async_delta_and_object_storage(tmp_path: Path) -> None:
    w = torch.randn(500, 8)
    chain = f"memory://bucket/{tmp_path.name}"  # the memory store is the process's: one prefix per test
    base = f"{chain}/s0"
    arrayckpt.save({"w": w}, base)
    w[17] += 1
    handle = arrayckpt.async_save({"w": w}, f"{chain}/s1", base=base)
    expected = w.clone()
    w[18] += 1  # after staging: not in this checkpoint
    handle.wait()
    ckpt = arrayckpt.open(f"{chain}/s1")
    assert ckpt.manifest.base.path == "../s0" and ckpt.manifest.entries["w"].delta.rows == 1
    assert torch.equal(ckpt["w"].torch(), expected)


def test_manager_starts_a_new_full_checkpoint_when_the_chain_costs_too_much(tmp_path: Path) -> None:
    manager = arrayckpt.CheckpointManager(tmp_path, incremental=arrayckpt.Incremental(max_chain_ratio=0.3),
                                          retention=arrayckpt.Retention(keep_last=1))
    g = torch.Generator().manual_seed(4)
    emb = torch.randn(4000, 32, generator=g)
    kinds = []
    for step in range(1, 13):
        rows = torch.randperm(4000, generator=g)[:400]  # 10% of the rows: 0.1 of a full save each time
        emb[rows] += 1
        manager.save(step, {"emb": emb}, changed_rows={"emb": rows})
        ckpt = arrayckpt.open(manager.path(step))
        kinds.append("delta" if ckpt.manifest.base else "full")
        assert torch.equal(ckpt["emb"].torch(), emb)
        assert set(manager.steps()) == {c.step for c in ckpt.chain()}  # only the newest chain is kept
    assert kinds[:5] == ["full", "delta", "delta", "delta", "full"]  # 3 deltas ~ 0.3 of a full one, then full
    assert kinds.count("full") >= 3
    restored = {"emb": torch.zeros_like(emb)}
    assert manager.restore(restored) == 12 and torch.equal(restored["emb"], emb)


# --- several ranks ---------------------------------------------------------------------------------


def _global(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10)
    table = torch.randn(90, 6, generator=g)
    for s in range(1, step + 1):
        table[torch.randint(0, 90, (5,), generator=g)] += s
    return table


def _save_sharded_chain(rank: int, world: int, root: str) -> None:
    rows = 90 // world
    for step in range(3):
        table = _global(step)[rank * rows:(rank + 1) * rows].clone()
        shard = arrayckpt.Shard(table, global_shape=(90, 6), global_offset=(rank * rows, 0))
        dense = torch.full((8, 8), float(step))  # replicated on every rank
        base = None if step == 0 else f"{root}/s{step - 1}"
        arrayckpt.save({"table": shard, "dense": dense}, f"{root}/s{step}", base=base, step=step)


def _load_resharded(rank: int, world: int, root: str) -> None:
    rows = [0, 40, 90]  # uneven: rank 0 holds 40 rows, rank 1 holds 50
    out = torch.zeros(rows[rank + 1] - rows[rank], 6)
    dense = torch.zeros(8, 8)
    arrayckpt.load({"table": arrayckpt.Shard(out, global_shape=(90, 6), global_offset=(rows[rank], 0)),
                    "dense": dense}, f"{root}/s2")
    assert torch.equal(out, _global(2)[rows[rank]:rows[rank + 1]]), rank
    assert torch.equal(dense, torch.full((8, 8), 2.0))


@pytest.mark.slow
def test_chain_saved_on_3_ranks_loads_resharded_on_2(tmp_path: Path) -> None:
    run_ranks(3, _save_sharded_chain, str(tmp_path))
    ckpt = arrayckpt.open(tmp_path / "s2")
    entry = ckpt.manifest.entries["table"]
    assert isinstance(entry, ArrayEntry) and entry.delta is not None and entry.delta.mode == "rows"
    assert torch.equal(ckpt["table"].torch(), _global(2))
    run_ranks(2, _load_resharded, str(tmp_path))
    full = {"table": torch.zeros(90, 6), "dense": torch.zeros(8, 8)}
    arrayckpt.load(full, tmp_path / "s2")
    assert torch.equal(full["table"], _global(2))


def test_diff_and_show_read_through_the_chain(tmp_path: Path) -> None:
    w = torch.zeros(300, 4)
    arrayckpt.save({"w": w, "v": torch.ones(50, 50)}, tmp_path / "a")
    w[[3, 200]] = 2.0
    arrayckpt.save({"w": w, "v": torch.ones(50, 50)}, tmp_path / "b", base=tmp_path / "a")
    report = arrayckpt.diff(tmp_path / "a", tmp_path / "b")
    by_key = {t.key: t for t in report.tensors}
    assert by_key["w"].differing_elements == 8 and by_key["w"].max_abs == 2.0 and by_key["v"].differing_elements == 0
    assert arrayckpt.diff(tmp_path / "b", tmp_path / "b").identical
    summary = arrayckpt.show(tmp_path / "b", "w", "200")
    assert summary.max == 2.0 and summary.count == 4


def test_crafted_chains_are_refused(tmp_path: Path) -> None:
    """A loop of bases, and a base whose tensor has another shape, are format damage, not reads."""
    arrayckpt.save({"w": torch.zeros(6, 2)}, tmp_path / "a")
    w = torch.zeros(6, 2)
    w[1] = 1
    arrayckpt.save({"w": w}, tmp_path / "b", base=tmp_path / "a")
    root = tmp_path / "a" / "zarr.json"
    original = root.read_text()
    document = json.loads(original)
    b_id = arrayckpt.open(tmp_path / "b").manifest.id
    document["attributes"]["arrayckpt"]["base"] = {"path": "../b", "id": b_id, "step": None}
    document["attributes"]["arrayckpt"]["entries"]["w"]["delta"] = {"mode": "chunks", "present": []}
    write_root(root.parent, document)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="loops back"):
        arrayckpt.open(tmp_path / "b").chain()
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="loops back"):
        arrayckpt.open(tmp_path / "b")["w"].torch()
    document = json.loads(original)
    document["attributes"]["arrayckpt"]["entries"]["w"]["shape"] = [3, 4]
    nodes_of(document)["w"]["shape"] = [3, 4]
    nodes_of(document)["w"]["chunk_grid"]["configuration"]["chunk_shape"] = [3, 4]
    write_root(root.parent, document)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"float32\[3, 4\] here but float32\[6, 2\]"):
        arrayckpt.open(tmp_path / "b")["w"].torch()


def test_converted_checkpoint_can_be_a_base(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(100, 3)}, tmp_path / "m.pt")
    arrayckpt.convert(tmp_path / "m.pt", tmp_path / "conv")
    converted = arrayckpt.open(tmp_path / "conv").manifest
    assert converted.id and converted.stored_bytes == 1200
    w = torch.zeros(100, 3)
    w[42] = 7
    arrayckpt.save({"w": w}, tmp_path / "d", base=tmp_path / "conv")
    assert arrayckpt.open(tmp_path / "d").manifest.entries["w"].delta.rows == 1
    assert torch.equal(arrayckpt.open(tmp_path / "d")["w"].torch(), w)


def test_async_kept_copy_spares_reading_the_base_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import arrayckpt._write.changes as changes

    reads: list[str] = []
    real = changes.read_box
    monkeypatch.setattr(changes, "read_box", lambda stored, key, box, out: (reads.append(key), real(stored, key, box,
                                                                                                          out))[1])
    g = torch.Generator().manual_seed(5)
    state = {"a": torch.randn(400, 16, generator=g), "b": torch.randn(64, 64, generator=g)}
    arrayckpt.async_save(state, tmp_path / "s0", keep_copy=True).wait()
    for step in range(1, 4):
        state["a"][step * 10] += 1
        state["b"][:, step] -= 1
        expected = {k: v.clone() for k, v in state.items()}
        handle = arrayckpt.async_save(state, tmp_path / f"s{step}", base=tmp_path / f"s{step - 1}", keep_copy=True)
        state["a"][:5] = 99.0  # after staging: neither in this checkpoint nor in the kept copy
        handle.wait()
        state["a"][:5] = expected["a"][:5]
        ckpt = arrayckpt.open(tmp_path / f"s{step}")
        assert ckpt.manifest.entries["a"].delta.rows == 1
        for key, value in expected.items():
            assert torch.equal(ckpt[key].torch(), value), (step, key)
    assert reads == []  # every comparison was against the kept copy
    # a delta against another checkpoint than the kept one reads that base back
    arrayckpt.async_save(state, tmp_path / "other", base=tmp_path / "s1").wait()
    assert sorted(set(reads)) == ["a", "b"]
    assert torch.equal(arrayckpt.open(tmp_path / "other")["b"].torch(), state["b"])


def test_a_delta_may_not_replace_any_checkpoint_of_its_chain(tmp_path: Path) -> None:
    arrayckpt.save({"w": torch.zeros(10, 2)}, tmp_path / "a")
    arrayckpt.save({"w": torch.ones(10, 2)}, tmp_path / "b", base=tmp_path / "a")
    with pytest.raises(arrayckpt.StateError, match="in the chain of bases"):
        arrayckpt.save({"w": torch.ones(10, 2)}, tmp_path / "a", base=tmp_path / "b", overwrite=True)
    assert torch.equal(arrayckpt.open(tmp_path / "b")["w"].torch(), torch.ones(10, 2))


def test_kept_copy_is_not_used_for_rows_stored_quantized(tmp_path: Path) -> None:
    """The staged bytes of a quantized save are not what it stored: the next delta must not compare with them."""
    emb = torch.randn(200, 16, generator=torch.Generator().manual_seed(6))
    arrayckpt.async_save({"emb": emb}, tmp_path / "a", keep_copy=True).wait()
    emb[3] += 1
    arrayckpt.async_save({"emb": emb}, tmp_path / "b", base=tmp_path / "a", quantize={"emb": 8}, keep_copy=True).wait()
    arrayckpt.async_save({"emb": emb}, tmp_path / "c", base=tmp_path / "b", keep_copy=True).wait()
    ckpt = arrayckpt.open(tmp_path / "c")
    assert ckpt.manifest.entries["emb"].delta.rows == 1  # row 3 is stored exactly again
    assert torch.equal(ckpt["emb"].torch(), emb)


def test_ranks_must_agree_on_the_base(tmp_path: Path) -> None:
    from thread_ranks import run_thread_ranks

    for name in ("a", "b"):
        arrayckpt.save({"w": torch.zeros(4)}, tmp_path / name)

    def save_rank(rank: int, group) -> str:
        try:
            arrayckpt.save({"w": torch.ones(4)}, tmp_path / "c", base=tmp_path / ("a", "b")[rank],
                           process_group=group)
        except arrayckpt.StateError as e:
            return str(e)
        return "saved"

    for message in run_thread_ranks(2, save_rank):
        assert "disagree on the incremental save" in message
    assert not (tmp_path / "c").exists()
