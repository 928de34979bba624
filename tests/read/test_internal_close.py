"""arrayckpt closes the checkpoints it opens itself, deterministically, and never one the caller passed in.

Every entry point that opens a checkpoint from a path (``load``, ``verify``, ``show``, ``diff``, ``compact``,
``convert``, an incremental ``save`` / ``async_save`` from ``base=`` a path, the manager, the command line) must
have released its pin (``_io/smallfiles.py``'s registry, and the directory descriptor) when it returns or raises,
with no garbage-collection pass: a checkpoint and its lazy arrays reference each other, so one dropped unclosed
would hold its directory until the cyclic collector runs, then warn (``ResourceWarning``). The collector is
disabled while an operation runs, so that a leak stays visible instead of being collected by chance.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import arrayckpt
from arrayckpt import cli
from arrayckpt._io import smallfiles
from arrayckpt._read.checkpoint import opened

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                                reason="local directories are pinned by descriptor on Linux only")

Op = Callable[[dict[str, Path], int], Any]  # (the chain's paths, which run: 0 warms up, 1 is measured)


def _state(scale: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.arange(64.0).reshape(16, 4) * scale, "emb": torch.zeros(32, 4)}, "step": 1}


@pytest.fixture
def chain(tmp_path: Path) -> dict[str, Path]:
    """A full checkpoint and a delta against it (``save(base=path)``: a call site under test too)."""
    paths = {"base": tmp_path / "base", "delta": tmp_path / "delta", "tmp": tmp_path}
    arrayckpt.save(_state(), paths["base"], step=1)
    changed = _state()
    changed["model"]["emb"][3] = 1.0
    arrayckpt.save(changed, paths["delta"], step=2, base=paths["base"])
    gc.collect()
    return paths


def _fds_under(root: Path) -> list[str]:
    """What the process's open descriptors name under ``root`` (a pinned checkpoint directory, a chunk file):
    precise where a count of all descriptors would also see what other threads open and close meanwhile."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor, another thread's file)
            continue
        if target.startswith(str(root)):
            out.append(target)
    return out


def _settled_fds_under(root: Path, seconds: float = 5.0) -> list[str]:
    """:func:`_fds_under` once the chunk files just read are closed: TensorStore closes a file on its own thread
    right after the read it served completed (a millisecond later), never a pinned directory."""
    deadline = time.monotonic() + seconds
    while (found := _fds_under(root)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def _never_closed(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)
            and "arrayckpt checkpoint was never closed" in str(w.message)]


def _check_releases(root: Path, op: Callable[[int], Any]) -> None:
    """``op`` leaves no pin and no descriptor open under ``root`` when it returns (no collection), and nothing
    unclosed that a collection would warn about."""
    op(0)  # a first run: the second one may hit what the first one left behind (a delta's bases, outputs)
    gc.collect()
    pins = dict(smallfiles._PINS)
    assert _settled_fds_under(root) == []
    gc.disable()  # a leak stays visible: nothing is collected by chance while the operation runs
    try:
        op(1)
        assert smallfiles._PINS == pins, f"pins left open: {set(smallfiles._PINS.values()) - set(pins.values())}"
        assert [t for t in _fds_under(root) if os.path.isdir(t)] == []  # a pinned directory: released at once
        assert _settled_fds_under(root) == []
    finally:
        gc.enable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert _never_closed(caught) == []


def _failing(error: type[BaseException], op: Op) -> Op:
    def run(paths: dict[str, Path], i: int) -> None:
        with pytest.raises(error):
            op(paths, i)
    return run


def _load(paths: dict[str, Path], i: int) -> None:
    state = _state(0.0)
    arrayckpt.load(state, paths["delta"])
    assert state["model"]["emb"][3].tolist() == [1.0] * 4


def _manager(asynchronous: bool) -> Op:
    def run(paths: dict[str, Path], i: int) -> None:
        root = paths["tmp"] / f"run-{asynchronous}-{i}"
        retention = arrayckpt.Retention(keep_last=2, keep_best=1, metric="loss")
        with arrayckpt.CheckpointManager(root, incremental=arrayckpt.Incremental(), retention=retention,
                                         asynchronous=asynchronous) as manager:
            state = _state()
            for step in range(1, 5):
                state["model"]["emb"][step] = float(step)
                manager.save(step, state, force=True, metrics={"loss": 1.0 / step})
            manager.wait()
            assert manager.restore(_state(0.0)) == 4
            with arrayckpt.open(manager.path(4)) as last:
                assert last.manifest.base is not None  # saved against the base the manager chose
    return run


def _cli(*args: str) -> Op:
    def run(paths: dict[str, Path], i: int) -> None:
        argv = [a.format(**paths, i=i) for a in args]
        assert cli.main(argv) == 0
    return run


