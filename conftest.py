"""Collection of the package's doctests (``testpaths`` holds ``arrayckpt``): the integration of a stack that is not
installed is left out, since its module imports the stack (its tests in ``tests/`` are skipped the same way)."""

from __future__ import annotations

import importlib.util

collect_ignore = [] if importlib.util.find_spec("torchtitan") else [
    "arrayckpt/torchtitan.py", "arrayckpt/_integrations/torchtitan_manager.py"]
