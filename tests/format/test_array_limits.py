"""The limits on an array's chunks (spec §12), on checkpoints crafted past them.

Crafted chunk grids (issue 23, item 5): a 1 KB checkpoint whose one array claims millions of chunks, root
re-sealed. Readers refuse grids over ``MAX_GRID_CHUNKS`` (spec §12) and writers never plan one; everything that
walks a grid at the limit (verify, sync, compact, diff, report, a read through a chunks delta) runs in memory
bounded by a batch, checked in a child process whose address space is capped at its baseline + 384 MiB.

A chunk's decoded size is limited too (``MAX_CHUNK_BYTES``): a chunk shape larger than its array, or one huge chunk,
is refused before anything is allocated (TensorStore would try, and abort the process with ``std::bad_alloc``:
those cases run in a subprocess with a timeout), and a save never writes a chunk readers would refuse.

Before the fixes each of these grew with the grid: ``verify`` of 2**26 one-element chunks passed 2.5 GiB in 15 s
(``itertools.product`` copies ``range(2**26)`` into a tuple), the local fast path listed (and, the chunks being
missing, raised and kept) one exception per chunk, ``diff`` summed its batch on every chunk, ``report`` listed a
writer per chunk, and a read through a chunks delta planned one read per chunk of the box.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch
from crafted import edit_metadata, probe, save_small
from helpers import write_root

import arrayckpt
from arrayckpt._format.zarr import MAX_GRID_CHUNKS, check_array_metadata, grid_indices

LIMIT = MAX_GRID_CHUNKS


def _root(path: Path) -> dict[str, Any]:
    return json.loads((path / "zarr.json").read_text())


def _craft(path: Path, chunks: int, codecs: list[dict[str, Any]] | None = None, key: str = "w",
           keep: bool = False) -> None:
    """Rewrite tensor ``key`` of the checkpoint at ``path`` to ``chunks`` one-element chunks (and ``codecs``, if
    given), its chunk files gone unless ``keep``; root re-sealed, the node document matching."""
    document = _root(path)
    manifest, metadata = document["attributes"]["arrayckpt"], document["consolidated_metadata"]["metadata"][key]
    manifest["entries"][key]["shape"] = metadata["shape"] = [chunks]
    metadata["chunk_grid"]["configuration"]["chunk_shape"] = [1]
    if codecs is not None:
        metadata["codecs"] = codecs
    write_root(path, document)
    (path / key / "zarr.json").write_text(json.dumps(metadata))
    if not keep:
        for file in (path / key).glob("c*"):
            file.unlink()


def _chunk(value: bytes) -> bytes:
    """An uncompressed chunk file: the bytes and their crc32c."""
    return value + crc32c.crc32c(value).to_bytes(4, "little")


def _crafted(root: Path, name: str, chunks: int, codecs: list[dict[str, Any]] | None = None) -> Path:
    """A checkpoint of about 1 KB whose one tensor claims ``chunks`` chunks, none of them stored."""
    path = root / name
    arrayckpt.save({"w": torch.ones(4), "step": 1}, path)
    _craft(path, chunks, codecs)
    return path


CHECKED = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
ZSTD = [CHECKED[0], {"name": "zstd", "configuration": {"level": 3, "checksum": False}}, CHECKED[1]]
SHARDED = [{"name": "sharding_indexed", "configuration": {"chunk_shape": [1], "codecs": CHECKED,
                                                          "index_codecs": CHECKED, "index_location": "end"}}]


def test_a_grid_over_the_limit_is_refused_by_every_reader(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from arrayckpt.cli import main

    path = _crafted(tmp_path, "over", 4 * LIMIT)
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 2000
    message = f"chunk grid of {4 * LIMIT} chunks exceeds the limit of {LIMIT} chunks per array"
    with pytest.raises(arrayckpt.FormatError, match=f"entry 'w': array metadata {message}"):
        arrayckpt.open(path)
    report = arrayckpt.verify(path)
    assert not report.ok and message in report.damage[0].problem and report.chunks == 0
    for command in (["info", str(path)], ["sync", str(path), str(tmp_path / "copy")],
                    ["compact", str(path), str(tmp_path / "full")], ["show", str(path), "w"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "copy").exists() and not (tmp_path / "full").exists()


def test_inner_chunks_per_outer_chunk_are_limited_too():
    metadata = {"zarr_format": 3, "node_type": "array", "shape": [2 * LIMIT], "data_type": "uint8",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2 * LIMIT]}},
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
                "codecs": [{"name": "sharding_indexed", "configuration": {"chunk_shape": [1]}}]}
    with pytest.raises(arrayckpt.FormatError, match=f"{2 * LIMIT} inner chunks per outer chunk exceed the limit"):
        check_array_metadata(metadata, (2 * LIMIT,), "uint8", "here")
    metadata["codecs"][0]["configuration"]["chunk_shape"] = [2]
    assert check_array_metadata(metadata, (2 * LIMIT,), "uint8", "here") is metadata  # LIMIT exactly: accepted


def test_a_save_never_plans_a_grid_readers_refuse():
    """Shard boundaries without a common divisor (2 and 5: gcd 1) leave one-element chunks; past the limit the
    save is refused before anything is written (it planned 2**24 + 3 chunk files before)."""
    from arrayckpt._layout.box import Box
    from arrayckpt._layout.saveplan import ArrayDescription, LocalDescription, plan_save

    def describe(n: int) -> list[LocalDescription]:
        cuts = [0, 2, 5, n]
        return [LocalDescription(arrays=(ArrayDescription("w", ("w",), "tensor", "uint8", (n,), Box((a,), (b - a,)),
                                                          0),)) for a, b in zip(cuts, cuts[1:], strict=False)]

    with pytest.raises(arrayckpt.StateError, match=f"tensor 'w' of shape \\[{LIMIT + 3}\\]: chunk grid of {LIMIT + 3} "
                                         "chunks exceeds the limit .* shard the tensor so that"):
        plan_save(describe(LIMIT + 3), None)
    assert plan_save(describe(1000), None).arrays["w"].outer_chunk == (1,)  # the same fallback, under the limit


def test_grid_indices_are_lazy_and_in_c_order():
    import itertools

    for ranges in ([range(3), range(2)], [range(2), range(70_000)], [range(70_000), range(0)], [],
                   [range(1, 3), range(70_000, 70_003), range(65_536)]):
        assert list(grid_indices(ranges)) == list(itertools.product(*ranges))
    walk = grid_indices([range(2**40), range(2**40)])  # itertools.product would copy both ranges first
    assert next(walk) == (0, 0) and next(walk) == (0, 1)


def _delta_with_crafted_grid(root: Path) -> tuple[Path, np.ndarray]:
    """A base of 2**24 bytes and a chunks delta on it whose grid claims 2**24 one-byte chunks, of which it stores
    one (chunk 0, written here with its crc32c): what reading it must give."""
    data = np.arange(LIMIT, dtype=np.uint8)
    base, delta = root / "base", root / "delta"
    arrayckpt.save({"w": torch.from_numpy(data.copy())}, base)
    changed = data.copy()
    changed[0] = 200
    arrayckpt.save({"w": torch.from_numpy(changed)}, delta, base=base)
    document, base_document = _root(delta), _root(base)
    manifest, nodes = document["attributes"]["arrayckpt"], document["consolidated_metadata"]["metadata"]
    manifest["entries"]["w"]["delta"] = {"mode": "chunks", "present": [0]}  # saved as a rows delta: made chunks
    for name in [name for name in nodes if name.startswith("w/")]:
        del nodes[name]
        manifest["chunk_digests"].pop(name, None)
    manifest["chunk_digests"]["w"] = "sha256:" + "1" * 64  # what verify would check; reads do not
    metadata = nodes["w"] = base_document["consolidated_metadata"]["metadata"]["w"]
    metadata["chunk_grid"]["configuration"]["chunk_shape"] = [1]
    metadata["codecs"] = CHECKED
    shutil.rmtree(delta / "w")
    (delta / "w").mkdir()
    (delta / "w" / "zarr.json").write_text(json.dumps(metadata))
    write_root(delta, document)
    (delta / "w" / "c.0").write_bytes(_chunk(bytes([200])))
    return delta, changed


_CHILD = r"""
import contextlib, io, json, resource, sys
import numpy as np, tensorstore, arrayckpt
from arrayckpt.cli import main

