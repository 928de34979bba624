"""Test helpers shared by several test modules."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from arrayckpt._format.integrity import INTEGRITY_MEMBER, PLACEHOLDER, seal

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


#: Pins a test of a module marked ``usefixtures("storage_layout")`` to the files layout (format version 3): it crafts
#: damage to chunk files or node documents, which a packed checkpoint does not have.
FILES_LAYOUT_ONLY = pytest.mark.parametrize("storage_layout", ["files"], indirect=True)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (every bit pattern, NaNs included, for exact round-trip checks)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bit-exact comparison (NaN == NaN, -0 != +0)."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(bits(a), bits(b))


def run_group(command: list[str], env: dict[str, str] | None, timeout: float, what: str,
              cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``command`` in a process group of its own; on a timeout the whole group is killed (the ranks a launcher
    spawned too, which a kill of the launcher alone leaves running) and the test fails saying so."""
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                          start_new_session=True) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            pytest.fail(f"{what} ran past {timeout:.0f} s and was killed with its process group:\n{out[-3000:]}\n"
                        f"{err[-6000:]}")
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def run_example(name: str, *args: str) -> str:
    """Run ``examples/<name>`` as a user would; returns its stdout, failing with both streams shown."""
    root = Path(__file__).resolve().parents[1]
    proc = run_group([sys.executable, str(root / "examples" / name), *args], None, 300, f"examples/{name}", cwd=root)
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, output
    return proc.stdout


def sealed(document: object) -> bytes:
    """A root document serialised with its checksum recomputed, as if arrayckpt had written it: tests that edit a
    root document on purpose test what a reader checks after the checksum (which would otherwise refuse it)."""
    attributes = document.get("attributes") if isinstance(document, dict) else None
    manifest = attributes.get("arrayckpt") if isinstance(attributes, dict) else None
    if not isinstance(manifest, dict):
        return json.dumps(document).encode()
    manifest[INTEGRITY_MEMBER] = PLACEHOLDER
    return seal(json.dumps(document).encode())


def write_root(path: Path, document: object) -> None:
    """Replace the root ``zarr.json`` of the checkpoint at ``path`` by ``document``, resealed (:func:`sealed`)."""
    (Path(path) / "zarr.json").write_bytes(sealed(document))


def crash(writer: object) -> None:
    """What the death of a save's process leaves, done in this process to an open storage writer: locally its
    temporary directory's lock is gone; on object storage its lease stops being renewed and is left to expire (here
    rewritten as expired, as if its TTL had passed)."""
    hold = getattr(writer, "_hold", None)
    if hold is not None:
        hold.release()
    lease = getattr(writer, "_lease", None)
    if lease is not None:
        lease._stop.set()
        lease._thread.join()
        lease.store.write(lease.key, dataclasses.replace(lease.holder, expires=time.time() - 1).encode()).result()
        lease._generation = None  # nothing deletes it now


def stored_chunks(path: str | os.PathLike[str], array: str) -> dict[str, int]:
    """The chunk key -> stored size of every chunk file of array ``array`` of the local checkpoint at ``path``, in
    either layout: the files below the array's directory, or the rows of its section of a packed checkpoint's
    table (spec §16)."""
    import arrayckpt
    from arrayckpt._format.packs import stored_chunk_keys
    from arrayckpt._read.checkpoint import stored_of

    with arrayckpt.open(path) as checkpoint:
        stored = stored_of(checkpoint)
        if stored.packed is None:
            return {p.name: p.stat().st_size for p in (Path(path) / array).iterdir() if p.name != "zarr.json"}
        rows = stored.packed.rows([array])[array]
        keys = stored_chunk_keys(stored.nodes[array], checkpoint.manifest.delta_chunks.get(array))
        return {key: int(row[2]) for key, row in zip(keys, rows, strict=True)}


def nodes_of(document: dict) -> dict:
    """The node metadata (path -> ``zarr.json`` document) of a parsed root document, in either layout: its
    consolidated metadata, or a packed root's ``attributes.arrayckpt.nodes`` (spec §16.1). The dict itself, so that
    a test crafting a root edits it in place."""
    if "consolidated_metadata" in document:
        return document["consolidated_metadata"]["metadata"]
    return document["attributes"]["arrayckpt"]["nodes"]


def zarr_group(path: str | os.PathLike[str]):  # -> zarr.Group (zarr imported here only)
    """The local checkpoint at ``path`` as zarr-python opens it without arrayckpt, in either layout: the directory
    itself, or a packed one through its kerchunk references (``docs/guide/reading-without-arrayckpt.md``)."""
    import zarr

    path = Path(path)
    if not (path / "refs.json").exists():
        return zarr.open_group(str(path), mode="r")
    return zarr.open_group("reference://", mode="r", zarr_format=3, storage_options={
        "fo": str(path / "refs.json"), "remote_protocol": "dir", "remote_options": {
            "path": str(path), "asynchronous": True, "target_protocol": "async_wrapper",
            "target_options": {"target_protocol": "file", "target_options": {}, "asynchronous": True}}})
