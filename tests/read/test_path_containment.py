"""Checkpoints crafted to reach outside their own tree (issue 23, items 1 and 2; spec §2, §8, §10.1, §12).

A root document's checksum proves nothing (anyone can recompute it: ``helpers.write_root`` does), so every path a
checkpoint names is hostile input: the keys of its consolidated metadata (node paths), its arrays' chunk key
encodings, its base reference, and symbolic links in its directory. For each, every command that reads or writes
checkpoints — ``open``/``load``, ``verify``, ``copy``/``sync`` both ways, ``compact``, ``convert``, ``report``,
``info``, the manager's ``restore``, DCP's ``ArrayckptReader``, ``gc`` — must refuse with an error naming the key or
reference, and nothing outside the place it may write may change: the whole test directory (another committed
checkpoint, a user's files, the crafted source itself) is listed and hashed before and after every trial.
"""

from __future__ import annotations

import contextlib
import copy as copying
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import sealed, write_root

import arrayckpt
from arrayckpt._storage import parse_location
from arrayckpt.cli import main as cli

GROUP = {"zarr_format": 3, "node_type": "group", "attributes": {}}
VICTIM_TENSOR = torch.full((4,), 7.0)


# --- the trees every trial must leave alone ---------------------------------------------------------------------


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every entry below ``root`` (links not followed) with what it holds: a file's SHA-256, a link's target."""
    out: dict[str, str] = {}
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(directory, name)
            relative = str(path.relative_to(root))
            if relative.split("/")[0] in skip:
                continue
            if path.is_symlink():
                out[relative] = "link:" + os.readlink(path)
            elif path.is_dir():
                out[relative] = "dir"
            else:
                out[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@contextlib.contextmanager
def untouched(root: Path, *writable: str) -> Iterator[None]:
    """Assert that nothing below ``root`` changes, except below the top-level names in ``writable`` (where a
    command may write), and that those hold nothing afterwards either (a refused command leaves nothing)."""
    before = snapshot(root, writable)
    yield
    assert snapshot(root, writable) == before, "something outside the command's destination changed"
    for name in writable:
        assert not (root / name).exists() or snapshot(root / name) == {}, f"{name}: a refused command left data"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``victim``: a committed checkpoint beside everything; ``sentinel``: a user's files, one shaped like a chunk
    of ``w``; ``src/ckpt``: the checkpoint to craft (tensor ``w``, a per-rank tensor, a plain value)."""
    arrayckpt.save({"v": VICTIM_TENSOR}, tmp_path / "victim")
    (tmp_path / "sentinel" / "outside" / "arr").mkdir(parents=True)
    (tmp_path / "sentinel" / "notes.txt").write_text("the user's own file")
    arrayckpt.save({"w": torch.arange(4.0), "r": arrayckpt.PerRank(torch.ones(2)), "step": 3}, tmp_path / "src/ckpt")
    shutil.copy(tmp_path / "src/ckpt/w/c.0", tmp_path / "sentinel/outside/arr/c.0")
    return tmp_path


