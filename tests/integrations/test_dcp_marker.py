"""The DCP marker (spec §2.1): ``ArrayckptWriter`` leaves ``.metadata`` in every checkpoint it commits, so that
DCP-based trainers that find their steps by that file (TorchTitan) find arrayckpt's; DCP's own reader refuses it
with a message naming arrayckpt's reader, and arrayckpt removes it only when it is its own.
(TorchTitan's own step discovery against it: ``test_torchtitan.py``.)
"""

from __future__ import annotations

import os
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import arrayckpt
from arrayckpt._errors import FormatError
from arrayckpt._format.marker import MARKER, MARKER_NAME, MESSAGE, is_marker
from arrayckpt._storage import parse_location
from arrayckpt.dcp import ArrayckptReader, ArrayckptWriter

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning"),
              pytest.mark.usefixtures("storage_layout")]


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(4, 3).state_dict(), "step": 7}


def test_the_marker_raises_naming_arrayckpts_reader_and_imports_nothing_of_arrayckpts() -> None:
    globals_named = [arg for op, arg, _ in pickletools.genops(MARKER) if op.name == "GLOBAL"]
    assert globals_named == ["operator getitem"]
    with pytest.raises(KeyError, match="ArrayckptReader"):
        pickle.loads(MARKER)
    assert is_marker(MARKER) and not is_marker(MARKER + b"\0") and not is_marker(pickle.dumps({}))


def test_a_dcp_writer_save_holds_the_marker_and_dcps_reader_refuses_it(tmp_path: Path) -> None:
    path = tmp_path / "step-7"
    saved = _state()
    dcp.save(saved, storage_writer=ArrayckptWriter(path), no_dist=True)
    assert (path / MARKER_NAME).read_bytes() == MARKER
    assert not (path / f"{MARKER_NAME}.tmp").exists()
    with pytest.raises(CheckpointException) as refused:  # DCP's FileSystemReader, chosen by the id alone
        dcp.load({"model": torch.nn.Linear(4, 3).state_dict()}, checkpoint_id=path, no_dist=True)
    assert MESSAGE in str(refused.value)
    target = {"model": torch.nn.Linear(4, 3).state_dict(), "step": 0}
    dcp.load(target, storage_reader=ArrayckptReader(path), no_dist=True)  # the way the message names
    assert torch.equal(target["model"]["weight"], saved["model"]["weight"]) and target["step"] == 7
    assert arrayckpt.verify(path).ok


def test_a_replacing_save_keeps_one_marker_and_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "latest"
    dcp.save(_state(0), storage_writer=ArrayckptWriter(path), no_dist=True)
    second = _state(1)
    dcp.save(second, storage_writer=ArrayckptWriter(path), no_dist=True)
    assert (path / MARKER_NAME).read_bytes() == MARKER
    assert torch.equal(torch.from_numpy(arrayckpt.open(path)["model.weight"][...]), second["model"]["weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]  # no temporary directory left beside


def test_no_marker_when_asked_and_none_from_arrayckpt_save(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=ArrayckptWriter(tmp_path / "a", dcp_marker=False), no_dist=True)
    arrayckpt.save(_state(), tmp_path / "b")
    assert not (tmp_path / "a" / MARKER_NAME).exists() and not (tmp_path / "b" / MARKER_NAME).exists()


def test_delete_removes_arrayckpts_marker_first_and_never_dcps_own(tmp_path: Path) -> None:
    ours, shared = tmp_path / "ours", tmp_path / "shared"
    dcp.save(_state(), storage_writer=ArrayckptWriter(ours), no_dist=True)
    parse_location(str(ours)).delete()
    assert not ours.exists()
    arrayckpt.save(_state(), shared)
    (shared / MARKER_NAME).write_bytes(b"DCP's own metadata")  # not arrayckpt's: stays
    parse_location(str(shared)).delete()
    assert sorted(os.listdir(shared)) == [MARKER_NAME]


def test_delete_leaves_a_link_in_the_markers_place(tmp_path: Path) -> None:
    path, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.write_bytes(MARKER)
    arrayckpt.save(_state(), path)
    (path / MARKER_NAME).symlink_to(outside)
    parse_location(str(path)).delete()
    assert outside.read_bytes() == MARKER and (path / MARKER_NAME).is_symlink()


def test_converting_reads_the_directory_as_arrayckpt_not_dcp(tmp_path: Path) -> None:
    from arrayckpt._convert.dcp import read_dcp_metadata
    from arrayckpt._convert.dispatch import detect_format

    path = tmp_path / "step-7"
    dcp.save(_state(), storage_writer=ArrayckptWriter(path), no_dist=True)
    assert detect_format(path) == "arrayckpt"
    with pytest.raises(FormatError, match="arrayckpt's DCP marker"):
        read_dcp_metadata(path)


@pytest.mark.slow
def test_on_s3_the_marker_is_an_object_kept_by_replacing_saves_and_deleted_first(s3_server: Any,
                                                                                   s3_bucket: str) -> None:
    import s3fs

    url, options = f"s3://{s3_bucket}/run/step-7", {"endpoint_url": s3_server.endpoint}
    dcp.save(_state(), storage_writer=ArrayckptWriter(url, storage_options=options), no_dist=True)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server.endpoint})
    assert fs.cat(f"{s3_bucket}/run/step-7/{MARKER_NAME}") == MARKER
    second = _state(1)  # a replacing save: its sweep of stale objects leaves the marker, which is written again
    dcp.save(second, storage_writer=ArrayckptWriter(url, storage_options=options), no_dist=True)
    assert fs.cat(f"{s3_bucket}/run/step-7/{MARKER_NAME}") == MARKER
    opened = arrayckpt.open(url, storage_options=options)
    assert torch.equal(torch.from_numpy(opened["model.weight"][...]), second["model"]["weight"])
    parse_location(url, options).delete()
    assert not fs.exists(f"{s3_bucket}/run/step-7/{MARKER_NAME}")
