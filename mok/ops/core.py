"""The JIT build of csrc/ and the precondition every kernel shares (a Hopper GPU).

`torch.utils.cpp_extension.load` compiles csrc/bindings.cpp and csrc/*.cu with an explicit
`-gencode=arch=compute_90a,code=sm_90a`, into the git-ignored `.cache/torch_extensions/` inside the
repository. The extension's name carries a hash of every file under csrc/, so an edited kernel is
rebuilt and a stale build is never loaded. `MOK_VERBOSE_BUILD=1` shows the compiler's output.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent.parent
CSRC = REPO / "csrc"
CACHE = REPO / ".cache" / "torch_extensions"
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]


def csrc_hash() -> str:
    """Short hash of every file under csrc/ (paths and contents): part of the extension's name."""
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(CSRC)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def extension_name() -> str:
    """mok_ext_<csrc hash>: an edited csrc/ is a new build."""
    return f"mok_ext_{csrc_hash()}"


def require_hopper() -> None:
    """Raise a clear error unless the current CUDA device is a Hopper GPU (compute capability 9.0)."""
    if not torch.cuda.is_available():
        raise RuntimeError("mok.ops: the csrc kernels need a Hopper GPU (sm_90a), but torch sees no CUDA "
                           f"device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda}); "
                           "use the L0/L1 levels on this machine")
    _require_hopper_device(torch.cuda.current_device())


@functools.cache  # a device passes once per process (the query costs ~10 us of host time)
def _require_hopper_device(index: int) -> None:
    capability = torch.cuda.get_device_capability(index)
    if capability != (9, 0):
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(f"mok.ops: the csrc kernels are built for Hopper (sm_90a, compute capability 9.0), "
                           f"got {name} with compute capability {capability[0]}.{capability[1]}")


@functools.cache
def load_extension():
    """The compiled extension module, built on first use (or loaded from .cache/)."""
    require_hopper()
    from torch.utils.cpp_extension import load

    name = extension_name()
    build_dir = CACHE / name
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [CSRC / "bindings.cpp", *sorted(CSRC.glob("*.cu"))]
    return load(
        name=name,
        sources=[str(s) for s in sources],
        extra_include_paths=[str(CSRC / "include")],
        extra_cflags=["-O3"],
        # ARCH_FLAGS given explicitly: torch then adds no arch flags of its own (no plain sm_90 pass).
        extra_cuda_cflags=["-O3", "-lineinfo", "--ftz=false", "--prec-div=true", *ARCH_FLAGS],
        build_directory=str(build_dir),
        verbose=os.environ.get("MOK_VERBOSE_BUILD", "0") == "1",
    )