OPS: dict[str, Op] = {
    "load": _load,
    "load-failing": _failing(arrayckpt.KeyMismatchError,
                             lambda p, i: arrayckpt.load({"missing": torch.zeros(1)}, p["delta"])),
    "verify": lambda p, i: arrayckpt.verify(p["delta"]).ok or pytest.fail("damaged"),
    "show": lambda p, i: arrayckpt.show(p["delta"], "model.emb", "2:4"),
    "diff": lambda p, i: arrayckpt.diff(p["delta"], p["base"]),
    "compact": lambda p, i: arrayckpt.compact(p["delta"], p["tmp"] / f"full-{i}"),
    "convert-safetensors": lambda p, i: arrayckpt.convert(p["delta"], p["tmp"] / f"m-{i}.safetensors"),
    "convert-torch": lambda p, i: arrayckpt.convert(p["delta"], p["tmp"] / f"m-{i}.pt"),
    "save-with-base": lambda p, i: arrayckpt.save(_state(2.0), p["tmp"] / f"d-{i}", base=p["delta"]),
    "save-with-base-failing": _failing(arrayckpt.ArrayckptError, lambda p, i: arrayckpt.save(
        {**_state(), "obj": {1, 2}}, p["tmp"] / f"d-{i}", base=p["delta"])),
    "save-onto-its-base": _failing(arrayckpt.StateError, lambda p, i: arrayckpt.save(
        _state(), p["base"], base=p["delta"], overwrite=True)),
    "async-save-with-base": lambda p, i: arrayckpt.async_save(_state(2.0), p["tmp"] / f"d-{i}",
                                                              base=p["delta"]).wait(),
    "async-save-with-base-failing-at-once": _failing(arrayckpt.ArrayckptError, lambda p, i: arrayckpt.async_save(
        {**_state(), "obj": {1, 2}}, p["tmp"] / f"d-{i}", base=p["delta"])),
    "async-save-with-base-failing-in-background": _failing(arrayckpt.ArrayckptError, lambda p, i: arrayckpt.async_save(
        _state(2.0), p["base"].parent / "delta", base=p["base"]).wait()),  # exists, no overwrite=True
    "manager": _manager(asynchronous=False),
    "manager-async": _manager(asynchronous=True),
    "cli-info": _cli("info", "{delta}"),
    "cli-info-json": _cli("info", "--json", "{delta}"),
    "cli-show": _cli("show", "{delta}", "model.emb", "0:4"),
    "cli-show-value": _cli("show", "{delta}", "step"),
    "cli-verify": _cli("verify", "{delta}"),
    "cli-compact": _cli("compact", "{delta}", "{tmp}/cli-full-{i}"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPS))
def test_internal_call_sites_release_what_they_open(chain: dict[str, Path], name: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _check_releases(chain["tmp"], lambda i: OPS[name](chain, i))


@pytest.mark.slow
def test_the_cli_diff_releases_both_sides(chain: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    diff = ["diff", str(chain["delta"]), str(chain["base"])]
    _check_releases(chain["tmp"], lambda i: cli.main(diff) == 1 or pytest.fail("they differ: exit status 1"))


def test_checkpoints_passed_in_stay_open(chain: dict[str, Path]) -> None:
    with arrayckpt.open(chain["delta"]) as delta, arrayckpt.open(chain["base"]) as base:
        expected = delta["model.emb"][:].copy()
        arrayckpt.compact(delta, chain["tmp"] / "full")
        arrayckpt.show(delta, "model.emb", "3")
        arrayckpt.diff(delta, base)
        arrayckpt.save(_state(2.0), chain["tmp"] / "d-sync", base=delta)
        arrayckpt.async_save(_state(3.0), chain["tmp"] / "d-async", base=delta).wait()
        with pytest.raises(arrayckpt.ArrayckptError):  # a failed save does not close the caller's base either
            arrayckpt.save({**_state(), "obj": {1, 2}}, chain["tmp"] / "d-bad", base=delta)
        with pytest.raises(arrayckpt.StateError):
            arrayckpt.save(_state(), chain["base"], base=delta, overwrite=True)
        with pytest.raises(arrayckpt.ArrayckptError):
            arrayckpt.async_save(_state(), chain["delta"], base=base).wait()
        assert not delta.closed and not base.closed and not delta.base.closed
        assert (delta["model.emb"][:] == expected).all()  # read through the chain: the base is open too
        assert base["model.w"][0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert delta.closed and base.closed


def test_opened_closes_only_what_it_opened(chain: dict[str, Path]) -> None:
    with opened(chain["base"]) as checkpoint:
        assert not checkpoint.closed
    assert checkpoint.closed
    with arrayckpt.open(chain["base"]) as mine:
        with opened(mine) as same:
            assert same is mine
        assert not mine.closed
