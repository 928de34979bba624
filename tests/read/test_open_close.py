"""An open checkpoint is closed deterministically: ``with arrayckpt.open(path) as ckpt:`` or ``ckpt.close()``.

Closing releases what it holds (on a local directory the descriptor pinning the directory, with the pin's entry in
``_io/smallfiles.py``; the bases a delta opened); it is idempotent; afterwards every read of data raises
``ClosedCheckpointError`` naming the checkpoint, while what is in memory (keys, shapes, manifest, plain values)
stays readable. A checkpoint dropped unclosed releases its pin when collected, with a ``ResourceWarning``.
"""

from __future__ import annotations

import gc
import json
import os
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import write_root
from policies import SHARDED

import arrayckpt
from arrayckpt import ClosedCheckpointError
from arrayckpt._io import smallfiles
from arrayckpt._io.arrays import ArrayIO, read_into
from arrayckpt._io.staged import source_of
from arrayckpt._read.checkpoint import stored_of

CLOSED = "the checkpoint was closed"
PINS_FDS = os.path.isdir("/proc/self/fd")  # local directories are pinned by descriptor on Linux only


def _state() -> dict[str, Any]:
    return {"w": torch.arange(24.0).reshape(6, 4), "r": arrayckpt.PerRank(torch.ones(3)), "obj": {1, 2},
            "step": 7}


