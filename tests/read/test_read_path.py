"""Every read of a checkpoint's data goes through one read path (``_read/reader.py``), which refuses a checkpoint
(or a base read through) replaced while it was being read.

On object storage nothing pins a checkpoint for reading: an overwrite can replace its chunks under an open
handle. The first overwrite writes the other generation's chunk keys (the handle's chunks are then gone); a
second one writes the handle's chunk keys again, with other bytes: only the check after the read can tell. Both
are refused by every reader, ``compact`` and ``verify`` included, with an error that says the checkpoint was
replaced (``ReplacedCheckpointError``, a ``CorruptCheckpointError``), and ``compact`` commits nothing then.
"""

from __future__ import annotations

import ast
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import arrayckpt
from arrayckpt._read.stored import StoredCheckpoint

REPLACED = "was replaced"


def _url(name: str = "ckpt") -> str:
    return f"memory://readpath-{uuid.uuid4().hex[:8]}/{name}"


def _urls(*names: str) -> list[str]:
    """Locations side by side in one fresh ``memory://`` bucket."""
    bucket = f"memory://readpath-{uuid.uuid4().hex[:8]}"
    return [f"{bucket}/{name}" for name in names]


def _state(k: int) -> dict[str, Any]:
    """State ``k``: every element of every array is ``k``."""
    return {"w": torch.full((64, 8), float(k)), "b": torch.full((17,), k, dtype=torch.int32),
            "n": np.full((5, 3), k, np.int16), "r": arrayckpt.PerRank(torch.full((4,), float(k))),
            "obj": {k, -1}, "step": k}  # a set: pickled


def _save(k: int, url: str, **kwargs: Any) -> None:
    arrayckpt.save(_state(k), url, allow_pickle=True, **kwargs)


def _overwrite(url: str, times: int, first: int = 2) -> None:
    for k in range(first, first + times):
        _save(k, url, overwrite=True)


# --- compact ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("times", [1, 2])
def test_compact_refuses_a_source_replaced_before_it_reads(tmp_path: Path, times: int) -> None:
    url = _url()
    _save(1, url)
    opened = arrayckpt.open(url, allow_pickle=True)
    _overwrite(url, times)  # twice: the handle's chunk keys hold the third save's bytes, and every read succeeds
    dst = tmp_path / "full"
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=REPLACED):
        arrayckpt.compact(opened, dst)
    assert not dst.exists()  # nothing committed (nor left behind)
    with pytest.raises(arrayckpt.CheckpointNotFoundError):
        arrayckpt.open(dst)


@pytest.mark.parametrize("times", [1, 2])
def test_compact_refuses_a_source_replaced_between_its_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               times: int, tuned) -> None:
    tuned(compact_batch_bytes=1)  # one array per batch
    url = _url()
    _save(1, url)
    overwritten: list[int] = []

    def overwrite_once(done: int, total: int) -> None:
        if not overwritten:
            overwritten.append(done)
            _overwrite(url, times)

    dst = tmp_path / "full"
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=REPLACED):
        arrayckpt.compact(url, dst, progress=overwrite_once)
    assert overwritten and not dst.exists()


def test_compact_of_a_delta_whose_base_is_replaced_meanwhile(tmp_path: Path) -> None:
    base, delta = _urls("base", "delta")  # one bucket: a base beside its delta is followed (spec §10.1)
    _save(1, base)
    state = _state(1)
    state["w"][3] = -1.0
    arrayckpt.save(state, delta, base=base, allow_pickle=True)
    opened = arrayckpt.open(delta, allow_pickle=True)
    assert [str(c.location) for c in opened.chain()] == [delta, base]  # the base is open
    _overwrite(base, 2)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=REPLACED):
        arrayckpt.compact(opened, tmp_path / "full")
    assert not (tmp_path / "full").exists()


def test_compact_of_an_unchanged_object_storage_chain_still_works(tmp_path: Path) -> None:
    base, delta = _urls("base", "delta")  # one bucket: a base beside its delta is followed (spec §10.1)
    _save(1, base)
    state = _state(1)
    state["w"][3] = -1.0
    arrayckpt.save(state, delta, base=base, allow_pickle=True)
    arrayckpt.compact(delta, tmp_path / "full")
    full = arrayckpt.open(tmp_path / "full", allow_pickle=True)
    assert torch.equal(full["w"].torch(), state["w"]) and full.plain_values["obj"] == {1, -1}
    assert torch.equal(full.per_rank("r")[0], state["r"].value)


# --- every read through an open handle ------------------------------------------------------------------------


