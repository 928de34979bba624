"""Hostile-paths campaign (issue 23, items 1 and 2): checkpoints crafted to reach outside their own tree.

Part of the fault campaign (``benchmarks/faults.py --paths``; runnable alone: ``python benchmarks/faults_paths.py``).
Each *variant* is a small checkpoint crafted one way, re-sealed with a valid root checksum (which anyone can
compute):

* node keys in the consolidated metadata that leave the checkpoint or name no node: ``..`` (alone and through a
  real node), absolute, percent-encoded, backslashes, NUL, empty, very long; each with a group and an array document;
* chunk key encodings whose keys could leave the array (separators ``/../``, ``\\``, empty; an unknown name);
* base references: outside the directory holding the delta (relative, absolute, ``file://``), climbing above ``/``,
  not starting with ``../``, the checkpoint itself or inside it, backslashes, NUL, encoded ``..``, very long;
* symbolic links inside the checkpoint: in place of a chunk file, an array's directory, a node's ``zarr.json``, the
  root ``zarr.json``, each pointing into the sentinel directory;
* on S3 (moto, ``--s3``): a crafted node key on a checkpoint in the bucket, and an object key with ``..`` segments
  under a step prefix (what another tool may create) seen by ``gc`` and by deleting a step.

Each variant is run through every command that reads or writes checkpoints (``open`` + every tensor, ``load``,
``verify``, ``copy``, ``sync``, ``compact``, ``convert`` to safetensors, ``info``, a manager's ``restore``, DCP's
``ArrayckptReader``, ``gc``) in a worker thread with a timeout. Beside the checkpoints lies a *sentinel* directory
(another committed checkpoint, a user's files, a file byte-identical to one of the crafted checkpoint's chunks):
the listing and hashes of everything outside the command's own output directory must be unchanged after every
trial. Outcomes:

* refused: an ``ArrayckptError`` (the CLI: exit status 2, one line; ``verify``: damage reported) naming the key,
  reference or link, nothing changed, nothing left in the output directory;
* harmless: it worked, read exactly the pristine values, and changed nothing outside its output;
* silent: it worked but read other values (data from outside the checkpoint), or a refusal did not name the culprit;
* escape: something outside the output directory changed (or a refused command left data in it);
* crash: another exception, or a traceback from the CLI; hang: no result within ``--timeout`` seconds.

Target: 0 silent, 0 escapes, 0 crash, 0 hang.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import arrayckpt
from arrayckpt._format.integrity import INTEGRITY_MEMBER, PLACEHOLDER, seal

OUTCOMES = ("trials", "refused", "harmless", "silent", "escape", "crash", "hang")
GROUP = {"zarr_format": 3, "node_type": "group", "attributes": {}}
NODE_KEYS = ["../../sentinel/victim", "../../sentinel/outside", "/tmp/arrayckpt-campaign-victim",
             "w/../../../sentinel/victim", "%2E%2E/%2E%2E/sentinel", "..\\..\\sentinel", "w\x00x", "",
             "a/" * 4000 + "b", "extra", "step/%r0"]
ENCODINGS = [{"name": "default", "configuration": {"separator": "/../"}},
             {"name": "v2", "configuration": {"separator": "\\"}},
             {"name": "default", "configuration": {"separator": ""}}, {"name": "../../sentinel"}]
BASE_REFERENCES = ["../../../sentinel/base", "ABSOLUTE", "FILE_URL", "../" * 64 + "etc", "step-00000001",
                   "../step-00000002", "../step-00000002/w", "..", "..\\step-00000001", "../step-00000001\x00",
                   "..%2F..%2F..%2Fsentinel%2Fbase", "../" + "x" * 5000, "../a/../step-00000001"]
CKPT = "src/step-00000003"  # the pristine checkpoint of the node-key, chunk-key and symlink variants
LINKS = ("chunk file", "array directory", "node document", "root document")


# --- the sentinel tree and snapshots ----------------------------------------------------------------------------


def snapshot(root: Path, skip: str = "out") -> dict[str, str]:
    """Everything below ``root`` except ``skip`` (links not followed): a file's SHA-256, a link's target."""
    out: dict[str, str] = {}
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(directory, name)
            relative = str(path.relative_to(root))
            if relative.split("/")[0] == skip:
                continue
            out[relative] = ("link:" + os.readlink(path) if path.is_symlink() else "dir" if path.is_dir()
                             else hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(16, generator=g), "u": torch.randn(4, 4, generator=g), "step": 3,
            "r": arrayckpt.PerRank(torch.arange(3.0))}


def _seal(path: Path, document: dict[str, Any]) -> None:
    document["attributes"]["arrayckpt"][INTEGRITY_MEMBER] = PLACEHOLDER
    (path / "zarr.json").write_bytes(seal(json.dumps(document).encode()))


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    document = json.loads((path / "zarr.json").read_text())
    change(document)
    _seal(path, document)


def make_tree(root: Path) -> None:
    """``sentinel``: a committed checkpoint (``victim``), a user's files, an array directory shaped like ``w`` of
    ``CKPT`` with other values (``outside``), and the base that crafted references point at; ``CKPT``: the
    pristine checkpoint every variant starts from; ``src/run/step-00000001`` and ``-2``: a chain whose reference
    the base variants edit."""
    arrayckpt.save({"v": torch.full((4,), 7.0)}, root / "sentinel/victim")
    (root / "sentinel/notes.txt").write_text("the user's own file")
    (root / "sentinel/outside").mkdir()
    arrayckpt.save(_state(), root / CKPT)
    other = _state()
    other["w"] *= 2  # the same layout, other values: a reader that follows a link or a crafted key reads these
    arrayckpt.save(other, root / "other")
    shutil.move(root / "other/w/c.0", root / "sentinel/outside/c.0")
    shutil.move(root / "other/w/zarr.json", root / "sentinel/outside/zarr.json")
    shutil.rmtree(root / "other")
    state = _state()
    state["u"] += 100  # another state than the chain's own base: a reader that follows a crafted reference differs
    arrayckpt.save(state, root / "sentinel/base")
    state = _state()
    arrayckpt.save(state, root / "src/run/step-00000001")
    state["w"][0] += 1
    arrayckpt.save(state, root / "src/run/step-00000002", base=root / "src/run/step-00000001")


# --- variants ---------------------------------------------------------------------------------------------------


def variants() -> Iterator[tuple[str, str, Callable[[Path], Path]]]:
    """(family, name, craft): ``craft(root)`` crafts a copy of a pristine checkpoint and returns its path."""
    for key in NODE_KEYS:
        for kind in ("group", "array"):
            def craft(root: Path, key: str = key, kind: str = kind) -> Path:
                path = _fresh(root, CKPT)
                _edit(path, lambda d: d["consolidated_metadata"]["metadata"].__setitem__(
                    key, GROUP if kind == "group" else d["consolidated_metadata"]["metadata"]["w"]))
                return path
            yield "node key", f"{kind} {key!r}"[:60], craft
    for encoding in ENCODINGS:
        def craft_encoding(root: Path, encoding: dict = encoding) -> Path:
            path = _fresh(root, CKPT)
            _edit(path, lambda d: d["consolidated_metadata"]["metadata"]["w"].__setitem__("chunk_key_encoding",
                                                                                          encoding))
            return path
        yield "chunk key", json.dumps(encoding), craft_encoding
    for reference in BASE_REFERENCES:
        def craft_base(root: Path, reference: str = reference) -> Path:
            path = _fresh(root, "src/run/step-00000002")
            target = {"ABSOLUTE": str(root / "sentinel/base"), "FILE_URL": f"file://{root / 'sentinel/base'}"}
            _edit(path, lambda d: d["attributes"]["arrayckpt"]["base"].update(
                path=target.get(reference, reference), id=_id(root / "sentinel/base")
                if reference in ("ABSOLUTE", "FILE_URL", "../../../sentinel/base") else d["attributes"]["arrayckpt"]
                ["base"]["id"]))
            return path
        yield "base reference", repr(reference)[:60], craft_base
    for where in LINKS:
        yield "symlink", where, lambda root, where=where: _linked(root, where)


def _id(path: Path) -> str:
    return json.loads((path / "zarr.json").read_text())["attributes"]["arrayckpt"]["id"]


def _fresh(root: Path, name: str) -> Path:
    """A fresh copy of the pristine ``name`` (kept under ``pristine``) at its place."""
    pristine, path = root / "pristine" / name, root / name
    if not pristine.exists():
        shutil.copytree(path, pristine, symlinks=True)
    shutil.rmtree(path)
    shutil.copytree(pristine, path, symlinks=True)
    return path


def _linked(root: Path, where: str) -> Path:
    path = _fresh(root, CKPT)
    if where == "chunk file":
        (path / "w/c.0").unlink()
        os.symlink(root / "sentinel/outside/c.0", path / "w/c.0")
    elif where == "array directory":
        shutil.rmtree(path / "w")
        os.symlink(root / "sentinel/outside", path / "w")
    elif where == "node document":
        (path / "w/zarr.json").unlink()
        os.symlink(root / "sentinel/outside/zarr.json", path / "w/zarr.json")
    else:
        (root / "sentinel/root.json").write_bytes((path / "zarr.json").read_bytes())
        (path / "zarr.json").unlink()
        os.symlink(root / "sentinel/root.json", path / "zarr.json")
    return path


# --- commands ---------------------------------------------------------------------------------------------------


def _read_all(path: Path, out: Path) -> Any:
    with arrayckpt.open(path) as ckpt:
        return {key: ckpt[key][...].tobytes() for key in ckpt} | {"values": dict(ckpt.plain_values)}


def _load(path: Path, out: Path) -> Any:
    state = _state()
    state = {k: v for k, v in state.items() if not isinstance(v, arrayckpt.PerRank)}
    state = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    arrayckpt.load(state, path, strict=False)
    return {k: v.numpy().tobytes() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _verify(path: Path, out: Path) -> Any:
    report = arrayckpt.verify(path)
    if not report.ok:
        raise _Reported(" ".join(f"{d.file}: {d.problem}" for d in report.damage))
    return "ok"


def _cli(*argv: str) -> Callable[[Path, Path], Any]:
    def run(path: Path, out: Path) -> Any:
        from arrayckpt.cli import main
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            code = main([a.format(src=path, out=out) for a in argv])
        text = stderr.getvalue()
        if "Traceback" in text or code not in (0, 2):
            raise RuntimeError(f"exit status {code}: {text[-300:]}")
        if code == 2:
            raise _Reported(text)
        return "ok"
    return run


def _manager(path: Path, out: Path) -> Any:
    """The crafted checkpoint restored as a step of a manager whose root is the directory holding it."""
    state = {"w": torch.zeros(16), "u": torch.zeros(4, 4)}
    arrayckpt.CheckpointManager(path.parent).restore(state, step=int(path.name.removeprefix("step-")), strict=False)
    return {k: v.numpy().tobytes() for k, v in state.items()}


def _dcp(path: Path, out: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    from arrayckpt.dcp import ArrayckptReader
    state = {"w": torch.zeros(16), "u": torch.zeros(4, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load(state, storage_reader=ArrayckptReader(path), no_dist=True)
        except dcp.api.CheckpointException as e:
            raise next(iter(e.failures.values()))[0] from None
    return {k: v.numpy().tobytes() for k, v in state.items()}


def _gc(path: Path, out: Path) -> Any:
    return sorted(map(str, arrayckpt.gc(path.parent, min_age_s=0)))


def _written(write: Callable[[Path, Path], Any]) -> Callable[[Path, Path], Any]:
    """A command that writes ``out/ckpt``, then reads it back; when the copy is refused on reading (a base named
    in full is copied as a reference, which readers then refuse), what was written is removed: the refusal is the
    read's, and the campaign checks the output directory is empty after every refusal."""
    def run(path: Path, out: Path) -> Any:
        write(path, out / "ckpt")
        try:
            return _read_all(out / "ckpt", out)
        except arrayckpt.ArrayckptError:
            shutil.rmtree(out / "ckpt")
            raise
    return run


