"""Central skipping of hardware marks: gpu (any CUDA GPU), sm90 (Hopper), multigpu (≥ 2 GPUs), bigmem (a GPU
with at least BIGMEM_GIB of memory).

A test asks for hardware with a mark; it never checks for it itself. Skips are listed by -ra. On a Hopper GPU the
kernels' one build is made on first use.
"""

import pytest
import torch

BIGMEM_GIB = 72  # tests/test_fused_large.py peaks at 62 GB (H200, 78e18e2): an 80 GB H100 runs it


def _hardware() -> dict[str, str | None]:
    """mark -> reason to skip, or None when the hardware is there."""
    if not torch.cuda.is_available():
        none = "no CUDA GPU on this machine"
        return {"gpu": none, "sm90": none, "multigpu": none, "bigmem": none}
    major, minor = torch.cuda.get_device_capability()
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return {
        "gpu": None,
        "sm90": None if (major, minor) == (9, 0) else f"needs sm_90 (Hopper), found sm_{major}{minor}",
        "multigpu": None if torch.cuda.device_count() >= 2 else "needs 2 or more CUDA GPUs",
        "bigmem": None if gib >= BIGMEM_GIB else f"needs a GPU with {BIGMEM_GIB} GiB, found {gib:.0f}",
    }


def pytest_collection_modifyitems(config, items):
    reasons = _hardware()
    for item in items:
        for mark, reason in reasons.items():
            if reason and mark in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
                break


@pytest.fixture
def device():
    """The device of a gpu-marked test (tests without the mark run on the CPU)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
