"""A reader during a save sees the old or the new checkpoint, never a mix.

A writer thread overwrites one checkpoint again and again (``save(..., overwrite=True)``) with states that say
which save they come from: every element of every tensor of state ``k``, and its plain value ``step``, is
``k``. Meanwhile readers (threads; for a local path also another process) read it in a loop: every tensor,
slice by slice, through one ``open`` handle kept for several rounds, and ``load`` in place. Every read must give
one whole state (every element of every tensor read through one handle, or filled by one ``load``, from the
same save) or fail cleanly with ``CorruptCheckpointError`` saying that the checkpoint was replaced while it was
being read. A path that is being overwritten always holds a committed checkpoint, so "no checkpoint here" and
"incomplete checkpoint" are wrong answers, as is any foreign exception. Each race runs until both outcomes
have been seen (and several different saves read), which takes a second or two, or fails after a deadline.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from policies import WHOLE, Chunking, small_chunks

import arrayckpt
import arrayckpt._storage.local as storage

KEYS = ("model.w", "model.b", "bf", "count")
DEADLINE_S = 40.0  # a race that has not shown both outcomes by then fails
ENOUGH = {"whole": 200, "refused": 20, "saves seen": 10}  # a race ends once it has seen this much (1-3 s)
ENOUGH_S3 = {"whole": 30, "refused": 3, "saves seen": 3}  # moto answers in ms, not us: about 5 s


def _state(k: int) -> dict:
    """State ``k``: every element is ``k`` (bfloat16 holds integers exactly only up to 256: ``k % 256`` there)."""
    return {"model": {"w": torch.full((48, 16), float(k)), "b": torch.full((33, 7), k, dtype=torch.int32)},
            "bf": torch.full((6, 5), k % 256, dtype=torch.bfloat16), "count": torch.tensor(k), "step": k}


def _expected(key: str, k: int) -> int:
    return k % 256 if key == "bf" else k


def _zeros() -> dict:
    state = _state(0)
    state["step"] = -1
    return state


@dataclass
class Tally:
    """What the readers saw: whole reads, clean refusals, the saves they came from, and everything wrong."""

    whole: int = 0
    refused: int = 0
    seen: set[int] = field(default_factory=set)
    mixed: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    goal: dict[str, int] = field(default_factory=lambda: dict(ENOUGH))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def enough(self) -> bool:
        return (self.whole >= self.goal["whole"] and self.refused >= self.goal["refused"]
                and len(self.seen) >= self.goal["saves seen"])

    def to_dict(self) -> dict[str, Any]:
        return {"whole": self.whole, "refused": self.refused, "seen": sorted(self.seen), "mixed": self.mixed,
                "unexpected": self.unexpected}


def _check(values: dict[str, np.ndarray], step: Any, tally: Tally, how: str) -> None:
    """Record one read: whole (every tensor uniform and from save ``step``) or mixed."""
    found = {key: sorted({float(v) for v in np.unique(np.asarray(array, dtype=np.float64))})
             for key, array in values.items()}
    whole = isinstance(step, int) and all(found[key] == [_expected(key, step)] for key in KEYS)
    with tally.lock:
        if whole:
            tally.whole += 1
            tally.seen.add(step)
        else:
            tally.mixed.append(f"{how}: step {step!r}, values {found}")


def _read_sliced(array: arrayckpt.LazyArray) -> np.ndarray:
    """The whole tensor, read as two slices (two reads through the handle) where it has rows."""
    if not array.shape:
        return np.asarray(array[()])
    half = array.shape[0] // 2
    return np.concatenate([array[:half], array[half:]])


def read_loop(url: str, options: dict | None, done: Callable[[], bool], tally: Tally, reuse: int = 3) -> None:
    """Read the checkpoint at ``url`` until ``done()``: three rounds of every tensor through one handle, then a
    ``load``, over and over; record every outcome in ``tally``."""
    handle: arrayckpt.Checkpoint | None = None
    rounds = 0
    while not done():
        rounds += 1
        how = "load" if rounds % (reuse + 1) == 0 else "open"
        try:
            if how == "load":
                target = _zeros()
                arrayckpt.load(target, url, storage_options=options)
                step = target["step"]
                values = {"model.w": target["model"]["w"], "model.b": target["model"]["b"],
                          "bf": target["bf"].float(), "count": target["count"]}
                values = {k: v.numpy() for k, v in values.items()}
            else:
                if handle is None:
                    handle = arrayckpt.open(url, storage_options=options)
                step = handle.plain_values["step"]
                values = {key: _read_sliced(handle[key]) for key in KEYS}
        except arrayckpt.CorruptCheckpointError as e:
            handle = None
            with tally.lock:
                if "was replaced" in str(e):
                    tally.refused += 1
                else:
                    tally.unexpected.append(f"{how}: {type(e).__name__}: {e}")
            continue
        except Exception as e:  # NotFound/Incomplete included: the path always holds a committed checkpoint
            handle = None
            with tally.lock:
                tally.unexpected.append(f"{how}: {type(e).__name__}: {e}")
            continue
        _check(values, step, tally, how)
        if how == "load":
            handle = None  # a fresh handle after each load


class Writer(threading.Thread):
    """Overwrites the checkpoint with state 1, 2, 3, ... until stopped (it has saved state 0 first), pausing
    up to ``pause_s`` (at random) between saves so that slow readers also get whole reads."""

    def __init__(self, url: str, options: dict | None, pause_s: float = 0.0, chunking: Chunking = WHOLE):
        super().__init__(name="overwriter", daemon=True)
        self.url, self.options, self.pause_s, self.chunking = url, options, pause_s, chunking
        self._rng = random.Random(0)
        self.saves = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        chunking.save(_state(0), url, storage_options=options)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.saves += 1
                self.chunking.save(_state(self.saves), self.url, storage_options=self.options, overwrite=True)
                if self.pause_s:
                    self.stop.wait(self._rng.uniform(0, self.pause_s))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def _race(url: str, options: dict | None, readers: int = 2, pause_s: float = 0.0,
          goal: dict[str, int] = ENOUGH, chunking: Chunking = WHOLE) -> tuple[Tally, Writer]:
    tally = Tally(goal=dict(goal))
    writer = Writer(url, options, pause_s, chunking)
    deadline = time.monotonic() + DEADLINE_S

    def done() -> bool:
        return (tally.enough() or time.monotonic() > deadline or writer.error is not None or bool(tally.mixed)
                or bool(tally.unexpected))

    threads = [threading.Thread(target=read_loop, args=(url, options, done, tally), daemon=True)
               for _ in range(readers)]
    writer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S + 60)
    writer.stop.set()
    writer.join(60)
    return tally, writer


def _assert_race(tally: Tally, writer: Writer) -> None:
    assert writer.error is None, repr(writer.error)
    assert not tally.mixed, tally.mixed[:3]
    assert not tally.unexpected, tally.unexpected[:3]
    assert tally.enough(), f"the race did not show both outcomes in {DEADLINE_S} s: {tally.to_dict()}, " \
                           f"{writer.saves} saves"


@pytest.mark.slow
def test_local_readers_see_one_whole_checkpoint(tmp_path: Path, chunking: Chunking) -> None:
    tally, writer = _race(str(tmp_path / "ckpt"), None, chunking=chunking)
    _assert_race(tally, writer)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # every overwrite cleaned up after itself


@pytest.mark.slow
def test_memory_store_readers_see_one_whole_checkpoint(chunking: Chunking) -> None:
    tally, writer = _race(f"memory://race/{uuid.uuid4().hex[:8]}", None, pause_s=0.02, chunking=chunking)
    _assert_race(tally, writer)


@pytest.mark.slow
def test_s3_readers_see_one_whole_checkpoint(s3_server: Any, s3_bucket: str) -> None:
    tally, writer = _race(f"s3://{s3_bucket}/ckpt", {"endpoint_url": s3_server.endpoint, "max_retries": 3},
                          pause_s=0.3, goal=ENOUGH_S3, chunking=small_chunks(64, 256))
    _assert_race(tally, writer)


# --- a reader in another process ----------------------------------------------------------------------------

_CHILD = """
import json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]  # this file's directory, and tests/ for its helpers
import test_concurrency as race
tally, deadline = race.Tally(), time.monotonic() + float(sys.argv[3])
print("ready", flush=True)
race.read_loop(sys.argv[2], None, lambda: tally.enough() or bool(tally.mixed) or time.monotonic() > deadline, tally)
print(json.dumps(tally.to_dict()), flush=True)
"""


@pytest.mark.slow
def test_local_reader_process_sees_one_whole_checkpoint(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    writer = Writer(url, None, chunking=small_chunks(64, 256))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(Path(__file__).parent), url, str(DEADLINE_S)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.stderr else ""
        writer.start()  # once the reader is up: torch's import takes longer than the race
        out, err = child.communicate(timeout=DEADLINE_S + 60)
    finally:
        writer.stop.set()
        writer.join(60)
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert writer.error is None, repr(writer.error)
    assert not seen["mixed"] and not seen["unexpected"], seen
    assert seen["whole"] >= ENOUGH["whole"] and seen["refused"] >= ENOUGH["refused"], seen
    assert len(seen["seen"]) >= ENOUGH["saves seen"], seen


# --- the two windows of a local overwrite, made deterministic -----------------------------------------------


def test_open_overtaken_between_pinning_and_reading_the_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An overwrite that swaps the directory out of the path (and deletes it) after ``open`` pinned it but
    before it read the root document: ``open`` takes the new checkpoint, it is not "incomplete"."""
    path = tmp_path / "ckpt"
    arrayckpt.save(_state(1), path)
    real = storage.pin_directory
    overwritten: list[bool] = []

    def pin_then_overwrite(target: Path) -> tuple[str, Callable[[], None]]:
        pinned = real(target)
        if not overwritten:
            overwritten.append(True)
            arrayckpt.save(_state(2), path, overwrite=True)
        return pinned

    monkeypatch.setattr(storage, "pin_directory", pin_then_overwrite)
    opened = arrayckpt.open(path)
    assert overwritten and opened.plain_values["step"] == 2
    assert torch.equal(opened["model.w"].torch(), _state(2)["model"]["w"])


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_handle_overtaken_by_an_overwrite_says_replaced(tmp_path: Path, chunking: Chunking, where: str) -> None:
    """The deterministic version of the refusal: a handle opened before an overwrite (two on object storage,
    where the second one reuses the first one's chunk keys) reads nothing of the new state."""
    url = str(tmp_path / "ckpt") if where == "local" else f"memory://race/{uuid.uuid4().hex[:8]}"
    chunking.save(_state(1), url)
    handle = arrayckpt.open(url)
    assert np.all(handle["model.b"][:] == 1)
    for k in (2, 3):
        chunking.save(_state(k), url, overwrite=True)
    for key in KEYS:
        with pytest.raises(arrayckpt.CorruptCheckpointError, match="was replaced"):
            handle[key][...]
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="was replaced"):
        handle["model.w"].torch()
    fresh = arrayckpt.open(url)
    assert all(np.all(np.asarray(fresh[key][...], dtype=np.float64) == _expected(key, 3)) for key in KEYS)
