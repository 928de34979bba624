"""What the commands share: progress on stderr, JSON on stdout, the argument types that turn a typo into a usage
error (not a traceback), and the ``--base-root`` option of the commands that read a delta's chain.

Imports nothing heavy: ``arrayckpt --help`` builds every command's parser.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TypeAlias

from .._tools.estimate import human_bytes

__all__ = ["Commands", "Counter", "add_base_root_option", "positive", "print_json"]

# What ``ArgumentParser.add_subparsers`` returns: every command adds its parser to it (``add_info(commands)``...).
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class Counter:
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


def print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2, default=repr)
    print()


def positive(text: str) -> float:
    """argparse type: a positive finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def add_base_root_option(parser: argparse.ArgumentParser) -> None:
    """``--base-root DIR_OR_URL`` (repeatable), for the commands that read a delta checkpoint's chain of bases:
    where bases may be besides the directory (prefix) holding each checkpoint (spec §10.1)."""
    parser.add_argument("--base-root", action="append", default=None, metavar="DIR_OR_URL",
                        help="also read (and, for sync, place) a delta checkpoint's bases inside this directory or "
                             "URL; repeatable (by default only bases beside the checkpoint are read: spec §10.1)")
