"""Fault campaign: flip one bit in every byte of every file of small checkpoints and classify what reading does.

For each kind of checkpoint (full, sharded, zstd, delta, per-rank, pickled) the script saves a small state into a
temp dir, then for every byte (every ``--stride``-th) of every file of that checkpoint (the root ``zarr.json``
included) xors one bit (``--bit``, default 0x01), runs ``arrayckpt.verify`` and a full read (``arrayckpt.open`` with
``allow_pickle=True``, every tensor's ``.numpy()``, every per-rank item, every plain value), restores the byte and
classifies the trial:

* detected: ``verify`` reports damage or raises an ``ArrayckptError``, or the read raises one;
* harmless: nothing reported and the read gives back exactly the original values (e.g. a flip inside a JSON
  string that is never used, or one that still parses to the same document);
* silent: nothing reported but the values read back differ (a bug);
* crash: some other exception (a bug; the first few are printed);
* hang: verify + read did not finish within ``--timeout`` seconds (run in a worker thread).

A kill sweep (``--kills N``) then starts a subprocess that saves, with ``overwrite=True``, to one path in a loop
(every element of every tensor equal to the iteration number) and SIGKILLs it after a random delay; the path must
then be absent or one whole saved state ("damaged" otherwise).

Liveness races (``--races N``, spec §9.4): N saves (small chunks: many chunk files) beside a collector that runs
without a minimum age, in four ways: ``arrayckpt gc`` looping in another process beside local saves; a manager's
own ``clean_up(min_age_s=0)`` after each asynchronous save; ``gc`` looping in a thread beside first saves on
``memory://``; and a second ``CheckpointManager`` on the root of one that saves in another process (each of its
saves must be refused). Each save that returns normally is verified and read back: "damaged" counts those that
then fail (the target is 0); "refused" the saves that raised, "interleaved" a second manager's saves that went
through.

The hostile-paths campaign (``benchmarks/faults_paths.py``: crafted node keys, chunk keys, base references and
symbolic links through every command, a sentinel tree hashed around every trial; ``--no-paths`` skips it, ``--no-s3``
its moto part) runs last.

    python benchmarks/faults.py                          # all kinds, defaults (zarr.json files: every 4th byte)
    python benchmarks/faults.py --kinds full,delta --json-stride 1 --kills 0 --json faults.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fractions
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import faults_paths
import numpy as np
import torch

import arrayckpt
from arrayckpt._format.manifest import PerRankEntry
from arrayckpt._layout.chunking import ChunkPolicy
from arrayckpt._write.options import SaveOptions, SaveSetup
from arrayckpt._write.save import save_with

KINDS = ("full", "sharded", "zstd", "delta-chunk", "delta-row", "delta-quant", "per-rank", "pickled")


def _base_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 16, generator=g),  # 512 bytes
        "emb": torch.randn(32, 4, generator=g),  # 512 bytes, rows for the deltas
        "h": torch.randn(10, 10, generator=g).to(torch.bfloat16),  # 200 bytes
        "n": torch.arange(12, dtype=torch.int64),
        "step": 7,
        "opt": {"lr": 0.125, "name": "adam"},
    }


def build(kind: str, root: Path) -> Path:
    """Save the checkpoint of ``kind`` under ``root``; return the path whose files are flipped."""
    state = _base_state()
    path = root / kind
    if kind == "full":
        arrayckpt.save(state, path)
    elif kind == "sharded":
        save_with(state, path, SaveOptions(),
                  SaveSetup(chunking=ChunkPolicy(inner_chunk_bytes=64, outer_chunk_bytes=256)))
    elif kind == "zstd":
        arrayckpt.save(state, path, codec="zstd")
    elif kind.startswith("delta"):
        base = root / f"{kind}.base"
        save_with(state, base, SaveOptions(),
                  SaveSetup(chunking=ChunkPolicy(inner_chunk_bytes=64, outer_chunk_bytes=256)))
        state["w"][0, :4] += 1.0  # one chunk of "w" changes
        rows = torch.tensor([3, 17])
        state["emb"][rows] -= 0.5
        state["step"] = 8
        options: dict[str, Any] = {}
        if kind in ("delta-row", "delta-quant"):
            options["changed_rows"] = {"emb": rows}
        if kind == "delta-quant":
            options["quantize"] = {"emb": 8}
        save_with(state, path, SaveOptions(base=base, **options),
                  SaveSetup(chunking=ChunkPolicy(inner_chunk_bytes=64, outer_chunk_bytes=256)))
    elif kind == "per-rank":
        state["rng"] = arrayckpt.PerRank(torch.arange(16, dtype=torch.uint8))
        state["cursor"] = arrayckpt.PerRank({"epoch": 2, "offset": 100})
        arrayckpt.save(state, path)
    elif kind == "pickled":
        state["frac"] = fractions.Fraction(3, 7)
        state["tags"] = {"a", "b", "c"}
        arrayckpt.save(state, path, allow_pickle=True)
    else:
        raise ValueError(kind)
    return path


def _norm(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.numpy() if value.dtype != torch.bfloat16 else value.view(torch.int16).numpy()
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_norm(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _norm(v)) for k, v in value.items())))
    return ("value", repr(value))


def read_all(path: Path) -> dict[str, Any]:
    """Everything the checkpoint holds, normalised for comparison."""
    ckpt = arrayckpt.open(path, allow_pickle=True)
    out: dict[str, Any] = {}
    for key in ckpt:
        a = ckpt[key].numpy()
        out[key] = _norm(a)
    for key, value in ckpt.plain_values.items():
        out["value:" + key] = _norm(value)
    for key, entry in ckpt.manifest.entries.items():
        if isinstance(entry, PerRankEntry):
            out["per_rank:" + key] = _norm(ckpt.per_rank(key))
    out["step"] = ckpt.step
    return out


def trial(path: Path, expected: dict[str, Any]) -> tuple[str, str | None]:
    """(outcome, detail) of verify + full read; "crash" comes back as a raised exception."""
    detected = None
    try:
        report = arrayckpt.verify(path)
        if not report.ok:
            detected = "verify: " + str(report.damage[0]) if getattr(report, "damage", None) else "verify"
    except arrayckpt.ArrayckptError as e:
        detected = f"verify raised {type(e).__name__}"
    try:
        got = read_all(path)
    except arrayckpt.ArrayckptError as e:
        return "detected", detected or f"read raised {type(e).__name__}"
    if detected:
        return "detected", detected
    if got == expected:
        return "harmless", None
    diff = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
    return "silent", "differs: " + ", ".join(diff)


def campaign(kind: str, path: Path, stride: int, json_stride: int, bit: int, timeout: float,
             findings: list[dict[str, Any]], max_print: int) -> dict[str, int]:
    expected = read_all(path)
    assert arrayckpt.verify(path).ok, kind
    counts = dict.fromkeys(("trials", "detected", "harmless", "silent", "crash", "hang"), 0)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        data = bytearray(file.read_bytes())
        step = json_stride if file.name == "zarr.json" else stride
        for offset in range(0, len(data), step):
            original = data[offset]
            data[offset] = original ^ bit
            file.write_bytes(data)
            try:
                outcome, detail = pool.submit(trial, path, expected).result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                outcome, detail = "hang", f"no result in {timeout} s"
                pool.shutdown(wait=False)  # the stuck thread is abandoned
                pool = concurrent.futures.ThreadPoolExecutor(1)
            except Exception as e:  # noqa: BLE001 - everything that is not an ArrayckptError is a finding
                outcome = "crash"
                detail = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                tb = traceback.extract_tb(e.__traceback__)
                if tb:
                    detail += f"  [at {tb[-1].filename}:{tb[-1].lineno} {tb[-1].name}]"
            finally:
                data[offset] = original
                file.write_bytes(data)
            counts["trials"] += 1
            counts[outcome] += 1
            if outcome in ("silent", "crash", "hang"):
                rel = str(file.relative_to(path))
                findings.append({"kind": kind, "file": rel, "byte": offset, "outcome": outcome, "detail": detail})
                if sum(f["outcome"] == outcome for f in findings) <= max_print:
                    print(f"  {outcome}: {kind} {rel} byte {offset}: {detail}", flush=True)
    pool.shutdown(wait=False)
    return counts


_SAVER = textwrap.dedent("""
    import sys, torch, arrayckpt
    path = sys.argv[1]
    i = 0
    while True:
        i += 1
        state = {"a": torch.full((64,), i, dtype=torch.int64), "b": torch.full((8, 8), float(i)),
                 "c": torch.full((5,), i, dtype=torch.int32), "i": i}
        arrayckpt.save(state, path, overwrite=True)
        print(i, flush=True)
