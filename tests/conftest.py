"""Central skipping of hardware marks: gpu (any CUDA GPU), sm90 (Hopper), multigpu (≥ 2 GPUs), bigmem (a GPU
with at least BIGMEM_GIB of memory, or `bigmem(gib=N)`'s N).

A test asks for hardware with a mark; it never checks for it itself. Skips are listed by -ra. On a Hopper GPU the
kernels' one build is made on first use.
"""

import pytest
import torch

BIGMEM_GIB = 72  # tests/test_fused_large.py peaks at 62 GB (H200, 78e18e2): an 80 GB H100 runs it


def _reason(mark: pytest.Mark, item: pytest.Item) -> str | None:
    """Why `item`, with this hardware mark, must skip here, or None when the hardware is there."""
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    if mark.name == "sm90":
        major, minor = torch.cuda.get_device_capability()
        return None if (major, minor) == (9, 0) else f"needs sm_90 (Hopper), found sm_{major}{minor}"
    if mark.name == "multigpu":
        return None if torch.cuda.device_count() >= 2 else "needs 2 or more CUDA GPUs"
    if mark.name == "bigmem":
        need = max(m.kwargs.get("gib", BIGMEM_GIB) for m in item.iter_markers("bigmem"))  # a param's may be larger
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        return None if gib >= need else f"needs a GPU with {need} GiB, found {gib:.0f}"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in ("gpu", "sm90", "multigpu", "bigmem"):
            mark = item.get_closest_marker(name)
            if mark and (reason := _reason(mark, item)):
                item.add_marker(pytest.mark.skip(reason=reason))
                break


@pytest.fixture
def device():
    """The device of a gpu-marked test (tests without the mark run on the CPU)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
