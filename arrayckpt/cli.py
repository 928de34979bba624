"""The ``arrayckpt`` command line (``arrayckpt ...``, ``python -m arrayckpt.cli ...``): :func:`main`.

The commands are in ``arrayckpt/_cli/`` (the parser and the error handling in ``main.py``, one module per group of
commands); this module is the public entry point the console script names.
"""

from __future__ import annotations

import sys

from ._cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
