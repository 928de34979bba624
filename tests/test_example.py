"""Runs the examples end to end: save mid-training, load into fresh objects (or a fresh process), resume."""

import pytest
from helpers import run_example

pytestmark = pytest.mark.slow  # spawns processes, starts a server or runs a foreign stack


def test_train_resume_example_is_bit_exact(tmp_path):
    out = run_example("train_resume.py", "--dir", str(tmp_path), "--steps", "10")
    assert "OK: resumed run matches the uninterrupted run exactly" in out, out
    assert any(tmp_path.iterdir()), "the example wrote no checkpoint into --dir"


def test_lightning_resume_example_is_bit_exact(tmp_path):
    out = run_example("lightning_resume.py", "--dir", str(tmp_path), "--epochs", "1", "--async")
    assert "OK: resumed Lightning run matches the uninterrupted run exactly" in out, out
    assert (tmp_path / "checkpoints" / "last.ckpt").is_dir()


def test_two_tier_resume_example_resumes_from_s3_bit_exact(tmp_path):
    out = run_example("two_tier_resume.py", "--dir", str(tmp_path), "--steps", "8", "--every", "4")
    assert "OK: resumed from S3 after losing the local tier, bit for bit" in out, out
    assert "restored from ('remote',)" in out, out


def test_peer_recovery_example_resumes_on_3_ranks_from_the_survivors_memory(tmp_path):
    out = run_example("peer_recovery.py", "--dir", str(tmp_path), "--steps", "14", "--kill-after", "8")
    assert "OK: resumed on 3 ranks from the survivors' memory; losses continue bit for bit" in out, out
    assert "from peer memory onto 3 ranks" in out and "SIGKILLed after memory step 8" in out, out
    assert "flushed to the durable tier: ('memory', 'local')" in out, out
    assert not (tmp_path / "shm-node1").exists()  # the lost node's memory stayed lost
