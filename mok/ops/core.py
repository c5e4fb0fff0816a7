"""The JIT build of csrc/ and the precondition every kernel shares.

`torch.utils.cpp_extension.load` compiles csrc/bindings.cpp and csrc/*.cu with an explicit
`-gencode=arch=compute_90a,code=sm_90a`, into the git-ignored `.cache/torch_extensions/` inside the
repository. The extension's name carries a hash of every file under csrc/, so an edited kernel is
rebuilt and a stale build is never loaded. `MOK_VERBOSE_BUILD=1` shows the compiler's output.

Compile-time switches of the kernels (BUILD_SWITCHES) come from the environment (read once per process) or
from `load_extension(switches)`: each one set becomes a `-D` define of the build and part of the extension's
name, so two values build side by side; `built_with(switches)` runs both in one process, which is how
`python -m mok.bench ab MOK_GEMM_TMA_STORE=0` compares them (interleaved, mok/bench_ab.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mok.checks import fail

REPO = Path(__file__).resolve().parent.parent.parent
CSRC = REPO / "csrc"
CACHE = REPO / ".cache" / "torch_extensions"
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
# name -> the values it may take; unset = the header's default (csrc/include/mok/gemm/config.cuh).
BUILD_SWITCHES = {
    "MOK_GEMM_TMA_STORE": (0, 1),  # 1 (default): GEMM epilogues store by TMA; 0: by 16-byte st.global
    "MOK_GEMM_NUM_STAGES": (3, 4),  # GEMM shared-memory stages (default 4; 3 gives the TMA staging 5 boxes a warp)
    "MOK_GEMM_MULTICAST": (0, 1),  # 1: GEMM2 and the dgrads on 2-CTA clusters sharing B by TMA multicast (default 0)
    "MOK_GEMM_GROUP_M": (1, 4, 8),  # row-wise GEMM tasks in groups of this many m-tiles (default 8; 1: m-major)
    "MOK_GEMM_TRACE": (0, 1),  # 1, a probe: per-task SM clocks recorded by the GEMMs (tools/task_timeline.py)
    "MOK_GEMM_DYNAMIC": (0, 1),  # 1: tasks from a device counter in task order, not a static stride (default 0)
}


def csrc_hash() -> str:
    """Short hash of every file under csrc/ (paths and contents): part of the extension's name."""
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(CSRC)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_switches(switches: dict | None = None) -> tuple[tuple[str, int], ...]:
    """The checked switches of a build: `switches` (name -> value), or None = the BUILD_SWITCHES variables set
    in the environment. A value outside BUILD_SWITCHES raises (a typo must not silently build the default)."""
    if switches is None:
        switches = {name: os.environ[name] for name in BUILD_SWITCHES if os.environ.get(name, "").strip()}
    checked = []
    for name, value in switches.items():
        allowed = BUILD_SWITCHES.get(name)
        if allowed is None:
            fail("switches", f"names from {sorted(BUILD_SWITCHES)}", repr(name))
        if str(value).strip() not in {str(v) for v in allowed}:
            fail(name, f"one of {allowed} (a build switch; environment variable or unset)", repr(value))
        checked.append((name, int(str(value).strip())))
    return tuple(sorted(checked))


def extension_name(switches: tuple[tuple[str, int], ...]) -> str:
    """mok_ext_<csrc hash>, plus the switches' values: builds with different switches live side by side."""
    suffix = "".join(f"_{name.removeprefix('MOK_').lower()}{value}" for name, value in switches)
    return f"mok_ext_{csrc_hash()}{suffix}"


def require_hopper() -> None:
    """Raise a clear error unless the current CUDA device is a Hopper GPU (compute capability 9.0)."""
    if not torch.cuda.is_available():
        raise RuntimeError("mok.ops: the csrc kernels need a Hopper GPU (sm_90a), but torch sees no CUDA "
                           f"device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda}); "
                           "use the L0/L1 levels on this machine")
    _require_hopper_device(torch.cuda.current_device())


@functools.cache  # a device passes once per process (the query took ~10 us of host time in every fused pass)
def _require_hopper_device(index: int) -> None:
    capability = torch.cuda.get_device_capability(index)
    if capability != (9, 0):
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(f"mok.ops: the csrc kernels are built for Hopper (sm_90a, compute capability 9.0), "
                           f"got {name} with compute capability {capability[0]}.{capability[1]}")


def load_extension(switches: dict | None = None):
    """The compiled extension module, built on first use (or loaded from .cache/). `switches`: build switches
    (BUILD_SWITCHES name -> value), None = those of the innermost `built_with`, else those set in the
    environment (read once per process)."""
    if switches is not None:
        return _load(build_switches(switches))
    return _load(_active if _active is not None else _env_switches())


_active: tuple[tuple[str, int], ...] | None = None  # built_with's switches


