"""Runs examples/fsdp_resume.py end to end: FSDP2 save on 2 ranks, resume on 1 and on 3 ranks (CPU, gloo)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_resume.py"
SUCCESS_LINE = "OK: FSDP2 checkpoint saved on 2 ranks resumes on 1 and 3 ranks"


def _fsdp2_available() -> bool:
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_gloo_available()):
            return False
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _fsdp2_available(), reason="needs torch.distributed with gloo and FSDP2 (fully_shard)")
def test_fsdp_resume_example_reshards_2_to_1_and_3(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--dir", str(tmp_path), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLE.parents[1],
    )
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, output
    assert SUCCESS_LINE in proc.stdout, output
    assert "MISMATCH" not in proc.stdout, output
    assert (tmp_path / "fsdp_step000003" / "zarr.json").is_file(), "the example wrote no checkpoint into --dir"
