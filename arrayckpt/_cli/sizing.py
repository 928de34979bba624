"""``arrayckpt estimate`` (how big a checkpoint will be, by the bytes-per-parameter rule) and ``interval`` (how often
to checkpoint, by Young's and Daly's formulas). Neither needs torch nor TensorStore."""

from __future__ import annotations

import argparse
import dataclasses

from .._tools.estimate import human_bytes
from .common import Commands, positive, print_json

__all__ = ["add_estimate", "add_interval"]


def add_estimate(commands: Commands) -> argparse.ArgumentParser:
    """Add ``estimate`` to the command line's subparsers."""
    estimate = commands.add_parser("estimate", help="checkpoint size by the 10/14 bytes-per-parameter rule")
    estimate.add_argument("--params", type=param_count, required=True, help="parameter count, e.g. 7B or 405e9")
    estimate.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "fp8"], default="bf16", help="weight dtype")
    estimate.add_argument("--optimizer", choices=["adam", "sgd", "none"], default="adam",
                          help="adam: fp32 m and v (8 bytes); sgd: fp32 momentum (4)")
    estimate.add_argument("--master-weights", action="store_true", help="add an fp32 master copy (4 bytes)")
    estimate.add_argument("--ranks", type=int, default=1, help="ranks the state is sharded over")
    estimate.add_argument("--json", action="store_true", help="print JSON")
    estimate.set_defaults(func=cmd_estimate)
    return estimate


def add_interval(commands: Commands) -> argparse.ArgumentParser:
    """Add ``interval`` to the command line's subparsers."""
    interval = commands.add_parser("interval", help="optimal checkpoint interval (Young/Daly)")
    interval.add_argument("--blocking-seconds", type=positive, required=True,
                          help="training time lost to one checkpoint, in seconds")
    interval.add_argument("--mtbf-hours", type=positive, required=True, help="mean time between job failures")
    interval.add_argument("--json", action="store_true", help="print JSON")
    interval.set_defaults(func=cmd_interval)
    return interval


def param_count(text: str) -> int:
    """argparse type: ``7B``, ``405e9``."""
    from .._tools.estimate import parse_count

    try:
        return parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_estimate(args: argparse.Namespace) -> int:
    from .._tools.estimate import estimate_size

    e = estimate_size(args.params, dtype=args.dtype, optimizer=args.optimizer, master_weights=args.master_weights,
                      ranks=args.ranks)
    if args.json:
        print_json(e.to_dict())
        return 0
    parts = " + ".join(f"{name} {n}" for name, n in e.breakdown.items() if n)
    print(f"{e.params:,} parameters × {e.bytes_per_param} bytes ({parts}) = {human_bytes(e.total_bytes)}")
    if e.ranks > 1:
        print(f"sharded over {e.ranks} ranks: {human_bytes(e.per_rank_bytes)} per rank")
    return 0


def cmd_interval(args: argparse.Namespace) -> int:
    from .._manage.policy import optimal_interval

    result = optimal_interval(args.blocking_seconds, args.mtbf_hours * 3600)
    overhead = result.blocking_seconds / (result.daly_seconds + result.blocking_seconds)
    if args.json:
        print_json({**dataclasses.asdict(result), "overhead": overhead})
        return 0
    print(f"checkpoint every {result.daly_seconds / 60:.1f} min (Daly; Young: {result.young_seconds / 60:.1f} min) "
          f"for {args.blocking_seconds:g} s blocked per checkpoint and an MTBF of {args.mtbf_hours:g} h; "
          f"checkpointing then takes {100 * overhead:.2f}% of the time")
    return 0
