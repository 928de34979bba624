"""Runs examples/train_resume.py end to end: save mid-training, load into fresh objects, resume."""

from helpers import run_example


def test_train_resume_example_is_bit_exact(tmp_path):
    out = run_example("train_resume.py", "--dir", str(tmp_path), "--steps", "10")
    assert "OK: resumed run matches the uninterrupted run exactly" in out, out
    assert any(tmp_path.iterdir()), "the example wrote no checkpoint into --dir"
