"""Saving and loading never report success for what cannot be read back, and never leave the state half-loaded
(issue 13, items 10, 11, 12, 14)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import arrayckpt


def _replace(path: Path) -> None:
    """A new checkpoint at ``path`` (a new id), as a later save with ``overwrite=True`` would leave."""
    arrayckpt.save({"e": torch.full((8, 2), 7.0)}, path, overwrite=True)


def test_delta_against_a_base_replaced_since_it_was_opened_is_not_committed(tmp_path: Path) -> None:
    arrayckpt.save({"e": torch.zeros(8, 2)}, tmp_path / "a")
    base = arrayckpt.open(tmp_path / "a")
    _replace(tmp_path / "a")
    e = torch.zeros(8, 2)
    e[3] = 1.0
    # changed_rows: no base data is read, so only the commit-time check can notice
    with pytest.raises(arrayckpt.ReplacedCheckpointError, match=r"/b: the delta was not committed: its base .*/a was "
                       r"replaced or removed after it was opened .*save again"):
        arrayckpt.save({"e": e}, tmp_path / "b", base=base, changed_rows={"e": [3]})
    assert not (tmp_path / "b").exists()
    arrayckpt.save({"e": e}, tmp_path / "c", base=tmp_path / "a", changed_rows={"e": [3]})  # the current base: fine
    expected = torch.full((8, 2), 7.0)
    expected[3] = 1.0  # the caller vouched that only row 3 differs from the base
    assert torch.equal(arrayckpt.open(tmp_path / "c")["e"].torch(), expected)


def test_async_delta_from_a_kept_copy_against_a_replaced_base_is_not_committed(tmp_path: Path) -> None:
    e = torch.zeros(8, 2)
    arrayckpt.async_save({"e": e}, tmp_path / "a", keep_copy=True).wait()
    base = arrayckpt.open(tmp_path / "a")
    _replace(tmp_path / "a")
    e[5] = 2.0
    handle = arrayckpt.async_save({"e": e}, tmp_path / "b", base=base, keep_copy=True)  # compared with the kept copy
    with pytest.raises(arrayckpt.ReplacedCheckpointError, match=r"/b: the delta was not committed: its base .*/a"):
        handle.wait()
    assert not (tmp_path / "b").exists()


def test_delta_whose_deeper_base_was_replaced_is_not_committed(tmp_path: Path) -> None:
    arrayckpt.save({"e": torch.zeros(8, 2)}, tmp_path / "a")
    arrayckpt.save({"e": torch.ones(8, 2)}, tmp_path / "b", base=tmp_path / "a")
    base = arrayckpt.open(tmp_path / "b")
    base.chain()
    _replace(tmp_path / "a")
    with pytest.raises(arrayckpt.ReplacedCheckpointError, match=r"a checkpoint in its chain of bases .*/a"):
        arrayckpt.save({"e": torch.ones(8, 2)}, tmp_path / "c", base=base,
                       changed_rows={"e": torch.tensor([], dtype=torch.int64)})


# --- item 11: a failed load says what it overwrote; atomic=True overwrites nothing -------------------------------


def _saved_state() -> dict:
    return {"model": {"a": torch.arange(12.0).reshape(3, 4), "b": torch.full((5,), 3.0, dtype=torch.bfloat16),
                      "c": torch.arange(6, dtype=torch.int64)},
            "np": np.arange(4, dtype=np.float32), "step": 10, "names": ["x", "y"]}


def _target() -> dict:
    return {"model": {"a": torch.full((3, 4), -1.0), "b": torch.zeros(5, dtype=torch.bfloat16),
                      "c": torch.full((6,), -7, dtype=torch.int64)},
            "np": np.full(4, -2.0, dtype=np.float32), "step": 0, "names": ["old"]}


def _damage_chunk(ckpt: Path, array: str) -> None:
    """Flip a byte of the (one, uncompressed) chunk of an array: caught by its crc32c, after it was read."""
    chunks = [p for p in (ckpt / array).iterdir() if p.is_file() and (p.name == "c" or p.name.startswith("c."))]
    raw = bytearray(chunks[0].read_bytes())
    raw[1] ^= 0x40
    chunks[0].write_bytes(bytes(raw))


def _snapshot(state: dict) -> dict:
    return {"a": state["model"]["a"].clone(), "b": state["model"]["b"].clone(), "c": state["model"]["c"].clone(),
            "np": state["np"].copy(), "step": state["step"], "names": list(state["names"])}


def _same_bytes(state: dict, snapshot: dict) -> bool:
    return (all(state["model"][k].view(torch.uint8).tolist() == snapshot[k].view(torch.uint8).tolist() for k in "abc")
            and state["np"].tobytes() == snapshot["np"].tobytes()
            and state["step"] == snapshot["step"] and state["names"] == snapshot["names"])


def test_failed_load_names_the_keys_it_may_have_overwritten(ckpt: Path) -> None:
    arrayckpt.save(_saved_state(), ckpt)
    _damage_chunk(ckpt, "model/a")
    target = _target()
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'model\.a'.*not loaded as a whole: 4 tensor\(s\) read "
                       r"in place .*'model\.a', 'model\.b', 'model\.c', 'np'.*atomic=True") as info:
        arrayckpt.load(target, ckpt)
    assert info.value.overwritten_keys == ["model.a", "model.b", "model.c", "np"]
    assert target["step"] == 0 and target["names"] == ["old"]  # plain values are replaced only after every read


@pytest.mark.parametrize("damaged", ["model/a", "model/b", "np"])
def test_failed_atomic_load_leaves_the_state_exactly_as_it_was(ckpt: Path, damaged: str) -> None:
    arrayckpt.save(_saved_state(), ckpt)
    _damage_chunk(ckpt, damaged)
    target = _target()
    before = _snapshot(target)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=repr(damaged.replace("/", "."))) as info:
        arrayckpt.load(target, ckpt, atomic=True)
    assert info.value.overwritten_keys == [] and "not loaded as a whole" not in str(info.value)
    assert _same_bytes(target, before)


def test_atomic_load_equals_a_normal_one(ckpt: Path) -> None:
    arrayckpt.save(_saved_state(), ckpt)
    normal, atomic = _target(), _target()
    assert arrayckpt.load(normal, ckpt) == arrayckpt.load(atomic, ckpt, atomic=True)
    assert _same_bytes(atomic, _snapshot(normal)) and _same_bytes(atomic, _snapshot(_saved_state()))
    transposed = torch.zeros(4, 3).t()  # a non-contiguous target is filled through its strides
    arrayckpt.load({"model": {"a": transposed}}, ckpt, strict=False, atomic=True)
    assert torch.equal(transposed, torch.arange(12.0).reshape(3, 4))


def test_manager_restore_passes_atomic_through(tmp_path: Path) -> None:
    manager = arrayckpt.CheckpointManager(tmp_path)
    manager.save(1, _saved_state())
    _damage_chunk(Path(manager.path(1)), "model/c")
    target = _target()
    before = _snapshot(target)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'model\.c'"):
        manager.restore(target, atomic=True)
    assert _same_bytes(target, before)


# --- item 14: targets that cannot hold what is loaded are refused -----------------------------------------------


def test_meta_device_target_is_refused(ckpt: Path) -> None:
    arrayckpt.save({"w": torch.ones(2, 3)}, ckpt)
    with pytest.raises(arrayckpt.StateError, match=r"'w' is on the meta device .*materialised tensor"):
        arrayckpt.load({"w": torch.empty(2, 3, device="meta")}, ckpt)
    module = torch.nn.Linear(3, 2, device="meta")
    arrayckpt.save({"m": torch.nn.Linear(3, 2)}, ckpt, overwrite=True)
    with pytest.raises(arrayckpt.StateError, match=r"'m\.weight' is on the meta device"):
        arrayckpt.load({"m": module}, ckpt)


@pytest.mark.parametrize("make", [lambda: torch.zeros(4).expand(3, 4), lambda: torch.zeros(1, 4).expand(3, 4),
                                  lambda: torch.zeros(8).as_strided((3, 4), (2, 1))],
                         ids=["expand", "expand-row", "as_strided"])
def test_target_whose_elements_share_memory_is_refused(ckpt: Path, make) -> None:
    arrayckpt.save({"w": torch.arange(12.0).reshape(3, 4), "step": 1}, ckpt)
    target = {"w": make(), "step": 0}
    with pytest.raises(arrayckpt.StateError, match=r"'w' .*sharing memory.*\.contiguous\(\) or \.clone\(\)"):
        arrayckpt.load(target, ckpt)
    assert target["step"] == 0 and not target["w"].any()  # refused before anything was read
    with pytest.raises(arrayckpt.StateError, match=r"'w' .*sharing memory"):
        arrayckpt.open(ckpt)["w"].read_into(make())


def test_overlapping_numpy_target_is_refused(ckpt: Path) -> None:
    arrayckpt.save({"w": np.arange(6, dtype=np.float32)}, ckpt)
    base = np.zeros(4, dtype=np.float32)
    overlapping = np.lib.stride_tricks.as_strided(base, shape=(6,), strides=(0,), writeable=True)
    with pytest.raises(arrayckpt.StateError, match=r"'w' .*sharing memory.*\.copy\(\)"):
        arrayckpt.load({"w": overlapping}, ckpt)


# --- item 12: converting a damaged checkpoint to DCP raises our error and leaves nothing behind --------------------


def test_convert_to_dcp_of_a_damaged_checkpoint_leaves_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    arrayckpt.save(_saved_state(), ckpt)
    arrayckpt.convert(ckpt, tmp_path / "good", to_format="dcp")
    _damage_chunk(ckpt, "model/b")
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'model\.b'.*checksum"):
        arrayckpt.convert(ckpt, tmp_path / "dcp", to_format="dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "good"]  # no output, no temporary directory
    before = {p.name: p.read_bytes() for p in (tmp_path / "good").iterdir()}
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'model\.b'"):
        arrayckpt.convert(ckpt, tmp_path / "good", to_format="dcp", overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "good").iterdir()} == before  # the old output is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "good"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_to_dcp_over_an_existing_output_replaces_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    arrayckpt.save({"w": torch.ones(3)}, tmp_path / "one")
    arrayckpt.save({"w": torch.full((3,), 2.0)}, tmp_path / "two")
    (tmp_path / "out").mkdir()  # an empty directory is taken over
    arrayckpt.convert(tmp_path / "one", tmp_path / "out", to_format="dcp")
    (tmp_path / "out" / "notes.txt").write_text("mine")
    arrayckpt.convert(tmp_path / "two", tmp_path / "out", to_format="dcp", overwrite=True)
    target = {"w": torch.zeros(3)}
    dcp.load(target, checkpoint_id=tmp_path / "out", no_dist=True)
    assert torch.equal(target["w"], torch.full((3,), 2.0)) and (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "out", "two"]