COMMANDS: dict[str, Callable[[Path, Path], Any]] = {
    "open": _read_all, "load": _load, "verify": _verify,
    "copy": _written(arrayckpt.copy),
    "sync": _cli("sync", "{src}", "{out}/ckpt"),
    "compact": _written(arrayckpt.compact),
    "convert": lambda path, out: arrayckpt.convert(path, out / "m.safetensors").tensors,
    "info": _cli("info", "{src}"), "manager": _manager, "dcp": _dcp, "gc": _gc,
}


class _Reported(Exception):
    """A refusal that was reported rather than raised (``verify``'s damage, the CLI's exit status 2)."""


# --- the campaign -----------------------------------------------------------------------------------------------


def _expected(root: Path, family: str) -> dict[str, Any]:
    """What each command gives on the pristine checkpoint of a family (the harmless outcome)."""
    name = "src/run/step-00000002" if family == "base reference" else CKPT
    path = _fresh(root, name)
    out: dict[str, Any] = {}
    for command, run in COMMANDS.items():
        target = root / "out"
        target.mkdir()
        try:
            out[command] = run(path, target)
        except Exception as e:  # noqa: BLE001 - the pristine checkpoint must not fail: say so loudly
            raise RuntimeError(f"{command} fails on the pristine {name}: {e}") from e
        finally:
            shutil.rmtree(target, ignore_errors=True)
    return out


