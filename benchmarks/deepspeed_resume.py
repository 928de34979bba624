"""Resuming a DeepSpeed ZeRO-2 checkpoint at a new data-parallel degree: arrayckpt against DeepSpeed's universal
checkpoint, in one run.

A torchrun job of ``--save-ranks`` ranks (DeepSpeed on CPU with gloo, as in ``tests/deepspeed_worker.py``) trains a
plain MLP of about ``--params-mib`` MiB of fp32 parameters one step with ZeRO-2 and AdamW and saves it with
``engine.save_checkpoint``. That checkpoint is then resumed on ``--resume-ranks`` ranks two ways:

* arrayckpt: offline ``arrayckpt.convert(<save dir>, <dst>)`` (a fresh ``python -c`` process), then a resume job whose
  ranks call ``arrayckpt.deepspeed.load(engine, dst)``;
* universal: offline ``python -m deepspeed.checkpoint.ds_to_universal --input_folder <save dir>/<tag>
  --output_folder <save dir>/<tag>_universal --inject_missing_state``, then a resume job with ``"checkpoint":
  {"load_universal": true}`` whose ranks call ``engine.load_checkpoint(<save dir>, tag=<tag>_universal)``.

Offline step: wall time of the whole process (interpreter start and imports included, as a user runs it). Load:
wall time of the load call in the resume job, between two barriers (rank 0's clock; imports, engine construction
and process start excluded, they are the same both ways). Bytes written: sum of the file sizes the offline step
leaves in its output directory. As a check, both resume jobs then compute the loss of one fixed batch and the
sum of the full fp32 parameters; the run fails when they differ.

    python benchmarks/deepspeed_resume.py                             # 32 MiB of parameters, 2 -> 3 ranks
    python benchmarks/deepspeed_resume.py --params-mib 8 --resume-ranks 1
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GLOBAL_BATCH = 6
MICRO_BATCH = {1: 3, 2: 3, 3: 2}  # by world size (tests/deepspeed_worker.py): x grad accumulation x ranks = 6
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # DeepSpeed on CPU (tests/deepspeed_worker.py)
LAYERS = 4


# ------------------------------------------------------------------------------------------------ the worker


def _width(params_mib: float) -> int:
    return max(8, int(math.sqrt(params_mib * MiB / 4 / LAYERS)))


def _engine(world: int, width: int, universal: bool = False) -> Any:
    import deepspeed
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    micro = MICRO_BATCH[world]
    config: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GLOBAL_BATCH // (micro * world),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},  # no C++ op to build
        "zero_optimization": {"stage": 2}}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def _batch(width: int, step: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(GLOBAL_BATCH, width, generator=generator),
            torch.randn(GLOBAL_BATCH, width, generator=generator))


def _worker(mode: str, root: Path, width: int) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo only: no shm op to compile
    deepspeed.init_distributed("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    result: dict[str, Any] = {}
    if mode == "train":
        engine = _engine(world, width)
        micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        x, y = _batch(width, 0)
        for i in range(accumulation):
            part = slice((i * world + rank) * micro, (i * world + rank + 1) * micro)
            engine.backward(((engine(x[part]) - y[part]) ** 2).mean())
            engine.step()
        engine.save_checkpoint(str(root / "ds"))
    else:
        import arrayckpt.deepspeed  # imported before the clock starts (DeepSpeed's loader is already imported)

        engine = _engine(world, width, universal=mode == "universal")
        dist.barrier()
        start = time.perf_counter()
        if mode == "arrayckpt":
            arrayckpt.deepspeed.load(engine, root / "ds.arrayckpt")
        else:
            tag = (root / "ds" / "latest").read_text().strip()
            path, _ = engine.load_checkpoint(str(root / "ds"), tag=f"{tag}_universal")
            assert path is not None, "universal checkpoint not loaded"
        dist.barrier()
        result["load_s"] = time.perf_counter() - start
        from deepspeed.utils import safe_get_full_fp32_param

        result["fp32_sum"] = sum(safe_get_full_fp32_param(p).double().sum().item() for p in engine.module.parameters())
        x, y = _batch(width, 1)
        with torch.no_grad():
            result["loss"] = ((engine(x) - y) ** 2).mean().item()
        result["global_steps"] = engine.global_steps
    if rank == 0:
        (root / f"{mode}.json").write_text(json.dumps(result))
    dist.barrier()


# ------------------------------------------------------------------------------------------------ the driver


def _run(command: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    took = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return took


def _torchrun(ranks: int, mode: str, root: Path, width: int) -> dict[str, Any]:
    env = {**os.environ, **ENV, "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions")}
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
          __file__, "_worker", mode, str(root), str(width)], env)
    return json.loads((root / f"{mode}.json").read_text())


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-mib", type=float, default=32, help="fp32 parameter size (default 32)")
    parser.add_argument("--save-ranks", type=int, default=2, choices=sorted(MICRO_BATCH))
    parser.add_argument("--resume-ranks", type=int, default=3, choices=sorted(MICRO_BATCH))
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ds_resume_", dir=args.dir))
    width = _width(args.params_mib)
    env = {**os.environ, **ENV}
    try:
        _torchrun(args.save_ranks, "train", root, width)
        tag = (root / "ds" / "latest").read_text().strip()
        saved = _bytes(root / "ds")

        convert = _run([sys.executable, "-c", "import sys, arrayckpt; arrayckpt.convert(sys.argv[1], sys.argv[2])",
                        str(root / "ds"), str(root / "ds.arrayckpt")], env)
        ours = _torchrun(args.resume_ranks, "arrayckpt", root, width)
        universal_dir = root / "ds" / f"{tag}_universal"
        to_universal = _run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                             "--input_folder", str(root / "ds" / tag), "--output_folder", str(universal_dir),
                             "--inject_missing_state"], env)
        theirs = _torchrun(args.resume_ranks, "universal", root, width)

        if (ours["loss"], ours["fp32_sum"], ours["global_steps"]) != (
                theirs["loss"], theirs["fp32_sum"], theirs["global_steps"]):
            sys.exit(f"the two resumes differ: arrayckpt {ours}, universal {theirs}")
        rows = {"arrayckpt": (convert, ours["load_s"], _bytes(root / "ds.arrayckpt")),
                "universal": (to_universal, theirs["load_s"], _bytes(universal_dir))}
        params = LAYERS * (width * width + width)
        print(f"ZeRO-2, {params * 4 / MiB:.1f} MiB fp32 parameters ({params} in {LAYERS} layers of width {width}), "
              f"AdamW; DeepSpeed checkpoint {saved / MiB:.1f} MiB; ranks {args.save_ranks} -> {args.resume_ranks}; "
              f"resumed states identical (loss {ours['loss']:.6g})")
        print(f"{'system':<10} {'offline s':>10} {'load s':>8} {'total s':>8} {'bytes written':>14}")
        for name, (offline, load, written) in rows.items():
            print(f"{name:<10} {offline:>10.2f} {load:>8.3f} {offline + load:>8.2f} {written:>14,}")
        a, u = (sum(rows[k][:2]) for k in ("arrayckpt", "universal"))
        if args.json:
            args.json.write_text(json.dumps({"params_mib": params * 4 / MiB, "checkpoint_bytes": saved,
                                             "save_ranks": args.save_ranks, "resume_ranks": args.resume_ranks,
                                             **{k: {"offline_s": v[0], "load_s": v[1], "bytes_written": v[2]}
                                                for k, v in rows.items()}}, indent=1))
        print(f"deepspeed_resume: ranks={args.save_ranks}->{args.resume_ranks} arrayckpt_s={a:.2f} "
              f"universal_s={u:.2f} ratio={u / a:.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _worker(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
