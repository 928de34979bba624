"""``ArrayckptWriter``/``ArrayckptReader`` as drop-ins for DCP's ``FileSystemWriter``/``FileSystemReader``: what
DCP users rely on, judged by DCP's own defaults and options (torch 2.13's ``filesystem.py``, ``state_dict_saver.py``,
``state_dict_loader.py``, ``staging.py``, ``_async_*_executor.py``).

Single process: saving again to a fixed path replaces the checkpoint (DCP's default), atomically (the old one loads
until the new one commits; a failed save leaves it whole), ``overwrite=False`` refuses; every argument of DCP's
own storage classes is accepted or refused with a clear error; ``checkpoint_id`` as str and PathLike, a reader
that follows its path between loads; DCP's planners and custom ones; ``dcp.async_save`` staged through the writer
(with ``cache_staged_state_dict``), through ``DefaultStager``, and two overlapping saves through one writer.
Distributed (3 gloo ranks): the same on DTensor shards, a save failing on one rank, ``dedup_save_to_lowest_rank``,
process-group subsets saving side by side, ``no_dist`` on one rank, ``use_collectives=False`` refused on every
rank, and ``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS`` (the writer pickled into DCP's checkpoint
process) with DCP's shared-memory staging.
"""

from __future__ import annotations

import inspect
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_helpers import run_ranks
from torch.distributed.checkpoint.api import CheckpointException

import arrayckpt
from arrayckpt._format.marker import MARKER
from arrayckpt.dcp import ArrayckptReader, ArrayckptWriter

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning"),
              pytest.mark.usefixtures("storage_layout")]

TMP_MARKER = ".arrayckpt-tmp-"


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARKER in p.name)