def _culprit(family: str, name: str) -> str:
    """What a refusal must name: the key or reference as quoted (a prefix: long ones are cut), or the link."""
    if family == "symlink":
        return "symbolic link"
    if family == "chunk key":
        return "chunk_key_encoding"
    return name.split(" ", 1)[1][:40] if family == "node key" else name[:40]


def trial(root: Path, family: str, name: str, craft: Callable[[Path], Path], command: str,
          expected: Any) -> tuple[str, str | None]:
    path = craft(root)
    before = snapshot(root)
    out = root / "out"
    out.mkdir()
    detail: str | None = None
    try:
        got = COMMANDS[command](path, out)
        outcome = "harmless" if got == expected else "silent"
        detail = None if outcome == "harmless" else "worked, with other values than the pristine checkpoint's"
    except (arrayckpt.ArrayckptError, _Reported) as e:
        text = str(e)
        outcome = "refused" if _culprit(family, name) in text or family in ("base reference",) and \
            ("base" in text) else "silent"
        detail = None if outcome == "refused" else f"refused without naming it: {text[:200]}"
        if outcome == "refused" and snapshot(out, skip="") not in ({},):
            outcome, detail = "escape", "a refused command left data in its output directory"
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if snapshot(root) != before:
        changed = sorted(set(snapshot(root).items()) ^ set(before.items()))
        outcome, detail = "escape", f"changed outside its output: {changed[:3]}"
        _fresh(root, "sentinel")  # the next trials start from the pristine sentinel again
    return outcome, detail