def edit_root(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    document = json.loads((path / "zarr.json").read_text())
    change(document)
    write_root(path, document)


def nodes_of(document: dict[str, Any]) -> dict[str, Any]:
    return document["consolidated_metadata"]["metadata"]


# --- the commands -----------------------------------------------------------------------------------------------


def _cli(*argv: str) -> Callable[[Path, Path], str]:
    """A command line run as a command of the table below: it must exit 2 with one line naming the problem."""
    def run(src: Path, out: Path) -> str:
        import io
        from contextlib import redirect_stderr, redirect_stdout
        stderr = io.StringIO()
        with redirect_stderr(stderr), redirect_stdout(io.StringIO()):
            code = cli([a.format(src=src, out=out) for a in argv])
        text = stderr.getvalue()
        assert code == 2 and text.startswith("arrayckpt: error:") and "Traceback" not in text, (code, text)
        return text
    return run


def _state_of(src: Path) -> dict[str, torch.Tensor]:
    """Zeros of every tensor the (crafted) checkpoint's manifest lists, from its root document as stored."""
    entries = json.loads((src / "zarr.json").read_text())["attributes"]["arrayckpt"]["entries"]
    return {key: torch.zeros(entry["shape"]) for key, entry in entries.items() if entry["kind"] == "tensor"}


def _dcp_load(src: Path, out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from arrayckpt.dcp import ArrayckptReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it loads in a single process
        try:
            dcp.load(_state_of(src), storage_reader=ArrayckptReader(src), no_dist=True)
        except dcp.api.CheckpointException as e:  # DCP collects what its reader raised, by rank
            raise next(iter(e.failures.values()))[0] from e


def _manager_restore(src: Path, out: Path) -> str:
    """The crafted checkpoint as the newest step of a manager's root (``out``), restored: the manager must pass it
    over for the older whole step, with a warning that names why (returned, as the other commands' errors are)."""
    state = _state_of(src)
    arrayckpt.save(state, out / "step-00000001")
    os.rename(src, out / "step-00000002")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = arrayckpt.CheckpointManager(out).restore(state, strict=False)
    finally:
        os.rename(out / "step-00000002", src)
        shutil.rmtree(out)
    assert restored == 1, f"manager-restore restored step {restored} of a crafted checkpoint"
    return " ".join(str(w.message) for w in caught if "step 2 cannot be restored" in str(w.message))


def _read_all(src: Path, out: Path) -> None:
    with arrayckpt.open(src) as ckpt:
        for key in ckpt:
            ckpt[key][...]


def _report(src: Path, out: Path) -> str:
    """The report's HTML: it shows what cannot be read (a base it may not follow) instead of failing."""
    return arrayckpt.report(src, output=out / "report.html", histograms=0, grids=0).read_text()


def _verify(src: Path, out: Path) -> str:
    report = arrayckpt.verify(src)
    assert not report.ok
    return " ".join(d.problem for d in report.damage)


COMMANDS: dict[str, Callable[[Path, Path], Any]] = {
    "open": _read_all,
    "load": lambda src, out: arrayckpt.load(_state_of(src), src, strict=False),
    "verify": _verify,
    "copy": lambda src, out: arrayckpt.copy(src, out / "ckpt"),
    "sync": _cli("sync", "{src}", "{out}/ckpt"),
    "compact": lambda src, out: arrayckpt.compact(src, out / "ckpt"),
    "convert-safetensors": lambda src, out: arrayckpt.convert(src, out / "model.safetensors"),
    "convert-torch": lambda src, out: arrayckpt.convert(src, out / "model.pt"),
    "report": _report,
    "info": _cli("info", "{src}"),
    "manager-restore": _manager_restore,
    "dcp-reader": _dcp_load,
}


def refused(command: str, src: Path, out: Path, *names: str, error: type[Exception] = arrayckpt.ArrayckptError) -> str:
    """Run ``command`` on ``src`` (writing below ``out``) and return its error message, which must name ``names``."""
    out.mkdir(exist_ok=True)
    try:
        message = COMMANDS[command](src, out)  # verify, report and the command lines report instead of raising
    except error as e:
        message = str(e)
    else:
        if command not in ("verify", "report", "sync", "info", "manager-restore"):
            pytest.fail(f"{command} accepted a crafted checkpoint")
        if command == "report":
            import html
            message = html.unescape(message)
            shutil.rmtree(out)
    for name in names:
        assert name in message, (name, message)
    return message


# --- item 1: node keys ------------------------------------------------------------------------------------------

# Keys of the consolidated metadata that are no node of the manifest: paths out of the checkpoint (relative,
# absolute, through a real node, encoded, with backslashes), a NUL, an empty key, a very long one, and well-formed
# node paths that no entry implies (an array that does not exist; a per-rank array of a key that is no per-rank
# entry; a reserved Zarr name).
NODE_KEYS = ["../../victim", "../../sentinel/outside/arr", "/tmp/victim", "w/../../../victim", "%2E%2E/%2E%2E/victim",
             "..\\..\\victim", "w\x00x", "", "a/" * 3000 + "b", "extra", "step/%r0", "__reserved"]


def _shown(key: str) -> str:
    return repr(key)[:60]  # what an error message quotes of a (long) key


@pytest.mark.parametrize("kind", ["group", "array"])
@pytest.mark.parametrize("key", NODE_KEYS, ids=lambda k: repr(k)[:24])
@pytest.mark.parametrize("command", ["copy", "sync", "open"])
def test_a_node_key_outside_the_manifest_is_refused_and_nothing_outside_changes(tree, key, kind, command):
    """Before: ``copy`` wrote ``../../victim``'s document over the victim's root ``zarr.json`` (two levels above the
    destination's temporary directory) and ``sync`` exited 0; with an array node ``../../sentinel/outside/arr`` it
    read the user's file as a chunk."""
    src = tree / "src/ckpt"
    edit_root(src, lambda d: nodes_of(d).__setitem__(key, GROUP if kind == "group" else nodes_of(d)["w"]))
    with untouched(tree, "out"):
        message = refused(command, src, tree / "out", _shown(key), str(src))
    assert "consolidated metadata" in message


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"copy", "sync", "open"}))
def test_every_command_refuses_a_node_key_leaving_the_checkpoint(tree, command):
    src = tree / "src/ckpt"
    edit_root(src, lambda d: nodes_of(d).__setitem__("../../victim", GROUP))
    with untouched(tree, "out"):
        refused(command, src, tree / "out", "'../../victim'")


