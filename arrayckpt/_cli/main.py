"""The ``arrayckpt`` command line: inspect, verify, compare and convert checkpoints without writing Python.

``arrayckpt info PATH`` prints a table of tensors (dtype, shape, size, codec) and plain values;
``verify PATH`` reads and checks every chunk (exit status 1 on damage); ``show PATH KEY [SLICE]`` prints
values and statistics; ``diff A B`` compares two checkpoints (exit status 1 when they differ);
``convert SRC DST`` converts from and to torch.save, safetensors, PyTorch DCP and DeepSpeed; ``compact SRC DST``
turns a delta checkpoint and its bases into one full checkpoint; ``estimate`` and ``interval`` size
checkpoints and their frequency. Paths may be URLs (``s3://bucket/prefix``; endpoint and credentials from
the standard AWS environment variables). ``--json`` prints JSON for scripts.

Longer than 500 lines: one short function per command and the argument parser that lists them all; kept
together so that the whole command line reads as one page.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import ArrayckptError
from ._tools.report_cli import add_report_parser, report_command
from ._tools.sync_cli import add_base_root_option, add_sync_parser, sync_command
from ._torch import TORCH_EXTRA, is_missing_torch
from ._units import human_bytes

if TYPE_CHECKING:  # imported when used: `estimate` and `interval` need neither torch nor TensorStore
    from ._read.checkpoint import Checkpoint, LazyArray

__all__ = ["main"]


def codec_name(array: LazyArray) -> str:
    """A short description of an array's codec pipeline (``zstd(3)``, ``blosc(zstd,5,bitshuffle)``)."""
    codecs = array.metadata.get("codecs", [])
    if codecs and codecs[0].get("name") == "sharding_indexed":
        codecs = codecs[0]["configuration"]["codecs"]
    for codec in codecs:
        name, config = codec.get("name"), codec.get("configuration", {})
        if name == "zstd":
            return f"zstd({config.get('level')})"
        if name == "blosc":
            return f"blosc({config.get('cname')},{config.get('clevel')},{config.get('shuffle')})"
    return "none"


def info_dict(checkpoint: Checkpoint) -> dict[str, Any]:
    """Everything ``info`` shows, as plain JSON-able data."""
    from ._format.manifest import PickleEntry

    values: dict[str, Any] = {}
    for key in checkpoint.plain_values:
        entry = checkpoint.manifest.entries[key]
        values[key] = {"pickled": entry.nbytes} if isinstance(entry, PickleEntry) else checkpoint.value(key)
    from ._cli_commands import per_rank_info

    return {
        "path": str(checkpoint.location),
        "format_version": checkpoint.manifest.format_version,
        "step": checkpoint.step,
        "per_rank": per_rank_info(checkpoint),
        "created": dict(checkpoint.manifest.created),
        "tensors": {
            key: {
                "dtype": a.entry.dtype.name,
                "shape": list(a.shape),
                "nbytes": a.nbytes,
                "codec": codec_name(a),
                "kind": a.entry.kind,
                "stored": stored_as(a),
                "chunks": chunk_grid(checkpoint, key),
            }
            for key, a in checkpoint.items() if a.key == key  # a tensor stored once, not its aliases
        },
        "aliases": dict(checkpoint.aliases()),
        "values": values,
        "total_bytes": checkpoint.nbytes,
        "stored_bytes": checkpoint.manifest.stored_bytes,
        "chain": chain_info(checkpoint),
    }


def chunk_grid(checkpoint: Checkpoint, key: str) -> list[int]:
    """Chunks per dimension of the array that holds the tensor's layout (its own, or its base's for a rows
    delta): the sharding at save, since chunks follow the ranks' shards (``[4, 1]``: split over rows in 4)."""
    try:
        metadata = checkpoint.dense_metadata(key)
    except ArrayckptError:  # a rows delta whose base cannot be read: `info` reports the chain's error instead
        return []
    from ._format.zarr import grid_counts

    return grid_counts(metadata)


