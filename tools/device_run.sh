#!/usr/bin/env bash
# One H200 run of everything that needs the GPU, inside a time budget: the L2 kernel and level tests, the
# quantization tests, compute-sanitizer on the L2 kernels, the layer benchmark beside L1/Liger/the ceiling, the L2
# breakdown kernel by kernel, and the quantizers' benchmark.
# Each step's timeout is cut to what is left of the budget, so the command always returns in time and the
# logs and CSVs under $OUT come back (docs/l2_fused.md, "Next"; ../shared/GPU.md).
#
#   usage (on the device machine, from the repo root):  [MOK_STEPS="gemm l2 ..."] bash tools/device_run.sh COMMIT BUDGET_SECONDS
#   COMMIT: the commit you shipped. The device's copy of .git can be stale, so `git rev-parse` there may
#   name an older commit; the benchmark rows record COMMIT through MOK_COMMIT.
#   Liger's wheel travels in the git-ignored .whl/ (carry it): pip download --no-deps liger-kernel==0.8.5 -d .whl
set -u
commit=${1:?usage: tools/device_run.sh COMMIT BUDGET_SECONDS}
budget=${2:?usage: tools/device_run.sh COMMIT BUDGET_SECONDS}
out=${OUT:-/tmp/mok_out}
# A COMMIT computed here (`git rev-parse HEAD` in the device command) names the device's stale .git, not the tree
# that came: refuse it when the tree differs from that commit, or every row would carry the wrong provenance.
if [[ $(git rev-parse --short HEAD 2>/dev/null) == "${commit:0:7}" ]] && ! git diff --quiet HEAD 2>/dev/null; then
  echo "COMMIT $commit is the device's own HEAD, but the tree differs from it: pass the hash from your machine"
  exit 2
fi
logs=$(mktemp -d)  # the logs come back as one archive, $out/logs.tgz: the device returns only a few files
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=$PWD/.cache/torch_extensions
export LIGER_FUSED_MOE_AUTOTUNE=0 MOK_COMMIT=$commit
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
t0=$(date +%s)

steps=" ${MOK_STEPS:-gemm l2 bench parts memcheck racecheck quant qbench} "  # MOK_STEPS="gemm parts": only those
switch=${MOK_SWITCH:-MOK_GEMM_MULTICAST=1}  # the build switch of the steps switches_sw, parts_sw and ab
ab_args=${MOK_AB_ARGS:-}  # more options of `ab`, `ab_parts`, `mx_steps_ab`, e.g. "--rounds 5 --shapes dsv4pro-rank"
# Build the extension first, outside any tool: built under compute-sanitizer it crashed (segfault, rc 139), and
# the crash left torch's build lock behind, on which every later build of that machine waited until killed.
# Every build the steps load is made here side by side (a build is ~1 minute, nearly all on one core): the
# default, MOK_SWITCH's for the A/B steps, the trace builds of `timeline`; pytest builds its tests' own switch
# sets side by side too (tests/conftest.py).
find .cache -name lock -delete 2>/dev/null  # one run at a time: no lock here is anyone's
builds=default
[[ $steps =~ \ (ab|ab_parts|parts_sw|switches_sw)\  ]] && builds+=" $switch"
# the dynamic step's tests' switch sets (tests/test_ops_gemm.py), built beside the default rather than after it
[[ $steps == *" dynamic "* ]] && builds+=" MOK_GEMM_DYNAMIC=1"
if [[ $steps == *" timeline "* ]]; then
  builds+=" MOK_GEMM_TRACE=1"
  for sw in ${MOK_TIMELINE:-}; do [[ $sw == *=* ]] && builds+=" MOK_GEMM_TRACE=1,$sw"; done