def _failure(error: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException`` (or the error itself)."""
    if isinstance(error, CheckpointException):
        return next(iter(error.failures.values()))[0]
    return error


def _entries(layout: str, *nodes: str) -> list[str]:
    """The names a checkpoint of top-level nodes ``nodes`` that ``ArrayckptWriter`` saved has in its directory, in the
    test's storage layout: its nodes, or (packed, spec §16.1) its packs and references; its root document and its
    DCP marker (spec §2.1)."""
    return sorted([*(nodes if layout == "files" else ("packs", "refs.json")), "zarr.json", ".metadata"])


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3) * step, "step": step, "meta": {"run": "a"}}


def _loaded(path: Any, **load: Any) -> dict[str, Any]:
    target = {"w": torch.zeros(4, 3), "step": -1, "meta": {"run": None}}
    reader = load.pop("storage_reader", None) or ArrayckptReader(path)
    dcp.load(target, storage_reader=reader, no_dist=True, **load)
    return target


def _assert_step(target: dict[str, Any], step: int) -> None:
    assert target["step"] == step
    assert torch.equal(target["w"], _state(step)["w"])
    assert target["meta"] == {"run": "a"}


class _FailingPlanner(dcp.DefaultSavePlanner):
    """Fails while the data is being written (after planning: the save's temporary target exists)."""

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.tensor_data is not None:
            raise RuntimeError("injected failure while writing")
        return super().resolve_data(write_item)


# --- overwrite: DCP's default, atomic ------------------------------------------------------------------------


def test_saving_again_to_one_path_replaces_the_checkpoint(tmp_path: Path) -> None:
    latest = tmp_path / "latest"
    dcp.save(_state(1), storage_writer=ArrayckptWriter(latest), no_dist=True)
    dcp.save(_state(2), storage_writer=ArrayckptWriter(latest), no_dist=True)  # a fresh writer, no argument
    _assert_step(_loaded(latest), 2)
    dcp.save(_state(3), checkpoint_id=str(latest), storage_writer=ArrayckptWriter(), no_dist=True)
    _assert_step(_loaded(latest), 3)
    writer = ArrayckptWriter()  # one writer for every save, the path as a PathLike checkpoint_id
    for step in (4, 5):
        dcp.save(_state(step), checkpoint_id=latest, storage_writer=writer, no_dist=True)
        _assert_step(_loaded(latest), step)
    assert arrayckpt.verify(latest).ok and _leftovers(tmp_path) == []

    with pytest.raises(CheckpointException) as info:  # overwrite=False: refused, the checkpoint stays
        dcp.save(_state(6), storage_writer=ArrayckptWriter(latest, overwrite=False), no_dist=True)
    error = _failure(info.value)
    assert isinstance(error, arrayckpt.CheckpointExistsError) and "overwrite=True" in str(error)
    _assert_step(_loaded(latest), 5)
    dcp.save(_state(7), storage_writer=ArrayckptWriter(tmp_path / "new", overwrite=False), no_dist=True)
    _assert_step(_loaded(tmp_path / "new"), 7)


def test_a_dcp_checkpoint_at_the_path_is_replaced_other_files_kept(tmp_path: Path, storage_layout: str) -> None:
    # switching from FileSystemWriter at a fixed path: DCP's checkpoint there is replaced (overwrite=True, DCP's
    # default), atomically; before, it was refused as "not an arrayckpt checkpoint"
    latest = tmp_path / "latest"
    dcp.save(_state(1), storage_writer=dcp.FileSystemWriter(latest), no_dist=True)
    assert sorted(os.listdir(latest)) == [".metadata", "__0_0.distcp"]
    with pytest.raises(CheckpointException) as info:  # overwrite=False: named as DCP's, kept
        dcp.save(_state(2), storage_writer=ArrayckptWriter(latest, overwrite=False), no_dist=True)
    error = _failure(info.value)
    assert isinstance(error, arrayckpt.CheckpointExistsError) and "PyTorch DCP (FileSystemWriter) checkpoint" in \
        str(error) and "overwrite=True" in str(error)
    _assert_step(_loaded(latest, storage_reader=dcp.FileSystemReader(latest)), 1)
    (latest / ".metadata.tmp").write_bytes(b"")  # what a DCP save that died before its commit leaves too
    dcp.save(_state(2), storage_writer=ArrayckptWriter(latest), no_dist=True)
    _assert_step(_loaded(latest), 2)
    assert "zarr.json" in os.listdir(latest) and not any(n.endswith(".distcp") for n in os.listdir(latest))
    assert (latest / ".metadata").read_bytes() == MARKER  # DCP's metadata replaced too: arrayckpt's marker now
    assert arrayckpt.verify(latest).ok and _leftovers(tmp_path) == []

    for extra, kind in (("notes.txt", "file"), ("sub", "directory"), ("__0_0.distcp.bak", "file")):
        other = tmp_path / f"other-{kind}-{extra}"  # DCP's files and one of the user's: committed beside them
        dcp.save(_state(3), storage_writer=dcp.FileSystemWriter(other), no_dist=True)
        (other / extra).mkdir() if kind == "directory" else (other / extra).write_text("keep me")
        dcp.save(_state(4), storage_writer=ArrayckptWriter(other), no_dist=True)
        assert sorted(os.listdir(other)) == sorted(["__0_0.distcp", extra, *_entries(storage_layout, "w")])
        assert (other / ".metadata").read_bytes() != MARKER  # DCP's own, of the checkpoint kept beside: left as is
        _assert_step(_loaded(other), 4)
        _assert_step(_loaded(other, storage_reader=dcp.FileSystemReader(other)), 3)
    dcp.save(_state(6), storage_writer=dcp.FileSystemWriter(tmp_path / "plain"), no_dist=True)
    arrayckpt.save(_state(6), tmp_path / "plain", overwrite=True)  # arrayckpt.save's overwrite=True: the same
    assert arrayckpt.open(tmp_path / "plain").plain_values["step"] == 6


class _LoadsBeforeCommit(ArrayckptWriter):
    """Loads its own path just before committing: what a reader sees while the save is under way."""

    seen: dict[str, Any] | None = None

    def finish(self, metadata: Any, results: Any) -> None:
        self.seen = _loaded(self.path)
        super().finish(metadata, results)


def _files(directory: Path) -> dict[str, bytes]:
    """Every file below ``directory``, with its bytes: what a refused or failed save must leave as it was."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _shared(tmp_path: Path) -> Path:
    """A directory holding the user's files: a ``torch.save`` file and another checkpoint in a subdirectory."""
    d = tmp_path / "d"
    d.mkdir()
    torch.save({"x": 1}, d / "model.pt")
    arrayckpt.save({"q": torch.ones(1)}, d / "nested")
    return d


def _assert_users_files(d: Path) -> None:
    assert torch.load(d / "model.pt") == {"x": 1} and arrayckpt.open(d / "nested")["q"].numpy().tolist() == [1.0]


def test_a_directory_holding_other_files_gets_the_checkpoint_beside_them(tmp_path: Path, storage_layout: str) -> None:
    # DCP's semantics (PyTorch's test_format_utils.py::test_torch_save_to_dcp): FileSystemWriter adds its files to a
    # directory's; arrayckpt commits into it (root zarr.json last), never deleting the user's files
    d = _shared(tmp_path)
    before = _files(d)
    with pytest.raises(CheckpointException, match="injected failure while writing"):  # a failed save: nothing touched
        dcp.save(_state(1), storage_writer=ArrayckptWriter(d), planner=_FailingPlanner(), no_dist=True)
    assert _files(d) == before
    dcp.save(_state(1), storage_writer=ArrayckptWriter(d), no_dist=True)
    assert sorted(os.listdir(d)) == sorted(["model.pt", "nested", *_entries(storage_layout, "w")])
    _assert_step(_loaded(d), 1)
    assert arrayckpt.verify(d).ok
    _assert_users_files(d)
    if storage_layout == "files":  # (packed, key 'nested.w' is no file: nothing in the way)
        with pytest.raises(CheckpointException) as info:  # a name the checkpoint needs holds the user's: refused
            dcp.save({"nested": {"w": torch.ones(2)}}, storage_writer=ArrayckptWriter(d, overwrite=True),
                     no_dist=True)
        assert "['nested']" in str(_failure(info.value)) and "move them away" in str(_failure(info.value))
    assert sorted(os.listdir(d)) == sorted(["model.pt", "nested", *_entries(storage_layout, "w")])
    _assert_step(_loaded(d), 1)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("keep me")
    with pytest.raises(arrayckpt.CheckpointExistsError, match="not an arrayckpt checkpoint"):  # arrayckpt.save refuses
        arrayckpt.save({"v": 1}, tmp_path / "plain")


def test_a_committed_checkpoint_beside_other_files_is_kept_unless_overwrite_is_given(tmp_path: Path,
                                                                                   storage_layout: str) -> None:
    # replacing it there is not atomic (the directory loads as no checkpoint for a moment), so DCP's default
    # (overwrite=True, left implicit) refuses it, as overwrite=False does; overwrite=True given replaces it in place
    d = _shared(tmp_path)
    dcp.save(_state(1), storage_writer=ArrayckptWriter(d), no_dist=True)
    before = _files(d)
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(2), storage_writer=ArrayckptWriter(d), no_dist=True)
    error = _failure(info.value)
    message = str(error)
    assert isinstance(error, arrayckpt.CheckpointExistsError) and "\n" not in message and str(d) in message
    assert "committed arrayckpt checkpoint beside other files ('model.pt', 'nested')" in message
    old = "'.metadata', 'w'" if storage_layout == "files" else "'.metadata', 'packs', 'refs.json'"
    assert f"save to another directory, or remove the old checkpoint ('zarr.json', {old}) first" in message
    assert "pass overwrite=True explicitly" in message
    with pytest.raises(CheckpointException, match="Checkpoint already exists and overwrite=False: .*remove the old"):
        dcp.save(_state(2), storage_writer=ArrayckptWriter(d, overwrite=False), no_dist=True)
    with pytest.raises(CheckpointException, match="injected failure while writing"):  # a failed replacement
        dcp.save(_state(2), storage_writer=ArrayckptWriter(d, overwrite=True), planner=_FailingPlanner(), no_dist=True)
    assert _files(d) == before
    _assert_step(_loaded(d), 1)

    dcp.save(_state(2), storage_writer=ArrayckptWriter(d, overwrite=True), no_dist=True)  # asked for: replaced
    assert sorted(os.listdir(d)) == sorted(["model.pt", "nested", *_entries(storage_layout, "w")])
    _assert_step(_loaded(d), 2)
    assert arrayckpt.verify(d).ok
    _assert_users_files(d)
    dcp.save({"v": torch.ones(2)}, storage_writer=ArrayckptWriter(d, overwrite=True), no_dist=True)  # old nodes go
    assert sorted(os.listdir(d)) == sorted(["model.pt", "nested", *_entries(storage_layout, "v")])
    assert arrayckpt.open(d)["v"].numpy().tolist() == [1.0, 1.0]
    _assert_users_files(d)

    for name in _entries(storage_layout, "v")[::-1]:  # the refusal's other way: remove the old checkpoint (its root
        shutil.rmtree(d / name) if (d / name).is_dir() else (d / name).unlink()  # first), then DCP's default saves
    dcp.save(_state(3), storage_writer=ArrayckptWriter(d), no_dist=True)
    _assert_step(_loaded(d), 3)
    _assert_users_files(d)

    both = tmp_path / "both"  # beside a committed one, DCP's files are a checkpoint (FileSystemWriter saved there
    dcp.save(_state(1), storage_writer=ArrayckptWriter(both), no_dist=True)  # too), not the user's: the directory
    dcp.save(_state(2), storage_writer=dcp.FileSystemWriter(both), no_dist=True)  # is replaced whole, atomically
    with pytest.raises(CheckpointException, match="Checkpoint already exists and overwrite=False"):
        dcp.save(_state(3), storage_writer=ArrayckptWriter(both, overwrite=False), no_dist=True)
    dcp.save(_state(3), storage_writer=ArrayckptWriter(both), no_dist=True)
    assert sorted(os.listdir(both)) == _entries(storage_layout, "w")
    _assert_step(_loaded(both), 3)


class _OneCommitsFirst(ArrayckptWriter):
    """Lets another save commit into its directory just before its own commit."""

    def finish(self, metadata: Any, results: Any) -> None:
        dcp.save(_state(5), storage_writer=ArrayckptWriter(self.path), no_dist=True)
        super().finish(metadata, results)


def test_a_checkpoint_committed_beside_other_files_during_a_save_is_kept(tmp_path: Path, storage_layout: str) -> None:
    d = _shared(tmp_path)  # no checkpoint when the save begins, one (step 5) when it commits: refused at the commit
    with pytest.raises(CheckpointException, match="committed arrayckpt checkpoint beside other files"):
        dcp.save(_state(4), storage_writer=_OneCommitsFirst(d), no_dist=True)
    _assert_step(_loaded(d), 5)
    assert sorted(os.listdir(d)) == sorted(["model.pt", "nested", *_entries(storage_layout, "w")])
    _assert_users_files(d)


def test_the_old_checkpoint_loads_until_the_new_one_commits(tmp_path: Path) -> None:
    latest = tmp_path / "latest"
    dcp.save(_state(1), storage_writer=ArrayckptWriter(latest), no_dist=True)
    writer = _LoadsBeforeCommit(latest)
    dcp.save(_state(2), storage_writer=writer, no_dist=True)
    assert writer.seen is not None
    _assert_step(writer.seen, 1)  # every chunk of the new one was written, and the old one still loads whole
    _assert_step(_loaded(latest), 2)

    failing = ArrayckptWriter(latest)  # a save that fails while writing commits nothing
    with pytest.raises(CheckpointException, match="injected failure while writing"):
        dcp.save(_state(3), storage_writer=failing, planner=_FailingPlanner(), no_dist=True)
    _assert_step(_loaded(latest), 2)
    assert len(_leftovers(tmp_path)) == 1  # its temporary directory, until the writer is used again
    dcp.save(_state(4), storage_writer=failing, no_dist=True)
    _assert_step(_loaded(latest), 4)
    assert _leftovers(tmp_path) == []


# --- DCP's storage arguments -----------------------------------------------------------------------------------


def _defaults(cls: type) -> dict[str, Any]:
    """The keyword arguments of one of DCP's storage classes, at their defaults (as this torch defines them)."""
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name not in ("self", "path") and p.kind not in skip}


