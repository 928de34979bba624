"""``arrayckpt.lightning.ArrayckptIO``: PyTorch Lightning's checkpoints as arrayckpt checkpoints.

A real ``Trainer.fit`` on the CPU (a tiny module: one ``nn.Linear``, Adam, 32 synthetic samples in batches of 8)
saves through the plug-in and resumes, in a fresh process, from ``ckpt_path="last"``; the resumed run matches the
uninterrupted one bit for bit (losses as exact floats, parameters and optimizer state with ``torch.equal``), as in
``examples/train_resume.py``. Then: asynchronous saves, top-k removal, hyper-parameters that need pickle, the
checkpoint dict round trip (``map_location``), keys too long for a directory, removal rules, and ``s3://`` paths.

Run as a script (``python tests/integrations/test_lightning.py ROOT EPOCHS CKPT_PATH OUT``) this module is the fresh
process: it fits to ``EPOCHS`` resuming from ``CKPT_PATH`` and writes what the parent compares to ``OUT``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time
import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ModuleNotFoundError:  # the unified package instead
    import lightning.pytorch as pl  # type: ignore[no-redef]

import arrayckpt
from arrayckpt._integrations import lightning_io
from arrayckpt._write import asynchronous as async_writes
from arrayckpt.lightning import ArrayckptIO

EPOCH_STEPS = 4  # 32 samples, batches of 8
pytestmark = [pytest.mark.slow,  # runs a foreign training stack
              pytest.mark.filterwarnings("ignore:.*does not have many workers"),  # Lightning's advice, not ours
              pytest.mark.filterwarnings("ignore:.*number of training batches.*is smaller than the logging interval"),
              pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
              pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")]


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 2)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)), batch_size=8)


def _fit(root: pathlib.Path, epochs: int, *, io: ArrayckptIO | None = None, callbacks: list | None = None,
         ckpt_path: str | None = None, seed: int = 0, model: Tiny | None = None) -> tuple[Tiny, pl.Trainer]:
    """Fit the tiny module for ``epochs`` (deterministic: seeded, one thread, no shuffling)."""
    pl.seed_everything(seed, verbose=False)
    model = model if model is not None else Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, default_root_dir=root, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                         plugins=[io] if io is not None else None, callbacks=callbacks,
                         enable_checkpointing=bool(callbacks))
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model, trainer


def _outcome(model: Tiny, trainer: pl.Trainer) -> dict[str, Any]:
    return {"losses": model.losses, "model": model.state_dict(), "optim": trainer.optimizers[0].state_dict()}


def _diff(a: Any, b: Any, where: str = "") -> list[str]:
    """Exact structural comparison (examples/train_resume.py's ``diff_trees``)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{where}: {a!r} vs {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{where}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{where}.{i}")]
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} vs {b!r}"]