@pytest.mark.parametrize("change", ["missing group", "missing array", "group as array", "array as group"])
def test_the_node_set_is_exactly_what_the_manifest_implies(tree, change):
    """Every writer lists exactly the nodes of spec §2; a document of the wrong kind, or a missing one, is refused
    when the root document is parsed (before: a group in an array's place was copied as an array)."""
    src = tree / "src/ckpt"
    arrayckpt.save({"m": {"w": torch.ones(2)}, "r": arrayckpt.PerRank(torch.ones(2))}, src, overwrite=True)

    def hurt(document):
        nodes = nodes_of(document)
        if change == "missing group":
            del nodes["m"]
        elif change == "missing array":
            del nodes["r/%r0"]
        elif change == "group as array":
            nodes["m"] = nodes["m/w"]
        else:
            nodes["m/w"] = GROUP
    edit_root(src, hurt)
    with untouched(tree, "out"):
        refused("open", src, tree / "out", "consolidated metadata", str(src))
        refused("copy", src, tree / "out", "consolidated metadata")


def test_writers_list_exactly_the_implied_nodes(tmp_path):
    """The rule is one every writer already followed: full, chunks-delta, rows-delta and quantized saves, per-rank
    and pickled values, a compacted chain and a copy all open (the suite's other tests cover DCP's writer, the
    converters, object storage and the format versions 1 and 2)."""
    state = {"emb": torch.zeros(64, 4), "w": torch.zeros(8, 8), "r": arrayckpt.PerRank(torch.ones(3)),
             "obj": {1, 2}, "step": 1}
    arrayckpt.save(state, tmp_path / "full", allow_pickle=True)
    state["emb"][3] = 1.0
    state["w"][0, 0] = 1.0
    arrayckpt.save(state, tmp_path / "rows", base=tmp_path / "full", changed_rows={"emb": torch.tensor([3])},
                   allow_pickle=True)
    arrayckpt.save(state, tmp_path / "quant", base=tmp_path / "full", changed_rows={"emb": torch.tensor([3])},
                   quantize={"emb": 8}, allow_pickle=True)
    arrayckpt.compact(tmp_path / "quant", tmp_path / "compact")
    arrayckpt.copy(tmp_path / "rows", tmp_path / "copied")
    for name in ("full", "rows", "quant", "compact", "copied"):
        with arrayckpt.open(tmp_path / name, allow_pickle=True) as ckpt:
            assert ckpt["emb"][3, 0] == (name != "full") and ckpt.plain_values["obj"] == {1, 2}, name
        assert arrayckpt.verify(tmp_path / name).ok, name


# --- item 1: chunk keys -----------------------------------------------------------------------------------------

ENCODINGS = [{"name": "default", "configuration": {"separator": "/../"}},
             {"name": "v2", "configuration": {"separator": "\\"}},
             {"name": "default", "configuration": {"separator": ""}},
             {"name": "../../victim"},
             {"name": "v2", "configuration": {"separator": ["."]}}]