fi
timeout 420 python tools/prebuild.py --timeout-s 360 $builds || echo "build failed"
# Opt-in steps (name them in MOK_STEPS), the GEMMs' build switches (mok/ops/core.py): `switches` builds every
# variant (about a minute each) and requires its bits to equal the default build's; for one switch MOK_SWITCH
# (NAME=VALUE, default MOK_GEMM_MULTICAST=1), `switches_sw` does that for it alone, `parts_sw` is `parts` on its
# build (an A/B against `parts` in the same run), `ab` times the layer's passes on the default build and on it,
# interleaved in one process (mok/bench_ab.py), and `ab_parts` does that kernel by kernel (`ab --parts`);
# `bench_mx` is `bench` for L2 alone (both precisions, no peers): the quick A/B of an MXFP8 change;
# `bench_mxloop` the same for mxfp8 with the forward's weights dequantized in the GEMM mainloops
# (MOK_MX_WEIGHTS=mainloop); `bench_mxcache` is `bench_mx` inside mok.mxfp8_weight_cache (the weights'
# round trips reused across calls); `bench_bound64` is `bench` for L2's BF16 alone with its bound rows over
# 64-row tiles (what a schedule padded to 64 rows could reach at cuBLAS speed); `bench_l2` is `bench` for L2's
# BF16 alone beside its ceiling and bound (a second sample of the fractions, ~2 minutes); `bench_100ms` is `bench`
# by the method of record before 2026-12-04 (100 ms of sustained calls, each timed call from an idle GPU:
# `--warmup-ms 100 --from-idle`) and `bench_3calls` by the one before a012d45 (3 warm-up calls only, queued);
# `ncu` profiles every GEMM once (tools/profile_gemms.py); `mx_ab` times those GEMMs alone against the BF16 ones
# (tools/mx_gemm_ab.py).

step() {  # step NAME TIMEOUT GREP_PATTERN CMD...: run CMD with its log in $out/NAME.log, print the matching lines
  local name=$1 tmo=$2 pattern=$3
  shift 3
  [[ $steps == *" $name "* ]] || return 0
  local left=$((budget - $(date +%s) + t0 - 5))
  if ((left < 20)); then echo "$name skipped (${left}s left)"; return; fi
  ((tmo > left)) && tmo=$left
  timeout "$tmo" "$@" >"$logs/$name.log" 2>&1
  echo "$name rc=$? [$(($(date +%s) - t0))s]"
  grep -E "$pattern" "$logs/$name.log" | tail -14
  tar czf "$out/logs.tgz" -C "$logs" .  # after every step: a run cut short keeps what it logged
}

step gemm 240 "passed|failed|FAILED|Error" python -m pytest -q --maxfail=10 tests/test_ops_gemm.py \
  tests/test_ops_gemm_mxfp8.py -k "not build_switches"
step switches 420 "passed|failed|FAILED|Error" python -m pytest -q tests/test_ops_gemm.py -k build_switches
step switches_sw 200 "passed|failed|FAILED|Error" python -m pytest -q tests/test_ops_gemm.py \
  -k "build_switches and ${switch%%=*}"
step l2 150 "passed|failed|FAILED|Error" python -m pytest -q --maxfail=5 tests/test_ops_combine.py tests/test_fused.py \
  tests/test_ops_gather.py tests/test_ops_schedule.py tests/test_ops_route_grads.py tests/test_nosync.py \
  tests/test_mx_cache.py tests/test_clocks.py
step bench 580 "fused|liger|cublas" python -m mok.bench moe --levels torch fused --out "$out/moe.csv"
step bench_bound64 240 "fused|cublas" python -m mok.bench moe --levels fused --precisions bf16 --peers \
  --bound-block-m 64 --out "$out/moe_bound64.csv"
step bench_l2 240 "fused|cublas" python -m mok.bench moe --levels fused --precisions bf16 --peers \
  --out "$out/moe_l2.csv"
# `bench_rounded`: `bench` in BF16 (L1, L2, Liger) on the same draw with every expert's routes rounded to the
# 128-row tile (mok.routing.round_to_tiles: no padding rows); `routing`: the routers' tests, their GPU ones too;
# `route`: the router's time with and without that rounding (mok.bench_route).
step bench_rounded 400 "fused|liger|cublas" python -m mok.bench moe --levels torch fused --precisions bf16 \
  --routing rounded --out "$out/moe_rounded.csv"
step routing 120 "passed|failed|FAILED|Error" python -m pytest -q tests/test_routing.py tests/test_rounding.py \
  tests/test_round_steps.py tests/test_layer.py