def test_every_argument_of_dcps_storage_classes_is_accepted_or_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    path = tmp_path / "c"
    for cls in (dcp.FileSystemWriter, FsspecWriter):
        options = _defaults(cls)
        assert {"overwrite", "thread_count", "sync_files"} <= set(options)
        assert options["overwrite"] is True  # DCP's default, and so ArrayckptWriter's (bar a shared directory)
        dcp.save(_state(1), storage_writer=ArrayckptWriter(path, **options), no_dist=True)
        _assert_step(_loaded(path), 1)
    for cls in (dcp.FileSystemReader, FsspecReader):
        _assert_step(_loaded(path, storage_reader=ArrayckptReader(path, **_defaults(cls))), 1)
    # the performance knobs are accepted with other values too (arrayckpt's own IO does their job)
    knobs = {"single_file_per_rank": False, "sync_files": False, "thread_count": 8, "per_thread_copy_ahead": 0}
    dcp.save(_state(2), storage_writer=ArrayckptWriter(path, **knobs), no_dist=True)
    _assert_step(_loaded(path), 2)

    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example

    with pytest.raises(ValueError, match="other than ZStandard.*codec='zstd'"):  # DCP's other stream transforms
        ArrayckptWriter(path, _extensions=[Rot13Example()])
    with pytest.raises(ValueError, match="Zarr v3"):
        ArrayckptWriter(path, serialization_format=SerializationFormat.SAFETENSORS)
    with pytest.raises(TypeError, match="'endpoint_url'.*storage_options="):
        ArrayckptWriter(path, endpoint_url="http://127.0.0.1:1")  # FsspecWriter's **kwargs: storage_options here
    with pytest.raises(TypeError, match="'thread_count'"):
        ArrayckptReader(path, thread_count=2)
    _assert_step(_loaded(path), 2)


