"""Bit-exact training resume with arrayckpt.

This example shows that a training run which is checkpointed with ``arrayckpt.save``
half-way through and resumed with ``arrayckpt.load`` into *brand-new* objects produces
exactly the same result as a run that was never interrupted.

What it does (single process, CPU, seeded, a few seconds):

1. Trains a small MLP on synthetic regression data with AdamW and a cosine LR schedule
   for ``2 * --steps`` steps without interruption, recording every loss.
   The model has two ``Linear`` layers, dropout (so the global RNG matters), a bfloat16
   parameter (trained by AdamW, so its optimizer state is bf16 too) and a bfloat16
   buffer that is updated during training.  Mini-batches are drawn from the global RNG.
2. Starts again from the same seed, trains ``--steps`` steps, then saves::

       arrayckpt.save({"model": model, "optim": opt, "sched": sched, "step": step,
                       "rng": torch.get_rng_state(), "meta": {...}}, path)

   Model, optimizer and scheduler are saved through their ``state_dict()``; every tensor
   becomes a chunked Zarr v3 array.
3. Throws those objects away, builds fresh ones from a *different* seed (a fresh AdamW has
   no per-parameter state until its first step), and loads the checkpoint into them with
   ``arrayckpt.load`` -- including the RNG state, which is loaded into a uint8 tensor and
   handed to ``torch.set_rng_state``.
4. Trains the remaining ``--steps`` steps and checks that every loss (compared as exact
   Python floats), every parameter and buffer (``torch.equal``), the optimizer state and
   the scheduler state are identical to the uninterrupted run.
5. Opens the checkpoint read-only with ``arrayckpt.open`` and lists a few arrays with
   their shape and dtype.

Run it with::

    python examples/train_resume.py                 # checkpoint in a temporary directory
    python examples/train_resume.py --dir /tmp/ck --steps 50

It prints a short summary and exits with status 1 if anything differs (0 on success).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import arrayckpt

SUCCESS_LINE = "OK: resumed run matches the uninterrupted run exactly"

IN_FEATURES = 16
HIDDEN = 32
OUT_FEATURES = 4
DATASET_SIZE = 512
BATCH_SIZE = 32


class MLP(nn.Module):
    """Two Linear layers, dropout, a bf16 parameter and a bf16 running-mean buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT_FEATURES)
        self.drop = nn.Dropout(p=0.1)
        # A trainable per-feature gate kept in bfloat16 (AdamW keeps bf16 moments for it).
        # Random init so that a differently seeded model really starts somewhere else.
        self.gate = nn.Parameter((1.0 + 0.1 * torch.randn(HIDDEN)).to(torch.bfloat16))
        # A bfloat16 buffer updated on every training forward pass (like BatchNorm stats).
        self.register_buffer("feat_mean", torch.zeros(HIDDEN, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.training:
            with torch.no_grad():
                batch_mean = h.mean(dim=0).to(torch.bfloat16)
                self.feat_mean.mul_(0.9).add_(0.1 * batch_mean)
        h = (h - self.feat_mean.float()) * self.gate.float()
        return self.fc2(self.drop(h))


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data from its own generator (independent of the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(DATASET_SIZE, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=g)
    y = torch.sin(x @ w) + 0.05 * torch.randn(DATASET_SIZE, OUT_FEATURES, generator=g)
    return x, y


def build(init_seed: int, total_steps: int):
    """Fresh model, optimizer (two param groups) and scheduler."""
    torch.manual_seed(init_seed)
    model = MLP()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.99),
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps, eta_min=1e-4)
    return model, opt, sched


def train(model, opt, sched, data, n_steps: int) -> list[float]:
    """Run ``n_steps`` optimizer steps; batches and dropout masks come from the global RNG."""
    x_all, y_all = data
    model.train()
    losses = []
    for _ in range(n_steps):
        idx = torch.randint(0, x_all.shape[0], (BATCH_SIZE,))
        loss = nn.functional.mse_loss(model(x_all[idx]), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def diff_trees(a, b, where: str = "") -> list[str]:
    """Exact structural comparison of two state trees; returns human-readable differences."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        return [] if torch.equal(a, b) else [f"{where}: tensor values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys differ: {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in diff_trees(a[k], b[k], f"{where}.{k}" if where else str(k))]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        out = [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff_trees(x, y, f"{where}.{i}")]
        if type(a) is not type(b):
            out.append(f"{where}: {type(a).__name__} vs {type(b).__name__}")
        return out
    if type(a) is not type(b) or a != b:
        return [f"{where}: {a!r} vs {b!r}"]
    return []


def du(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def run(workdir: Path, n: int, seed: int = 0) -> int:
    total = 2 * n
    data = make_data(seed)
    ckpt = workdir / f"ckpt_step{n:06d}"
    t0 = time.perf_counter()

    # 1. Reference: 2N steps, uninterrupted.
    ref_model, ref_opt, ref_sched = build(seed, total)
    ref_losses = train(ref_model, ref_opt, ref_sched, data, total)

    # 2. First half of the interrupted run, then checkpoint.
    model, opt, sched = build(seed, total)
    init_fc1 = model.fc1.weight.detach().clone()
    losses = train(model, opt, sched, data, n)
    step = n
    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "step": step,
        "rng": torch.get_rng_state(),
        "meta": {"seed": seed, "total_steps": total, "lr_now": sched.get_last_lr()[0], "note": "demo"},
    }
    # overwrite=True only so that re-running with the same --dir works.
    arrayckpt.save(state, str(ckpt), overwrite=True)
    saved_lr = sched.get_last_lr()
    saved_fc1 = model.fc1.weight.detach().clone()  # to check a lazy read from arrayckpt.open below
    del model, opt, sched, state

    # 3. Brand-new objects with a different init and a scrambled global RNG, then load.
    model, opt, sched = build(seed + 12345, total)
    assert len(opt.state) == 0, "a fresh AdamW should have no per-parameter state yet"
    started_elsewhere = not torch.equal(model.fc1.weight, init_fc1)
    target = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "step": 0,
        "rng": torch.empty_like(torch.get_rng_state()),
        "meta": {"seed": -1, "total_steps": -1, "lr_now": 0.0, "note": ""},
    }
    result = arrayckpt.load(target, str(ckpt))
    torch.set_rng_state(target["rng"])
    step = target["step"]

    problems: list[str] = []
    if result.missing_keys or result.unexpected_keys:
        problems.append(f"load reported {result!r}")
    if step != n:
        problems.append(f"step: loaded {step!r}, expected {n}")
    if target["meta"] != {"seed": seed, "total_steps": total, "lr_now": saved_lr[0], "note": "demo"}:
        problems.append(f"meta: loaded {target['meta']!r}")
    if len(opt.state) == 0:
        problems.append("optimizer state is still empty after load")
    if sched.get_last_lr() != saved_lr:
        problems.append(f"scheduler lr: {sched.get_last_lr()} vs saved {saved_lr}")

    # 4. Second half.
    losses += train(model, opt, sched, data, total - step)
    elapsed = time.perf_counter() - t0

    for i, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        if a != b:
            problems.append(f"loss at step {i + 1}: {a!r} (uninterrupted) vs {b!r} (resumed)")
            break
    for name, p_ref in ref_model.named_parameters():
        if not torch.equal(p_ref, model.get_parameter(name)):
            problems.append(f"final parameter {name} differs")
    problems += [f"model state {d}" for d in diff_trees(ref_model.state_dict(), model.state_dict())]
    problems += [f"optimizer state {d}" for d in diff_trees(ref_opt.state_dict(), opt.state_dict())]
    problems += [f"scheduler state {d}" for d in diff_trees(ref_sched.state_dict(), sched.state_dict())]

    # 5. Read-only, lazy view of the checkpoint.
    n_files, n_bytes = du(ckpt)
    reader = arrayckpt.open(str(ckpt))
    keys = sorted(reader)
    print(f"checkpoint  : {ckpt} ({len(keys)} arrays, {n_files} files, {n_bytes / 1024:.1f} KiB)")
    # The optimizer state is keyed by parameter index; find the bf16 gate's AdamW moment.
    gate_idx = [id(p) for g in opt.param_groups for p in g["params"]].index(id(model.gate))
    wanted = ["model.fc1.weight", "model.gate", "model.feat_mean", "optim.state.0.exp_avg"]
    wanted += [f"optim.state.{gate_idx}.exp_avg", f"optim.state.{gate_idx}.step", "rng"]
    for key in [k for k in wanted if k in keys] or keys[:5]:
        print(f"  {key:<24} shape={reader[key].shape} dtype={reader[key].dtype}")
    shown = ("step", "meta.note", "sched.last_epoch")
    print(f"  plain values ({len(reader.plain_values)}), e.g. { {k: reader.plain_values[k] for k in shown} }")
    # Arrays are read only when sliced: one row, then the whole tensor as torch.
    row0 = reader["model.fc1.weight"][0, :3]
    print(f"  model.fc1.weight[0, :3] read lazily -> {row0.tolist()}")
    if not torch.equal(reader["model.fc1.weight"].torch(), saved_fc1):
        problems.append("arrayckpt.open: model.fc1.weight differs from the saved tensor")

    print(f"load result : {result!r}")
    print(f"training    : {total} steps uninterrupted vs {n} + save/load + {total - n} ({elapsed:.2f}s)")
    print(f"init        : fresh objects started from different weights: {started_elsewhere}")
    r = ref_losses
    print(f"losses      : first {r[0]:.6f}, at resume {r[n]:.6f}, final {r[-1]:.6f}")
    if problems:
        print(f"MISMATCH ({len(problems)} problems):")
        for p in problems[:20]:
            print(f"  - {p}")
        return 1
    print(SUCCESS_LINE)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: temp dir)")
    parser.add_argument("--steps", type=int, default=25, help="steps before and after the checkpoint (N)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        return run(args.dir, args.steps, args.seed)
    with tempfile.TemporaryDirectory(prefix="arrayckpt-example-") as tmp:
        return run(Path(tmp), args.steps, args.seed)


if __name__ == "__main__":
    sys.exit(main())