def stored_as(array: LazyArray) -> str:
    """How a tensor is stored: ``whole``, or relative to the base (``unchanged``, ``3/16 chunks``, ``120 rows``)."""
    delta = array.entry.delta
    if delta is None:
        return "whole"
    if delta.mode == "chunks":
        if not delta.present:
            return "unchanged"
        from ._format.zarr import grid_counts

        return f"{len(delta.present)}/{math.prod(grid_counts(array.metadata))} chunks"
    lossy = f", {delta.quantized.bits}-bit (max error {delta.quantized.max_abs_error:.3g})" if delta.quantized else ""
    return f"{delta.rows} rows{lossy}"


def chain_info(checkpoint: Checkpoint) -> list[dict[str, Any]]:
    """The checkpoint and its bases, newest first; an unreadable base ends the list with its error."""
    out = []
    layer: Checkpoint | None = checkpoint
    while layer is not None:
        out.append({"path": str(layer.location), "step": layer.step, "id": layer.manifest.id,
                    "stored_bytes": layer.manifest.stored_bytes, "delta": layer.manifest.base is not None})
        if layer.manifest.base is None:
            break
        try:
            layer = layer.base
        except ArrayckptError as e:
            out.append({"path": layer.manifest.base.path, "error": str(e)})
            layer = None
    return out


def _print_info(info: dict[str, Any], width: int) -> None:
    from ._cli_text import info_lines, zarr_hint

    note = zarr_hint(t["dtype"] for t in info["tensors"].values())
    print("\n".join(info_lines(info, width, [note] if note else [])))


def _cmd_info(args: argparse.Namespace) -> int:
    from ._read.checkpoint import open_checkpoint

    with open_checkpoint(args.path, base_roots=args.base_root) as checkpoint:  # closing it closes the bases too
        info = info_dict(checkpoint)
    from ._cli_text import terminal_width, tree_lines

    width = 0 if args.wide else terminal_width()
    if args.json:
        _print_json(info)
    elif args.tree:
        print("\n".join(tree_lines(info, width)))
    else:
        _print_info(info, width)
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from ._cli_commands import cmd_gc

    return cmd_gc(args)


