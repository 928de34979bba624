"""One place for settings (issue 34, item 4): defaults, environment overrides read once, bad values ignored with a
warning naming them, and ``override`` for a block."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from arrayckpt._settings import Settings, override, settings


def test_every_knob_has_an_environment_variable_and_bad_values_keep_the_default():
    environ = {f"ARRAYCKPT_{f.name.upper()}": "7" for f in dataclasses.fields(Settings)}
    tuned = Settings.from_environ(environ)
    assert all(getattr(tuned, f.name) == 7 for f in dataclasses.fields(Settings))
    with pytest.warns(RuntimeWarning, match="ARRAYCKPT_IO_THREADS='lots' is not a valid value"):
        assert Settings.from_environ({"ARRAYCKPT_IO_THREADS": "lots"}).io_threads == Settings().io_threads
    with pytest.warns(RuntimeWarning, match="ARRAYCKPT_BACKGROUND_NICE='25'.*at most 19"):
        assert Settings.from_environ({"ARRAYCKPT_BACKGROUND_NICE": "25"}).background_nice == 10
    with pytest.warns(RuntimeWarning, match="ARRAYCKPT_VERIFY_BATCH_BYTES='0'"):
        assert Settings.from_environ({"ARRAYCKPT_VERIFY_BATCH_BYTES": "0"}).verify_batch_bytes == 256 << 20
    assert Settings.from_environ({"ARRAYCKPT_LEASE_TTL_S": "2.5"}).lease_ttl_s == 2.5


def test_override_changes_the_settings_for_a_block_only():
    before = settings()
    with override(verify_batch_bytes=1 << 20) as inside:
        assert settings() is inside and inside.verify_batch_bytes == 1 << 20
        with override(io_threads=1):
            assert settings().io_threads == 1 and settings().verify_batch_bytes == 1 << 20
        assert settings().io_threads == before.io_threads
    assert settings() == before


@pytest.mark.slow
def test_a_process_reads_its_environment_once():
    code = ("import os; from arrayckpt._settings import settings; a = settings().io_threads; "
            "os.environ['ARRAYCKPT_IO_THREADS'] = '5'; print(a, settings().io_threads)")
    out = subprocess.run([sys.executable, "-c", code], env={"ARRAYCKPT_IO_THREADS": "3", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["3", "3"]


def test_the_manual_lists_every_knob():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "guide" / "settings.md").read_text()
    missing = [f.name for f in dataclasses.fields(Settings) if f"`ARRAYCKPT_{f.name.upper()}`" not in page]
    assert not missing, f"docs/guide/settings.md does not list {missing}"
