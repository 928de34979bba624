"""``allow_pickle=True`` stays opt-in, and a load that actually unpickles says so (issue 23, item 8): one
:class:`arrayckpt.PickleWarning` per load (or per read of a pickled value of an open checkpoint) naming the keys,
as ``torch.load(weights_only=False)`` warns; ``warnings.filterwarnings("ignore", category=arrayckpt.PickleWarning)``
silences it."""

from __future__ import annotations

import fractions
import warnings
from pathlib import Path

import pytest
import torch

import arrayckpt


@pytest.fixture
def pickled(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.ones(2), "f": fractions.Fraction(1, 3), "opt": {"g": fractions.Fraction(2, 3)},
                    "step": 4}, path, allow_pickle=True)
    return path


def _pickle_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, arrayckpt.PickleWarning)]


def test_a_load_that_unpickles_warns_once_naming_the_keys(pickled: Path):
    state = {"w": torch.zeros(2), "f": None, "opt": {"g": None}, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrayckpt.load(state, pickled, allow_pickle=True)
    (message,) = _pickle_warnings(caught)
    assert message.startswith(f"{pickled}: unpickling 'f', 'opt.g' (allow_pickle=True)")
    assert "only from checkpoints you trust" in message and "category=arrayckpt.PickleWarning" in message
    (record,) = [w for w in caught if issubclass(w.category, arrayckpt.PickleWarning)]
    assert record.filename == __file__  # it points at the caller's line, not arrayckpt's
    assert state["f"] == fractions.Fraction(1, 3) and state["opt"]["g"] == fractions.Fraction(2, 3)
    assert issubclass(arrayckpt.PickleWarning, UserWarning)


def test_reading_a_pickled_value_of_an_open_checkpoint_warns_naming_it(pickled: Path):
    with arrayckpt.open(pickled, allow_pickle=True) as opened, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert opened.plain_values["step"] == 4 and opened["w"].numpy().sum() == 2  # nothing unpickled yet
        assert _pickle_warnings(caught) == []
        assert opened.plain_values["opt.g"] == fractions.Fraction(2, 3)
    (message,) = _pickle_warnings(caught)
    assert "unpickling 'opt.g' (allow_pickle=True)" in message


def test_no_warning_without_unpickling_and_the_filter_silences_it(pickled: Path, tmp_path: Path):
    plain = tmp_path / "plain"
    arrayckpt.save({"w": torch.ones(2), "step": 1}, plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrayckpt.load({"w": torch.zeros(2), "step": 0}, plain, allow_pickle=True)  # consent, nothing pickled
        arrayckpt.load({"w": torch.zeros(2)}, pickled, allow_pickle=True, strict=False)  # pickles not taken
        with pytest.raises(arrayckpt.PickleNotAllowedError, match="needs allow_pickle=True"):  # still opt-in
            arrayckpt.load({"f": None}, pickled, strict=False)
        warnings.filterwarnings("ignore", category=arrayckpt.PickleWarning)  # the documented filter
        arrayckpt.load({"f": None}, pickled, allow_pickle=True, strict=False)
    assert _pickle_warnings(caught) == []


def test_converting_with_allow_pickle_warns_once(pickled: Path, tmp_path: Path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrayckpt.convert(pickled, tmp_path / "out.pt", allow_pickle=True)
    (message,) = _pickle_warnings(caught)
    assert "unpickling 'f', 'opt.g'" in message