class _Counter:
    """A one-line progress counter on stderr, only when stderr is a terminal (free otherwise)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if self.enabled:
            percent = 100 * done / total if total else 100.0
            print(f"\r{self.what}: {human_bytes(done)} of {human_bytes(total)} ({percent:.0f}%)", end="",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=repr)
    print()


MAX_DAMAGE_LINES = 50


def _print_zarr_hint(dtypes: Iterable[str]) -> None:
    """One note for bfloat16/float8 arrays when zarr-python run without arrayckpt cannot read them here."""
    import textwrap

    from ._cli_text import terminal_width, zarr_hint

    note = zarr_hint(dtypes)
    if note:
        width = terminal_width()
        print("\n".join(textwrap.wrap(note, width, subsequent_indent="      ")) if width else note)


def _cmd_verify(args: argparse.Namespace) -> int:
    from ._tools.verify import verify

    counter = _Counter("verify")
    try:
        report = verify(args.path, progress=counter, base_roots=args.base_root)
    finally:
        counter.close()
    if args.json:
        _print_json(report.to_dict())
        return 0 if report.ok else 1
    for damage in report.damage[:MAX_DAMAGE_LINES]:
        print(f"DAMAGED {damage.key or '(checkpoint)'}: {damage.file}: {damage.problem}")
    if len(report.damage) > MAX_DAMAGE_LINES:
        print(f"... and {len(report.damage) - MAX_DAMAGE_LINES} more (--json lists all)")
    checked = f"{report.arrays} arrays, {report.chunks} chunks, {human_bytes(report.bytes_checked)} checked"
    for what in report.unprotected:
        print(f"unprotected: {what}")
    if report.ok:
        print(f"OK {report.path}: {checked}")
        from ._read.checkpoint import open_checkpoint

        with open_checkpoint(args.path, base_roots=args.base_root) as checkpoint:
            _print_zarr_hint(array.entry.dtype.name for array in checkpoint.values())
        return 0
    print(f"DAMAGED {report.path}: {len(report.damage)} problem(s) in {len(report.damaged_keys)} entr"
          f"{'y' if len(report.damaged_keys) == 1 else 'ies'} ({checked})")
    return 1


def _slice_text(text: str) -> str:
    """argparse type for SLICE: checked now, so a typo is a usage error, not a traceback."""
    from ._tools.inspect import parse_slice

    try:
        parse_slice(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _cmd_show(args: argparse.Namespace) -> int:
    from ._format.manifest import PerRankEntry, PickleEntry
    from ._read.checkpoint import open_checkpoint
    from ._tools.inspect import show

    with open_checkpoint(args.path, base_roots=args.base_root) as checkpoint:
        entry = checkpoint.manifest.entries.get(args.key)
        if entry is not None and args.key not in checkpoint:  # a plain value: show it as it is
            if isinstance(entry, PickleEntry):
                value: Any = f"<pickled value, {entry.nbytes} bytes; not unpickled>"
            elif isinstance(entry, PerRankEntry):
                from ._cli_commands import per_rank_values

                value = per_rank_values(checkpoint, args.key)
                if not args.json:
                    print(f"{args.key}: per rank ({len(value)} rank{'' if len(value) == 1 else 's'})")
                    print("\n".join(f"  rank {rank}: {text}" for rank, text in enumerate(value)))
                    return 0
            else:
                value = checkpoint.value(args.key)
            _print_json({"key": args.key, "value": value}) if args.json else print(f"{args.key} = {value!r}")
            return 0
        summary = show(checkpoint, args.key, args.slice, max_values=args.max_values)
    if args.json:
        _print_json(summary.to_dict())
        return 0
    shape = "×".join(map(str, summary.shape)) or "scalar"
    selected = "×".join(map(str, summary.selected_shape)) or "scalar"
    where = f"[{args.slice}]" if args.slice else ""
    print(f"{summary.key}{where}  {summary.dtype}  shape {shape}  selected {selected} ({summary.count} values)")
    if summary.count:
        print(f"min {summary.min}  max {summary.max}  mean {summary.mean}  std {summary.std}  "
              f"nan {summary.nan_count}  inf {summary.inf_count}")
    if summary.values is not None:
        import numpy as np

        print(np.array2string(np.asarray(summary.values), threshold=args.max_values))
    if summary.note:
        print(f"({summary.note})")
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from ._read.checkpoint import open_checkpoint
    from ._tools.inspect import diff

    roots = args.base_root
    with open_checkpoint(args.a, base_roots=roots) as a, open_checkpoint(args.b, base_roots=roots) as b:
        report = diff(a, b)
    if args.json:
        _print_json(report.to_dict())
        return 0 if report.identical else 1
    for key in report.only_in_a:
        print(f"only in A: {key}")
    for key in report.only_in_b:
        print(f"only in B: {key}")
    for key, change in report.changed.items():
        print(f"changed:   {key}: {change}")
    for t in report.tensors:
        if t.differing_elements:
            chunks = "" if t.differing_chunks is None else f", {t.differing_chunks}/{t.chunks} chunks"
            extra = f", {t.nonfinite} NaN/inf" if t.nonfinite else ""
            elements = f"{t.differing_elements} element{'' if t.differing_elements == 1 else 's'}"
            print(f"differs:   {t.key}: {elements}{chunks}, max abs {t.max_abs:.6g}, "
                  f"max rel {t.max_rel:.6g}{extra}")
    for key, (a, b) in report.values.items():
        print(f"value:     {key}: {a!r} -> {b!r}")
    same = sum(1 for t in report.tensors if not t.differing_elements)
    print("identical" if report.identical else f"{same} of {len(report.tensors)} common tensors identical")
    return 0 if report.identical else 1


def _param_count(text: str) -> int:
    from ._tools.estimate import parse_count

    try:
        return parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ._tools.estimate import estimate_size

    e = estimate_size(args.params, dtype=args.dtype, optimizer=args.optimizer, master_weights=args.master_weights,
                      ranks=args.ranks)
    if args.json:
        _print_json(e.to_dict())
        return 0
    parts = " + ".join(f"{name} {n}" for name, n in e.breakdown.items() if n)
    print(f"{e.params:,} parameters × {e.bytes_per_param} bytes ({parts}) = {human_bytes(e.total_bytes)}")
    if e.ranks > 1:
        print(f"sharded over {e.ranks} ranks: {human_bytes(e.per_rank_bytes)} per rank")
    return 0


def _cmd_interval(args: argparse.Namespace) -> int:
    import dataclasses

    from ._manage.policy import optimal_interval

    result = optimal_interval(args.blocking_seconds, args.mtbf_hours * 3600)
    overhead = result.blocking_seconds / (result.daly_seconds + result.blocking_seconds)
    if args.json:
        _print_json({**dataclasses.asdict(result), "overhead": overhead})
        return 0
    print(f"checkpoint every {result.daly_seconds / 60:.1f} min (Daly; Young: {result.young_seconds / 60:.1f} min) "
          f"for {args.blocking_seconds:g} s blocked per checkpoint and an MTBF of {args.mtbf_hours:g} h; "
          f"checkpointing then takes {100 * overhead:.2f}% of the time")
    return 0


def _size(text: str) -> int:
    """``5GB``, ``500MiB``, ``1000000`` -> bytes (for --max-shard-size)."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GB, 500MiB or 1000000")
    base = 1024 if match[3] else 1000
    return round(float(match[1]) * base ** " kmgt".index(match[2] or " "))