def vm(name):
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith(name + ":"))

warm, growth, cases = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
with contextlib.redirect_stdout(io.StringIO()):  # warm up: TensorStore's thread pools exist from here on
    assert main(["verify", warm]) == 0 and main(["compact", warm, warm + "-full"]) == 0
base, rss = vm("VmSize"), vm("VmRSS")
resource.setrlimit(resource.RLIMIT_AS, (base + growth, resource.getrlimit(resource.RLIMIT_AS)[1]))
results = []
for argv in cases:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps({"results": results, "peak_above_baseline": vm("VmHWM") - rss}))
"""

GROWTH = 384 << 20  # what the child may add to its address space: a list of 2**24 Python objects needs far more


def _run_capped(root: Path, cases: list[list[str]]) -> tuple[list[dict[str, Any]], int]:
    warm = root / "warm"
    arrayckpt.save({"a": torch.ones(100, 10), "b": torch.ones(10)}, warm)
    done = subprocess.run([sys.executable, "-c", _CHILD, str(warm), str(GROWTH), json.dumps(cases)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MALLOC_ARENA_MAX": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return found["results"], found["peak_above_baseline"]


@pytest.mark.slow
def test_walking_a_crafted_grid_at_the_limit_runs_in_bounded_memory(tmp_path: Path):
    """2**24 missing one-element chunks (uncompressed: the fast path; zstd and sharded: TensorStore), and a chunks
    delta claiming 2**24 chunks of which it stores one: every command answers, in bounded memory."""
    plain = _crafted(tmp_path, "plain", LIMIT)
    zstd = _crafted(tmp_path, "zstd", LIMIT, ZSTD)
    sharded = _crafted(tmp_path, "sharded", LIMIT, SHARDED)
    delta, changed = _delta_with_crafted_grid(tmp_path)
    out = tmp_path / "out"
    cases = [["verify", str(plain), "--json"], ["verify", str(zstd), "--json"], ["verify", str(sharded), "--json"],
             ["sync", str(plain), f"{out}-sync"], ["compact", str(zstd), f"{out}-compact"],
             ["diff", str(plain), str(plain)], ["show", str(sharded), "w"],
             ["report", str(plain), "-o", f"{out}.html", "--histograms", "0"],
             ["compact", str(delta), f"{out}-delta"],
             ["report", str(delta), "-o", f"{out}-delta.html", "--max-tensors", "0"]]  # its grid and delta pictures
    results, peak = _run_capped(tmp_path, cases)
    for result in results[:3]:  # verify: the first 100 damaged chunks, then it leaves the array, saying so
        assert result["code"] == 1, result
        report = json.loads(result["out"])
        assert report["chunks"] == 100 and len(report["damage"]) == 101, report
        assert all("missing" in d["problem"] for d in report["damage"][:100]), report["damage"][:3]
        assert report["damage"][100]["problem"].startswith("100 damaged chunks found: verify stopped reading")
    for result in results[3:7]:
        assert result["code"] == 2 and "missing" in result["err"] and result["err"].count("\n") == 1, result
    assert results[7]["code"] == 1 and "no tensor could be read" in results[7]["err"], results[7]
    assert results[8]["code"] == 0 and results[9]["code"] == 0, results[8:]
    assert not Path(f"{out}-sync").exists() and not Path(f"{out}-compact").exists()
    with arrayckpt.open(f"{out}-delta") as full:  # the delta read through: its one chunk, the base's others
        assert np.array_equal(full["w"].numpy(), changed)
    assert peak < GROWTH, peak


def test_verify_reports_every_damaged_chunk_up_to_a_hundred_per_array(tmp_path: Path):
    """Below the cap every damaged chunk is still reported, by file (verify reports all damage, not the first);
    past it, the array is left with a damage that says so, and the other arrays are still read."""
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.ones(300), "v": torch.ones(300)}, path)
    one = _chunk(np.float32(1).tobytes())
    for key in ("w", "v"):
        _craft(path, 300, key=key)
        for i in range(300):
            (path / key / f"c.{i}").write_bytes(one)
    for i in range(99):
        (path / "w" / f"c.{3 * i}").unlink()
    for i in range(150):
        (path / "v" / f"c.{2 * i}").unlink()
    report = arrayckpt.verify(path)
    damage = {key: [d for d in report.damage if d.key == key] for key in ("w", "v")}
    assert [d.file for d in damage["w"]] == [f"w/c.{3 * i}" for i in range(99)]  # each one, no summary
    assert [d.file for d in damage["v"][:100]] == [f"v/c.{2 * i}" for i in range(100)]
    assert len(damage["v"]) == 101 and damage["v"][100].problem.startswith("100 damaged chunks found: verify stopped")
    assert all("missing" in d.problem for d in damage["w"] + damage["v"][:100])
    assert report.chunks == 300 + 199  # v's chunks up to its 100th damaged one


def test_the_limit_is_the_one_the_spec_states():
    spec = (Path(__file__).parents[2] / "spec" / "FORMAT.md").read_text()
    assert LIMIT == 2**24 and "`MAX_GRID_CHUNKS = 2^24` (16,777,216)" in spec


# --- the size of one decoded chunk (each probe in a child process: TensorStore would abort it) --------------------


@pytest.mark.slow
def test_a_chunk_larger_than_its_array_is_refused_before_allocating(tmp_path: Path) -> None:
    path = save_small(tmp_path / "ckpt")
    edit_metadata(path, chunk_shape=[2**45, 4])
    results = probe(path, "slice,show,verify")
    for op, (kind, message) in results.items():
        assert kind in ("FormatError", "CorruptCheckpointError"), (op, kind, message)
        assert "chunk shape [35184372088832, 4] is larger than the array's shape [4, 4]" in message, (op, message)
    with pytest.raises(arrayckpt.FormatError, match=r"entry 'w': array metadata chunk shape \[35184372088832, 4\]"):
        arrayckpt.open(path)["w"]  # in this process too: refused before TensorStore sees it


@pytest.mark.slow
def test_a_huge_array_with_one_huge_chunk_is_refused_before_allocating(tmp_path: Path) -> None:
    path = save_small(tmp_path / "ckpt")
    edit_metadata(path, shape=[2**45, 4], chunk_shape=[2**45, 4])
    kind, message = probe(path, "slice")["slice"]
    assert kind == "FormatError" and "exceeds the limit of 17179869184 bytes per decoded chunk" in message, message


def test_a_save_never_writes_a_chunk_readers_would_refuse():
    """Shards with a prime row count and small rows fall back to one chunk per shard; past the readers' limit on a
    decoded chunk the save is refused with the fix, rather than writing a checkpoint nobody can read."""
    from arrayckpt._errors import StateError
    from arrayckpt._format.zarr import MAX_CHUNK_BYTES
    from arrayckpt._layout.box import Box
    from arrayckpt._layout.saveplan import ArrayDescription, LocalDescription, plan_save

    def describe(rows: int, cols: int) -> list[LocalDescription]:
        return [LocalDescription(arrays=(ArrayDescription("w", ("w",), "tensor", "float32", (2 * rows, cols),
                                                          Box((r * rows, 0), (rows, cols)), 0),)) for r in range(2)]

    prime = 4194319  # rows per rank: no divisor near any chunk target
    assert prime * 1024 * 4 > MAX_CHUNK_BYTES
    with pytest.raises(StateError, match="tensor 'w': its shards .* leave no chunk grid under"):
        plan_save(describe(prime, 1024), None)
    planned = plan_save(describe(prime, 4), None)  # the same fallback, small enough: planned as before
    assert planned.arrays["w"].outer_chunk == (prime, 4)