""")


def _whole(path: Path) -> bool:
    ckpt = arrayckpt.open(path)
    i = ckpt.plain_values["i"]
    if sorted(ckpt) != ["a", "b", "c"]:
        return False
    return all(bool((ckpt[k].numpy() == i).all()) for k in ckpt) and arrayckpt.verify(path).ok


def kill_sweep(kills: int, root: Path, seed: int, findings: list[dict[str, Any]]) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"kills": 0, "whole": 0, "absent": 0, "damaged": 0}
    for n in range(kills):
        path = root / f"kill{n}" / "ckpt"
        path.parent.mkdir()
        child = subprocess.Popen([sys.executable, "-c", _SAVER, str(path)], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        child.stdout.readline()  # one save done: torch is imported, the loop is running
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        counts["kills"] += 1
        if not path.exists():
            counts["absent"] += 1
            continue
        try:
            ok = _whole(path)
            detail = "mixed iterations or verify failed"
        except Exception as e:  # noqa: BLE001
            ok, detail = False, f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if ok:
            counts["whole"] += 1
        else:
            counts["damaged"] += 1
            findings.append({"kind": "kill", "file": str(path), "byte": None, "outcome": "damaged", "detail": detail})
            print(f"  damaged after kill {n}: {detail}", flush=True)
    return counts


# --- the CLI garbage-input corpus (issue 23): every command on every bad input, no traceback ---------------------

CLI_COMMANDS = [
    ["info", "{bad}"], ["info", "{bad}", "--json"], ["info", "{bad}", "--tree"], ["verify", "{bad}"],
    ["verify", "{bad}", "--json"], ["show", "{bad}", "w"], ["show", "{bad}", "w", "0:2"], ["diff", "{bad}", "{good}"],
    ["diff", "{good}", "{bad}"], ["compact", "{bad}", "{out}"], ["convert", "{bad}", "{out}"],
    ["convert", "{bad}", "{out}.safetensors"], ["convert", "{bad}", "{out}.pt"], ["convert", "{bad}", "{out}",
                                                                                  "--to", "dcp"],
    ["report", "{bad}", "-o", "{out}.html", "--histograms", "1"], ["sync", "{bad}", "{out}"],
    ["gc", "{bad}", "--dry-run"],
]
CLI_ARGUMENTS = [  # argument values, not files: each must be a one-line usage error or a result
    ["estimate", "--params", "1e400"], ["estimate", "--params", "-5"], ["estimate", "--params", "nan"],
    ["estimate", "--params", "1e18", "--ranks", "0"], ["estimate", "--params", "7B", "--ranks", "-3"],
    ["interval", "--blocking-seconds", "inf", "--mtbf-hours", "1"], ["interval", "--blocking-seconds", "1e308",
                                                                      "--mtbf-hours", "1e-308"],
    ["show", "{good}", "w", "::-1"], ["show", "{good}", "w", "9999"], ["show", "{good}", "w", "[0]"],
    ["show", "{good}", "nope"], ["convert", "{good}", "{out}", "--max-shard-size", "-1GB"],
    ["report", "{good}", "-o", "{out}.html", "--grids", "-1"], ["gc", "{good}", "--min-age", "nan"],
]


def _crafted_grid(path: Path, chunks: int) -> None:
    """A 1 KB checkpoint whose one tensor claims ``chunks`` one-element chunks, root re-sealed, chunks gone."""
    from arrayckpt._format.integrity import INTEGRITY_MEMBER, PLACEHOLDER, seal

    arrayckpt.save({"w": torch.ones(4)}, path)
    document = json.loads((path / "zarr.json").read_text())
    manifest, metadata = document["attributes"]["arrayckpt"], document["consolidated_metadata"]["metadata"]["w"]
    manifest["entries"]["w"]["shape"] = metadata["shape"] = [chunks]
    metadata["chunk_grid"]["configuration"]["chunk_shape"] = [1]
    manifest[INTEGRITY_MEMBER] = PLACEHOLDER
    (path / "zarr.json").write_bytes(seal(json.dumps(document).encode()))
    (path / "w" / "zarr.json").write_text(json.dumps(metadata))
    (path / "w" / "c.0").unlink()


def cli_corpus(root: Path, seed: int, mutations: int) -> dict[str, Path]:
    """The bad inputs: random bytes, empty and truncated files of every format, lying headers, a malicious pickle,
    a truncated ``.distcp``, crafted chunk grids (over and at the limit), a directory whose name is not UTF-8, a
    symlink loop, and ``mutations`` checkpoints whose root document had a random JSON value put somewhere (root
    re-sealed)."""
    import os
    import struct

    import torch.distributed.checkpoint as dcp

    rng = random.Random(seed)
    root.mkdir(parents=True)
    good = root / "good"
    arrayckpt.save({"w": torch.arange(8.0), "step": 1}, good)
    corpus: dict[str, Path] = {"missing": root / "missing"}
    (corpus.setdefault("empty-dir", root / "empty-dir")).mkdir()
    for name, data in (("empty.pt", b""), ("random.bin", rng.randbytes(4096)), ("zip-header.pt", b"PK\x03\x04" * 8),
                       ("huge-header.safetensors", struct.pack("<Q", 2**62) + b"{}"),
                       ("lying.safetensors", _safetensors_header(json.dumps({"w": {
                           "dtype": "F32", "shape": [10**9], "data_offsets": [0, 4 * 10**9]}}).encode())),
                       ("nested.safetensors", _safetensors_header(b"[" * 100_000 + b"]" * 100_000))):
        corpus[name] = root / name
        corpus[name].write_bytes(data)
    whole = root / "whole.pt"
    torch.save({"w": torch.ones(100), "b": torch.zeros(3)}, whole)
    data = whole.read_bytes()
    for i, n in enumerate(sorted(rng.sample(range(1, len(data)), 6))):
        corpus[f"truncated-{i}.pt"] = root / f"truncated-{i}.pt"
        corpus[f"truncated-{i}.pt"].write_bytes(data[:n])
    torch.save({"x": _Evil(str(root / "pwned"))}, root / "evil.pt")
    corpus["evil.pt"] = root / "evil.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(16, 4), "cfg": {"lr": 0.5}}, checkpoint_id=root / "dcp-truncated", no_dist=True)
    for file in (root / "dcp-truncated").glob("*.distcp"):
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    corpus["dcp-truncated"] = root / "dcp-truncated"
    for name, chunks in (("grid-over-limit", 2**26), ("grid-at-limit", 2**24)):
        _crafted_grid(root / name, chunks)
        corpus[name] = root / name
    odd = Path(os.fsdecode(bytes(root) + b"/odd\xff"))
    arrayckpt.save({"w": torch.ones(3)}, odd / "ckpt")
    corpus["non-utf8-dir"] = odd / "ckpt"
    (root / "loop").symlink_to(root / "loop")
    corpus["symlink-loop"] = root / "loop"
    document = json.loads((good / "zarr.json").read_text())
    for i in range(mutations):
        path = root / f"mutated-{i}"
        shutil.copytree(good, path)
        _cli_mutate(path, document, rng)
        corpus[f"mutated-{i}"] = path
    corpus["good"] = good
    return corpus


def _safetensors_header(raw: bytes) -> bytes:
    import struct

    return struct.pack("<Q", len(raw)) + raw + b"\0" * 16


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (f"touch {self.marker}",))


def _cli_mutate(path: Path, document: dict[str, Any], rng: random.Random) -> None:
    """Put a random or hostile JSON value at a random place of the root document and re-seal it."""
    import copy

    from arrayckpt._format.integrity import INTEGRITY_MEMBER, PLACEHOLDER, seal

    mutated = copy.deepcopy(document)
    places: list[tuple[Any, Any]] = []

    def collect(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            places.append((node, key))
            collect(value)

    collect(mutated)
    node, key = rng.choice(places)
    node[key] = rng.choice([None, True, -1, 0, 2**63, 2**70, 1e308, "", "../../etc", "/abs", "%", [], {},
                            [2**40] * 3, "bfloat16", "pickle", {"$tuple": 1}, [[[[]]]], "\udcff", 0.5])
    manifest = mutated.get("attributes", {}).get("arrayckpt") if isinstance(mutated.get("attributes"), dict) else None
    if isinstance(manifest, dict):
        manifest[INTEGRITY_MEMBER] = PLACEHOLDER
        try:
            raw = seal(json.dumps(mutated).encode())
        except (AssertionError, UnicodeEncodeError):
            raw = json.dumps(mutated, ensure_ascii=True).encode()
    else:
        raw = json.dumps(mutated, ensure_ascii=True).encode()
    (path / "zarr.json").write_bytes(raw)


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_symlink()} if root.exists() else set()


def cli_trial(argv: list[str], timeout: float) -> tuple[str, str]:
    """(outcome, detail) of one command run in this process: ``ok`` (status 0), ``refused`` (status 1 or 2 and
    one line ``arrayckpt: error: …``, or argparse's usage error), ``unclear`` (another status, or other stderr),
    ``crash`` (an exception escaped ``main``: a traceback), ``hang`` (no answer within ``timeout``)."""
    import contextlib
    import io

    from arrayckpt.cli import main

    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                return main(argv)
            except SystemExit as e:  # argparse: usage errors
                return int(e.code or 0)

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        code = pool.submit(run).result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return "hang", f"no answer in {timeout} s"
    except BaseException as e:  # noqa: BLE001 - what escaped main is the finding
        tb = traceback.extract_tb(e.__traceback__)
        where = f"  [at {tb[-1].filename}:{tb[-1].lineno}]" if tb else ""
        return "crash", f"{type(e).__name__}: {e}".splitlines()[0][:300] + where
    finally:
        pool.shutdown(wait=False)
    text = err.getvalue()
    if code == 0:
        return "ok", ""
    lines = text.strip().splitlines()
    usage = bool(lines) and lines[0].startswith("usage:") and lines[-1].startswith("arrayckpt") \
        and ": error: " in lines[-1]  # argparse: the usage (wrapped), then one line
    if code in (1, 2) and "Traceback" not in text and (usage or (len(lines) == 1 and lines[0].startswith(
            "arrayckpt: error: ")) or (code == 1 and not lines)):
        return "refused", lines[-1][:300] if lines else "damage reported"
    return "unclear", f"status {code}: {text.strip()[:300]!r}"


def cli_campaign(root: Path, seed: int, mutations: int, timeout: float, findings: list[dict[str, Any]],
                 max_print: int) -> dict[str, int]:
    """Every command of ``CLI_COMMANDS`` on every input of :func:`cli_corpus`, and ``CLI_ARGUMENTS``: counts of
    each outcome of :func:`cli_trial`, plus ``leftover`` (a failed command left files, or a pickle ran)."""
    corpus = cli_corpus(root / "cli", seed, mutations)
    good = corpus.pop("good")
    out = root / "cli-out" / "target"
    counts = dict.fromkeys(("trials", "ok", "refused", "unclear", "crash", "hang", "leftover"), 0)
    trials = [(command, name) for command in CLI_COMMANDS for name in corpus]
    trials += [(command, "good") for command in CLI_ARGUMENTS]
    for command, name in trials:
        shutil.rmtree(out.parent, ignore_errors=True)
        fill = {"bad": str(corpus.get(name, good)), "good": str(good), "out": str(out)}
        argv = [part.format(**fill) for part in command]
        before = _listing(root / "cli")
        outcome, detail = cli_trial(argv, timeout)
        counts["trials"] += 1
        counts[outcome] += 1
        left = _listing(out.parent) if outcome != "ok" else set()
        if command[0] == "report" and ("could not be read" in detail or "no tensor could be read" in detail):
            left -= {out.name + ".html"}  # status 1: the picture is written, and lists the damage
        if outcome != "hang" and (left or _listing(root / "cli") != before or (root / "cli" / "pwned").exists()):
            counts["leftover"] += 1
            outcome, detail = "leftover", f"left {sorted(left)[:3]} (or changed the corpus, or ran a pickle)"
        if outcome in ("unclear", "crash", "hang", "leftover"):
            findings.append({"kind": "cli", "file": name, "byte": None, "outcome": outcome,
                             "detail": f"{' '.join(command)}: {detail}"})
            if sum(f["outcome"] == outcome for f in findings) <= max_print:
                print(f"  {outcome}: arrayckpt {' '.join(command)} ({name}): {detail}", flush=True)
    return counts


_GC_LOOP = textwrap.dedent("""
    import sys, arrayckpt
    print("ready", flush=True)
    while True:
        arrayckpt.gc(sys.argv[1], min_age_s=0)
""")

_HOLDER = textwrap.dedent("""
    import sys, torch, arrayckpt
    manager = arrayckpt.CheckpointManager(sys.argv[1], retention=arrayckpt.Retention(keep_last=2))
    step = 0
    while True:
        step += 1
        manager.save(step, {"a": torch.full((64,), step, dtype=torch.int64), "i": step})
        print(step, flush=True)
""")


def _race_state(i: int) -> dict[str, Any]:
    return {"a": torch.full((64,), i, dtype=torch.int64), "b": torch.full((8, 16), float(i)),
            "c": torch.full((40,), i, dtype=torch.int32), "i": i}


def _race_whole(path: Any, i: int) -> bool:
    """The checkpoint at ``path`` verifies and holds save ``i``'s state exactly."""
    ckpt = arrayckpt.open(path)
    return (ckpt.plain_values["i"] == i and all(bool((ckpt[k].numpy() == i).all()) for k in ("a", "b", "c"))
            and arrayckpt.verify(path).ok)


def _race_save(save: Any, path: Any, i: int, counts: dict[str, int], findings: list[dict[str, Any]],
               race: str) -> None:
    """One save of a race, classified: refused (it raised), whole, or damaged (returned, then failed)."""
    try:
        save()
    except arrayckpt.ArrayckptError:
        counts["refused"] += 1
        return
    counts["returned"] += 1
    try:
        ok, detail = _race_whole(path, i), "verify failed or values differ"
    except Exception as e:  # noqa: BLE001
        ok, detail = False, f"{type(e).__name__}: {e}".splitlines()[0][:300]
    if not ok:
        counts["damaged"] += 1
        findings.append({"kind": race, "file": str(path), "byte": None, "outcome": "damaged", "detail": detail})
        print(f"  damaged ({race}) after save {i}: {detail}", flush=True)


def gc_races(saves: int, root: Path, findings: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The collectors beside saves (see the module docstring); counts per race."""
    import threading
    import uuid

    from arrayckpt._layout.chunking import ChunkPolicy

    small = ChunkPolicy(inner_chunk_bytes=64, outer_chunk_bytes=256)
    out = {}

    counts = dict.fromkeys(("saves", "returned", "refused", "damaged"), 0)
    local = root / "race-gc"
    local.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _GC_LOOP, str(local)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for i in range(1, saves + 1):
            path = local / f"s{i % 4}"
            counts["saves"] += 1
            _race_save(lambda p=path, n=i: save_with(_race_state(n), p, SaveOptions(overwrite=True),
                                                     SaveSetup(chunking=small)),
                       path, i, counts, findings, "gc-process")
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    out["gc (another process) beside local saves"] = counts

    counts = dict.fromkeys(("saves", "returned", "refused", "damaged"), 0)
    manager = arrayckpt.CheckpointManager(root / "race-clean-up", asynchronous=True,
                                          retention=arrayckpt.Retention(keep_last=3))

    def save_and_clean_up(n: int) -> None:
        manager.save(n, _race_state(n))  # returns once staged: the save runs in the background ...
        manager.clean_up(min_age_s=0)  # ... while the clean-up runs
        manager.wait()

    for i in range(1, saves + 1):
        counts["saves"] += 1
        _race_save(lambda n=i: save_and_clean_up(n), manager.path(i), i, counts, findings, "clean-up")
    manager.close()
    out["clean_up(min_age_s=0) beside async saves of its manager"] = counts

    counts = dict.fromkeys(("saves", "returned", "refused", "damaged"), 0)
    bucket = f"memory://race-{uuid.uuid4().hex[:12]}/run"
    stop = threading.Event()

    def collect() -> None:
        while not stop.is_set():
            arrayckpt.gc(bucket, min_age_s=0)

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    try:
        for i in range(1, saves + 1):
            path = f"{bucket}/s{i}"
            counts["saves"] += 1
            _race_save(lambda p=path, n=i: save_with(_race_state(n), p, SaveOptions(), SaveSetup(chunking=small)),
                       path, i, counts, findings, "gc-object-storage")
    finally:
        stop.set()
        collector.join()
    out["gc (a thread) beside first saves on memory://"] = counts
    return out


def manager_race(saves: int, root: Path, findings: list[dict[str, Any]]) -> dict[str, int]:
    """A second manager on the root of one that saves in another process: each of its saves must be refused, and
    the first manager's steps must stay whole."""
    import warnings

    counts = {"saves": 0, "refused": 0, "interleaved": 0, "warned": 0, "holder damaged": 0}
    where = root / "race-managers"
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(where)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "1"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = arrayckpt.CheckpointManager(where)
        counts["warned"] = sum("another CheckpointManager holds this root" in str(w.message) for w in caught)
        for i in range(1, saves + 1):
            counts["saves"] += 1
            try:
                second.save(10**6 + i, {"a": torch.full((64,), -i, dtype=torch.int64), "i": -i})
            except arrayckpt.CheckpointBusyError:
                counts["refused"] += 1
                continue
            counts["interleaved"] += 1
            findings.append({"kind": "managers", "file": str(where), "byte": None, "outcome": "interleaved",
                             "detail": f"a second manager's save {i} went through"})
        child.stdout.readline()
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    with arrayckpt.CheckpointManager(where) as after:  # (the holder is gone: its lock with it)
        steps = after.steps()
    for step in (s for s in steps if s < 10**6):  # the holder's steps (a second manager's would be 10**6 + i)
        path = where / f"step-{step:08d}"
        try:
            ckpt = arrayckpt.open(path)
            whole = (ckpt.plain_values["i"] == step and bool((ckpt["a"].numpy() == step).all())
                     and arrayckpt.verify(path).ok)
        except arrayckpt.ArrayckptError:
            whole = False
        counts["holder damaged"] += not whole
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    p.add_argument("--stride", type=int, default=1, help="flip every Nth byte of chunk/data files (default 1)")
    p.add_argument("--json-stride", type=int, default=4,
                   help="flip every Nth byte of zarr.json files (default 4: they are ~85%% of the bytes; 1 for all)")
    p.add_argument("--bit", type=lambda s: int(s, 0), default=0x01, help="xor mask (default 0x01)")
    p.add_argument("--timeout", type=float, default=10.0, help="per-trial seconds before a hang is counted")
    p.add_argument("--kills", type=int, default=20, help="random-kill sweep size (0: none)")
    p.add_argument("--races", type=int, default=0, help="saves per liveness race (gc, clean_up, two managers; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-print", type=int, default=5, help="findings of each outcome printed")
    p.add_argument("--dir", default=None, help="where the temp dir goes")
    p.add_argument("--json", default=None, help="write results and findings as JSON here")
    p.add_argument("--cli", type=int, default=20, metavar="N",
                   help="CLI garbage-input corpus, with N mutated root documents (-1: skip the corpus)")
    _add_paths_arguments(p)
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            p.error(f"unknown kind {k!r}")
    json_stride = args.json_stride
    print(f"stride {args.stride} (zarr.json files: {json_stride}), bit mask {args.bit:#04x}, "
          f"timeout {args.timeout} s, kills {args.kills}", flush=True)
    findings: list[dict[str, Any]] = []
    results: dict[str, dict[str, int]] = {}
    root = Path(tempfile.mkdtemp(prefix="arrayckpt-faults-", dir=args.dir))
    t0 = time.perf_counter()
    try:
        for kind in kinds:
            start = time.perf_counter()
            path = build(kind, root)
            results[kind] = campaign(kind, path, args.stride, json_stride, args.bit, args.timeout, findings,
                                     args.max_print)
            print(f"{kind}: {results[kind]} ({time.perf_counter() - start:.1f} s)", flush=True)
        sweep = kill_sweep(args.kills, root, args.seed, findings) if args.kills else None
        cli = cli_campaign(root, args.seed, args.cli, args.timeout, findings, args.max_print) if args.cli >= 0 else None
        races = gc_races(args.races, root, findings) if args.races else {}
        managers = manager_race(args.races, root, findings) if args.races else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    paths, paths_bad = _hostile_paths(args, findings)
    cols = ("trials", "detected", "harmless", "silent", "crash", "hang")
    print()
    print("| kind | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for kind, c in results.items():
        print(f"| {kind} | " + " | ".join(str(c[x]) for x in cols) + " |")
    total = {x: sum(c[x] for c in results.values()) for x in cols}
    print("| **total** | " + " | ".join(str(total[x]) for x in cols) + " |")
    if sweep is not None:
        print()
        print("| kill sweep | kills | whole | absent | damaged |")
        print("|---|---|---|---|---|")
        print(f"| save loop, SIGKILL | {sweep['kills']} | {sweep['whole']} | {sweep['absent']} | {sweep['damaged']} |")
    if cli is not None:
        print("\n| CLI corpus | " + " | ".join(cli) + " |\n" + "|---" * (len(cli) + 1) + "|")
        print("| every command × every bad input | " + " | ".join(str(v) for v in cli.values()) + " |")
    if races:
        print()
        print("| race | saves | returned | refused | damaged |")
        print("|---|---|---|---|---|")
        for race, c in races.items():
            print(f"| {race} | {c['saves']} | {c['returned']} | {c['refused']} | {c['damaged']} |")
    if managers is not None:
        print()
        print("| second manager on a held root | saves | refused | interleaved | warned | holder damaged |")
        print("|---|---|---|---|---|---|")
        print(f"| local, the holder saving in another process | {managers['saves']} | {managers['refused']} | "
              f"{managers['interleaved']} | {managers['warned']} | {managers['holder damaged']} |")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "results": results, "total": total, "kill_sweep": sweep, "races": races,
            "managers": managers, "cli": cli, "findings": findings, "hostile_paths": paths,
        }, indent=2, default=str))
    bad = total["silent"] + total["crash"] + total["hang"] + (sweep["damaged"] if sweep else 0) + paths_bad
    bad += sum(c["damaged"] for c in races.values())
    bad += (managers["interleaved"] + managers["holder damaged"]) if managers else 0
    bad += sum(cli[k] for k in ("unclear", "crash", "hang", "leftover")) if cli else 0
    return 1 if bad else 0


# --- hostile paths (issue 23 items 1 and 2): the campaign lives in faults_paths.py --------------------------------


def _add_paths_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--paths", action=argparse.BooleanOptionalAction, default=True,
                   help="run the hostile-paths campaign too (crafted node, chunk and base keys, links; "
                        "benchmarks/faults_paths.py)")
    faults_paths.add_arguments(p)


def _hostile_paths(args: argparse.Namespace, findings: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, int]:
    """The hostile-paths campaign's counts by family and its number of bad outcomes (``--no-paths``: none)."""
    if not args.paths:
        return None, 0
    print("\nhostile paths: crafted node keys, chunk keys, base references and links", flush=True)
    return faults_paths.run(args, findings)


if __name__ == "__main__":
    sys.exit(main())