def _tie(text: str) -> tuple[str, str]:
    """``lm_head.weight=transformer.wte.weight`` -> the two names (for --tie)."""
    alias, sep, target = text.partition("=")
    if not (sep and alias.strip() and target.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not ALIAS=TARGET (e.g. lm_head.weight=transformer.wte.weight)")
    return alias.strip(), target.strip()


def _cmd_convert(args: argparse.Namespace) -> int:
    from ._cli_commands import cmd_convert

    return cmd_convert(args, _Counter("convert"), human_bytes)


def _cmd_compact(args: argparse.Namespace) -> int:
    from ._write.compact import compact

    counter = _Counter("compact")
    try:
        kwargs = {} if args.codec is None else {"codec": args.codec}
        result = compact(args.src, args.dst, overwrite=args.overwrite, progress=counter, base_roots=args.base_root,
                         **kwargs)
    finally:
        counter.close()
    if args.json:
        _print_json(result.to_dict())
        return 0
    print(f"compacted {' -> '.join(result.chain)} into {result.destination}: {result.arrays} arrays, "
          f"{human_bytes(result.bytes_written)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arrayckpt", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="list the tensors and values of a checkpoint")
    info.add_argument("path", help="checkpoint directory (or file:// URL)")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.add_argument("--tree", action="store_true", help="print the keys as a tree of their dotted parts")
    info.add_argument("--wide", action="store_true", help="print long keys, values and records in full, however "
                      "wide the terminal (default: every line fits it; --json: everything, for scripts)")
    info.set_defaults(func=_cmd_info)
    gc = commands.add_parser("gc", help="remove what interrupted saves left in a directory or under a prefix "
                                        "(s3://bucket/run: its incomplete checkpoints)")
    gc.add_argument("root", help="directory, or object-storage prefix (s3://bucket/run), holding checkpoints")
    gc.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                    help="only remove leftovers untouched this long (default 3600; on object storage without "
                         "modification times, memory:// or gs://, only 0 removes). A running save's is never "
                         "removed, at any age: its lock or lease marks it (spec §9.4)")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed")
    gc.add_argument("--json", action="store_true", help="print JSON")
    gc.set_defaults(func=_cmd_gc)

    verify = commands.add_parser("verify", help="read every chunk and check checksums and completeness "
                                                "(exit status 1 on damage)")
    verify.add_argument("path", help="checkpoint directory (or file:// URL)")
    verify.add_argument("--json", action="store_true", help="print JSON (every problem found)")
    verify.set_defaults(func=_cmd_verify)

    show = commands.add_parser("show", help="values and statistics of a tensor or a slice of it")
    show.add_argument("path", help="checkpoint directory (or file:// URL)")
    show.add_argument("key", help="dotted key, e.g. model.layers.0.weight")
    show.add_argument("slice", nargs="?", default="", type=_slice_text,
                      help="numpy-style slice, e.g. '0:4,::2' or '...,-1' (default: everything)")
    show.add_argument("--max-values", type=int, default=1000, help="print values of selections up to this size")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=_cmd_show)

    diff = commands.add_parser("diff", help="compare two checkpoints (exit status 1 when they differ)")
    diff.add_argument("a", help="first checkpoint")
    diff.add_argument("b", help="second checkpoint")
    diff.add_argument("--json", action="store_true", help="print JSON")
    diff.set_defaults(func=_cmd_diff)

    estimate = commands.add_parser("estimate", help="checkpoint size by the 10/14 bytes-per-parameter rule")
    estimate.add_argument("--params", type=_param_count, required=True, help="parameter count, e.g. 7B or 405e9")
    estimate.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "fp8"], default="bf16", help="weight dtype")
    estimate.add_argument("--optimizer", choices=["adam", "sgd", "none"], default="adam",
                          help="adam: fp32 m and v (8 bytes); sgd: fp32 momentum (4)")
    estimate.add_argument("--master-weights", action="store_true", help="add an fp32 master copy (4 bytes)")
    estimate.add_argument("--ranks", type=int, default=1, help="ranks the state is sharded over")
    estimate.add_argument("--json", action="store_true", help="print JSON")
    estimate.set_defaults(func=_cmd_estimate)

    interval = commands.add_parser("interval", help="optimal checkpoint interval (Young/Daly)")
    interval.add_argument("--blocking-seconds", type=_positive, required=True,
                          help="training time lost to one checkpoint, in seconds")
    interval.add_argument("--mtbf-hours", type=_positive, required=True, help="mean time between job failures")
    interval.add_argument("--json", action="store_true", help="print JSON")
    interval.set_defaults(func=_cmd_interval)

    convert = commands.add_parser("convert", help="convert from/to torch.save, safetensors, PyTorch DCP, Megatron "
                                  "torch_dist, DeepSpeed (from ZeRO or Universal, to a Universal Checkpoint); to a "
                                  "Hugging Face model directory")
    convert.add_argument("src", help="source: arrayckpt, DCP, DeepSpeed or Megatron directory, .pt file, .safetensors "
                         "file/index/dir")
    convert.add_argument("dst", help="target path (its suffix can give the format: .safetensors, .pt)")
    formats = ["arrayckpt", "dcp", "deepspeed", "hf", "megatron", "safetensors", "torch"]
    convert.add_argument("--from", dest="from_format", choices=formats,
                         help="source format (default: detected)")
    convert.add_argument("--to", dest="to_format", choices=formats,
                         help="target format (default: arrayckpt, or from the target's suffix); hf: a directory "
                              "from_pretrained loads (the model's weights only); deepspeed: a Universal Checkpoint "
                              "engine.load_checkpoint resumes with load_universal; megatron: a torch_dist directory "
                              "megatron.core.dist_checkpointing.load loads")
    convert.add_argument("--max-shard-size", type=_size, default=None, metavar="SIZE",
                         help="safetensors/hf output: shards of at most SIZE (e.g. 5GB) with an index JSON (hf "
                              "default: 50GB, as save_pretrained)")
    convert.add_argument("--select", default=None, metavar="PREFIX",
                         help="hf: the model's key prefix, stripped from the names (default: the one module under "
                              "a top-level key, e.g. model.; '' for the whole state)")
    convert.add_argument("--tie", action="append", type=_tie, default=[], metavar="ALIAS=TARGET",
                         help="hf: ALIAS holds the same tensor as TARGET and is left out (repeatable), e.g. "
                              "lm_head.weight=transformer.wte.weight")
    convert.add_argument("--config", default=None, metavar="CONFIG_JSON",
                         help="hf: config.json to copy into the output (its model's tied weights are left out)")
    convert.add_argument("--param-names", default=None, metavar="FILE",
                         help="deepspeed: the module's names of the optimizer's parameters, one per line, in the "
                              "order its param groups list them (for an optimizer saved by number whose numbers "
                              "cannot be mapped unambiguously)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing target")
    convert.add_argument("--allow-pickle", action="store_true",
                         help="store/read values only pickle can hold (only for sources you trust)")
    convert.add_argument("--json", action="store_true", help="print JSON")
    convert.set_defaults(func=_cmd_convert)

    compact = commands.add_parser("compact", help="write a delta checkpoint and its chain of bases as one full one")
    compact.add_argument("src", help="checkpoint directory or URL (a delta: its bases are read too)")
    compact.add_argument("dst", help="where the full checkpoint goes")
    compact.add_argument("--codec", default=None, help="compression of the output (default: as each tensor had)")
    compact.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at dst")
    compact.add_argument("--json", action="store_true", help="print JSON")
    compact.set_defaults(func=_cmd_compact)
    for add_parser, command in EXTRA_COMMANDS:
        add_parser(commands).set_defaults(func=command)
    for name in ("info", "verify", "show", "diff", "compact", "convert"):  # sync and report add their own
        add_base_root_option(commands.choices[name])
    return parser