step route 120 "tile|shape|rank|a3b|235b" python -m mok.bench route --out "$out/route.csv"
# `round_profile`: where the rounding's time goes per shape: aten calls, eager and graph times, GPU ops, top kernels
step round_profile 180 "==|graph|  " python tools/round_profile.py
step bench_100ms 300 "fused|liger|cublas" python -m mok.bench moe --levels torch fused --warmup-ms 100 --from-idle \
  --out "$out/moe_100ms.csv"
step bench_3calls 300 "fused|liger" python -m mok.bench moe --levels torch fused --warmup-ms 0 \
  --out "$out/moe_3calls.csv"
step bench_mx 360 "fused" python -m mok.bench moe --levels fused --peers --out "$out/moe_mx.csv"
step bench_mxloop 300 "fused" env MOK_MX_WEIGHTS=mainloop python -m mok.bench moe --levels fused --precisions mxfp8 \
  --peers --out "$out/moe_mx_mainloop.csv"
step bench_mxcache 300 "fused" python -m mok.bench moe --levels fused --peers --mx-weight-cache \
  --out "$out/moe_mx_cache.csv"
step mx_ab 120 "gemm|shape" python tools/mx_gemm_ab.py
step ab 560 "shape|bf16|wrote" python -m mok.bench ab "$switch" $ab_args --out "$out/ab.csv"
step ab_parts 580 "gemm|dgrad|wgrad|wrote" python -m mok.bench ab "$switch" --parts $ab_args --out "$out/ab_parts.csv"
step parts 320 "whole|steps|gemm|wgrad|dgrad" python -m mok.bench parts --out "$out/parts.csv"
# `parts_base`, `route_base`: `parts` / `route` at MOK_BASE, a commit (checked out from the device's .git into a
# worktree; that copy may lack recent commits) or a directory holding that commit's tree (`git archive C | tar -x -C
# DIR` in the repo, DIR untracked so that it travels), its own build: the A/B partner of `parts` / `route` in the
# same run when a change has no build switch. MOK_BASE_COMMIT labels its rows (default: MOK_BASE).
at_base='if [[ -d $1 ]]; then cd "$1"; else [[ -d /tmp/mok_base ]] || git worktree add -f /tmp/mok_base "$1" >/dev/null
  cd /tmp/mok_base || exit 1; fi
  MOK_COMMIT=$2 PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=$PWD/.cache/torch_extensions \
    python -m mok.bench "${@:3}"'
base=("${MOK_BASE:-HEAD}" "${MOK_BASE_COMMIT:-${MOK_BASE:-HEAD}}")
step parts_base 320 "whole|steps|gemm|wgrad|dgrad" bash -c "$at_base" _ "${base[@]}" parts --out "$out/parts_base.csv"
step route_base 240 "tile|shape|rank|a3b|235b" bash -c "$at_base" _ "${base[@]}" route --out "$out/route_base.csv"
step parts_sw 320 "whole|steps|gemm|wgrad|dgrad" env "$switch" python -m mok.bench parts --out "$out/parts_switch.csv"
step ncu 300 "profiling|PROF|rror" "$ncu" --profile-from-start off -k regex:grouped_gemm --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --csv --page details \
  --log-file "$out/ncu_gemms.csv" python tools/profile_gemms.py
# `stalls`: Nsight Compute's warp-state and per-instruction stall samples of dsv4pro's GEMM1 (both launches: routed,
# shared) and first weight gradient, or of MOK_STALLS="SHAPE KERNEL_REGEX COUNT"; `trace`: whole passes under
# torch.profiler (tools/trace_passes.py; its options in MOK_TRACE_ARGS, e.g. "qwen3-30b-a3b --precision mxfp8
# --mx-weight-cache"); `host`: each call's host time in a pass (tools/host_time.py); `order_ab`:
# the forward's shared expert first against last, and from an idle GPU against back to back
# (tools/forward_order_ab.py).
step stalls 240 "profiling|PROF|rror|Stall|==" bash -c '"$0" --profile-from-start off --kernel-name-base demangled \
  -k "regex:$3" -c "$4" --section WarpStateStats --section SourceCounters --section SpeedOfLight -f \
  -o "$1/stalls" python tools/profile_gemms.py "$2" && "$0" -i "$1/stalls.ncu-rep" --page details --csv \
  >"$1/stalls_details.csv" && "$0" -i "$1/stalls.ncu-rep" --page source --csv --print-source sass \
  >"$1/stalls_sass.csv"; rm -f "$1/stalls.ncu-rep"; head -c 3000 "$1/stalls_details.csv"' "$ncu" "$logs" ${MOK_STALLS:-dsv4pro-rank 'Gemm\)(0|4)>' 3}