@pytest.fixture(params=["local", "memory", "local-packed", "memory-packed"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A saved checkpoint: a local directory, or ``memory://`` (object storage); one file per chunk, or packed (spec
    §16: its arrays are read through chunk files staged in memory, ``_io/staged.py``)."""
    local = request.param.startswith("local")
    path = str(tmp_path / "ckpt") if local else f"memory://openclose-{uuid.uuid4().hex[:8]}/ckpt"
    arrayckpt.save(_state(), path, step=7, allow_pickle=True, packed=request.param.endswith("-packed"))
    return path


def _open_fds(under: Path | None = None) -> int:
    """Descriptors open now (only those of directories below ``under``, if given: TensorStore may close a chunk
    file it has just read a millisecond after the read returns, on its own thread)."""
    if under is None:
        return len(os.listdir("/proc/self/fd"))
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith(str(under)) and os.path.isdir(target)
    return count


def _pins() -> dict[str, str]:
    """The directories pinned now, once checkpoints dropped unclosed (``save`` opens its base) are collected."""
    gc.collect()
    return dict(smallfiles._PINS)


@pytest.mark.skipif(not PINS_FDS, reason="local directories are pinned by descriptor on Linux only")
def test_with_releases_the_pin(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    arrayckpt.save(_state(), path, allow_pickle=True)
    pins, fds = _pins(), _open_fds(tmp_path)
    with arrayckpt.open(path) as ckpt:
        assert str(path) in smallfiles._PINS.values() and _open_fds(tmp_path) == fds + 1
        assert ckpt["w"][1].tolist() == [4.0, 5.0, 6.0, 7.0]
        assert not ckpt.closed
    assert ckpt.closed
    assert smallfiles._PINS == pins and _open_fds(tmp_path) == fds


def test_enter_returns_the_checkpoint_and_close_twice_is_fine(where: str) -> None:
    ckpt = arrayckpt.open(where)
    with ckpt as entered:
        assert entered is ckpt
    ckpt.close()
    ckpt.close()
    assert ckpt.closed and "closed" in repr(ckpt)


READS: dict[str, Callable[[arrayckpt.Checkpoint], object]] = {
    "slice": lambda c: c["w"][1:3],
    "int": lambda c: c["w"][0, 1],
    "fancy": lambda c: c["w"][[0, 2]],
    "numpy": lambda c: c["w"].numpy(),
    "asarray": lambda c: np.asarray(c["w"]),
    "torch": lambda c: c["w"].torch(),
    "read_into": lambda c: c["w"].read_into(torch.empty(6, 4)),
    "spec": lambda c: c["w"].spec if stored_of(c).packed is None else c["w"].numpy(),  # (packed: no spec)
    "per_rank": lambda c: c.per_rank("r"),
    "pickled": lambda c: c.plain_values["obj"],
    "pickle_bytes": lambda c: stored_of(c).pickle_bytes("obj"),
}


@pytest.mark.parametrize("read", READS)
def test_reads_after_close_fail_naming_the_checkpoint(where: str, read: str) -> None:
    with arrayckpt.open(where, allow_pickle=True) as ckpt:
        READS[read](ckpt)  # works while open (and keeps what it caches: an open array handle, a spec)
        array = ckpt["w"]
    with pytest.raises(ClosedCheckpointError, match=f"{where}: {CLOSED}"):
        READS[read](ckpt)
    with pytest.raises(arrayckpt.ArrayckptError, match=CLOSED):  # a LazyArray kept past the close too
        array[0]
    assert issubclass(ClosedCheckpointError, ValueError)  # as I/O on a closed Python file


def test_a_packed_array_read_past_its_collected_checkpoint_fails_naming_it(tmp_path: Path) -> None:
    """A packed array's spec names its chunk source by a token held weakly (``_io/staged.py``): a spec kept past
    its checkpoint's close and collection is read as a closed checkpoint's, naming the array."""
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.ones(3)}, path, packed=True)
    with arrayckpt.open(path) as ckpt:
        spec, context = stored_of(ckpt).read_spec("w"), stored_of(ckpt).read_context
        assert source_of(spec) is not None
    del ckpt
    gc.collect()
    with pytest.raises(ClosedCheckpointError, match=f"array 'w': {CLOSED}"):
        read_into([ArrayIO("w", spec, np.empty(3, np.float32))], context, str(path))


def test_a_packed_array_has_no_spec_of_its_own_to_open(tmp_path: Path) -> None:
    """A packed array's chunks are byte ranges of packs: ``.spec`` is refused in one line that says how to read it,
    rather than handing out a memory kvstore spec that TensorStore would open empty."""
    arrayckpt.save({"w": torch.ones(3)}, tmp_path / "ckpt", packed=True)
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        with pytest.raises(TypeError, match=r"tensor 'w' is stored in the checkpoint's packs.*refs\.json"):
            _ = ckpt["w"].spec
        assert ckpt["w"].numpy().tolist() == [1.0, 1.0, 1.0]
    arrayckpt.save({"w": torch.ones(3)}, tmp_path / "files", packed=False)
    with arrayckpt.open(tmp_path / "files") as ckpt:
        assert ckpt["w"].spec["kvstore"]["driver"] == "file"


def test_metadata_stays_readable_after_close(where: str) -> None:
    with arrayckpt.open(where) as ckpt:
        pass
    assert sorted(ckpt) == ["w"] and ckpt["w"].shape == (6, 4) and ckpt["w"].numpy_dtype == np.float32
    assert ckpt.step == 7 and ckpt.manifest.step == 7 and ckpt.plain_values["step"] == 7
    assert len(ckpt) == 1 and ckpt.nbytes == 96 and "w" in stored_of(ckpt).nodes


def test_an_exception_inside_with_still_closes(where: str) -> None:
    pins = _pins()
    with pytest.raises(RuntimeError, match="boom"), arrayckpt.open(where) as ckpt:
        ckpt["w"][0]
        raise RuntimeError("boom")
    assert ckpt.closed and smallfiles._PINS == pins


def _chain(tmp_path: Path) -> list[Path]:
    """Three checkpoints, each a delta of the one before (a chunks delta of ``w``, a rows delta of ``e``)."""
    w, e = torch.zeros(64, 8), torch.zeros(100, 4)
    paths = [tmp_path / f"s{i}" for i in range(3)]
    for i, path in enumerate(paths):
        w[i * 20] += 1
        e[i] += 1
        delta = {"base": paths[i - 1], "quantize": {"e": 8}} if i else {}  # quantized: stored as rows
        SHARDED.save({"w": w, "e": e}, path, **delta)
    return paths


def test_closing_a_delta_closes_the_bases_it_opened(tmp_path: Path) -> None:
    paths = _chain(tmp_path)
    pins = _pins()
    with arrayckpt.open(paths[2]) as ckpt:
        modes = {key: entry.delta.mode for key, entry in ckpt.manifest.entries.items() if entry.delta is not None}
        assert modes == {"w": "chunks", "e": "rows"}
        assert ckpt["w"][40].sum() == 8 and ckpt["e"][:3].sum() == pytest.approx(12, abs=0.1)  # through the bases
        chain = ckpt.chain()
        assert len(chain) == 3
        if PINS_FDS:
            assert sorted(smallfiles._PINS.values()) == sorted([*pins.values(), *map(str, paths)])
    assert all(layer.closed for layer in chain)
    assert smallfiles._PINS == pins
    with pytest.raises(ClosedCheckpointError, match=f"{paths[2]}: {CLOSED}"):
        ckpt.base  # noqa: B018 - opening a base after close is a read too
    with pytest.raises(ClosedCheckpointError, match=f"{paths[2]}: {CLOSED}"):
        ckpt["e"][0]
    with pytest.raises(ClosedCheckpointError, match=f"{paths[1]}: {CLOSED}"):
        chain[1]["w"][0]


def test_a_delta_never_read_through_opens_no_base_and_closes(tmp_path: Path) -> None:
    paths = _chain(tmp_path)
    pins = _pins()
    with arrayckpt.open(paths[2]) as ckpt:
        assert "base" not in stored_of(ckpt).__dict__
    assert smallfiles._PINS == pins


def _collected(open_it: Callable[[], object]) -> list[warnings.WarningMessage]:
    """The ResourceWarnings raised when what ``open_it`` returns is dropped."""
    gc.collect()  # checkpoints other code dropped before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        held = open_it()
        del held
        gc.collect()
    return [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_an_unclosed_checkpoint_is_released_when_collected_with_a_resource_warning(tmp_path: Path) -> None:
    paths = _chain(tmp_path)
    pins = _pins()

    def read_through_the_chain() -> arrayckpt.Checkpoint:
        ckpt = arrayckpt.open(paths[2])
        ckpt["e"][0]
        return ckpt

    caught = [w for w in _collected(read_through_the_chain) if str(tmp_path) in str(w.message)]
    assert [str(w.message).split(":")[0] for w in caught] == [str(paths[2])]  # once, for the one opened
    assert "never closed" in str(caught[0].message)
    assert smallfiles._PINS == pins


def test_a_closed_checkpoint_is_collected_quietly(where: str) -> None:
    def opened_and_closed() -> arrayckpt.Checkpoint:
        with arrayckpt.open(where) as ckpt:
            return ckpt

    assert [w for w in _collected(opened_and_closed) if where in str(w.message)] == []


@pytest.mark.skipif(not PINS_FDS, reason="local directories are pinned by descriptor on Linux only")
def test_a_failed_open_holds_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.ones(3)}, path)
    document = json.loads((path / "zarr.json").read_text())
    document["consolidated_metadata"]["metadata"]["w"]["shape"] = [7]  # damaged after the pin is taken
    write_root(path, document)  # resealed: the shape check, after the pin is taken, refuses it
    pins, fds = _pins(), _open_fds(tmp_path)
    with pytest.raises(arrayckpt.FormatError, match="shape"):
        arrayckpt.open(path)
    gc.collect()
    assert smallfiles._PINS == pins and _open_fds(tmp_path) == fds


def test_a_replaced_base_is_released_at_once(tmp_path: Path) -> None:
    w = torch.zeros(64, 8)
    arrayckpt.save({"w": w}, tmp_path / "a")
    w[3] = 1
    arrayckpt.save({"w": w}, tmp_path / "b", base=tmp_path / "a")  # a rows delta: reads row 0 from "a"
    arrayckpt.save({"w": w}, tmp_path / "a", overwrite=True)
    pins = _pins()
    with arrayckpt.open(tmp_path / "b") as ckpt:
        with pytest.raises(arrayckpt.CorruptCheckpointError, match="not the checkpoint it was saved against"):
            ckpt["w"][0]
        base_pin = next(p for p, v in smallfiles._PINS.items() if v.endswith("/b"))
        assert smallfiles._PINS.keys() - pins.keys() == {base_pin}
    assert smallfiles._PINS == pins