# Commands that other modules add: ``(add_parser, command)`` pairs; ``add_parser(subparsers)`` adds the command's
# parser and ``command(args) -> int`` runs it (``set_defaults(func=...)`` is done here).
EXTRA_COMMANDS: list[tuple[Callable[[Any], argparse.ArgumentParser], Callable[[argparse.Namespace], int]]] = [
    (add_report_parser, report_command),
    (add_sync_parser, sync_command),
]
# The commands that read an arrayckpt checkpoint, and the arguments that name it.
READ_COMMANDS = {"info": ("path",), "verify": ("path",), "show": ("path",), "diff": ("a", "b"), "compact": ("src",),
                 "report": ("path",)}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; a bad input ends in one line on stderr and exit status 2 (1: damage or a difference),
    never a traceback; a closed output pipe (``| head``) ends quietly with status 141, as a Unix tool has."""
    from ._cli_commands import cli_message
    from ._whatis import explain_path

    args = build_parser().parse_args(argv)
    try:
        for name in READ_COMMANDS.get(args.command, ()):
            explained = explain_path(getattr(args, name))
            if explained is not None:
                print(f"arrayckpt: error: {explained}", file=sys.stderr)
                return 2
        return args.func(args)
    except BrokenPipeError:  # `arrayckpt info ... | head`: stop writing, quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout at exit: let that go nowhere
        return 141
    except ArrayckptError as e:
        message = cli_message(e)
    except ModuleNotFoundError as e:  # a part that needs torch (a per-rank tensor, ...) where torch is not installed
        if not is_missing_torch(e):
            raise
        message = f"this needs PyTorch ({e}): {TORCH_EXTRA}"
    except (KeyError, IndexError, OSError, ValueError) as e:  # a missing key or slice; unreadable/malformed input
        message = cli_message(e)
    except RecursionError:  # input nested too deeply for Python
        message = "the input is nested too deeply to be read (damaged or crafted?)"
    except MemoryError:
        message = "the input asks for more memory than there is (damaged or crafted?)"
    print(f"arrayckpt: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
