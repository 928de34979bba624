"""The command line's wing: argument parsing and printing, one module per group of commands; the work itself is the
library's (``_tools``, ``_convert``, ``_write``, ``_storage``, ``_manage``). ``arrayckpt/cli.py`` is its public entry
point (``main``).

- ``main.py``: the parser (each command's own arguments are added by its module) and :func:`main`, where every error
  becomes one line on stderr and an exit status;
- ``common.py``: progress on stderr, JSON on stdout, shared argument types, ``--base-root``;
- ``info.py``: ``info`` (what a checkpoint holds, from its root document); ``text.py``: its text for a person
  (lines that fit the terminal, the writers summary, the zarr-python note);
- ``inspect.py``: ``verify``, ``show``, ``diff``;
- ``sizing.py``: ``estimate``, ``interval``;
- ``convert.py``: ``convert``, ``compact``;
- ``storage.py``: ``gc``, ``sync``;
- ``report.py``: ``report``.

No torch, numpy or TensorStore at import (``arrayckpt --help`` imports every module here): each command imports what
it needs when it runs.
"""
