"""Runs examples/fsdp_resume.py end to end: FSDP2 save on 2 ranks, resume on 1 and on 3 ranks (CPU, gloo)."""

import pytest
from helpers import run_example

pytestmark = pytest.mark.slow  # spawns processes, starts a server or runs a foreign stack

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
    out = run_example("fsdp_resume.py", "--dir", str(tmp_path), "--steps", "3")
    assert SUCCESS_LINE in out and "MISMATCH" not in out, out
    assert (tmp_path / "fsdp_step000003" / "zarr.json").is_file(), "the example wrote no checkpoint into --dir"