@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: json.dumps(e)[:40])
@pytest.mark.parametrize("command", ["open", "copy", "verify", "compact"])
def test_a_chunk_key_encoding_that_could_leave_the_array_is_refused(tree, encoding, command):
    """Only ``default`` and ``v2`` with ``.`` or ``/`` are accepted (spec §2): every chunk key is then integers and
    those separators below the array's own directory."""
    src = tree / "src/ckpt"
    edit_root(src, lambda d: nodes_of(d)["w"].__setitem__("chunk_key_encoding", encoding))
    (src / "w/zarr.json").write_text(json.dumps(nodes_of(json.loads((src / "zarr.json").read_text()))["w"]))
    with untouched(tree, "out"):
        refused(command, src, tree / "out", "chunk_key_encoding")


# --- item 1: object storage -------------------------------------------------------------------------------------


def _bucket_state(s3_server: Any, bucket: str) -> dict[str, str]:
    objects = s3_server.client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in objects}


def _put_checkpoint(s3_server: Any, bucket: str, prefix: str, path: Path) -> None:
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        s3_server.client.put_object(Bucket=bucket, Key=f"{prefix}/{file.relative_to(path)}", Body=file.read_bytes())


def test_node_keys_leaving_the_prefix_are_refused_on_object_storage(tree, s3_server, s3_bucket):
    """TensorStore's S3 client normalises ``..`` in the URL it sends (``run/ckpt/../../victim/zarr.json`` reaches
    ``victim/zarr.json``): before, copying a crafted checkpoint to ``s3://bucket/run/ckpt`` replaced the root
    document of the checkpoint at ``s3://bucket/victim``."""
    options = {"endpoint_url": s3_server.endpoint}
    arrayckpt.copy(tree / "victim", f"s3://{s3_bucket}/victim", dst_options=options)
    src = tree / "src/ckpt"
    edit_root(src, lambda d: nodes_of(d).__setitem__("../../victim", GROUP))
    _put_checkpoint(s3_server, s3_bucket, "crafted", src)
    bucket = _bucket_state(s3_server, s3_bucket)
    with untouched(tree, "out"):
        for call in (lambda: arrayckpt.copy(src, f"s3://{s3_bucket}/run/ckpt", dst_options=options),
                     lambda: arrayckpt.copy(f"s3://{s3_bucket}/crafted", tree / "out/ckpt", src_options=options),
                     lambda: arrayckpt.open(f"s3://{s3_bucket}/crafted", storage_options=options),
                     lambda: arrayckpt.compact(f"s3://{s3_bucket}/crafted", tree / "out/ckpt",
                                               storage_options=options)):
            with pytest.raises(arrayckpt.FormatError, match=r"'\.\./\.\./victim'"):
                call()
    assert _bucket_state(s3_server, s3_bucket) == bucket
    with arrayckpt.open(f"s3://{s3_bucket}/victim", storage_options=options) as victim:
        assert torch.equal(victim["v"].torch(), VICTIM_TENSOR)


@pytest.mark.parametrize("committed", [False, True])
def test_listed_object_keys_with_dot_segments_are_never_touched(tree, s3_server, s3_bucket, committed):
    """An object store keeps ``run/step-00000001/../../victim/zarr.json`` as a key of its own; before, ``gc``
    (an incomplete step) and a manager's retention (``delete`` of a committed step) deleted it through TensorStore,
    which removed ``victim/zarr.json``: the root document of another checkpoint."""
    options = {"endpoint_url": s3_server.endpoint}
    arrayckpt.copy(tree / "victim", f"s3://{s3_bucket}/victim", dst_options=options)
    step = "run/step-00000001"
    _put_checkpoint(s3_server, s3_bucket, step, tree / "src/ckpt")
    if not committed:
        s3_server.client.delete_object(Bucket=s3_bucket, Key=f"{step}/zarr.json")
    s3_server.client.put_object(Bucket=s3_bucket, Key=f"{step}/../../victim/zarr.json", Body=b"{}")
    victim = s3_server.client.get_object(Bucket=s3_bucket, Key="victim/zarr.json")["Body"].read()
    if committed:
        parse_location(f"s3://{s3_bucket}/{step}", options).delete()
    else:
        assert arrayckpt.gc(f"s3://{s3_bucket}/run", min_age_s=0, storage_options=options) == []
    assert s3_server.client.get_object(Bucket=s3_bucket, Key="victim/zarr.json")["Body"].read() == victim


