"""Crafting damaged or hostile checkpoints, and watching what arrayckpt makes of them: shared by the tests of
manifest validation, array limits, special files, converter sources and verify.

- :func:`edit_root` / :func:`entries` / :func:`edit_metadata`: change a saved checkpoint's root document (resealed
  with ``helpers.write_root``, so only the change is under test, not the checksum);
- :func:`cli_error`: run the command line and return its exit code and the one line it printed;
- :func:`probe`: run operations on a checkpoint in a fresh interpreter, for crafted inputs that TensorStore would
  abort the process on (a hang shows as a timeout, not as a slow pass).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import write_root

import arrayckpt
from arrayckpt.cli import main

PROBE_TIMEOUT_S = 60  # generous: the subprocess imports torch

_PROBE = textwrap.dedent("""
    import json, sys, torch, arrayckpt
    path, ops = sys.argv[1], sys.argv[2].split(",")
    def run(op):
        if op == "open":
            return arrayckpt.open(path)
        if op == "slice":
            return arrayckpt.open(path)["w"][0:1]
        if op == "numpy":
            return arrayckpt.open(path)["w"].numpy()
        if op == "load":
            return arrayckpt.load({"w": torch.zeros(4, 4)}, path)
        if op == "verify":
            report = arrayckpt.verify(path)
            raise arrayckpt.CorruptCheckpointError("; ".join(d.problem for d in report.damage) or "ok")
        if op == "show":
            return arrayckpt.show(path, "w")
        if op == "steps":
            return arrayckpt.CheckpointManager(sys.argv[3]).steps()
    out = {}
    for op in ops:
        try:
            out[op] = ["ok", repr(run(op))[:200]]
        except Exception as e:
            out[op] = [type(e).__name__, str(e)]
    print(json.dumps(out))
""")


def probe(path: Path, ops: str, *extra: str) -> dict[str, list[str]]:
    """Run ``ops`` (comma-separated: open, slice, numpy, load, verify, show, steps) on the checkpoint at ``path`` in a
    fresh interpreter: {op: [exception name or 'ok', message]}."""
    done = subprocess.run([sys.executable, "-c", _PROBE, str(path), ops, *extra], capture_output=True, text=True,
                          timeout=PROBE_TIMEOUT_S)
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def save_small(path: Path, codec: str | None = None) -> Path:
    """A checkpoint of one 4 x 4 float32 tensor ``w`` (what :func:`probe` reads)."""
    arrayckpt.save({"w": torch.arange(16.0).reshape(4, 4)}, path, codec=codec)
    return path


def edit_root(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """Apply ``change`` to the root document of the checkpoint at ``path`` and write it back, resealed."""
    document = json.loads((path / "zarr.json").read_text())
    change(document)
    write_root(path, document)


def entries(document: dict[str, Any]) -> dict[str, Any]:
    """The manifest's entries in a root document."""
    return document["attributes"]["arrayckpt"]["entries"]


def edit_metadata(path: Path, **changes: object) -> None:
    """Change fields of array ``w``'s consolidated metadata (and the manifest's shape, if given)."""
    document = json.loads((path / "zarr.json").read_text())
    metadata = document["consolidated_metadata"]["metadata"]["w"]
    if "shape" in changes:
        metadata["shape"] = changes["shape"]
        document["attributes"]["arrayckpt"]["entries"]["w"]["shape"] = changes["shape"]
    if "chunk_shape" in changes:
        metadata["chunk_grid"]["configuration"]["chunk_shape"] = changes["chunk_shape"]
    write_root(path, document)


def cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Run the command line with ``args``: its exit code and what it printed on stderr."""
    code = main(list(args))
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, match: str) -> None:
    """The command failed with exit code 2 and one line ``arrayckpt: error: ...`` containing ``match``."""
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("arrayckpt: error: "), err
    assert match in lines[0], err
