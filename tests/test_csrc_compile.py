"""CPU compile check of csrc/ for Hopper (sm_90a) with nvcc: no GPU, no torch headers needed.

Each device header must compile on its own (a one-line .cu that includes it: headers are
self-contained), and every csrc/*.cu must compile with all its kernel templates instantiated, with no
register spills (ptxas -v: a spill is a silent slowdown in a memory-bound kernel).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mok.ops import ARCH_FLAGS, CSRC

INCLUDE = CSRC / "include"
HEADERS = sorted(INCLUDE.rglob("*.cuh")) + sorted(INCLUDE.rglob("*.h"))
UNITS = sorted(CSRC.glob("*.cu"))


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


NVCC = _find_nvcc()
pytestmark = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): the csrc/ compile "
    "check needs the CUDA toolkit (>= 12.4 for sm_90a)")


def _nvcc(source: Path, out: Path, extra: list[str] = ()) -> subprocess.CompletedProcess:
    cmd = [NVCC, *ARCH_FLAGS, "-std=c++17", "-O3", f"-I{INCLUDE}", *extra, "-c", str(source), "-o", str(out)]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)


def test_csrc_has_headers_and_units():
    assert HEADERS, f"no device headers under {INCLUDE}"
    assert UNITS, f"no .cu translation units under {CSRC}"


def test_headers_compile_standalone(tmp_path):
    """One translation unit that includes each header after a different first header would hide a
    missing include; so each header gets its own unit, all compiled in one nvcc call per header."""
    failures = []
    for header in HEADERS:
        rel = header.relative_to(INCLUDE)
        unit = tmp_path / (str(rel).replace("/", "_") + ".cu")
        unit.write_text(f'#include "{rel}"\n')
        result = _nvcc(unit, unit.with_suffix(".o"), ["-Xcompiler", "-Wall"])
        if result.returncode != 0:
            failures.append(f"{rel}:\n{result.stderr}")
    assert not failures, "headers that do not compile on their own:\n" + "\n".join(failures)


def _check_compiles_without_spills(unit: Path, tmp_path: Path, extra: list[str] = ()) -> None:
    result = _nvcc(unit, tmp_path / "unit.o", ["-Xptxas", "-v", "-Xcompiler", "-Wall", *extra])
    assert result.returncode == 0, f"nvcc failed on {unit.name} {extra}:\n{result.stderr}"
    report = result.stderr  # ptxas -v writes its resource report to stderr
    assert "Compiling entry function" in report, f"no kernels compiled for sm_90a in {unit.name}:\n{report}"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert not any(spills), f"register spills in {unit.name} {extra}:\n{report}"
    warnings = [line for line in report.splitlines() if "warning" in line.lower()]
    assert not warnings, f"compiler warnings in {unit.name} {extra}:\n" + "\n".join(warnings)
    # ptxas reports serialized wgmma (C7510 / C7515 ...) as "info", not a warning: each one silently
    # turns the tensor-core pipeline into one MMA at a time.
    # Injected warpgroup.arrive / warpgroup.wait (C7519 / C7517) mean accumulators touched by other
    # instructions without a fence: the same stall, placed by the compiler.
    serialized = [line for line in report.splitlines()
                  if ("wgmma" in line.lower() and "serializ" in line.lower()) or "is injected" in line]
    assert not serialized, f"wgmma serialized by ptxas in {unit.name} {extra}:\n" + "\n".join(serialized)


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_unit_compiles_without_spills(unit, tmp_path):
    _check_compiles_without_spills(unit, tmp_path)


def test_bindings_type_check_against_torch_headers(tmp_path):
    """csrc/bindings.cpp, the one file that sees torch, type-checks against this machine's torch headers and
    mok/api.h (-fsyntax-only): a binding that disagrees with the host API would break every build on the device.
    A CPU wheel of torch lacks one generated CUDA header, c10/cuda/impl/cuda_cmake_macros.h: a stub stands in."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    cxx, python_include = shutil.which("g++") or shutil.which("c++"), Path(sysconfig.get_paths()["include"])
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", str(Path(os.path.realpath(NVCC)).parents[1])]
    cuda_include = next((Path(h) / "include" for h in homes if h and (Path(h) / "include/cuda_runtime.h").is_file()),
                        None)
    if cxx is None or not (python_include / "Python.h").is_file() or cuda_include is None:
        pytest.skip(f"needs a C++ compiler, Python's headers ({python_include}/Python.h) and cuda_runtime.h")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cmd = [cxx, "-std=c++17", "-fsyntax-only", *(f"-I{p}" for p in include_paths()), f"-I{tmp_path}",
           f"-I{python_include}", f"-I{cuda_include}", f"-I{INCLUDE}",
           "-DTORCH_EXTENSION_NAME=mok_type_check", str(CSRC / "bindings.cpp")]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0, "bindings.cpp does not type-check:\n" + "\n".join(errors[:20])