# --- item 2: base references ------------------------------------------------------------------------------------


def _delta(tree: Path, reference: str | None = None, *, base: Path | None = None) -> Path:
    """``src/run/step-2``, a delta whose base is ``src/run/step-1`` (or ``base``), its reference then replaced by
    ``reference`` (keeping the base's id: a reader that follows it reads that base's data)."""
    base = base or tree / "src/run/step-1"
    if not (base / "zarr.json").exists():
        arrayckpt.save({"w": torch.zeros(64), "u": torch.ones(4)}, base)
    delta = tree / "src/run/step-2"
    state = {"w": torch.zeros(64), "u": torch.ones(4)}
    state["w"][0] = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a base elsewhere: readers will need its root
        arrayckpt.save(state, delta, base=base)
    if reference is not None:
        edit_root(delta, lambda d: d["attributes"]["arrayckpt"]["base"].__setitem__("path", reference))
    return delta


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("reference", ["relative", "absolute", "file URL"])
def test_a_base_outside_the_directory_holding_the_delta_is_not_followed(tree, reference, command):
    """The base is the real one (its id matches): before, a delta's base was opened wherever its reference led
    (``../`` up to ``/``, any absolute path or URL, with the delta's storage options), so a crafted delta read
    another directory's checkpoint through itself, and ``copy``/``sync`` copied it. Now opening the delta is
    refused, naming the reference and the root to pass."""
    delta = _delta(tree, base=tree / "elsewhere")  # saved as '../../../elsewhere'
    reference = {"relative": "../../../elsewhere", "absolute": str(tree / "elsewhere"),
                 "file URL": f"file://{tree / 'elsewhere'}"}[reference]
    edit_root(delta, lambda d: d["attributes"]["arrayckpt"]["base"].__setitem__("path", reference))
    with untouched(tree, "out"):
        message = refused(command, delta, tree / "out", repr(reference)[:40], error=arrayckpt.BaseNotAllowedError)
    assert "base_roots" in message or "--base-root" in message


def test_base_roots_name_where_bases_may_be(tree, capsys):
    """A base outside the directory holding its delta is read once the caller names a root that holds it, by every
    reader; the save that wrote such a reference warned that readers will need it."""
    base = tree / "src/other/step-1"
    arrayckpt.save({"w": torch.zeros(64), "u": torch.ones(4)}, base)
    state = {"w": torch.zeros(64), "u": torch.ones(4)}
    state["w"][0] = 1.0
    with pytest.warns(UserWarning, match="base_roots"):
        arrayckpt.save(state, tree / "src/run/step-2", base=base)
    delta, roots = tree / "src/run/step-2", [tree / "src/other"]
    with pytest.raises(arrayckpt.BaseNotAllowedError, match=r"'\.\./\.\./other/step-1'.*base_roots"):
        arrayckpt.open(delta)["u"][:]
    with arrayckpt.open(delta, base_roots=roots) as ckpt:
        assert ckpt["u"][:].tolist() == [1.0] * 4
    target = {"w": torch.zeros(64), "u": torch.zeros(4)}
    arrayckpt.load(target, delta, base_roots=roots)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["u"], state["u"])
    assert arrayckpt.verify(delta, base_roots=roots).ok
    arrayckpt.compact(delta, tree / "out/full", base_roots=roots)
    assert cli(["info", str(delta), "--base-root", str(tree / "src/other")]) == 0
    capsys.readouterr()
    assert cli(["info", str(delta)]) == 2  # one line: the reference and the option that allows it
    assert f"--base-root {tree / 'src/other'}" in capsys.readouterr().err
    with pytest.raises(arrayckpt.BaseNotAllowedError):  # the destination's place for the base is outside dst/x
        arrayckpt.copy(delta, tree / "out/x/step-2", base_roots=roots)
    assert not (tree / "out/x").exists() and not (tree / "out/other").exists()
    result = arrayckpt.copy(delta, tree / "out/x/step-2", base_roots=[*roots, tree / "out"])
    assert result.copied == (str(tree / "out/other/step-1"), str(tree / "out/x/step-2"))


