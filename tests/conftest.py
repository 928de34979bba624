"""Shared fixtures: checkpoint paths and a knob that forces small chunks, so small tensors exercise
the sharded (outer/inner chunk) layout that big tensors get."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import crafted
import pytest
from policies import SHARDED, WHOLE, Chunking


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A path for one checkpoint (not yet created)."""
    return tmp_path / "ckpt"


@pytest.fixture(params=["whole", "sharded"])
def chunking(request: pytest.FixtureRequest) -> Chunking:
    """Default chunk targets, or tiny ones so that every non-trivial tensor is split and sharded: a test saves
    with ``chunking.save(state, path, **save_options)`` (``chunking.name`` is the parameter)."""
    return {"whole": WHOLE, "sharded": SHARDED}[request.param]


@pytest.fixture(params=["files", "packed"])
def storage_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Every save of the test in one layout: one file per chunk (format version 3) or packed (one pack per rank,
    version 4, spec §16), whatever its number of ranks; ranks the test spawns inherit it through the environment.
    A module whose tests hold for both says ``pytestmark = pytest.mark.usefixtures("storage_layout")``."""
    from arrayckpt._settings import override

    from_ranks = 1 if request.param == "packed" else 1 << 30
    monkeypatch.setenv("ARRAYCKPT_PACKED_FROM_RANKS", str(from_ranks))
    with override(packed_from_ranks=from_ranks):
        yield request.param


# The S3 fixtures (a moto server subprocess on 127.0.0.1, a fault-injecting proxy, a fresh bucket) and the GCS ones
# (fake-gcs-server, a fresh bucket), shared by every test module; a server starts only when a test asks for it.
from gcs_server import gcs_bucket, gcs_server  # noqa: E402, F401
from s3_server import s3_bucket, s3_proxy, s3_server  # noqa: E402, F401

# Fixtures that start a server or spawn ranks: a test asking for one (directly or through another fixture) is slow.
SLOW_FIXTURES = frozenset({"s3_server", "s3_proxy", "s3_bucket", "gcs_server", "gcs_bucket", "jobs"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that needs a :data:`SLOW_FIXTURES` fixture, so that ``pytest -m "not slow"`` never
    starts a server or spawns ranks, whoever wrote the test."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def tuned():
    """``tuned(verify_batch_bytes=1 << 20)``: other settings (``arrayckpt/_settings.py``) until the test ends."""
    from arrayckpt._settings import override

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(override(**changes))


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB tmpfs (mounting needs root, as in CI; elsewhere the test is skipped with that reason)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def claims_32_gib(tmp_path: Path) -> Path:
    """A 1.7 KB checkpoint whose (resealed) root document says ``w`` is float32[2**33]: 32 GiB in 512 chunks,
    of which ``c.0`` is the 16 bytes saved for a float32[4] (and ``missing``: not there at all)."""
    import torch

    import arrayckpt

    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.ones(4)}, path)
    n = 1 << 33

    def claim(document):
        crafted.entries(document)["w"]["shape"] = [n]
        document["attributes"]["arrayckpt"]["stored_bytes"] = 4 * n
        array = document["consolidated_metadata"]["metadata"]["w"]
        array["shape"], array["chunk_grid"]["configuration"]["chunk_shape"] = [n], [1 << 24]
    crafted.edit_root(path, claim)
    return path
