"""Runs examples/train_resume.py end to end: save mid-training, load into fresh objects, resume."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_resume.py"
SUCCESS_LINE = "OK: resumed run matches the uninterrupted run exactly"


def test_train_resume_example_is_bit_exact(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--dir", str(tmp_path), "--steps", "10"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLE.parents[1],
    )
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, output
    assert SUCCESS_LINE in proc.stdout, output
    assert any(tmp_path.iterdir()), "the example wrote no checkpoint into --dir"