def campaign(root: Path, timeout: float, findings: list[dict[str, Any]], max_print: int,
             families: tuple[str, ...] | None = None) -> dict[str, dict[str, int]]:
    """Every variant through every command; counts by family (see the module docstring)."""
    make_tree(root)
    _fresh(root, "sentinel")  # keeps a pristine copy, restored after an escape
    counts: dict[str, dict[str, int]] = {}
    expected = {family: _expected(root, family) for family in ("node key", "base reference")}
    expected["chunk key"] = expected["symlink"] = expected["node key"]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    for family, name, craft in variants():
        if families and family not in families:
            continue
        row = counts.setdefault(family, dict.fromkeys(OUTCOMES, 0))
        for command in COMMANDS:
            future = pool.submit(trial, root, family, name, craft, command, expected[family][command])
            try:
                outcome, detail = future.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                outcome, detail = "hang", f"no result in {timeout} s"
                pool.shutdown(wait=False)
                pool = concurrent.futures.ThreadPoolExecutor(1)
            except Exception as e:  # noqa: BLE001 - anything else is a finding
                tb = traceback.extract_tb(e.__traceback__)
                outcome = "crash"
                detail = f"{type(e).__name__}: {e}".splitlines()[0][:300] + \
                    (f"  [at {tb[-1].filename}:{tb[-1].lineno}]" if tb else "")
            row["trials"] += 1
            row[outcome] += 1
            if outcome in ("silent", "escape", "crash", "hang"):
                findings.append({"kind": f"paths/{family}", "file": name, "byte": command, "outcome": outcome,
                                 "detail": detail})
                if sum(f["outcome"] == outcome for f in findings) <= max_print:
                    print(f"  {outcome}: {family} {name} / {command}: {detail}", flush=True)
    pool.shutdown(wait=False)
    return counts