GEMM_UNIT = CSRC / "gemm_bf16.cu"


def _gemm_kernels_ptx(tmp_path) -> list[str]:
    """The PTX of the six GEMM kinds of gemm_bf16.cu (Gemm enum order: gate/up, down, down dgrad, gate/up dgrad,
    wgrad, then gate/up with MXFP8 outputs)."""
    out = tmp_path / "gemm.ptx"
    cmd = [NVCC, "-arch=compute_90a", "-std=c++17", "-O3", f"-I{INCLUDE}", "-ptx", str(GEMM_UNIT), "-o", str(out)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"nvcc -ptx failed:\n{result.stderr}"
    kernels = re.split(r"\.entry ", out.read_text())[1:]
    gemms = sorted(k for k in kernels if k.startswith("_ZN3mok4gemm24grouped_gemm_bf16_kernel"))
    assert len(gemms) == 6, f"expected the six GEMM kinds, found {len(gemms)} kernels"
    return gemms


def test_gemm_epilogues_store_by_tma_and_load_without_multicast(tmp_path):
    """Every GEMM kernel's PTX has bulk tensor stores (ptxas turns them into UTMASTG), and no kind loads by
    cluster multicast: one CTA per task."""
    gemms = _gemm_kernels_ptx(tmp_path)
    stores = [k.count("cp.async.bulk.tensor.3d.global.shared::cta") for k in gemms]
    assert all(stores), f"TMA stores per GEMM kernel: {stores}"
    loads = [k.count("multicast::cluster") > 0 for k in gemms]
    assert not any(loads), f"multicast per kind: {loads}"


def test_only_the_gathered_round_trip_carries_l2_hints(tmp_path):
    """mxfp8_fake_quantize_gathered's kernel (quantize_tiled_kernel with kGather) loads x with an L2 evict_last
    policy and stores its round trip with an evict_first one, each load and store hinted; no other tiled kernel
    carries a hint (docs/lab/log.md, "The MXFP8 backward kernel by kernel")."""
    out = tmp_path / "quant.ptx"
    cmd = [NVCC, "-arch=compute_90a", "-std=c++17", "-O3", f"-I{INCLUDE}", "-ptx", str(CSRC / "quant_mxfp8.cu"),
           "-o", str(out)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"nvcc -ptx failed:\n{result.stderr}"
    entries = {k.split("(")[0]: k for k in re.split(r"\.entry ", out.read_text())[1:]}
    tiled = {name: ptx for name, ptx in entries.items() if name.startswith("_ZN3mok5mxfp821quantize_tiled_kernel")}
    gathered = [name for name in tiled if "Lb1EEEv" in name]  # the last template argument, kGather, true
    assert len(gathered) == 1 and len(tiled) > 1, sorted(tiled)
    for name, ptx in tiled.items():
        hinted = re.findall(r"(ld|st)\.global[\w:.]*L2::cache_hint", ptx)
        if name in gathered:
            assert hinted.count("ld") > 0 and hinted.count("st") > 0, name
            assert "L2::evict_last" in ptx and "L2::evict_first" in ptx, name
        else:
            assert not hinted, f"{name}: {len(hinted)} hinted accesses"


# ---- the boundary by name: bindings.cpp's keyword arguments, mok/ops' calls, api.h's structs ---------------------

def _binding_keywords() -> dict[str, list[str]]:
    """op name -> its keyword arguments, in order (every m.def of csrc/bindings.cpp takes keywords only)."""
    text = (CSRC / "bindings.cpp").read_text()
    module = text[text.index("PYBIND11_MODULE"):]
    defs = re.split(r"\bm\.def\(", module)[1:]
    return {re.match(r'\s*"(\w+)"', d).group(1): re.findall(r'py::arg\("(\w+)"\)', d) for d in defs}


def _extension_calls() -> list[tuple[str, str, list[str], int, bool]]:
    """Every `load_extension().NAME(...)` in mok/ops/*.py: (file:line, NAME, keywords, positional count, **)."""
    import ast

    calls = []
    for path in sorted((CSRC.parent / "mok" / "ops").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "")
                    == "load_extension"):
                names = [k.arg for k in node.keywords if k.arg is not None]
                splat = any(k.arg is None for k in node.keywords)
                calls.append((f"{path.name}:{node.lineno}", node.func.attr, names, len(node.args), splat))
    return calls


def test_every_binding_takes_keywords_only_and_mok_ops_passes_them_by_name():
    """A reorder of a binding's arguments must not bind one tensor in another's place: every op is declared with
    py::kw_only() and a py::arg per parameter, and every call in mok/ops names its arguments (those a ** supplies:
    the schedule's, the SwiGLU limit, num_sms, round_to_tiles' buffers) with the binding's names."""
    from mok.ops.moe import ROUND_BUFFERS

    text = (CSRC / "bindings.cpp").read_text()
    module = text[text.index("PYBIND11_MODULE"):]
    keywords = _binding_keywords()
    assert module.count("m.def(") == len(keywords) == module.count("py::kw_only()"), "a binding without kw_only"
    for name, args in keywords.items():
        assert args and len(set(args)) == len(args), f"{name}: py::arg names {args}"
    splattable = {"row_to_token", "tile_to_expert", "counts", "swiglu_limit", "has_limit", "num_sms", *ROUND_BUFFERS}
    calls = _extension_calls()
    assert len(calls) >= 20, calls
    for where, name, names, positional, splat in calls:
        assert name in keywords, f"{where}: no binding {name}"
        assert positional == 0, f"{where}: {name} called with {positional} positional arguments"
        unknown = set(names) - set(keywords[name])
        assert not unknown, f"{where}: {name} has no arguments {sorted(unknown)}"
        missing = set(keywords[name]) - set(names)
        assert not (missing - splattable if splat else missing), f"{where}: {name} misses {sorted(missing)}"


def _struct_fields(struct: str) -> list[str]:
    """The field names of `struct NAME { ... };` in mok/api.h, in order."""
    text = (INCLUDE / "mok" / "api.h").read_text()
    body = re.search(rf"struct {struct} {{(.*?)\n}};", text, re.S).group(1)
    declarations = (line.split("//")[0].strip().rstrip(";") for line in body.splitlines())
    return [re.findall(r"\w+", piece)[-1] for decl in declarations if decl for piece in decl.split(",")]


def test_the_python_names_of_the_device_structs_are_their_fields():
    """round_to_tiles' buffers (mok.ops.moe.ROUND_BUFFERS: the binding's keywords and tests/test_round_steps.py's
    ctypes mirror of struct RouteRound) are RouteRound's pointer fields in order; make_schedule's arrays by name are
    struct ScheduleOutputs' fields."""
    from mok.ops.moe import _SCHEDULE_ARRAYS, ROUND_BUFFERS

    route_round = _struct_fields("RouteRound")
    assert tuple(route_round[:len(ROUND_BUFFERS)]) == ROUND_BUFFERS
    assert route_round[len(ROUND_BUFFERS):] == ["num_tokens", "num_topk", "num_experts", "num_pool", "tile"]
    assert sorted(_struct_fields("ScheduleOutputs")) == sorted(_SCHEDULE_ARRAYS)
