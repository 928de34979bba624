"""The ``arrayckpt`` command line: inspect, verify, compare and convert checkpoints without writing Python.

``arrayckpt info PATH`` prints a table of tensors (dtype, shape, size, codec) and plain values;
``verify PATH`` reads and checks every chunk (exit status 1 on damage); ``show PATH KEY [SLICE]`` prints
values and statistics; ``diff A B`` compares two checkpoints (exit status 1 when they differ);
``convert SRC DST`` converts from and to torch.save, safetensors, PyTorch DCP and DeepSpeed; ``compact SRC DST``
turns a delta checkpoint and its bases into one full checkpoint; ``refs PATH`` writes a packed checkpoint's kerchunk
references for zarr-python; ``estimate`` and ``interval`` size checkpoints and their frequency. Paths may be URLs
(``s3://bucket/prefix``; endpoint and credentials from the standard AWS environment variables). ``--json`` prints
JSON for scripts.

This module holds the parser (each command's own arguments are added by its module) and :func:`main`, the one place
where an error becomes one line on stderr and an exit status.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from .._errors import ArrayckptError
from .._torch import TORCH_EXTRA, is_missing_torch
from .common import Commands, add_base_root_option
from .convert import add_compact, add_convert
from .info import add_info
from .inspect import add_diff, add_show, add_verify
from .report import add_report
from .sizing import add_estimate, add_interval
from .storage import add_gc, add_refs, add_sync
from .text import emit, escaped

__all__ = ["build_parser", "cli_message", "main"]

# Every command, in the order ``--help`` lists them: ``add(subparsers)`` adds its parser, with ``func`` to run.
COMMANDS: tuple[Callable[[Commands], argparse.ArgumentParser], ...] = (
    add_info, add_gc, add_verify, add_show, add_diff, add_estimate, add_interval, add_convert, add_compact,
    add_report, add_sync, add_refs,
)
# The commands that read an arrayckpt checkpoint, and the arguments that name it.
READ_COMMANDS = {"info": ("path",), "verify": ("path",), "show": ("path",), "diff": ("a", "b"), "compact": ("src",),
                 "report": ("path",), "refs": ("path",)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arrayckpt", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(commands)
    for name in ("info", "verify", "show", "diff", "compact", "convert"):  # sync, report, refs: their own
        add_base_root_option(commands.choices[name])
    return parser


def cli_message(error: BaseException) -> str:
    """An error's text in command-line terms (``--overwrite``, not ``overwrite=True``), on one line: a newline or
    other control character in it (a path or key from the checkpoint: ``a\\nb``) is escaped, not collapsed into a
    space, so that the path printed is the path on disk."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    text = text.replace("pass overwrite=True (--overwrite)", "pass --overwrite")
    text = text.replace("with overwrite=True", "with --overwrite").replace("overwrite=True", "--overwrite")
    return escaped(text.strip()) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; a bad input ends in one line on stderr and exit status 2 (1: damage or a difference),
    never a traceback; a closed output pipe (``| head``) ends quietly with status 141, as a Unix tool has."""
    from .._convert.whatis import explain_path

    args = build_parser().parse_args(argv)
    try:
        for name in READ_COMMANDS.get(args.command, ()):
            explained = explain_path(getattr(args, name))
            if explained is not None:
                emit(f"arrayckpt: error: {explained}", file=sys.stderr)
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
    except MemoryError as e:  # ours names the checkpoint and the tensor
        message = cli_message(e) if str(e) else "the input asks for more memory than there is (damaged or crafted?)"
    emit(f"arrayckpt: error: {message}", file=sys.stderr)
    return 2