def _reads(tmp_path: Path) -> dict[str, Callable[[arrayckpt.Checkpoint], Any]]:
    return {
        "slice": lambda c: c["w"][1:3],
        "strided slice": lambda c: c["w"][::7, 1],
        "element": lambda c: c["b"][2],
        "numpy": lambda c: c["n"].numpy(),
        "__array__": lambda c: np.asarray(c["w"]),
        "torch": lambda c: c["w"].torch(),
        "read_into": lambda c: c["b"].read_into(torch.empty(17, dtype=torch.int32)),
        "per_rank": lambda c: c.per_rank("r"),
        "pickled value": lambda c: c.plain_values["obj"],
        "show": lambda c: arrayckpt.show(c, "w", "0:4"),
        "compact": lambda c: arrayckpt.compact(c, tmp_path / "compacted", overwrite=True),
    }


@pytest.mark.parametrize("times", [1, 2])
@pytest.mark.parametrize("how", list(_reads(Path())))
def test_every_read_of_a_replaced_checkpoint_is_refused(tmp_path: Path, how: str, times: int) -> None:
    url = _url()
    _save(1, url)
    handle = arrayckpt.open(url, allow_pickle=True)
    read = _reads(tmp_path)[how]
    read(handle)  # fine before the overwrite
    _overwrite(url, times)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=REPLACED):
        read(handle)
    fresh = arrayckpt.open(url, allow_pickle=True)  # opened afresh: the last save, whole
    assert np.all(fresh["w"].numpy() == times + 1) and fresh.plain_values["obj"] == {times + 1, -1}


@pytest.mark.parametrize("how", ["slice", "torch", "load"])
def test_a_delta_read_through_a_base_replaced_mid_read_is_refused(how: str) -> None:
    base, delta = _urls("base", "delta")  # one bucket: a base beside its delta is followed (spec §10.1)
    _save(1, base)
    state = _state(1)
    state["w"][3] = -1.0  # a rows delta: the rest of w is read from the base
    arrayckpt.save(state, delta, base=base, allow_pickle=True)
    assert arrayckpt.open(delta).manifest.entries["w"].delta is not None
    handle = arrayckpt.open(delta, allow_pickle=True)
    assert [str(c.location) for c in handle.chain()] == [delta, base]  # both opened: the base was the right one
    if how == "load":  # load opens its own handle: replace the base between that open and its reads
        import arrayckpt._read.load as load_module

        real = load_module._load

        def replace_base_then_read(state: Any, opened: StoredCheckpoint, *args: Any, **kwargs: Any) -> Any:
            opened.base  # noqa: B018 - the chain is open (its base pinned/identified) before the base is replaced
            _overwrite(base, 2)
            return real(state, opened, *args, **kwargs)

        target = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in _state(0).items()}
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(load_module, "_load", replace_base_then_read)
            with pytest.raises(arrayckpt.CorruptCheckpointError, match=REPLACED):
                arrayckpt.load(target, delta, allow_pickle=True)
        return
    _overwrite(base, 2)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=REPLACED):
        handle["w"][2:5] if how == "slice" else handle["w"].torch()


def test_verify_raises_for_a_checkpoint_replaced_while_it_is_verified() -> None:
    """Not damage (the report would describe a mix of two checkpoints): raised, like unreachable storage."""
    url = _url()
    _save(1, url)
    overwritten: list[bool] = []

    def overwrite_once(done: int, total: int) -> None:
        if not overwritten:
            overwritten.append(True)
            _overwrite(url, 2)

    with pytest.raises(arrayckpt.CorruptCheckpointError, match=REPLACED):
        arrayckpt.verify(url, batch_bytes=1, progress=overwrite_once)
    assert overwritten
    assert arrayckpt.verify(url).ok  # the checkpoint there now is whole


# --- one read path ---------------------------------------------------------------------------------------------

PACKAGE = Path(arrayckpt.__file__).parent
# the read path: its reads, the overlays it runs, and load's read-once ``execute`` hook that it calls
READ_PATH = {"_read/reader.py", "_read/chain.py", "_read/load.py"}


def test_array_data_is_read_only_by_the_read_path() -> None:
    """Only the read path imports what reads array data (``_io.arrays.read_into``, ``open_array``): every other
    module reads through ``_read/reader.read``, so its replaced-checkpoint checks cover every read."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("_io/") or relative in READ_PATH:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_io.arrays"):
                names = [a.name for a in node.names if a.name in ("read_into", "open_array")]
                if names:
                    found.append(f"{relative}:{node.lineno}: imports {names}")
    assert not found, "read through _read/reader.py instead:\n" + "\n".join(found)


def test_no_module_outside_the_read_layer_uses_checkpoint_internals(tmp_path: Path) -> None:
    from arrayckpt._read.checkpoint import Checkpoint

    arrayckpt.save({"w": torch.ones(2)}, tmp_path / "c")
    opened = arrayckpt.open(tmp_path / "c")
    private = {n for n in [*dir(Checkpoint), *vars(opened)] if n.startswith("_") and not n.startswith("__")}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("_read/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{relative}:{node.lineno}: .{node.attr}")
    assert not found, "use Checkpoint's internal interface (public names) instead:\n" + "\n".join(found)
