"""Where the L2 `fused` level's time goes, kernel by kernel (`python -m bench parts`).

For each shape (bf16, no swiglu_limit, as the layer benchmark runs), one fused forward gives the saved
state; every step of a pass (the list in mok/fused.py's docstring) then runs once, in the level's order, to
build the intermediates, and is timed alone with bench.timing.time_ms (CUDA events, one sync per timing),
next to the whole fused passes timed in the same process. The GEMM steps are the level's own named steps
(fused.gemm1, gemm2, dgrad_swiglu, dgrad_gate_up; the weight gradients and the memory steps are one kernel
each, called with the level's arguments); tests/test_bench.py runs both on the kernels' L0 twins and checks
that they make the same calls.

Per (shape, step) one row:
    GEMM steps     flops = 2·M·N·K on real rows (M = routes, or tokens for the shared expert; for the weight
                   gradients those rows are K), padded_flops on the schedule's rows (padding included: what
                   the kernel runs), tflops on the useful flops, the cuBLAS dense ceiling of the same (M, N, K)
                   (torch.mm on bf16 randn, same timing, same process) and frac_of_ceiling; frac_of_executed
                   against the same on the padded (M, N, K): how close the kernel comes to cuBLAS on the work it
                   is given, padding apart (bench.moe's `bound` rows, kernel by kernel)
    memory steps   bytes = the fewest bytes the step must move (every input byte read once, every output
                   byte written once, as bench.quant counts) and gbps
    whole_fwd/bwd  the level's passes (bench.moe.level_pass_fn, as `python -m bench moe` times them)
                   with MoK's flops (mok.config) against the sum of the GEMM steps' ceilings (frac_of_executed:
                   against the sum of their padded ones)
    steps_fwd/bwd  the sum of the pass's steps; 1 - its share_of_pass is launch gaps and anything missed
share_of_pass = time_ms / the whole pass's time_ms.

    python -m bench parts [--shapes ...] [--iters 20] [--out data/bench/parts.csv]
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from bench import clocks, moe
from bench.timing import DATA, add_timing_options, clocked, provenance, sweep, time_ms, timing_of
from mok import fused, ops
from mok.config import STANDARD_SHAPES, MoEConfig
from mok.schedule import Schedule
from mok.testing import make_inputs, moe_args

KEY = ["shape", "step"]  # step names are unique over both passes
BF16_B, FP32_B, INT32_B, INT64_B = 2, 4, 4, 8  # bytes per element


@dataclass(frozen=True)
class Step:
    name: str  # unique over both passes
    pass_: str  # "fwd" or "bwd"
    run: Callable[[dict], dict]  # the pass's state -> the tensors the step adds to it
    mnk: tuple[int, int, int] | None = None  # GEMM (M, N, K) on real rows; None: a memory-bound step
    padded_mnk: tuple[int, int, int] | None = None  # the same GEMM on the schedule's rows
    nbytes: int | None = None  # memory-bound: fewest bytes read + written

    @property
    def flops(self) -> float:
        return 2.0 * math.prod(self.mnk) if self.mnk else math.nan

    @property
    def padded_flops(self) -> float:
        return 2.0 * math.prod(self.padded_mnk) if self.padded_mnk else math.nan


# --- the steps ---------------------------------------------------------------------------------------

def _rows_gemm(real: int, padded: int, n: int, k: int) -> dict:
    """An activation GEMM: M = rows (real, or the schedule's)."""
    return dict(mnk=(real, n, k), padded_mnk=(padded, n, k))


def _wgrad_gemm(m: int, n: int, real: int, padded: int) -> dict:
    """A weight-gradient GEMM: K = rows, summed per expert."""
    return dict(mnk=(m, n, real), padded_mnk=(m, n, padded))


def _schedule_bytes(sched: Schedule) -> int:
    """topk_idx read, every schedule array written (and the GEMMs' int32 copies, when the kernel made them)."""
    arrays = [getattr(sched, f.name) for f in fields(sched)] + list(getattr(sched, "gemm_tensors", ()))
    return sched.num_routes * INT64_B + sum(t.nbytes for t in arrays if isinstance(t, torch.Tensor))


def _expert_forward_steps(p: str, real: int, padded: int, width: int, hidden: int, limit, num_sms) -> list[Step]:
    """The level's steps gemm1 and gemm2 (fused.experts_forward) of one expert group; p: state-key prefix."""
    def gemm1(s):
        h, gate, up = fused.gemm1(s["x"], s[p + "w_gate"], s[p + "w_up"], s[p + "sched"], limit, num_sms)  # [R, I]
        return {p + "h": h, p + "gate": gate, p + "up": up}

    def gemm2(s):
        return {p + "y_rows": fused.gemm2(s[p + "h"], s[p + "w_down"], s[p + "sched"], num_sms)}  # [R, H]

    return [Step(p + "gemm1", "fwd", gemm1, **_rows_gemm(real, padded, 2 * width, hidden)),
            Step(p + "gemm2", "fwd", gemm2, **_rows_gemm(real, padded, hidden, width))]


def _expert_backward_steps(p: str, real: int, padded: int, width: int, hidden: int, limit, num_sms,
                           routes: bool = False) -> list[Step]:
    """The level's steps dgrad_swiglu (which also recomputes h) and dgrad_gate_up, then the three weight gradients
    of one expert group (fused._experts_dgrad, fused._weight_grads); x_rows and dy_rows come from the steps before.
    routes: the routed experts, whose dgrad_swiglu weights the unweighted d_out rows and gives d_topk_weights."""
    def dgrad_swiglu(s):
        if routes:
            d_gate, d_up, h, d_topk_weights = fused.dgrad_swiglu_route_grads(
                s[p + "dy_rows"], s[p + "w_down"], s[p + "gate"], s[p + "up"], s["topk_weights"], s[p + "sched"],
                limit, num_sms)  # [R, I] x3, [T, K]
            return {p + "d_gate": d_gate, p + "d_up": d_up, p + "h_rows": h, "d_topk_weights": d_topk_weights}
        d_gate, d_up, h = fused.dgrad_swiglu(s[p + "dy_rows"], s[p + "w_down"], s[p + "gate"], s[p + "up"],
                                             s[p + "sched"], limit, num_sms)  # [R, I] each
        return {p + "d_gate": d_gate, p + "d_up": d_up, p + "h_rows": h}

    def dgrad_gate_up(s):
        return {p + "dx_rows": fused.dgrad_gate_up(s[p + "d_gate"], s[p + "d_up"], s[p + "w_gate"], s[p + "w_up"],
                                                   s[p + "sched"], num_sms)}  # [R, H]

    def wgrad(name: str, out: str, a: str, b: str, m: int, n: int) -> Step:  # d_w[e] = Σ_r a[r]ᵀ·b[r], e's rows
        run = lambda s: {p + out: ops.grouped_gemm_bf16_weight_grad(s[p + a], s[p + b], s[p + "sched"],
                                                                    num_sms=num_sms)}  # [E, m, n]
        return Step(p + name, "bwd", run, **_wgrad_gemm(m, n, real, padded))

    return [Step(p + "dgrad_swiglu", "bwd", dgrad_swiglu, **_rows_gemm(real, padded, width, hidden)),
            wgrad("wgrad_down", "d_w_down", "dy_rows", "h_rows", hidden, width),
            Step(p + "dgrad_gate_up", "bwd", dgrad_gate_up, **_rows_gemm(real, padded, hidden, 2 * width)),
            wgrad("wgrad_gate", "d_w_gate", "d_gate", "x_rows", width, hidden),
            wgrad("wgrad_up", "d_w_up", "d_up", "x_rows", width, hidden)]


def steps_of(saved: fused.FusedSaved) -> list[Step]:
    """Every step of the fused forward then backward, in the level's order, sized from its saved state."""
    T, H = saved.x.shape  # [T, H]
    R, I = saved.topk_idx.numel(), saved.weights[0].shape[1]  # routes, intermediate
    sched, limit, num_sms = saved.sched, saved.swiglu_limit, saved.num_sms
    rows = int(sched.expert_offsets[-1])  # routes and padding: the real rows (sched.num_rows adds spare rows)
    shared = saved.weights[3] is not None
    routed = (R, rows, I, H, limit, num_sms)

    def make_schedule(s):
        return {"sched": ops.make_schedule_cuda(s["topk_idx"], s["w_gate"].shape[0], block_m=fused.BLOCK_M,
                                                sync=False)}

    def combine(s):
        y_shared = s["shared_y_rows"][:T] if shared else None  # [T, H]: row t = token t
        return {"out": ops.combine_rows(s["y_rows"], s["sched"].route_to_row, s["topk_weights"], y_shared,
                                        check_rows=False)}  # [T, H]

    def combine_dx(s):
        dx_shared = s["shared_dx_rows"][:T] if shared else None  # [T, H]
        return {"d_x": ops.combine_rows(s["dx_rows"], s["sched"].route_to_row, None, dx_shared, check_rows=False)}

    tok, row_buf = T * H * BF16_B, rows * H * BF16_B  # one [T, H] and one [num_rows, H] bf16 tensor
    routes_in = R * (H * BF16_B + INT64_B)  # each route's row of a [num_rows, H] tensor and its row id
    shared_in = tok if shared else 0  # the shared expert's [T, H] output or d_x part
    fwd = [Step("schedule", "fwd", make_schedule, nbytes=_schedule_bytes(sched)),
           *_expert_forward_steps("", *routed)]
    routed_bwd = _expert_backward_steps("", *routed, routes=True)  # dgrad x2, then the weight gradients
    # token-major: each token's row in once, its routes' row ids, both views of each row, rows out
    gather_bytes = tok + R * INT64_B + rows * (INT32_B + INT64_B) + row_buf
    # the level's order (fused._experts_backward): the shared expert first, then the routed steps with the combine
    # of d_x before the x rows are gathered
    bwd = [Step("gather_d_out", "bwd", lambda s: {"dy_rows": ops.gather_rows_cuda(s["d_out"], s["sched"])},
                nbytes=gather_bytes),  # the unweighted d_out rows: no y saved
           *routed_bwd[:3],
           Step("combine_dx", "bwd", combine_dx, nbytes=routes_in + shared_in + tok),
           Step("gather_x", "bwd", lambda s: {"x_rows": fused.gather_x_rows(s["x"], s["sched"])}, nbytes=gather_bytes),
           *routed_bwd[3:]]
    if shared:
        I_sh, R_sh = saved.weights[3].shape[0], fused.shared_schedule(T, saved.x.device).num_rows
        fwd[:0] = _expert_forward_steps("shared_", T, R_sh, I_sh, H, limit, num_sms)  # the level runs it first
        shared_bwd = _expert_backward_steps("shared_", T, R_sh, I_sh, H, limit, num_sms)
        bwd[:0] = [Step("shared_pad_rows", "bwd", lambda s: {"shared_dy_rows": fused.pad_rows(s["d_out"], R_sh),
                                                             "shared_x_rows": fused.pad_rows(s["x"], R_sh)},
                        nbytes=2 * (T + R_sh) * H * BF16_B if R_sh > T else 0),  # no padding: no copy
                   *shared_bwd]
    fwd.append(Step("combine", "fwd", combine, nbytes=routes_in + R * FP32_B + shared_in + tok))
    return fwd + bwd


def _group_weights(w: dict) -> dict:
    """The state's weights: routed as given, the shared expert's viewed as one expert ([1, ...])."""
    state = {k: w[k] for k in ("w_gate", "w_up", "w_down")}
    if w["w_shared_gate"] is not None:
        state.update({f"shared_{k}": w[f"w_shared_{k[2:]}"][None] for k in ("w_gate", "w_up", "w_down")})
    return state


def forward_state(inputs: dict) -> dict:
    """What the forward steps start from: the inputs and the cached shared-expert schedule."""
    x = inputs["x"]  # [T, H]
    return {**inputs, **_group_weights(inputs), "shared_sched": fused.shared_schedule(x.shape[0], x.device)}


def backward_state(inputs: dict, saved: fused.FusedSaved) -> dict:
    """What the backward steps start from: the level's saved state and d_out."""
    names = ("w_gate", "w_up", "w_down", "w_shared_gate", "w_shared_up", "w_shared_down")
    state = {"x": saved.x, "topk_weights": saved.topk_weights, "d_out": inputs["d_out"], "sched": saved.sched,
             "gate": saved.gate, "up": saved.up,  # [R, I] each
             **_group_weights(dict(zip(names, saved.weights)))}
    if saved.shared_rows is not None:
        state.update(shared_sched=fused.shared_schedule(saved.x.shape[0], saved.x.device),
                     shared_gate=saved.shared_rows[0], shared_up=saved.shared_rows[1])  # [R_sh, I_sh] each
    return state


def run_steps(steps: list[Step], state: dict) -> dict:
    """Each step once, in order, each adding its outputs to `state` (the intermediates the timings reuse)."""
    for step in steps:
        state.update(step.run(state))
    return state


# --- timing and rows ----------------------------------------------------------------------------------

NO_CLOCK = dict.fromkeys(clocks.COLUMNS, math.nan)


def step_row(step: Step, ms: float, pass_ms: float, ceiling_ms: float, clock: dict = NO_CLOCK,
             ceiling_clock: dict = NO_CLOCK, executed_ms: float = math.nan) -> dict:
    """One step's row; `clock` the clocks its timing ran at, ceiling_sm_mhz its dense GEMM's (bench.timing.clocked),
    executed_ms that GEMM's time on the padded rows."""
    gemm = step.mnk is not None
    return {"pass": step.pass_, "step": step.name, "kind": "gemm" if gemm else "memory", "time_ms": ms, **clock,
            "ceiling_sm_mhz": ceiling_clock["sm_mhz"],
            "share_of_pass": ms / pass_ms, "flops": step.flops, "padded_flops": step.padded_flops,
            "tflops": step.flops / ms / 1e9, "ceiling_tflops": step.flops / ceiling_ms / 1e9,
            "frac_of_ceiling": ceiling_ms / ms, "frac_of_executed": executed_ms / ms,
            "bytes": step.nbytes if not gemm else math.nan,
            "gbps": step.nbytes / ms / 1e6 if not gemm else math.nan,
            "mnk": "x".join(map(str, step.mnk)) if gemm else ""}


def pass_rows(cfg: MoEConfig, pass_: str, whole_ms: float, rows: list[dict], ceiling_ms: float,
              whole_clock: dict = NO_CLOCK, executed_ms: float = math.nan) -> list[dict]:
    """The whole pass (MoK's flops against the GEMM steps' summed ceiling, and their summed padded one) and the sum
    of its steps."""
    padded = sum(r["padded_flops"] for r in rows if r["kind"] == "gemm")
    flops = cfg.flops(pass_)
    out = []
    for step, kind, ms, clock in ((f"whole_{pass_}", "pass", whole_ms, whole_clock),
                                  (f"steps_{pass_}", "sum", sum(r["time_ms"] for r in rows), NO_CLOCK)):
        out.append({"pass": pass_, "step": step, "kind": kind, "time_ms": ms, **clock, "ceiling_sm_mhz": math.nan,
                    "share_of_pass": ms / whole_ms,
                    "flops": flops, "padded_flops": padded, "tflops": flops / ms / 1e9,
                    "ceiling_tflops": flops / ceiling_ms / 1e9, "frac_of_ceiling": ceiling_ms / ms,
                    "frac_of_executed": executed_ms / ms, "bytes": math.nan, "gbps": math.nan, "mnk": ""})
    return out


def bench_parts_shape(cfg: MoEConfig, iters: int = 20, device="cuda", time_fn=time_ms, seed: int = 0,
                      routing_fn=None):
    """Rows for one shape: every step of both passes, then each pass whole and summed (see the docstring).
    time_fn(fn, iters) -> ms (bench.timing.time_ms; tests inject their own); routing_fn: make_inputs' (None: the
    benchmark's random routing)."""
    inputs = make_inputs(cfg, device=device, seed=seed, routing_fn=routing_fn, draw_on=device)
    _, saved = fused.forward(*moe_args(inputs))
    fused.backward(saved, inputs["d_out"])  # warm: the JIT build and every kernel's first launch
    steps, ceilings, rows = steps_of(saved), {}, []
    for pass_, state in (("fwd", forward_state(inputs)), ("bwd", backward_state(inputs, saved))):
        pass_steps = [s for s in steps if s.pass_ == pass_]
        run_steps(pass_steps, state)
        whole_ms, whole_clock = clocked(time_fn, moe.level_pass_fn("fused", inputs, "bf16", pass_), iters)
        step_rows = []
        for step in pass_steps:
            ms, clock = clocked(time_fn, functools.partial(step.run, state), iters)
            for mnk in (step.mnk, step.padded_mnk):
                if mnk is not None and mnk not in ceilings:
                    ceilings[mnk] = moe.clocked_dense_ms([mnk], iters, device, time_fn)
            ceiling_ms, ceiling_clock = ceilings.get(step.mnk, (math.nan, NO_CLOCK))
            executed_ms = ceilings.get(step.padded_mnk, (math.nan,))[0]
            step_rows.append(step_row(step, ms, whole_ms, ceiling_ms, clock, ceiling_clock, executed_ms))
        gemms = [s for s in pass_steps if s.mnk is not None]
        ceiling_ms = sum(ceilings[s.mnk][0] for s in gemms)
        executed_ms = sum(ceilings[s.padded_mnk][0] for s in gemms)
        rows += step_rows + pass_rows(cfg, pass_, whole_ms, step_rows, ceiling_ms, whole_clock, executed_ms)
        del state
    prov = provenance()
    return [{"shape": cfg.name, **r, "iters": iters, **prov} for r in rows]


# --- CLI ----------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench parts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES), help="names from mok.config")
    p.add_argument("--iters", type=int, default=20, help="timed runs of every step, pass and ceiling (≥ 20)")
    add_timing_options(p)
    p.add_argument("--out", type=Path, default=DATA / "parts.csv")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    time_fn, method = timing_of(args)
    all_rows = sweep(args.shapes, lambda cfg: [{**r, **method}
                                                     for r in bench_parts_shape(cfg, args.iters, device, time_fn)],
                           args.out, KEY)
    cols = ["shape", "step", "time_ms", "share_of_pass", "tflops", "frac_of_ceiling", "gbps"]
    print(pd.DataFrame(all_rows)[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {args.out}")
    return 0
