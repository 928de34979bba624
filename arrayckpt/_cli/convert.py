"""``arrayckpt convert SRC DST`` (from and to torch.save, safetensors, PyTorch DCP, Megatron ``torch_dist`` and
``fsdp_dtensor``, DeepSpeed and ``torch_checkpointing``; to a Hugging Face model directory) and ``compact SRC DST``
(a delta checkpoint and its bases as one full checkpoint)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from .._errors import FormatError
from .._tools.estimate import human_bytes
from .common import Commands, Counter, print_json
from .text import emit

__all__ = ["add_compact", "add_convert"]

FORMATS = ["arrayckpt", "dcp", "deepspeed", "hf", "megatron", "peft", "safetensors", "torch", "torch_checkpointing"]


def add_convert(commands: Commands) -> argparse.ArgumentParser:
    """Add ``convert`` to the command line's subparsers."""
    convert = commands.add_parser("convert", help="convert from/to torch.save, safetensors, PyTorch DCP, Megatron "
                                  "torch_dist and fsdp_dtensor, DeepSpeed (from ZeRO or Universal, to a Universal "
                                  "Checkpoint), torch_checkpointing; to a Hugging Face model directory")
    convert.add_argument("src", help="source: arrayckpt, DCP, DeepSpeed, Megatron or torch_checkpointing directory, "
                         ".pt file, .safetensors file/index/dir")
    convert.add_argument("dst", help="target path (its suffix can give the format: .safetensors, .pt)")
    convert.add_argument("--from", dest="from_format", choices=FORMATS,
                         help="source format (default: detected)")
    convert.add_argument("--to", dest="to_format", choices=FORMATS,
                         help="target format (default: arrayckpt, or from the target's suffix); hf: a directory "
                              "from_pretrained loads (the model's weights only); deepspeed: a Universal Checkpoint "
                              "engine.load_checkpoint resumes with load_universal; megatron: a torch_dist directory "
                              "megatron.core.dist_checkpointing.load loads (or fsdp_dtensor: --ckpt-format); peft: a "
                              "LoRA adapter directory PeftModel.from_pretrained loads; torch_checkpointing: a "
                              "directory its CheckpointManager loads")
    convert.add_argument("--max-shard-size", type=size, default=None, metavar="SIZE",
                         help="safetensors/hf output: shards of at most SIZE (e.g. 5GB) with an index JSON (hf "
                              "default: 50GB, as save_pretrained)")
    convert.add_argument("--select", default=None, metavar="PREFIX",
                         help="hf, peft: the model's key prefix, stripped from the names (default: the one module "
                              "under a top-level key, e.g. model.; '' for the whole state)")
    convert.add_argument("--tie", action="append", type=tie, default=[], metavar="ALIAS=TARGET",
                         help="hf: ALIAS holds the same tensor as TARGET and is left out (repeatable), e.g. "
                              "lm_head.weight=transformer.wte.weight")
    convert.add_argument("--config", default=None, metavar="CONFIG_JSON",
                         help="hf: config.json to copy into the output (its model's tied weights are left out); peft: "
                              "the adapter_config.json to write (default: the one the checkpoint records)")
    convert.add_argument("--adapter", default=None, metavar="NAME",
                         help="peft: the adapter to export (of several), or the name to import it under (default: "
                              "default)")
    convert.add_argument("--key-prefix", default="", metavar="PREFIX",
                         help="into arrayckpt: store the source's keys under PREFIX (e.g. model, so that "
                              "arrayckpt.load({'model': model}, ...) finds a Hugging Face model's weights)")
    convert.add_argument("--param-names", default=None, metavar="FILE",
                         help="deepspeed: the module's names of the optimizer's parameters, one per line, in the "
                              "order its param groups list them (for an optimizer saved by number whose numbers "
                              "cannot be mapped unambiguously)")
    convert.add_argument("--ckpt-format", default=None, choices=["torch_dist", "fsdp_dtensor"],
                         help="megatron: the layout written, as Megatron-LM's --ckpt-format (default: torch_dist; "
                              "fsdp_dtensor: Megatron-FSDP's DCP of the flattened state); a source's is detected")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing target")
    convert.add_argument("--allow-pickle", action="store_true",
                         help="store/read values only pickle can hold (only for sources you trust)")
    convert.add_argument("--json", action="store_true", help="print JSON")
    convert.set_defaults(func=cmd_convert)
    return convert