def test_dcps_zstandard_extension_is_the_zstd_codec(tmp_path: Path) -> None:
    # PyTorch's TestDistributedStateDictSaveLoadZStandard: FileSystemWriter(_extensions=[ZStandard()])
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example

    zstd = object.__new__(ZStandard)  # its constructor needs the zstandard module, which arrayckpt does not
    assert ArrayckptWriter(tmp_path / "c", _extensions=[zstd]).codec == "zstd"
    assert ArrayckptWriter(tmp_path / "c", _extensions=[zstd], codec="blosc").codec == "blosc"  # codec= wins
    assert ArrayckptWriter(tmp_path / "c", _extensions=[]).codec is None
    dcp.save(_state(1), storage_writer=ArrayckptWriter(tmp_path / "c", _extensions=[zstd]), no_dist=True)
    assert "zstd" in [codec["name"] for codec in arrayckpt.open(tmp_path / "c")["w"].metadata["codecs"]]
    _assert_step(_loaded(tmp_path / "c"), 1)
    with pytest.raises(ValueError, match=r"\['Rot13Example'\].*leave them out"):  # named, even beside ZStandard
        ArrayckptWriter(tmp_path / "c", _extensions=[zstd, Rot13Example()])


def test_read_metadata_gives_back_the_writers_save_id(tmp_path: Path) -> None:
    # PyTorch's test_compatibility.py::test_storage_meta
    writer = ArrayckptWriter(tmp_path / "c")
    dcp.save(_state(1), storage_writer=writer, no_dist=True)
    reader = ArrayckptReader(tmp_path / "c")
    meta = reader.read_metadata().storage_meta
    assert meta is not None and (meta.checkpoint_id, meta.save_id, meta.load_id) == (
        str(tmp_path / "c"), writer.save_id, reader.load_id)
    arrayckpt.save(_state(2), tmp_path / "plain")  # not saved through DCP: no save_id
    meta = ArrayckptReader(tmp_path / "plain").read_metadata().storage_meta
    assert meta is not None and meta.save_id is None


