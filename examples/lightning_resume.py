"""Bit-exact resume of a PyTorch Lightning run whose checkpoints are arrayckpt checkpoints.

``Trainer(plugins=[ArrayckptIO()])`` makes every checkpoint Lightning writes an arrayckpt checkpoint: model
and optimizer state become chunked Zarr arrays, loops, callbacks and hyper-parameters plain JSON values. A
path Lightning names ``epoch=1-step=32.ckpt`` is a directory of that name; ``ModelCheckpoint``'s top-k
removal, ``last.ckpt`` and ``fit(ckpt_path="last")`` work as with files.

What it does (CPU, seeded, about half a minute, most of it importing Lightning twice):

1. Trains a small MLP (dropout, shuffled mini-batches, Adam with a step LR schedule) for ``2 * --epochs``
   epochs without interruption, recording every loss.
2. Starts again from the same seed and trains ``--epochs`` epochs with ``ArrayckptIO`` (``--async`` saves in
   the background) and a ``ModelCheckpoint`` keeping the best two checkpoints by training loss and
   ``last.ckpt``. The module adds the global RNG state to each checkpoint (``on_save_checkpoint``), so dropout
   masks and shuffling continue exactly.
3. Resumes **in a fresh process** (this script again, ``--resume``) with ``fit(ckpt_path="last")`` from a
   module initialised from another seed, and trains to ``2 * --epochs``.
4. Checks that every loss after the checkpoint (exact Python floats), every parameter and the optimizer and
   scheduler state (``torch.equal``) match the uninterrupted run, and that top-k removal left exactly the
   checkpoints ``ModelCheckpoint`` keeps.
5. Opens ``last.ckpt`` read-only with ``arrayckpt.open`` and lists a few arrays and values.

Run it with::

    python examples/lightning_resume.py                 # checkpoints in a temporary directory
    python examples/lightning_resume.py --dir /tmp/lt --epochs 3 --async

It prints a short summary and exits with status 1 if anything differs (0 on success).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ModuleNotFoundError:  # the unified 'lightning' package
    import lightning.pytorch as pl  # type: ignore[no-redef]

import arrayckpt
from arrayckpt.lightning import ArrayckptIO

SUCCESS_LINE = "OK: resumed Lightning run matches the uninterrupted run exactly"
SAMPLES, BATCH = 64, 8
SAVE_EVERY = 2  # steps between ModelCheckpoint saves


class MLP(pl.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 2))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]

    # Lightning does not checkpoint the global RNG; dropout and shuffling need it to continue exactly.
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        torch.set_rng_state(checkpoint["rng"])


def make_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = torch.sin(x[:, :2] * 2) + 0.05 * torch.randn(SAMPLES, 2, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def fit(root: Path, epochs: int, seed: int, io: ArrayckptIO | None = None, ckpt_dir: Path | None = None,
        ckpt_path: str | None = None) -> tuple[MLP, pl.Trainer, Any]:
    pl.seed_everything(seed, verbose=False)
    model = MLP()
    checkpoint = None
    if ckpt_dir is not None:
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, monitor="train_loss", save_top_k=2,
                                                  every_n_train_steps=SAVE_EVERY, save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, default_root_dir=root, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                         plugins=[io] if io is not None else None, callbacks=[checkpoint] if checkpoint else None,
                         enable_checkpointing=checkpoint is not None)
    trainer.fit(model, make_data(), ckpt_path=ckpt_path)
    return model, trainer, checkpoint


def outcome(model: MLP, trainer: pl.Trainer) -> dict[str, Any]:
    return {"losses": model.losses, "model": model.state_dict(), "optim": trainer.optimizers[0].state_dict(),
            "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict()}


def diff_trees(a: Any, b: Any, where: str = "") -> list[str]:
    """Exact structural comparison of two state trees; returns human-readable differences."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys differ: {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in diff_trees(a[k], b[k], f"{where}.{k}" if where else str(k))]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff_trees(x, y, f"{where}.{i}")]
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} vs {b!r}"]


def resume(workdir: Path, epochs: int, asynchronous: bool, out: Path) -> None:
    """The fresh process: another seed (the checkpoint must bring everything back), ``ckpt_path="last"``."""
    model, trainer, _ = fit(workdir / "resumed", 2 * epochs, seed=12345, io=ArrayckptIO(asynchronous=asynchronous),
                            ckpt_dir=workdir / "checkpoints", ckpt_path="last")
    torch.save({**outcome(model, trainer), "resumed_from": str(trainer.ckpt_path)}, out)