MALFORMED_REFERENCES = {
    "climbs above /": "../" * 40 + "victim",
    "no ../": "step-1",
    "backslash": "..\\step-1",
    "NUL": "../step-1\x00",
    "empty segment": "..//step-1",
    "dot segment": "../step-1/.",
    "itself": "../step-2",
    "inside itself": "../step-2/w",
    "the parent": "..",
    "very long": "../" + "x" * 5000,
}


@pytest.mark.parametrize(("name", "command"), [
    (name, command) for name in sorted(MALFORMED_REFERENCES)
    for command in ("open", "load", "verify", "copy", "sync", "compact", "manager-restore")
    if not (command == "manager-restore" and "itself" in name)])  # moved into a manager's root, it is not itself
def test_a_malformed_base_reference_is_a_format_error(tree, name, command):
    """Spec §10.1's grammar: ``../`` one or more times, then plain names of at most 255 bytes; resolved on
    segments, never clamped at ``/``."""
    delta = _delta(tree, MALFORMED_REFERENCES[name])
    with untouched(tree, "out"):
        refused(command, delta, tree / "out", repr(MALFORMED_REFERENCES[name])[:40])


def test_base_references_on_object_storage_stay_in_the_prefix(tree, s3_server, s3_bucket):
    """Before: a reference with more ``..`` than the prefix has was clamped at the bucket's root, so
    ``s3://bucket/run/step-2`` with ``../../../victim`` read ``s3://bucket/victim``; and ``sync`` of such a delta to
    a directory created its base wherever the reference led."""
    options = {"endpoint_url": s3_server.endpoint}
    arrayckpt.copy(tree / "victim", f"s3://{s3_bucket}/victim", dst_options=options)
    delta = _delta(tree)
    arrayckpt.copy(delta, f"s3://{s3_bucket}/run/step-2", dst_options=options)
    assert arrayckpt.open(f"s3://{s3_bucket}/run/step-2", storage_options=options)["u"][:].tolist() == [1.0] * 4
    for reference, error in (("../../../victim", arrayckpt.FormatError),
                             ("../../victim", arrayckpt.BaseNotAllowedError)):
        document = json.loads((delta / "zarr.json").read_text())
        document["attributes"]["arrayckpt"]["base"]["path"] = reference
        s3_server.client.put_object(Bucket=s3_bucket, Key="run/step-2/zarr.json", Body=sealed(document))
        bucket = _bucket_state(s3_server, s3_bucket)
        with untouched(tree, "out"):
            with pytest.raises(error, match=repr(reference)):
                arrayckpt.open(f"s3://{s3_bucket}/run/step-2", storage_options=options)["u"][:]
            with pytest.raises(error, match=repr(reference)):
                arrayckpt.copy(f"s3://{s3_bucket}/run/step-2", tree / "out/a/step-2", src_options=options)
        assert _bucket_state(s3_server, s3_bucket) == bucket


# --- symbolic links inside a checkpoint -------------------------------------------------------------------------


def _link(tree: Path, where: str) -> None:
    src = tree / "src/ckpt"
    if where == "chunk file":
        (src / "w/c.0").unlink()
        os.symlink(tree / "sentinel/outside/arr/c.0", src / "w/c.0")
    elif where == "array directory":
        shutil.rmtree(src / "w")
        os.symlink(tree / "sentinel/outside/arr", src / "w")
    elif where == "root document":
        shutil.copy(src / "zarr.json", tree / "sentinel/root.json")
        (src / "zarr.json").unlink()
        os.symlink(tree / "sentinel/root.json", src / "zarr.json")


@pytest.mark.parametrize("codec", [None, "zstd"])
@pytest.mark.parametrize("where", ["chunk file", "array directory", "root document"])
@pytest.mark.parametrize("command", ["open", "load", "verify", "copy", "compact"])
def test_a_link_inside_a_checkpoint_is_never_followed(tree, where, command, codec):
    """A link in place of a chunk file (to a byte-identical copy: following it would succeed), of an array's
    directory, or of the root document, is damage naming the link; ``copy`` never reads through one."""
    arrayckpt.save({"w": torch.arange(4.0), "step": 3}, tree / "src/ckpt", overwrite=True, codec=codec)
    shutil.copy(tree / "src/ckpt/w/c.0", tree / "sentinel/outside/arr/c.0")
    shutil.copy(tree / "src/ckpt/w/zarr.json", tree / "sentinel/outside/arr/zarr.json")
    _link(tree, where)
    with untouched(tree, "out"):
        message = refused(command, tree / "src/ckpt", tree / "out", "symbolic link")
    assert "never follows a link" in message