@pytest.fixture(autouse=True)
def _one_thread_quiet():
    """One intra-op thread (the fresh process uses one too: float sums must match bit for bit); Lightning's info
    logs off."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    yield
    torch.set_num_threads(threads)


def _checkpointing(dirpath: pathlib.Path, **options: Any) -> pl.callbacks.ModelCheckpoint:
    return pl.callbacks.ModelCheckpoint(dirpath=dirpath, **options)


def test_resume_in_a_fresh_process_is_bit_exact(tmp_path):
    reference = _outcome(*_fit(tmp_path / "reference", 3))

    ckpts = tmp_path / "ckpts"
    model, trainer = _fit(tmp_path / "run", 1, io=ArrayckptIO(), callbacks=[_checkpointing(ckpts, save_last=True)])
    assert model.losses == reference["losses"][:EPOCH_STEPS]
    assert sorted(os.listdir(ckpts)) == [f"epoch=0-step={EPOCH_STEPS}.ckpt", "last.ckpt"]
    with arrayckpt.open(ckpts / "last.ckpt") as opened:  # an ordinary arrayckpt checkpoint
        assert {"state_dict.layer.weight", "optimizer_states.0.state.0.exp_avg"} <= set(opened)
        assert opened.step == EPOCH_STEPS and opened.plain_values["hyper_parameters.lr"] == 0.05
        assert torch.equal(opened["state_dict.layer.weight"].torch(), model.layer.weight.detach())
    assert arrayckpt.verify(ckpts / "last.ckpt").ok

    out = tmp_path / "resumed.pt"
    done = subprocess.run([sys.executable, __file__, str(tmp_path / "resumed"), "3", "last", str(ckpts), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = torch.load(out, weights_only=True)
    assert resumed["losses"] == reference["losses"][EPOCH_STEPS:], (resumed["losses"], reference["losses"])
    assert not _diff(reference["model"], resumed["model"]) and not _diff(reference["optim"], resumed["optim"])
    assert resumed["resumed_from"] == str(ckpts / "last.ckpt")


def _resume_main(root: str, epochs: str, ckpt_path: str, dirpath: str, out: str) -> None:
    """The fresh process of the test above: another seed (the checkpoint must bring everything), ``ckpt_path``."""
    torch.set_num_threads(1)
    model, trainer = _fit(pathlib.Path(root), int(epochs), io=ArrayckptIO(), ckpt_path=ckpt_path, seed=123,
                          callbacks=[_checkpointing(pathlib.Path(dirpath), save_last=True)])
    torch.save({**_outcome(model, trainer), "resumed_from": str(trainer.ckpt_path)}, out)


def test_load_checkpoint_returns_the_dict_lightning_saved(tmp_path):
    """Everything Lightning put in the dict comes back: types, int keys, tuples, 0-d tensors; ``map_location``."""
    seen: list[dict] = []

    class Recording(ArrayckptIO):
        def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            seen.append(_copy(checkpoint))
            super().save_checkpoint(checkpoint, path, storage_options)

    ckpts = tmp_path / "ckpts"
    _fit(tmp_path, 1, io=Recording(), callbacks=[_checkpointing(ckpts, monitor="train_loss")])
    (saved,) = seen
    path = ckpts / f"epoch=0-step={EPOCH_STEPS}.ckpt"
    loaded = ArrayckptIO().load_checkpoint(path)
    assert not _diff(saved, loaded)
    assert list(loaded["state_dict"]) == list(saved["state_dict"])  # (top-level keys: tensors first, then values)
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    for map_location in ("meta", torch.device("meta"), {"cpu": "meta"}, _to_meta):
        moved = ArrayckptIO().load_checkpoint(path, map_location=map_location)
        assert moved["state_dict"]["layer.weight"].device.type == "meta"
        assert moved["optimizer_states"][0]["state"][0]["exp_avg"].device.type == "meta"
    kept = ArrayckptIO().load_checkpoint(path, map_location=lambda storage, loc: storage)
    assert not _diff(saved, kept)


def _to_meta(storage: Any, location: str) -> Any:
    """torch.load's ``map_location`` function, returning a storage on the meta device (as far as it is looked at:
    CPU storages cannot be moved there)."""
    assert location == "cpu" and isinstance(storage, torch.UntypedStorage)
    return types.SimpleNamespace(device=torch.device("meta"))


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(v) for v in value)
    return value


@pytest.mark.parametrize(("asynchronous", "save_last"), [(False, True), (True, True), (True, "link")],
                         ids=["sync", "async", "async-link"])
def test_top_k_removal_deletes_old_checkpoints_and_nothing_else(tmp_path, monkeypatch, asynchronous, save_last):
    if save_last == "link":  # background saves that start late: Lightning links to a checkpoint not written yet
        finish_save = async_writes.finish_save
        monkeypatch.setattr(async_writes, "finish_save", lambda *a, **k: time.sleep(0.05) or finish_save(*a, **k))
    ckpts = tmp_path / "ckpts"
    mine = [] if save_last == "link" else ["notes.txt"]  # (link: Lightning links before the async save has made ckpts)
    for name in mine:
        ckpts.mkdir()
        (ckpts / name).write_text("mine")
    callback = _checkpointing(ckpts, monitor="train_loss", save_top_k=2, every_n_train_steps=1, save_last=save_last)
    model, trainer = _fit(tmp_path, 2, io=ArrayckptIO(asynchronous=asynchronous), callbacks=[callback])
    kept = sorted(os.path.basename(p) for p in callback.best_k_models)
    assert len(kept) == 2 and callback.last_model_path == str(ckpts / "last.ckpt")
    assert sorted(os.listdir(ckpts)) == sorted([*kept, "last.ckpt", *mine])  # 8 saved, 6 removed
    assert all((ckpts / name).read_text() == "mine" for name in mine)
    for name in kept:
        assert arrayckpt.verify(ckpts / name).ok
    if save_last == "link":  # a link to the newest top-k checkpoint
        assert (ckpts / "last.ckpt").is_symlink() and os.readlink(ckpts / "last.ckpt") in kept
        return
    last = ArrayckptIO().load_checkpoint(ckpts / "last.ckpt")
    assert last["global_step"] == 2 * EPOCH_STEPS
    assert not _diff(last["state_dict"], model.state_dict())  # teardown waited for the last save
    assert last["callbacks"][callback.state_key]["best_k_models"].keys() == callback.best_k_models.keys()


def test_resume_from_an_asynchronous_save_matches(tmp_path):
    reference = _outcome(*_fit(tmp_path / "reference", 2))
    ckpts = tmp_path / "ckpts"
    _fit(tmp_path / "run", 1, io=ArrayckptIO(asynchronous=True), callbacks=[_checkpointing(ckpts)])
    model, trainer = _fit(tmp_path / "resumed", 2, io=ArrayckptIO(asynchronous=True), seed=7,
                          ckpt_path=str(ckpts / f"epoch=0-step={EPOCH_STEPS}.ckpt"), callbacks=[_checkpointing(ckpts)])
    assert model.losses == reference["losses"][EPOCH_STEPS:]
    assert not _diff(reference["model"], model.state_dict())
    assert not _diff(reference["optim"], trainer.optimizers[0].state_dict())


def test_non_json_hyperparameter_needs_allow_pickle(tmp_path):
    ckpts = tmp_path / "ckpts"
    with pytest.raises(arrayckpt.PickleNotAllowedError,
                       match=r"'hyper_parameters\.extra'.*save_hyperparameters\(ignore=.*ArrayckptIO\(allow_pickle=True"):
        _fit(tmp_path, 1, io=ArrayckptIO(), callbacks=[_checkpointing(ckpts)], model=Tiny(extra=pathlib.Path("x")))
    assert not ckpts.exists() or not os.listdir(ckpts), "nothing may be committed or left behind"

    _fit(tmp_path, 1, io=ArrayckptIO(allow_pickle=True), callbacks=[_checkpointing(ckpts)],
         model=Tiny(extra=pathlib.Path("data/train")))
    path = ckpts / f"epoch=0-step={EPOCH_STEPS}.ckpt"
    assert ArrayckptIO(allow_pickle=True).load_checkpoint(path)["hyper_parameters"]["extra"] == pathlib.Path(
        "data/train")
    with pytest.raises(arrayckpt.PickleNotAllowedError, match=r"hyper_parameters\.extra.*ArrayckptIO\(allow_pickle"):
        ArrayckptIO().load_checkpoint(path)
    with pytest.raises(arrayckpt.PickleNotAllowedError, match="weights_only=True"):
        ArrayckptIO(allow_pickle=True).load_checkpoint(path, weights_only=True)
    with pytest.raises(arrayckpt.PickleNotAllowedError, match="nothing was saved"):
        ArrayckptIO(asynchronous=True).save_checkpoint({"x": pathlib.Path("y")}, tmp_path / "async.ckpt")
    assert not (tmp_path / "async.ckpt").exists()


def test_saving_waits_for_the_save_in_flight_and_removals_wait_for_its_commit(tmp_path, monkeypatch):
    release = threading.Event()
    finish_save = async_writes.finish_save

    def slow(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30)
        return finish_save(*args, **kwargs)

    io = ArrayckptIO(asynchronous=True)
    io.save_checkpoint({"w": torch.zeros(3), "global_step": 1}, tmp_path / "a.ckpt")
    io.teardown()  # a.ckpt committed before finish_save is slowed down
    monkeypatch.setattr(async_writes, "finish_save", slow)
    w = torch.ones(3)
    io.save_checkpoint({"w": w, "global_step": 2}, tmp_path / "b.ckpt")  # in flight until released
    w.fill_(5)  # staged already: the checkpoint keeps the ones
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert (tmp_path / "a.ckpt").exists(), "removed only once b.ckpt has committed"
    threading.Timer(0.2, release.set).start()
    started = time.monotonic()
    io.save_checkpoint({"w": w, "global_step": 3}, tmp_path / "c.ckpt")  # waits for b first
    assert time.monotonic() - started >= 0.15
    assert (tmp_path / "b.ckpt").is_dir() and not (tmp_path / "a.ckpt").exists()
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.ones(3))
    assert torch.equal(io.load_checkpoint(tmp_path / "c.ckpt")["w"], torch.full((3,), 5.0))


def test_a_failed_asynchronous_save_is_raised_and_keeps_what_it_was_to_replace(tmp_path, monkeypatch):
    io = ArrayckptIO(asynchronous=True)
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "old.ckpt")
    io.teardown()

    release = threading.Event()

    def broken(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30)
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(async_writes, "finish_save", broken)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")  # waits for new.ckpt to commit
    release.set()
    with pytest.raises(OSError, match="disk full") as failure:
        io.teardown()
    assert any("kept" in note and "old.ckpt" in note for note in getattr(failure.value, "__notes__", []))
    assert arrayckpt.verify(tmp_path / "old.ckpt").ok and not (tmp_path / "new.ckpt").exists()
    io.teardown()  # reported once


def test_remove_checkpoint_removes_only_arrayckpt_files(tmp_path):
    io = ArrayckptIO()
    target = tmp_path / "epoch=0-step=1.ckpt"
    io.save_checkpoint({"w": torch.ones(2)}, target)
    link = tmp_path / "last.ckpt"
    link.symlink_to(target.name)
    assert torch.equal(io.load_checkpoint(link)["w"], torch.ones(2))
    io.remove_checkpoint(link)
    assert not os.path.lexists(link) and arrayckpt.verify(target).ok, "a link goes, never what it points to"
    (target / "mine.txt").write_text("keep")
    with pytest.warns(RuntimeWarning, match="left in place"):
        io.remove_checkpoint(target)
    assert sorted(os.listdir(target)) == ["mine.txt"]
    torch.save({"a": 1}, tmp_path / "old.ckpt")  # a torch.save checkpoint (TorchCheckpointIO's)
    with pytest.warns(RuntimeWarning, match="not an arrayckpt"):
        io.remove_checkpoint(tmp_path / "old.ckpt")
    assert (tmp_path / "old.ckpt").is_file()
    with pytest.raises(arrayckpt.CheckpointNotFoundError, match="arrayckpt convert"):
        io.load_checkpoint(tmp_path / "old.ckpt")
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.remove_checkpoint(tmp_path / "missing.ckpt")  # nothing there: nothing to do


def test_keys_too_long_for_a_directory_are_folded(tmp_path):
    """A dict holding tensors under a key over 255 bytes once escaped is stored folded, and comes back as it was;
    callback states are plain values under readable keys, however long their state key or ``best_k_models`` paths."""
    long_path = "/" + "/".join(["d" * 60] * 5) + "/epoch=3-step=40.ckpt"
    state_key = "ModelCheckpoint{'monitor': '" + "val/" * 30 + "loss', 'mode': 'min'}"
    checkpoint = {"callbacks": {state_key: {"best_k_models": {long_path: torch.tensor(0.5)}, "kth_value": torch.tensor(
        0.5), "dirpath": "/x"}, "Other": {"n": torch.tensor(1)}}, "state_dict": {"w": torch.ones(2)}, "epoch": 3,
                  "extra": {long_path: torch.ones(3)}}
    io = ArrayckptIO()
    io.save_checkpoint(checkpoint, tmp_path / "c.ckpt")
    assert not _diff(checkpoint, io.load_checkpoint(tmp_path / "c.ckpt"))
    with arrayckpt.open(tmp_path / "c.ckpt") as opened:
        assert "state_dict.w" in opened and [key for key in opened if lightning_io.FOLDED in key] == [
            f"extra.{lightning_io.FOLDED}.0.1"]
        assert {"callbacks.ModelCheckpoint", "callbacks.Other"} <= set(opened.plain_values)


def _keys(path: pathlib.Path) -> list[str]:
    """Every key of an arrayckpt checkpoint: arrays, plain values, per-rank entries."""
    with arrayckpt.open(path) as opened:
        return list(opened.manifest.entries)


class _StateAtStart(pl.Callback):
    """Records the state of a callback once the trainer has restored it (at the start of training)."""

    def __init__(self, watched: pl.Callback) -> None:
        self.watched = watched
        self.state: dict | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = _copy(self.watched.state_dict())


def test_callback_states_are_readable_and_resume_exactly(tmp_path):
    """ModelCheckpoint (monitor, top-k) and EarlyStopping: each callback's state is one plain value under
    ``callbacks.<ClassName>`` (no key holds a state key's ``{...}`` or a checkpoint path), the dict Lightning saved
    comes back exactly, and ``fit(ckpt_path="last")`` restores both states and carries on with top-k."""
    seen: list[dict] = []

    class Recording(ArrayckptIO):
        def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            seen.append(_copy(checkpoint))
            super().save_checkpoint(checkpoint, path, storage_options)

    ckpts = tmp_path / "ckpts"

    def callbacks() -> list[pl.Callback]:
        return [_checkpointing(ckpts, monitor="train_loss", save_top_k=2, save_last=True),
                pl.callbacks.EarlyStopping(monitor="train_loss", patience=50)]

    first = callbacks()
    _fit(tmp_path / "run", 3, io=Recording(), callbacks=first)
    keys = _keys(ckpts / "last.ckpt")
    assert "callbacks.ModelCheckpoint" in keys and "callbacks.EarlyStopping" in keys
    assert not [key for key in keys if key.startswith("callbacks.") and key.count(".") > 1], keys
    assert not [key for key in keys if "{" in key or "/" in key or ".ckpt" in key], keys
    with arrayckpt.open(ckpts / "last.ckpt") as opened:
        state, state_key, _ = opened.plain_values["callbacks.ModelCheckpoint"]
        assert state_key == first[0].state_key and state["monitor"] == "train_loss"
        assert state["best_k_models"] == {p: s.item() for p, s in first[0].best_k_models.items()}  # plain numbers
    assert not _diff(seen[-1], ArrayckptIO().load_checkpoint(ckpts / "last.ckpt"))  # tensors back, dtypes and all

    second = callbacks()
    watch = _StateAtStart(second[0]), _StateAtStart(second[1])
    _fit(tmp_path / "run", 5, io=ArrayckptIO(), callbacks=[*second, *watch], ckpt_path="last")
    saved = seen[-1]["callbacks"]
    restored = {**saved[first[0].state_key], "current_score": None}  # (ModelCheckpoint does not restore that one)
    assert not _diff(restored, watch[0].state) and not _diff(saved[first[1].state_key], watch[1].state)
    assert len(second[0].best_k_models) == 2 and second[0].best_model_score == min(second[0].best_k_models.values())
    kept = sorted(os.path.basename(p) for p in second[0].best_k_models)
    assert sorted(os.listdir(ckpts)) == sorted([*kept, "last.ckpt"])  # top-k went on: older ones removed


def test_checkpoints_with_callback_states_under_lightning_keys_still_load(tmp_path):
    """Checkpoints written before readable callback keys (states under Lightning's state keys, folded where a key
    was too long for a directory) load as they were saved."""
    long_path = "/" + "/".join(["d" * 60] * 5) + "/epoch=3-step=40.ckpt"
    checkpoint = {"callbacks": {
        "ModelCheckpoint{'monitor': '" + "val/" * 30 + "loss', 'mode': 'min'}": {
            "best_k_models": {long_path: torch.tensor(0.5)}, "best_model_score": torch.tensor(0.5), "dirpath": "/x"},
        "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}": {"best_score": torch.tensor(0.25), "wait_count": 1}},
        "state_dict": {"w": torch.ones(2)}, "global_step": 4}
    short = {**checkpoint, "callbacks": {"ModelCheckpoint{'monitor': 'val_loss'}": {
        "best_k_models": {"/runs/a/epoch=0-step=4.ckpt": torch.tensor(0.5)}, "kth_value": torch.tensor(float("inf"))}}}
    for name, old in (("folded", checkpoint), ("plain", short)):
        arrayckpt.save(lightning_io._fold(old), tmp_path / name, step=4)  # what ArrayckptIO wrote then
        assert any(("callbacks." + lightning_io.FOLDED if name == "folded" else "ModelCheckpoint{") in key
                   for key in _keys(tmp_path / name))
        assert not _diff(old, ArrayckptIO().load_checkpoint(tmp_path / name))


def test_callback_states_with_large_tensors_keep_them_as_arrays(tmp_path):
    """A callback state with a tensor too large to be part of a plain value (or a value JSON cannot hold) keeps its
    tensors as arrays, under the same readable key; both come back exactly, next to inline ones."""
    checkpoint = {"callbacks": {
        "Averaging{'every': 2}": {"buffer": torch.arange(100, dtype=torch.float64), "n": 3},
        "Averaging{'every': 4}": {"scores": [torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor([1, 2])],
                                  "pair": (torch.tensor(True), "x"), "empty": torch.zeros(0, 3)},
        "Complex": {"z": torch.tensor([1 + 2j])}}}
    io = ArrayckptIO()
    io.save_checkpoint(checkpoint, tmp_path / "c.ckpt")
    keys = _keys(tmp_path / "c.ckpt")
    assert {"callbacks.Averaging.state.buffer", "callbacks.Averaging.arrayckpt_state_key", "callbacks.Averaging_2",
            "callbacks.Complex.state.z"} <= set(keys), keys
    assert not _diff(checkpoint, io.load_checkpoint(tmp_path / "c.ckpt"))


@pytest.mark.parametrize(("tensors", "error"), [
    ([[["missing"], "float32", []]], "leads nowhere"),
    ([[["a"], "not-a-dtype", []]], "not a not-a-dtype tensor"),
    ([[["a"], "float32", [2]]], "1 values for shape"),
    ([["a", "float32"]], "not a .path, dtype, shape. record"),
])
def test_crafted_callback_records_are_errors_that_name_the_checkpoint(tensors, error):
    from arrayckpt._integrations.lightning_callbacks import restore_callbacks

    loaded = {"callbacks": {"Thing": ({"a": 1.0}, "Thing{}", tensors)}}
    with pytest.raises(arrayckpt.FormatError, match=f"ckpt-path: callbacks.Thing.*{error}"):
        restore_callbacks(loaded, "ckpt-path")


def test_object_storage_paths_get_storage_options(s3_server, s3_bucket):
    io = ArrayckptIO(storage_options={"endpoint_url": s3_server.endpoint})
    url = f"s3://{s3_bucket}/run/epoch=0-step=4.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}, "global_step": 4}, url)
    assert torch.equal(io.load_checkpoint(url)["state_dict"]["w"], torch.arange(4.0))
    with arrayckpt.open(url, storage_options={"endpoint_url": s3_server.endpoint}) as opened:
        assert opened.step == 4
    io.remove_checkpoint(url)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(url)


def test_without_lightning_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'arrayckpt\[lightning\]'"):
        lightning_io._checkpoint_io_bases()


def test_the_lightning_package_accepts_it_too(tmp_path):
    import lightning

    assert isinstance(ArrayckptIO(), lightning.fabric.plugins.CheckpointIO)
    trainer = lightning.pytorch.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                                        plugins=[ArrayckptIO()], default_root_dir=tmp_path)
    assert isinstance(trainer.strategy.checkpoint_io, ArrayckptIO)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    _resume_main(*sys.argv[1:])