def run(workdir: Path, epochs: int, asynchronous: bool) -> int:
    t0 = time.perf_counter()
    steps = SAMPLES // BATCH * epochs
    reference = outcome(*fit(workdir / "reference", 2 * epochs, seed=0)[:2])

    ckpt_dir = workdir / "checkpoints"
    if ckpt_dir.is_dir():  # a run before with the same --dir: its checkpoints go (arrayckpt's files only)
        for old in ckpt_dir.iterdir():
            ArrayckptIO().remove_checkpoint(old)
    model, _, callback = fit(workdir / "run", epochs, seed=0, io=ArrayckptIO(asynchronous=asynchronous),
                             ckpt_dir=ckpt_dir)
    problems: list[str] = []
    if model.losses != reference["losses"][:steps]:
        problems.append("the first half differs from the uninterrupted run (not deterministic?)")
    kept = sorted([*(Path(p).name for p in callback.best_k_models), "last.ckpt"])
    if sorted(os.listdir(ckpt_dir)) != kept:
        problems.append(f"top-k removal: {sorted(os.listdir(ckpt_dir))} on disk, ModelCheckpoint keeps {kept}")

    last = ckpt_dir / "last.ckpt"  # read-only and lazy, before the resumed run saves over it
    with arrayckpt.open(last) as reader:
        keys = sorted(reader)
        print(f"checkpoint  : {last} is a directory: {last.is_dir()} ({len(keys)} arrays, "
              f"{len(reader.plain_values)} plain values, step {reader.step})")
        for key in ["state_dict.net.0.weight", "optimizer_states.0.state.0.exp_avg", "rng"]:
            print(f"  {key:<36} shape={reader[key].shape} dtype={reader[key].dtype}")
        values = reader.plain_values
        print(f"  hyper_parameters: hidden={values['hyper_parameters.hidden']} lr={values['hyper_parameters.lr']}, "
              f"lr_schedulers[0]['last_epoch']={values['lr_schedulers'][0]['last_epoch']}")
    print(f"kept        : {', '.join(kept)} (the other {steps // SAVE_EVERY - 2} removed by top-k)")

    out = workdir / "resumed.pt"
    done = subprocess.run([sys.executable, __file__, "--resume", "--dir", str(workdir), "--epochs", str(epochs),
                           *(["--async"] if asynchronous else [])], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(done.stdout + done.stderr)
        return 1
    resumed = torch.load(out, weights_only=True)
    elapsed = time.perf_counter() - t0

    for i, (a, b) in enumerate(zip(reference["losses"][steps:], resumed["losses"], strict=True)):
        if a != b:
            problems.append(f"loss at step {steps + i + 1}: {a!r} (uninterrupted) vs {b!r} (resumed)")
            break
    for part in ("model", "optim", "sched"):
        problems += [f"{part} {d}" for d in diff_trees(reference[part], resumed[part])]

    print(f"resumed     : from {resumed['resumed_from']} in a fresh process "
          f"({'asynchronous' if asynchronous else 'synchronous'} saves)")
    print(f"training    : {2 * epochs} epochs uninterrupted vs {epochs} + resume + {epochs} ({elapsed:.1f}s)")
    r = reference["losses"]
    print(f"losses      : first {r[0]:.6f}, after resume {r[steps]:.6f}, final {r[-1]:.6f}")
    if problems:
        print(f"MISMATCH ({len(problems)} problems):")
        for p in problems[:20]:
            print(f"  - {p}")
        return 1
    print(SUCCESS_LINE)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs before and after the checkpoint")
    parser.add_argument("--async", dest="asynchronous", action="store_true", help="save in the background")
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # the fresh process
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be >= 1")
    torch.set_num_threads(1)  # both processes sum in the same order
    warnings.filterwarnings("ignore", module="pytorch_lightning|lightning")
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if args.resume:
        resume(args.dir, args.epochs, args.asynchronous, args.dir / "resumed.pt")
        return 0
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        return run(args.dir, args.epochs, args.asynchronous)
    with tempfile.TemporaryDirectory(prefix="arrayckpt-lightning-") as tmp:
        return run(Path(tmp), args.epochs, args.asynchronous)


if __name__ == "__main__":
    sys.exit(main())