def s3_campaign(root: Path, findings: list[dict[str, Any]]) -> dict[str, int]:
    """The object-storage part (moto): a crafted node key copied both ways and opened; an object key with ``..``
    segments under a step prefix, seen by ``gc`` (incomplete step) and by deleting a committed step. The bucket's
    other objects (a victim checkpoint at its root) must stay as they were."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from s3_server import S3Server, patched_environ, s3_test_env

    from arrayckpt._storage import parse_location
    row = dict.fromkeys(OUTCOMES, 0)
    with patched_environ(s3_test_env()), S3Server() as server:
        server.client.create_bucket(Bucket="campaign")
        options = {"endpoint_url": server.endpoint}
        arrayckpt.copy(root / "sentinel/victim", "s3://campaign/victim", dst_options=options)
        bucket = lambda: {o["Key"]: o["ETag"] for o in server.client.list_objects_v2(  # noqa: E731
            Bucket="campaign").get("Contents", [])}
        crafted = _fresh(root, CKPT)
        _edit(crafted, lambda d: d["consolidated_metadata"]["metadata"].__setitem__("../../victim", GROUP))
        for file in sorted(p for p in crafted.rglob("*") if p.is_file()):
            server.client.put_object(Bucket="campaign", Key=f"crafted/{file.relative_to(crafted)}",
                                     Body=file.read_bytes())
        for step, committed in (("run/step-00000001", False), ("run/step-00000002", True)):
            pristine = root / CKPT
            for file in sorted(p for p in pristine.rglob("*") if p.is_file()):
                if committed or file.name != "zarr.json" or file.parent != pristine:
                    server.client.put_object(Bucket="campaign", Key=f"{step}/{file.relative_to(pristine)}",
                                             Body=file.read_bytes())
            server.client.put_object(Bucket="campaign", Key=f"{step}/../../victim/zarr.json", Body=b"{}")
        calls = {
            "copy local->s3": lambda: arrayckpt.copy(crafted, "s3://campaign/run/copy", dst_options=options),
            "copy s3->local": lambda: arrayckpt.copy("s3://campaign/crafted", root / "out/ckpt", src_options=options),
            "open s3": lambda: arrayckpt.open("s3://campaign/crafted", storage_options=options),
            "gc s3": lambda: arrayckpt.gc("s3://campaign/run", min_age_s=0, storage_options=options),
            "delete step s3": lambda: parse_location("s3://campaign/run/step-00000002", options).delete(),
        }
        for name, call in calls.items():
            before, local = bucket(), snapshot(root)
            try:
                call()
                outcome = "harmless"
            except arrayckpt.ArrayckptError:
                outcome = "refused"
            except Exception as e:  # noqa: BLE001
                outcome = "crash"
                findings.append({"kind": "paths/s3", "file": name, "byte": None, "outcome": "crash",
                                 "detail": f"{type(e).__name__}: {e}"[:300]})
            shutil.rmtree(root / "out", ignore_errors=True)
            now = bucket()
            outside = {k for k in set(before) | set(now) if before.get(k) != now.get(k)
                       and not k.startswith(("run/copy/", "run/step-"))}
            if outside or snapshot(root) != local:
                outcome = "escape"
                findings.append({"kind": "paths/s3", "file": name, "byte": None, "outcome": "escape",
                                 "detail": f"changed: {sorted(outside)[:3]}"})
            row["trials"] += 1
            row[outcome] += 1
    return row


def print_table(counts: dict[str, dict[str, int]]) -> dict[str, int]:
    print()
    print("| family | " + " | ".join(OUTCOMES) + " |")
    print("|---" * (len(OUTCOMES) + 1) + "|")
    for family, row in counts.items():
        print(f"| {family} | " + " | ".join(str(row[x]) for x in OUTCOMES) + " |")
    total = {x: sum(row[x] for row in counts.values()) for x in OUTCOMES}
    print("| **total** | " + " | ".join(str(total[x]) for x in OUTCOMES) + " |")
    return total


def run(args: argparse.Namespace, findings: list[dict[str, Any]]) -> tuple[dict[str, dict[str, int]], int]:
    """The campaign as ``faults.py --paths`` runs it: counts by family, and how many bad outcomes."""
    root = Path(tempfile.mkdtemp(prefix="arrayckpt-paths-", dir=args.dir))
    start = time.perf_counter()
    try:
        counts = campaign(root, args.timeout, findings, args.max_print)
        if args.s3:
            shutil.rmtree(root)
            root.mkdir()
            make_tree(root)
            counts["object storage"] = s3_campaign(root, findings)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = print_table(counts)
    print(f"hostile paths: {time.perf_counter() - start:.0f} s")
    return counts, total["silent"] + total["escape"] + total["crash"] + total["hang"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True,
                        help="include the object-storage variants (a moto server; default on)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=20.0, help="per-trial seconds before a hang is counted")
    p.add_argument("--max-print", type=int, default=5, help="findings of each outcome printed")
    p.add_argument("--dir", default=None, help="where the temp dir goes")
    p.add_argument("--json", default=None, help="write results and findings as JSON here")
    add_arguments(p)
    args = p.parse_args(argv)
    findings: list[dict[str, Any]] = []
    counts, bad = run(args, findings)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": counts, "findings": findings}, indent=2, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