@pytest.mark.parametrize("command", ["info", "verify", "show", "convert"])
def test_a_root_document_linked_to_a_device_is_damage_not_a_directory_of_checkpoints(tmp_path, capsys, command):
    """``zarr.json -> /dev/zero``: the checkpoint is refused as damaged (its array directories, each with its own
    ``zarr.json``, are not counted as "a directory of 1 checkpoint(s)")."""
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.ones(2)}, path)
    (path / "zarr.json").unlink()
    os.symlink("/dev/zero", path / "zarr.json")
    argv = {"show": [str(path), "w"], "convert": [str(path), str(tmp_path / "out.safetensors")]}.get(command,
                                                                                                   [str(path)])
    assert cli([command, *argv]) in (1, 2)
    printed = capsys.readouterr()
    text = printed.err if command != "verify" else printed.out
    assert "zarr.json is a symbolic link" in text and "checkpoint(s)" not in printed.out + printed.err, text
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_manager_root_counts_no_linked_step(tmp_path, capsys):
    """A step directory that is a link, or whose root document is one, is not one of the root's checkpoints."""
    for step in ("step-1", "step-2"):
        arrayckpt.save({"w": torch.ones(2)}, tmp_path / "root" / step)
    os.symlink(tmp_path / "root/step-1", tmp_path / "root/step-9")
    (tmp_path / "root/step-2/zarr.json").rename(tmp_path / "elsewhere.json")
    os.symlink(tmp_path / "elsewhere.json", tmp_path / "root/step-2/zarr.json")
    assert cli(["info", str(tmp_path / "root")]) == 2
    err = capsys.readouterr().err
    assert "a directory of 1 checkpoint(s)" in err and "(found: step-1)" in err, err


def test_a_linked_node_document_is_reported_by_verify_and_never_copied(tree):
    src = tree / "src/ckpt"
    (src / "w/zarr.json").unlink()
    os.symlink(tree / "victim/v/zarr.json", src / "w/zarr.json")
    report = arrayckpt.verify(src)
    assert [d.file for d in report.damage] == ["w/zarr.json"] and "symbolic link" in report.damage[0].problem
    with untouched(tree, "out"):
        arrayckpt.copy(src, tree / "out/ckpt")  # the documents written are the consolidated copies, never the link
        assert not (tree / "out/ckpt/w/zarr.json").is_symlink() and arrayckpt.verify(tree / "out/ckpt").ok
        shutil.rmtree(tree / "out")


def test_deleting_a_checkpoint_never_follows_a_link_inside_it(tree):
    src = tree / "src/ckpt"
    os.symlink(tree / "victim", src / "linked")
    os.symlink(tree / "sentinel/notes.txt", src / "w/c.1")
    before = snapshot(tree, ("src",))
    parse_location(src).delete()
    assert snapshot(tree, ("src",)) == before
    assert sorted(snapshot(src)) == ["linked", "w", "w/c.1"]  # the links stay, as links: they are not its files


# --- the crafted documents are what the commands refuse, not something else -------------------------------------


def test_the_crafted_documents_are_otherwise_valid(tree):
    """The same edits with a harmless value read fine: the refusals above are for the paths, not for the edit."""
    src = tree / "src/ckpt"
    edit_root(src, lambda d: d["attributes"]["arrayckpt"].__setitem__("step", 4))
    assert arrayckpt.open(src).step == 4 and arrayckpt.verify(src).ok
    delta = _delta(tree, "../step-1")
    assert arrayckpt.open(delta)["u"][:].tolist() == [1.0] * 4
    document = json.loads((src / "zarr.json").read_text())
    assert copying.deepcopy(nodes_of(document)) == nodes_of(document)


# --- converters: the file names a foreign checkpoint names ------------------------------------------------------