@contextlib.contextmanager
def built_with(switches: dict):
    """Inside it, every mok.ops call runs the build with `switches` ({} = the headers' defaults, whatever the
    environment says): two builds in one process, for an interleaved A/B (mok.bench_ab)."""
    global _active
    outer, _active = _active, build_switches(switches)
    try:
        yield
    finally:
        _active = outer


@functools.cache
def _env_switches() -> tuple[tuple[str, int], ...]:
    return build_switches()


@functools.cache
def _load(switches: tuple[tuple[str, int], ...]):
    require_hopper()
    from torch.utils.cpp_extension import load

    name = extension_name(switches)
    build_dir = CACHE / name
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [CSRC / "bindings.cpp", *sorted(CSRC.glob("*.cu"))]
    defines = [f"-D{switch}={value}" for switch, value in switches]
    return load(
        name=name,
        sources=[str(s) for s in sources],
        extra_include_paths=[str(CSRC / "include")],
        extra_cflags=["-O3"],
        # ARCH_FLAGS given explicitly: torch then adds no arch flags of its own (no plain sm_90 pass).
        extra_cuda_cflags=["-O3", "-lineinfo", "--ftz=false", "--prec-div=true", *ARCH_FLAGS, *defines],
        build_directory=str(build_dir),
        verbose=os.environ.get("MOK_VERBOSE_BUILD", "0") == "1",
    )


def is_built(switches: dict | None = None) -> bool:
    """Whether `switches`' build (None = the environment's) is already in .cache/ for today's csrc/."""
    name = extension_name(build_switches(switches))
    return (CACHE / name / f"{name}.so").is_file()


# One build, in a process of its own: the switches come as JSON in argv[1].
_BUILD_ONE = "import json, sys; from mok.ops.core import load_extension; load_extension(json.loads(sys.argv[1]))"


def prebuild(variants: list[dict], timeout_s: float = 600, workers: int | None = None) -> list[dict]:
    """Build every switch set of `variants` ({} = the headers' defaults) not yet in .cache/, side by side, and wait
    for them. A build takes about a minute, most of it csrc/bindings.cpp under torch's headers on one core (the .cu
    units compile in seconds), so N builds take about one's time instead of N: device time is what the GPU sessions
    lack. `workers` builds at once (default: half the cores), each with two compiles at once (MAX_JOBS=2 unless
    set), so that memory stays bounded. Returns the switch sets it built; raises naming every build that failed or
    was still running after `timeout_s` (then killed, with its compilers), with the end of its output."""
    pending = [c for c in dict.fromkeys(build_switches(s) for s in variants) if not is_built(dict(c))]  # once each
    built = [dict(c) for c in pending]
    workers = workers or max(1, (os.cpu_count() or 2) // 2)
    env = {"MAX_JOBS": "2", **os.environ}
    deadline = time.monotonic() + timeout_s
    running, failed = {}, []
    while pending or running:
        while pending and len(running) < workers:
            checked = pending.pop(0)
            log = tempfile.TemporaryFile("w+")  # not a pipe: a full one would stall the build
            running[checked] = log, subprocess.Popen(
                [sys.executable, "-c", _BUILD_ONE, json.dumps(dict(checked))], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)  # its own group: a kill reaches ninja and nvcc
        late = time.monotonic() > deadline
        for checked, (log, proc) in list(running.items()):
            if proc.poll() is None and not late:
                continue
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                (CACHE / extension_name(checked) / "lock").unlink(missing_ok=True)  # else the next build waits
                failed.append(f"{dict(checked)}: still building after {timeout_s:g} s, killed")
            elif proc.returncode != 0:
                log.seek(0)
                failed.append(f"{dict(checked)}: exit {proc.returncode}\n" + "\n".join(log.read().splitlines()[-15:]))
            log.close()
            del running[checked]
        if late:
            failed += [f"{dict(checked)}: not started within {timeout_s:g} s" for checked in pending]
            break
        time.sleep(0.05)
    if failed:
        raise RuntimeError("mok.ops.prebuild: builds failed:\n" + "\n".join(failed))
    return built


def check_cuda_tensor(name: str, t, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype != dtype:
        fail(name, f"dtype {dtype}", t.dtype)
    if t.dim() not in (2, 3):
        fail(name, "a 2D [rows, cols] or 3D [experts, rows, cols] tensor", f"shape {tuple(t.shape)}")
    if t.device.type != "cuda":
        fail(name, "a CUDA tensor", f"device {t.device}")
    if not t.is_contiguous():
        fail(name, "a contiguous tensor (call .contiguous())", f"strides {t.stride()}")
    if t.data_ptr() % 16 != 0:
        fail(name, "a 16-byte aligned data pointer (a view with a storage offset is not)",
              f"address {t.data_ptr():#x}")