def test_bytesio_values_are_stored_as_bytes_without_pickle(tmp_path: Path) -> None:
    # DCP's documented way to store raw bytes (PyTorch's test_list_stored_state_dict.py, e2e's TestTrainState)
    import io

    state = {"w": torch.ones(2), "blob": io.BytesIO(b"TrainingEpoch:4"), "raw": b"raw"}
    dcp.save(state, storage_writer=ArrayckptWriter(tmp_path / "c"), no_dist=True)  # no allow_pickle
    opened = arrayckpt.open(tmp_path / "c")
    assert opened.plain_values["blob"] == b"TrainingEpoch:4" and opened.plain_values["raw"] == b"raw"  # not pickled
    target: dict[str, Any] = {"w": torch.zeros(2), "blob": io.BytesIO(), "raw": b""}
    dcp.load(target, storage_reader=ArrayckptReader(tmp_path / "c"), no_dist=True)
    assert isinstance(target["blob"], io.BytesIO) and target["blob"].getvalue() == b"TrainingEpoch:4"
    assert target["raw"] == b"raw" and torch.equal(target["w"], torch.ones(2))
    described = ArrayckptReader(tmp_path / "c").read_metadata().state_dict_metadata
    assert type(described["blob"]).__name__ == "BytesStorageMetadata"


def test_a_reader_follows_its_path_between_loads(tmp_path: Path) -> None:
    a, b, latest = tmp_path / "a", tmp_path / "b", tmp_path / "latest"
    for step, path in ((1, a), (2, b), (1, latest)):
        dcp.save(_state(step), storage_writer=ArrayckptWriter(path), no_dist=True)
    reader = ArrayckptReader()  # one reader, the checkpoint_id changing between loads (DCP calls reset)
    _assert_step(_loaded(None, storage_reader=reader, checkpoint_id=str(a)), 1)
    _assert_step(_loaded(None, storage_reader=reader, checkpoint_id=b), 2)
    _assert_step(_loaded(None, storage_reader=reader, checkpoint_id=a), 1)
    following = ArrayckptReader(latest)  # made once for a fixed path: each load reads what is there then
    for step in (2, 3):
        dcp.save(_state(step), storage_writer=ArrayckptWriter(latest), no_dist=True)
        _assert_step(_loaded(None, storage_reader=following), step)
    assert not following._open  # nothing held between loads