def add_compact(commands: Commands) -> argparse.ArgumentParser:
    """Add ``compact`` to the command line's subparsers."""
    compact = commands.add_parser("compact", help="write a delta checkpoint and its chain of bases as one full one")
    compact.add_argument("src", help="checkpoint directory or URL (a delta: its bases are read too)")
    compact.add_argument("dst", help="where the full checkpoint goes")
    compact.add_argument("--codec", default=None, help="compression of the output (default: as each tensor had)")
    compact.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at dst")
    compact.add_argument("--json", action="store_true", help="print JSON")
    compact.set_defaults(func=cmd_compact)
    return compact


def size(text: str) -> int:
    """``5GB``, ``500MiB``, ``1000000`` -> bytes (for --max-shard-size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GB, 500MiB or 1000000")
    base = 1024 if match[3] else 1000
    return round(float(match[1]) * base ** " kmgt".index(match[2] or " "))


def tie(text: str) -> tuple[str, str]:
    """``lm_head.weight=transformer.wte.weight`` -> the two names (for --tie)."""
    alias, sep, target = text.partition("=")
    if not (sep and alias.strip() and target.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not ALIAS=TARGET (e.g. lm_head.weight=transformer.wte.weight)")
    return alias.strip(), target.strip()


def cmd_convert(args: argparse.Namespace) -> int:
    from .._convert.dispatch import convert

    counter = Counter("convert")
    try:
        result = convert(args.src, args.dst, from_format=args.from_format, to_format=args.to_format,
                         overwrite=args.overwrite, allow_pickle=args.allow_pickle,
                         max_shard_bytes=args.max_shard_size, select=args.select, tie=dict(args.tie) or None,
                         config=args.config, progress=counter, base_roots=args.base_root,
                         param_names=_param_names(args.param_names), key_prefix=args.key_prefix,
                         adapter=args.adapter, ckpt_format=args.ckpt_format)
    finally:
        counter.close()
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        print()
        return 0
    took = f" ({result.selected}* with the prefix stripped)" if result.selected else ""
    emit(f"converted {result.source_format} {args.src} -> {result.target_format} {args.dst}: {result.tensors} "
          f"tensors{took}, {human_bytes(result.bytes)}")
    if result.tied:
        emit("left out as tied: " + ", ".join(f"{alias} (= {name})" for alias, name in result.tied.items()))
    if result.skipped:
        shown = ", ".join(result.skipped[:10]) + (f" ... ({len(result.skipped)} in all)" if len(result.skipped) > 10
                                                  else "")
        why = "not the model's weights" if result.target_format == "hf" else f"{result.target_format} cannot hold them"
        emit(f"not converted ({why}): {shown}", file=sys.stderr)
    for note in result.notes:
        emit(f"note: {note}", file=sys.stderr)
    return 0


def _param_names(path: str | None) -> list[str] | None:
    """``--param-names FILE``: one name per line (blank lines ignored)."""
    if path is None:
        return None
    from .._io.smallfiles import read_user_file

    try:
        text = read_user_file(path, "the parameter names (one a line)").decode()
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: the parameter names are not UTF-8 text ({e.reason} at byte {e.start})") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def cmd_compact(args: argparse.Namespace) -> int:
    from .._write.compact import compact

    counter = Counter("compact")
    try:
        kwargs = {} if args.codec is None else {"codec": args.codec}
        result = compact(args.src, args.dst, overwrite=args.overwrite, progress=counter, base_roots=args.base_root,
                         **kwargs)
    finally:
        counter.close()
    if args.json:
        print_json(result.to_dict())
        return 0
    emit(f"compacted {' -> '.join(result.chain)} into {result.destination}: {result.arrays} arrays, "
          f"{human_bytes(result.bytes_written)}")
    return 0
