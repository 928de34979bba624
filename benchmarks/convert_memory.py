"""Peak memory of converting a big checkpoint, against the bound "largest tensor + 512 MiB".

Builds a state of ``--size-gib`` GiB (tensors of ``--tensor-mib`` MiB, bfloat16 and float32), writes it as a
safetensors file, a torch.save file and a DCP checkpoint (and, with fp32 Adam moments, as a training checkpoint for
the DeepSpeed Universal Checkpoint directions), then runs every conversion in a fresh process
and reports that process's peak resident memory (``ru_maxrss``: anonymous *and* file-backed pages, the
strictest reading; Linux ``VmHWM``), the part above the interpreter's own footprint after imports, and whether the
peak stays within the largest tensor + 512 MiB. Every direction is held to the bound (arrayckpt -> torch.save
writes torch.save's zip one tensor record at a time). Exit status 1 when a conversion exceeds it.

    python benchmarks/convert_memory.py                      # 2 GiB in a temporary directory
    python benchmarks/convert_memory.py --size-gib 0.5 --dir /tmp/convbench --keep
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
BOUND_EXTRA = 512 * MiB

# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child would report its parent's peak.
_CHILD = """
import json, sys, time
import torch, tensorstore, arrayckpt, arrayckpt._convert.dispatch
import torch.distributed.checkpoint

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

base = hwm()
src, dst, to = sys.argv[1], sys.argv[2], sys.argv[3] or None
t0 = time.perf_counter()
arrayckpt.convert(src, dst, to_format=to)
seconds = time.perf_counter() - t0
print(json.dumps({"base": base, "peak": hwm(), "seconds": seconds}))
"""


def build_sources(root: Path, size: int, tensor_bytes: int) -> int:
    """Write the same state as safetensors, torch.save and DCP; return the largest tensor's size."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {}
    total, i = 0, 0
    while total < size:
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        n = min(tensor_bytes, size - total) // (2 if dtype == torch.bfloat16 else 4)
        state[f"layers.{i}.weight"] = torch.randn(max(1, n // 1024), 1024).to(dtype)
        total += state[f"layers.{i}.weight"].nbytes
        i += 1
    save_file(state, root / "model.safetensors")
    torch.save(state, root / "model.pt")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=root / "dcp", no_dist=True)
    largest = max(t.nbytes for t in state.values())
    _training_state(root, state)
    del state
    return largest


def _training_state(root: Path, weights: dict) -> None:
    """The weights as a module's with fp32 Adam moments (plain PyTorch's optimizer state: parameters numbered in
    the module's order, one param group), saved as arrayckpt: the source of a DeepSpeed Universal Checkpoint."""
    import torch

    import arrayckpt

    state = {i: {"step": torch.tensor(7.0), "exp_avg": t.float(), "exp_avg_sq": t.float().abs()}
             for i, t in enumerate(weights.values())}
    arrayckpt.save({"model": weights, "optim": {"state": state, "param_groups": [
        {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(len(state)))}]}},
        root / "train")


def measure(src: Path, dst: Path, to: str | None) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst), to or ""], capture_output=True,
                          text=True)
    if proc.returncode:
        raise RuntimeError(f"converting {src} -> {dst} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (default 2)")
    parser.add_argument("--tensor-mib", type=float, default=256.0, help="size of each tensor (default 256)")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    args = parser.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="arrayckpt-convbench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        largest = build_sources(root, int(args.size_gib * (1 << 30)), int(args.tensor_mib * MiB))
        bound = largest + BOUND_EXTRA
        runs = [
            ("safetensors -> arrayckpt", root / "model.safetensors", root / "from_st", None),
            ("torch.save  -> arrayckpt", root / "model.pt", root / "from_pt", None),
            ("DCP         -> arrayckpt", root / "dcp", root / "from_dcp", None),
            ("arrayckpt   -> safetensors", root / "from_st", root / "out.safetensors", None),
            ("arrayckpt   -> DCP", root / "from_st", root / "out_dcp", "dcp"),
            ("arrayckpt   -> torch.save", root / "from_st", root / "out.pt", None),
            ("arrayckpt   -> DeepSpeed UC", root / "train", root / "out_uc", "deepspeed"),
            ("DeepSpeed UC -> arrayckpt", root / "out_uc", root / "from_uc", None),
        ]
        print(f"checkpoint {args.size_gib:g} GiB, largest tensor {largest / MiB:.0f} MiB, bound "
              f"{bound / MiB:.0f} MiB (largest tensor + 512 MiB); peak = whole-process max RSS")
        print(f"{'conversion':28} {'peak MiB':>9} {'above imports':>14} {'seconds':>8}  within bound")
        failures = 0
        for name, src, dst, to in runs:
            t0 = time.perf_counter()
            result = measure(src, dst, to)
            ok = result["peak"] <= bound
            failures += not ok
            verdict = "yes" if ok else "NO"
            print(f"{name:28} {result['peak'] / MiB:9.0f} {(result['peak'] - result['base']) / MiB:14.0f} "
                  f"{result.get('seconds', time.perf_counter() - t0):8.1f}  {verdict}")
        return 1 if failures else 0
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