# --- planners --------------------------------------------------------------------------------------------------


class _AddsStep(dcp.DefaultSavePlanner):
    """A custom save planner: adds an entry to what it is given."""

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner({**state_dict, "planner_note": torch.ones(2)}, storage_meta, is_coordinator)


class _CountsCommits(dcp.DefaultLoadPlanner):
    """A custom load planner: records the tensors it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.committed: list[str] = []

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        self.committed.append(read_item.dest_index.fqn)
        super().commit_tensor(read_item, tensor)


def test_dcps_planners_and_custom_ones(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = tmp_path / "c"
    nested = {"model": {"w": torch.arange(6.0)}, "step": 3}
    dcp.save(nested, storage_writer=ArrayckptWriter(path), planner=_AddsStep(), no_dist=True)
    assert torch.equal(arrayckpt.open(path)["planner_note"].torch(), torch.ones(2))
    planner = _CountsCommits()
    target: dict[str, Any] = {"model": {"w": torch.zeros(6)}, "step": 0}
    dcp.load(target, storage_reader=ArrayckptReader(path), planner=planner, no_dist=True)
    assert planner.committed == ["model.w"] and torch.equal(target["model"]["w"], torch.arange(6.0))
    assert target["step"] == 3
    # DCP's partial loads: a key the checkpoint lacks, and only some keys (DCP's _EmptyStateDictLoadPlanner)
    partial: dict[str, Any] = {"model": {"w": torch.zeros(6)}, "extra": torch.zeros(1)}
    with pytest.raises(CheckpointException, match="extra"):
        dcp.load(partial, storage_reader=ArrayckptReader(path), no_dist=True)
    dcp.load(partial, storage_reader=ArrayckptReader(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
             no_dist=True)
    assert torch.equal(partial["model"]["w"], torch.arange(6.0)) and torch.equal(partial["extra"], torch.zeros(1))
    only = _load_state_dict_from_keys("model", storage_reader=ArrayckptReader(path))
    assert list(only) == ["model"] and torch.equal(only["model"]["w"], torch.arange(6.0))

    # flatten_state_dict=False: a flat state round-trips; a dict of tensors is one opaque value (only with pickle)
    flat = tmp_path / "flat"
    unflattened = dcp.DefaultSavePlanner(flatten_state_dict=False)
    dcp.save({"w": torch.arange(3.0), "step": 4}, storage_writer=ArrayckptWriter(flat), planner=unflattened,
             no_dist=True)
    target = {"w": torch.zeros(3), "step": 0}
    unflattened_load = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)  # (else DCP's
    dcp.load(target, storage_reader=ArrayckptReader(flat), planner=unflattened_load, no_dist=True)  # drops values)
    assert torch.equal(target["w"], torch.arange(3.0)) and target["step"] == 4
    with pytest.raises(CheckpointException) as info:
        dcp.save(nested, storage_writer=ArrayckptWriter(tmp_path / "opaque"),
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    error = _failure(info.value)
    assert isinstance(error, arrayckpt.PickleNotAllowedError) and "'model'" in str(error)
    # use_collectives=False in a single process is an ordinary save
    dcp.save(_state(5), storage_writer=ArrayckptWriter(flat), use_collectives=False, no_dist=True)
    _assert_step(_loaded(flat), 5)



# --- dcp.async_save ----------------------------------------------------------------------------------------------


def test_async_save_stages_through_the_writer_or_dcps_stagers(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    state = _state(1)
    future = dcp.async_save(state, storage_writer=ArrayckptWriter(tmp_path / "a"), no_dist=True)
    state["w"].add_(100)  # staged already: training goes on
    future.result()
    _assert_step(_loaded(tmp_path / "a"), 1)

    writer = ArrayckptWriter(tmp_path / "cached", cache_staged_state_dict=True)
    for step in (2, 3):  # the staged copy is kept and refilled (pinned only where an accelerator is)
        dcp.async_save(_state(step), storage_writer=writer, no_dist=True).result()
        _assert_step(_loaded(tmp_path / "cached"), step)
    assert writer.state_dict_cache is not None

    options = StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                             use_non_blocking_copy=False)
    stager = DefaultStager(options)
    try:
        response = dcp.async_save(_state(4), storage_writer=ArrayckptWriter(tmp_path / "zoc"), async_stager=stager,
                                  no_dist=True)
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result()
        response.upload_completion.result()
    finally:
        stager.close()
    _assert_step(_loaded(tmp_path / "zoc"), 4)


def test_the_writer_pickles_as_its_configuration(tmp_path: Path) -> None:
    writer = ArrayckptWriter(tmp_path / "c", codec="zstd", allow_pickle=True, cache_staged_state_dict=True,
                             storage_options=None)
    dcp.async_save(_state(1), storage_writer=writer, no_dist=True).result()
    assert writer.state_dict_cache is not None
    copy = pickle.loads(pickle.dumps(writer))
    assert (copy.path, copy.codec, copy.overwrite, copy.allow_pickle, copy.cache_staged_state_dict) == (
        os.fspath(tmp_path / "c"), "zstd", None, True, True)  # overwrite: DCP's default, not given
    assert copy.state_dict_cache is None  # the staged copy stays behind
    dcp.save(_state(2), storage_writer=copy, no_dist=True)
    _assert_step(_loaded(tmp_path / "c"), 2)


class _Paused(dcp.DefaultSavePlanner):
    """Pauses while writing until told to go on."""

    def __init__(self, entered: threading.Event, go: threading.Event) -> None:
        super().__init__()
        self.entered, self.go = entered, go

    def resolve_data(self, write_item: Any) -> Any:
        self.entered.set()
        assert self.go.wait(60)
        return super().resolve_data(write_item)


def test_overlapping_async_saves_through_one_writer_do_not_touch_each_other(tmp_path: Path) -> None:
    latest = tmp_path / "latest"
    writer = ArrayckptWriter(latest)
    entered, go = threading.Event(), threading.Event()
    first = dcp.async_save(_state(1), storage_writer=writer, planner=_Paused(entered, go), no_dist=True)
    try:
        assert entered.wait(60)  # the first save is planned and writing
        dcp.async_save(_state(2), storage_writer=writer, no_dist=True).result()  # a second one starts and commits
        _assert_step(_loaded(latest), 2)
    finally:
        go.set()
    first.result()  # the first was left alone: it commits too, last
    _assert_step(_loaded(latest), 1)
    assert _leftovers(tmp_path) == []


# --- distributed ---------------------------------------------------------------------------------------------------


def _sharded(step: int, mesh: Any, placements: list[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    full = torch.arange(28, dtype=torch.float32).reshape(7, 4) * step  # 7 rows over 3 ranks: 3, 3, 1
    return {"model": {"w": distribute_tensor(full, mesh, placements)}, "bias": torch.full((3,), float(step)),
            "step": step}


def _check_sharded(path: Path, step: int, mesh: Any, **load: Any) -> None:
    """Load into the other placement (a full replica on every rank) and compare."""
    from torch.distributed.tensor import Replicate

    target = _sharded(0, mesh, [Replicate()])
    dcp.load(target, storage_reader=ArrayckptReader(path), **load)
    assert torch.equal(target["model"]["w"].to_local(), _sharded(step, mesh, [Replicate()])["model"]["w"].to_local())
    assert torch.equal(target["bias"], torch.full((3,), float(step))) and target["step"] == step


class _FailOnRank1(dcp.DefaultSavePlanner):
    def resolve_data(self, write_item: Any) -> Any:
        if torch.distributed.get_rank() == 1 and write_item.tensor_data is not None:
            raise RuntimeError("injected failure on rank 1")
        return super().resolve_data(write_item)


def _dropin_on_3(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    base, report = Path(root), {}
    mesh = init_device_mesh("cpu", (world,))
    latest = base / "latest"

    # saved again and again to one path (DCP's default), through fresh writers and one reused with checkpoint_id
    dcp.save(_sharded(1, mesh, [Shard(0)]), storage_writer=ArrayckptWriter(latest))
    dcp.save(_sharded(2, mesh, [Shard(0)]), storage_writer=ArrayckptWriter(latest))
    _check_sharded(latest, 2, mesh)
    writer = ArrayckptWriter()
    dcp.save(_sharded(3, mesh, [Shard(0)]), checkpoint_id=latest, storage_writer=writer,
             planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    _check_sharded(latest, 3, mesh)

    # a save failing on rank 1 after the others wrote: the previous checkpoint loads whole, on every rank
    try:
        dcp.save(_sharded(4, mesh, [Shard(0)]), checkpoint_id=latest, storage_writer=writer, planner=_FailOnRank1())
    except CheckpointException as e:
        report["failed"] = repr(_failure(e))
    _check_sharded(latest, 3, mesh)
    dist.barrier()
    if rank == 0:
        report["leftovers_after_failure"] = _leftovers(base)
    dist.barrier()
    with pytest.raises(CheckpointException) as info:  # overwrite=False, refused on every rank
        dcp.save(_sharded(5, mesh, [Shard(0)]), storage_writer=ArrayckptWriter(latest, overwrite=False))
    report["refused"] = type(_failure(info.value)).__name__
    dcp.save(_sharded(6, mesh, [Shard(0)]), checkpoint_id=latest, storage_writer=writer)  # the writer again
    _check_sharded(latest, 6, mesh)
    dist.barrier()
    if rank == 0:
        report["leftovers_after_retry"] = _leftovers(base)

    # process-group subsets saving side by side (HSDP-style), and no_dist on one rank
    pair, solo = dist.new_group([0, 1]), dist.new_group([2])
    own = {"shared": torch.arange(3.0), f"rank{rank}": torch.full((2,), float(rank))}
    if rank < 2:
        dcp.save(own, storage_writer=ArrayckptWriter(base / "pair"), process_group=pair)
        loaded = {"shared": torch.zeros(3), f"rank{rank}": torch.zeros(2)}
        dcp.load(loaded, storage_reader=ArrayckptReader(base / "pair"), process_group=pair)
        assert torch.equal(loaded[f"rank{rank}"], own[f"rank{rank}"])
    else:
        dcp.save(own, storage_writer=ArrayckptWriter(base / "solo"), process_group=solo)
    if rank == 0:
        dcp.save({"rank0": torch.ones(2)}, storage_writer=ArrayckptWriter(base / "rank0-only"), no_dist=True)
    dist.barrier()
    if rank == 0:
        report["pair"] = (sorted(arrayckpt.open(base / "pair").manifest.entries),
                          arrayckpt.open(base / "pair").manifest.created["world_size"])
        report["solo"] = sorted(arrayckpt.open(base / "solo").manifest.entries)
        report["rank0-only"] = sorted(arrayckpt.open(base / "rank0-only").manifest.entries)

    # use_collectives=False: refused on every rank (none is left waiting for the others)
    try:
        dcp.save(own, storage_writer=ArrayckptWriter(base / "nocoll"), use_collectives=False)
    except arrayckpt.StateError as e:
        report["no_collectives"] = str(e)
    dist.barrier()
    report["nocoll_exists"] = (base / "nocoll").exists()

    # dcp.async_save in DCP's checkpoint process: the writer is pickled into it; DCP's shared-memory staging
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where DCP's checkpoint processes meet
    process = AsyncCheckpointerType.PROCESS
    dcp.async_save(_sharded(7, mesh, [Shard(0)]), storage_writer=ArrayckptWriter(latest),
                   async_checkpointer_type=process).result()
    _check_sharded(latest, 7, mesh)
    stager = DefaultStager(StagingOptions(False, True, False, False))
    try:
        dcp.async_save(_sharded(8, mesh, [Shard(0)]), checkpoint_id=latest, storage_writer=writer,
                       async_checkpointer_type=process, async_stager=stager).result()
    finally:
        stager.close()
    _check_sharded(latest, 8, mesh)
    with pytest.raises(CheckpointException) as info:  # errors come back from the checkpoint process
        dcp.async_save(_sharded(9, mesh, [Shard(0)]), storage_writer=ArrayckptWriter(latest, overwrite=False),
                       async_checkpointer_type=process).result()
    report["process_refused"] = type(_failure(info.value)).__name__
    _check_sharded(latest, 8, mesh)
    return report


@pytest.mark.slow
def test_dropin_on_3_ranks(tmp_path: Path) -> None:
    reports = run_ranks(3, _dropin_on_3, str(tmp_path))
    assert all("injected failure on rank 1" in r["failed"] for r in reports)
    assert len(reports[0]["leftovers_after_failure"]) == 1 and reports[0]["leftovers_after_retry"] == []
    assert {r["refused"] for r in reports} == {"CheckpointExistsError"}
    assert reports[0]["pair"] == (["rank0", "rank1", "shared"], 2)
    assert reports[0]["solo"] == ["rank2", "shared"] and reports[0]["rank0-only"] == ["rank0"]
    assert all("use_collectives=True" in r["no_collectives"] for r in reports)
    assert not any(r["nocoll_exists"] for r in reports)
    assert {r["process_refused"] for r in reports} == {"CheckpointExistsError"}
    assert arrayckpt.verify(tmp_path / "latest").ok and _leftovers(tmp_path) == []
    assert arrayckpt.open(tmp_path / "latest").plain_values["step"] == 8
