"""``benchmarks/s3_ranks.py`` on a tiny state and 2 ranks (reshard to 1): the benchmark stays runnable, and the
request counts of a packed multi-rank save and load on moto S3 stay within the bounds of issue 35."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # starts a server and spawns ranks

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RANKS = 2
SAVE_PUT_CONSTANT = 4  # besides one pack per rank: the lease, the pack index, refs.json and the root


@pytest.fixture(scope="module")
def result() -> Iterator[dict[str, Any]]:
    """One run of the benchmark, for packed arrayckpt and DCP (the files layout is the packed code with
    ``packed=False``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # spawned ranks import the module by name, so it must be importable
        import s3_ranks

        args = s3_ranks.parse_args(["--layers", "1", "--hidden", "8", "--vocab", "12", "--ranks", str(RANKS),
                                    "--reshard-to", "1", "--systems", "arrayckpt[packed],dcp"])
        yield s3_ranks.run(args)
        sys.modules.pop("s3_ranks", None)


def _phase(result: dict[str, Any], system: str, phase: str) -> dict[str, Any]:
    return next(p for p in result["phases"] if (p["system"], p["phase"]) == (system, phase))


def _arrays(result: dict[str, Any]) -> int:
    return int(result["info"]["tensors"])


def test_a_packed_save_puts_one_object_per_rank_plus_a_constant_and_its_commit_lists_nothing(result) -> None:
    save = _phase(result, "arrayckpt[packed]", "save")["requests"]
    assert save["PUT"] + save["part"] <= RANKS + SAVE_PUT_CONSTANT, save
    assert save["LIST"] == 1, save  # the fresh prefix, listed once before the save; nothing at the commit
    assert result["stored"]["arrayckpt[packed]"]["objects"] == RANKS + 3  # packs, index, refs.json, root


def test_a_packed_open_is_one_get(result) -> None:
    opened = _phase(result, "arrayckpt[packed]", "open")
    assert opened["total"] == opened["requests"]["GET"] == 1


def test_packed_loads_issue_a_few_gets_per_rank_per_data_file(result) -> None:
    """A packed load reads every section it needs in one ranged read of the index and each pack's chunks in merged
    ranged reads (``_io/staged.py``, ``PackedChunks.fetch_many``): a few GETs per rank per pack, however many arrays.
    Merging ranges closer than ``pack_read_gap_bytes`` may fetch the bytes between them: at most that per GET."""
    from arrayckpt._settings import settings

    for phase, packs in (("load", 1), ("reshard", RANKS)):
        got = _phase(result, "arrayckpt[packed]", phase)
        assert got["requests"]["LIST"] == got["requests"]["PUT"] == 0, got
        assert got["max_get_per_rank"] <= 4 * packs + 4, got  # a few per pack, plus the root and the index
        gets = got["requests"]["GET"]
        assert got["data_bytes_fetched"] <= 1.1 * got["bytes_needed"] + settings().pack_read_gap_bytes * gets, got


def test_dcp_ran_every_phase(result) -> None:
    assert [p["phase"] for p in result["phases"] if p["system"] == "dcp"] == ["save", "open", "load", "reshard"]
    assert _phase(result, "dcp", "open")["requests"]["GET"] >= 1