@pytest.mark.parametrize("name", ["a\x00.safetensors", "..", "../model.safetensors"])
def test_a_safetensors_index_naming_a_file_outside_or_with_a_nul_is_refused(tree, name):
    """Before: a NUL in a ``weight_map`` file name raised ``ValueError: embedded null byte`` (a traceback from the
    Python API, and no file named)."""
    index = tree / "src/model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": name}}))
    with untouched(tree, "out"), pytest.raises(arrayckpt.FormatError, match="outside its directory"):
        arrayckpt.convert(index, tree / "out/ckpt")


@pytest.mark.parametrize("relative", ["__0_0.distcp\x00", "../../sentinel/notes.txt", "/etc/passwd"])
def test_a_dcp_data_file_named_outside_or_with_a_nul_is_refused(tree, relative):
    """Before: a NUL in a ``.distcp`` file name raised ``ValueError: embedded null byte``."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from arrayckpt._convert.dcp import read_dcp_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.randn(4, 3)}, checkpoint_id=tree / "src/dcp", no_dist=True)
    metadata = read_dcp_metadata(tree / "src/dcp")
    for info in metadata.storage_data.values():
        info.relative_path = relative
    (tree / "src/dcp/.metadata").write_bytes(pickle.dumps(metadata))
    with untouched(tree, "out"), pytest.raises(arrayckpt.FormatError, match="a data file outside the checkpoint"):
        arrayckpt.convert(tree / "src/dcp", tree / "out/ckpt")


# --- URLs with dot segments (issue 5, item 5) -------------------------------------------------------------------


@pytest.mark.parametrize(("url", "fix"), [("s3://bucket/a/../b", "s3://bucket/b"), ("s3://bucket/a/./b", "s3://bucket/a/b"),
                                          ("gs://bucket/a//b/..", "gs://bucket/a")])
def test_a_url_with_dot_segments_is_a_location_error_naming_the_fix(url, fix, capsys):
    with pytest.raises(arrayckpt.LocationError, match=rf"^'{url}': the prefix must not contain '\.', '\.\.' or empty "
                                                      rf"segments .*; write the prefix they stand for: '{fix}'$"):
        arrayckpt.open(url)
    with pytest.raises(ValueError, match="must not contain"):  # still a ValueError for callers that catch that
        arrayckpt.load({"w": torch.zeros(1)}, url)
    assert cli(["info", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"arrayckpt: error: '{url}': the prefix must not contain") and err.count("\n") == 1


# --- bases reached through a link (issue 5, item 7) -------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"manager-restore"}))  # moved, it has no base beside it
def test_a_base_whose_directory_is_a_link_is_not_followed(tree, command):
    """``src/run/step-1``, the delta's ``../step-1``, is a link to a byte-identical base outside ``src/run``:
    following it would succeed, and read (or copy) whatever the link names. Lexically the base is beside the delta;
    on disk it is not: refused, naming the link."""
    delta = _delta(tree)
    shutil.move(tree / "src/run/step-1", tree / "sentinel/step-1")
    os.symlink(tree / "sentinel/step-1", tree / "src/run/step-1")
    with untouched(tree, "out"):
        refused(command, delta, tree / "out", f"{tree}/src/run/step-1, a symbolic link",
                error=arrayckpt.BaseNotAllowedError)


@pytest.mark.parametrize("how", ["python", "sync"])
def test_copy_never_writes_a_base_through_a_link_at_the_destination(tree, how):
    """Copying ``src/run/step-2`` (base ``../step-1``) to ``dst/run/step-2`` places the base at ``dst/run/step-1``;
    a link there (to the user's directory) is refused before anything is written, and the user's directory stays
    as it was."""
    delta = _delta(tree)
    (tree / "dst/run").mkdir(parents=True)
    (tree / "sentinel/empty").mkdir()
    os.symlink(tree / "sentinel/empty", tree / "dst/run/step-1")
    with untouched(tree):
        if how == "python":
            with pytest.raises(arrayckpt.BaseNotAllowedError, match=r"dst/run/step-1, a symbolic link"):
                arrayckpt.copy(delta, tree / "dst/run/step-2")
        else:
            assert "dst/run/step-1, a symbolic link" in _cli("sync", "{src}", "{out}")(delta, tree / "dst/run/step-2")