# `ncu_dual`: the same profile (and SOL, memory, occupancy, DRAM and L2 bytes) of dual quantization on dsv4pro's
# weights as one 2D tensor, then on the same bytes 4096 wide (faster: quant_shapes_0b51dea.csv); summarize either
# page with tools/ncu_sass_summary.py.
step ncu_dual 200 "profiling|PROF|rror" bash -c '"$0" --profile-from-start off -k regex:dual_split -c 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters \
  --section Occupancy --section LaunchStats --metrics dram__bytes_read.sum,dram__bytes_write.sum,\
lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum -f -o "$1/dual" python -c "
import torch
from mok import ops
for shape in [(48 * 3072, 7168), (63 * 4096, 4096)]:
    x = torch.randn(shape, device=\"cuda\").bfloat16()
    ops.mxfp8_quantize_dual(x)
    torch.cuda.synchronize(); torch.cuda.profiler.start(); ops.mxfp8_quantize_dual(x); torch.cuda.profiler.stop()
" && "$0" -i "$1/dual.ncu-rep" --page details --csv >"$1/dual_details.csv" && "$0" -i "$1/dual.ncu-rep" \
  --page source --csv --print-source sass >"$1/dual_sass.csv"; rm -f "$1/dual.ncu-rep"' "$ncu" "$logs"
step trace 150 "span|at " python tools/trace_passes.py ${MOK_TRACE_ARGS:-}
step host 120 "host|at " python tools/host_time.py
step order_ab 150 "shared_first|idle" python tools/forward_order_ab.py
# `launch`: each launch's host time on the forward's path, through the raw bindings (tools/launch_cost.py).
step launch 120 " us$" python tools/launch_cost.py
# `wgrad_ab`: the weight gradients' K over the real rows against the whole padded segment (tools/wgrad_k_ab.py).
step wgrad_ab 120 "ratio" python tools/wgrad_k_ab.py
# `dynamic`: the task counter's GEMM tests (MOK_GEMM_DYNAMIC: its bits, overlapping launches, a CUDA graph).
step dynamic 300 "passed|failed|FAILED|Error" python -m pytest -q tests/test_ops_gemm.py -k DYNAMIC
# `timeline`: per-task SM clocks of GEMM1 from MOK_GEMM_TRACE builds, plain and with each switch of MOK_TIMELINE
# ("SHAPE NAME=VALUE ...", default: dsv4pro's, plain only; tools/task_timeline.py).
step timeline 240 "==|group|^ *[01] " env OUT="$out" python tools/task_timeline.py ${MOK_TIMELINE:-dsv4pro-rank}
# `mx_steps_ab`: MXFP8 steps two ways, the level's way last (tools/mx_steps_ab.py; MOK_AB_ARGS="--steps dgrad").
step mx_steps_ab 180 "shape|step|gather|gemm1|  " env OUT="$out" python tools/mx_steps_ab.py $ab_args
# `values_ab`: the same BF16 GEMMs on random bf16 operands and on their MXFP8 round trips (tools/operand_values_ab.py).
step values_ab 180 "shape|mm|gemm2|  " env OUT="$out" python tools/operand_values_ab.py
# `padding_ab`: the forward's routed GEMMs by cuBLAS with the padding rows random, zeros, padded to 64 rows, or none
# (tools/padding_rows_ab.py).
step padding_ab 200 "shape|ms|  " env OUT="$out" python tools/padding_rows_ab.py
# `grid_ab`: the level's BF16 passes with the GEMMs on every SM and on 124, 116 and 100 (tools/grid_ab.py, ~4 minutes;
# MOK_AB_ARGS adds options, e.g. "--sms 116 --shapes qwen3-30b-a3b"): at the power cap, does a GEMM on fewer SMs
# lose time? (docs/l2_fused.md, "Next" 8).
step grid_ab 400 "shape|ms|  |all" env OUT="$out" python tools/grid_ab.py $ab_args
# `experts`: `bench parts` at qwen3-30b and dsv4pro with their random routing, every expert given the same routes,
# and fewer experts (tools/experts_sweep.py, ~4 minutes; MOK_AB_ARGS adds options, e.g. "--experts 16"): what the
# experts cost apart from their padding.
step experts 420 "E=|pad|random|balanced" env OUT="$out" python tools/experts_sweep.py $ab_args
# `ceiling_ab`: the pass's dense GEMMs and the level's pass in alternating rounds (tools/ceiling_ab.py, ~2 minutes;
# MOK_AB_ARGS adds options): does `bench moe`'s order (the ceiling first) bias the fraction?
step ceiling_ab 300 "shape|fwd|bwd|  " env OUT="$out" python tools/ceiling_ab.py $ab_args
# `ceiling`: the dense ceiling timed several times in one process with the benchmark's warm-up and a 100 ms one,
# each after an idle spell (tools/ceiling_spread.py; "Next" 6).
step ceiling 240 "shape|fwd|bwd|  " env OUT="$out" python tools/ceiling_spread.py
step memcheck 60 "ERROR SUMMARY|tolerance|Error" "$sanitizer" --tool memcheck python tools/sanitize.py
step racecheck 240 "RACECHECK SUMMARY|ERROR SUMMARY|tolerance|Error" "$sanitizer" --tool racecheck python tools/sanitize.py
step racecheck_bf16 300 "RACECHECK SUMMARY|ERROR SUMMARY|tolerance|Error" "$sanitizer" --tool racecheck \
  python tools/sanitize.py bf16
step racecheck_mx 300 "RACECHECK SUMMARY|ERROR SUMMARY|tolerance|Error" "$sanitizer" --tool racecheck \
  python tools/sanitize.py mainloop
# `rounding_sanitize`: round_to_tiles' kernels under memcheck, racecheck and synccheck (their barriers).
step rounding_sanitize 240 "SUMMARY|rounding|Error" bash -c 'for tool in memcheck racecheck synccheck; do
  "$0" --tool $tool python tools/sanitize.py rounding || exit; done' "$sanitizer"
step quant 90 "passed|failed|FAILED" python -m pytest -q -x tests/test_ops_quant.py
# `fp8_probe`: FP8 wgmma with MXFP8's per-k32 promotion against the BF16 mainloop's MMAs, operands in shared memory,
# and one FP8 wgmma's bits against BF16's and the exact sum (tools/fp8_wgmma_probe.cu, built here).
step fp8_probe 120 "way|bf16|fp8|bits|worst" bash -c '"$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" \
  -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/include tools/fp8_wgmma_probe.cu -o /tmp/fp8_probe &&
  /tmp/fp8_probe "$0/fp8_wgmma_probe.csv"' "$out"
# `large`: the level on tensors past 2^31 elements, bitwise against the last expert's tokens alone (62 GB at its peak).
step large 300 "passed|failed|FAILED|Error" python -m pytest -q tests/test_fused_large.py
step qbench 90 "dual|rowwise|colwise|copy" python -m mok.bench_quant --variants 0 --out "$out/quant.csv"
# `qdual`: dual quantization alone (its default, or the variants MOK_QVARIANTS="16,22,23") beside the copy kernels'
# 4 GiB rows, a quick A/B of dual's ceiling.
step qdual 150 "dual|copy" python -m mok.bench_quant --ops dual --no-l0 --variants ${MOK_QVARIANTS:-0} --out "$out/quant_dual.csv"
# `qshape`: dual, row-wise and column-wise quantization on tensors of the same bytes as dsv4pro's weights but other
# row lengths: does the 7168-column gap to the copy ceiling follow the row length?
step qshape 120 "dual|rowwise|colwise" python -m mok.bench_quant --ops dual,rowwise,colwise --no-l0 --variants ${MOK_QVARIANTS:-0} \
  --shapes 147456x7168,258048x4096,516096x2048,73728x14336 --out "$out/quant_shapes.csv"
