"""Communication/compute overlap of an expert-parallel MoE pass: a timeline model (notebook 03).

One rank of an EP group of `ep_degree` GPUs runs dispatch (its token rows go to the experts' owners),
the expert GEMMs, and combine (the outputs come back). Two schedules:

    unfused   dispatch -> compute -> combine, serialized: a comm kernel that may use every SM and the
              full NVLink bandwidth, then GEMMs at the full rate, then the comm kernel again
              (DeepEP + grouped GEMMs today).
    fused     MoK's minibatch overlap: tokens split into `num_minibatches`; a share
              `comm_sm_fraction` of the SMs moves data (peer loads/stores) while the others compute,
              so the GEMMs run at (1 - share) of the rate and the link at what those SMs can drive.
              Minibatch i computes once its dispatch landed; the comm SMs send a ready combine first
              (it ends the pass), else the next dispatch (greedy list scheduling).

Costs per rank (routing balanced, tokens_per_rank tokens of num_topk routes each):
    dispatch bytes  routes off this rank × bytes_per_row(hidden, precision)  (mok.comm's byte model)
                    off-rank routes = K·(R-1)/R per token; with dedup (a token sent once per
                    destination rank) (R-1)·(1 - (1 - 1/R)^K) rows per token
    combine bytes   the same rows back, always BF16 (DESIGN §4)
    compute         MoEConfig.flops(pass_) at `compute_tflops` (calibrate_tflops reads data/bench)
    comm bandwidth  min(nvlink_gb_s, SMs given to comm × SM_STREAM_GB_S); each comm step also pays
                    `sync_us` (flags, a barrier)
NOTE: a model, not a measurement: no multi-GPU row exists in data/ yet. GEMM efficiency is taken as
independent of the minibatch size, and routing as balanced.

The megakernel's forward (mok.ep_plan, docs/megakernel.md) on a persistent grid of CTAs per rank: simulate_grid runs
the plan's tickets and counters with a duration per task (task_cost_ns: FLOPs of a GEMM tile, bytes of a pull or a
combine, at one SM's share of the rates); critical_path_ns is its floor, overlap_share how much two kinds overlap.
Also a model: no NVLink latency, a counter seen the moment its last producer ends.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, replace

import pandas as pd

from bench.timing import DATA, read_rows
from mok.checks import fail
from mok.comm import bytes_per_row
from mok.config import PASSES, PRECISIONS, MoEConfig

NUM_SMS = 132  # H200 (DESIGN §2)
SM_STREAM_GB_S = 4200.0 / NUM_SMS  # measured D2D copy rate (read+write 4.2 TB/s) per SM: ~32 GB/s


@dataclass(frozen=True)
class EPSetup:
    """One rank's share of an EP MoE pass and the machine it runs on."""

    ep_degree: int = 8  # R, GPUs in the EP group (72 for an NVL72)
    tokens_per_rank: int = 4096  # T_r
    hidden: int = 7168  # H
    intermediate: int = 2048  # I
    num_topk: int = 8  # K
    shared_intermediate: int = 0  # shared expert width (compute only: it needs no communication)
    precision: str = "bf16"  # dispatch payload; combine is always bf16
    pass_: str = "fwd"  # fwd: dispatch x, combine y; bwd: dispatch dy, combine dx, 2x the FLOPs
    dedup: bool = False  # send a token once per destination rank instead of once per route
    nvlink_gb_s: float = 450.0  # per GPU per direction (H200 NVLink 4; GB300 NVL72: 900)
    compute_tflops: float = 700.0  # dense BF16 rate of the expert GEMMs (calibrate_tflops)
    comm_sm_fraction: float = 0.1  # fused only: share of the SMs that move data
    num_minibatches: int = 4  # fused only
    sync_us: float = 5.0  # fixed cost of each communication step

    def __post_init__(self):
        for name in ("ep_degree", "tokens_per_rank", "hidden", "intermediate", "num_topk", "num_minibatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail(name, "an int >= 1", v)
        if self.precision not in PRECISIONS:
            fail("precision", f"one of {PRECISIONS}", self.precision)
        if self.pass_ not in ("fwd", "bwd"):
            fail("pass_", "'fwd' or 'bwd'", self.pass_)
        if not 0.0 < self.comm_sm_fraction < 1.0:
            fail("comm_sm_fraction", "a share in (0, 1)", self.comm_sm_fraction)
        for name in ("nvlink_gb_s", "compute_tflops"):
            if not getattr(self, name) > 0:
                fail(name, "a positive rate", getattr(self, name))
        if not self.sync_us >= 0:
            fail("sync_us", "a time >= 0", self.sync_us)

    @classmethod
    def from_config(cls, cfg: MoEConfig, **changes) -> EPSetup:
        """A setup with cfg's shape (cfg.num_tokens tokens per rank) and the given changes."""
        shape = dict(tokens_per_rank=cfg.num_tokens, hidden=cfg.hidden, intermediate=cfg.intermediate,
                     num_topk=cfg.num_topk, shared_intermediate=cfg.shared_intermediate)
        return cls(**{**shape, **changes})

    def replace(self, **changes) -> EPSetup:
        return replace(self, **changes)


# ---- costs --------------------------------------------------------------------------------------


def remote_rows_per_token(ep_degree: int, num_topk: int, dedup: bool = False) -> float:
    """Rows a token sends off its rank, on average, with experts chosen uniformly over the ranks."""
    if ep_degree == 1:
        return 0.0
    if dedup:  # distinct destination ranks, excluding its own
        return (ep_degree - 1) * (1.0 - (1.0 - 1.0 / ep_degree) ** num_topk)
    return num_topk * (ep_degree - 1) / ep_degree


def costs(s: EPSetup) -> dict:
    """Bytes and FLOPs of one rank's pass: dispatch_bytes, combine_bytes, flops."""
    rows = s.tokens_per_rank * remote_rows_per_token(s.ep_degree, s.num_topk, s.dedup)
    cfg = MoEConfig("ep", s.tokens_per_rank, s.hidden, s.intermediate, s.ep_degree, s.num_topk,
                    s.shared_intermediate)
    return {"dispatch_bytes": rows * bytes_per_row(s.hidden, s.precision),
            "combine_bytes": rows * bytes_per_row(s.hidden, "bf16"),
            "flops": cfg.flops(s.pass_)}


def comm_gb_s(s: EPSetup, fused: bool) -> float:
    """Bandwidth of the comm work: the link, or what the SMs given to comm can drive."""
    sms = NUM_SMS * (s.comm_sm_fraction if fused else 1.0)
    return min(s.nvlink_gb_s, sms * SM_STREAM_GB_S)


# ---- schedules ----------------------------------------------------------------------------------


def _task(resource, phase, minibatch, start, duration) -> dict:
    return {"resource": resource, "phase": phase, "minibatch": minibatch, "start_us": start,
            "end_us": start + duration}


def unfused_timeline(s: EPSetup) -> pd.DataFrame:
    """dispatch -> compute -> combine, one after the other; tidy rows of tasks (times in µs)."""
    c = costs(s)
    bw = comm_gb_s(s, fused=False) * 1e3  # bytes per µs
    comm = c["dispatch_bytes"] > 0
    d = (c["dispatch_bytes"] / bw + s.sync_us) if comm else 0.0
    g = c["flops"] / (s.compute_tflops * 1e6)  # µs
    b = (c["combine_bytes"] / bw + s.sync_us) if comm else 0.0
    tasks = [_task("comm", "dispatch", 0, 0.0, d), _task("compute", "compute", 0, d, g),
             _task("comm", "combine", 0, d + g, b)]
    return pd.DataFrame([t for t in tasks if t["end_us"] > t["start_us"]])


def fused_timeline(s: EPSetup) -> pd.DataFrame:
    """MoK's minibatch pipeline: tidy rows of tasks (times in µs). With nothing to send (EP = 1) the
    kernel reserves no SMs for comm and this is the compute alone."""
    c = costs(s)
    if c["dispatch_bytes"] == 0:
        return unfused_timeline(s)
    m = s.num_minibatches
    bw = comm_gb_s(s, fused=True) * 1e3  # bytes per µs
    d = c["dispatch_bytes"] / m / bw + s.sync_us  # per minibatch
    b = c["combine_bytes"] / m / bw + s.sync_us
    g = c["flops"] / m / (s.compute_tflops * (1.0 - s.comm_sm_fraction) * 1e6)
    d_end, g_end, tasks = [], [], []
    comm_free = compute_free = 0.0
    while len(tasks) < 3 * m:
        for j in range(len(g_end), len(d_end)):  # minibatches compute in order, once dispatched
            tasks.append(_task("compute", "compute", j, max(compute_free, d_end[j]), g))
            compute_free = tasks[-1]["end_us"]
            g_end.append(compute_free)
        done = len(tasks) - len(d_end) - len(g_end)  # combines issued so far
        # Comm: a combine that is ready goes first (it ends the pass), else the next dispatch,
        # else wait for the next combine.
        if done < len(g_end) and (g_end[done] <= comm_free or len(d_end) == m):
            tasks.append(_task("comm", "combine", done, max(comm_free, g_end[done]), b))
        else:
            tasks.append(_task("comm", "dispatch", len(d_end), comm_free, d))
            d_end.append(tasks[-1]["end_us"])
        comm_free = tasks[-1]["end_us"]
    return pd.DataFrame(tasks).sort_values(["resource", "start_us"], ignore_index=True)


def predict(s: EPSetup) -> dict:
    """One tidy row: the setup, its costs, unfused_us, fused_us, speedup, exposed_comm_us (fused)."""
    unfused = unfused_timeline(s)["end_us"].max()
    fused_tl = fused_timeline(s)
    fused = fused_tl["end_us"].max()
    busy = fused_tl[fused_tl.resource == "compute"].eval("end_us - start_us").sum()
    return {**asdict(s), **costs(s), "unfused_us": unfused, "fused_us": fused,
            "speedup": unfused / fused, "exposed_comm_us": fused - busy}


def sweep(base: EPSetup, **axes) -> pd.DataFrame:
    """predict() over the product of axes (field name -> list of values), one row each."""
    names = list(axes)
    return pd.DataFrame([predict(base.replace(**dict(zip(names, values))))
                         for values in itertools.product(*(axes[n] for n in names))])


# ---- calibration --------------------------------------------------------------------------------


def calibrate_tflops(shape: str, level: str = "cublas-dense", pass_: str = "fwd", precision: str = "bf16",
                     csv=DATA / "moe.csv") -> tuple[float, dict]:
    """The measured TFLOP/s of (shape, level, precision, pass_) in data/bench/moe.csv (or a DataFrame),
    and the row's provenance (gpu, torch, cuda, commit, date)."""
    if pass_ not in PASSES:
        fail("pass_", f"one of {PASSES}", pass_)
    df = csv if isinstance(csv, pd.DataFrame) else read_rows(csv)
    hit = df[(df["shape"] == shape) & (df["level"] == level) & (df["pass"] == pass_)
             & (df["precision"] == precision)]
    if hit.empty:
        have = sorted(set(zip(df["shape"], df["level"])))
        fail("shape/level", f"a measured (shape, level) pair, one of {have}", (shape, level))
    row = hit.iloc[-1]
    return float(row["tflops"]), {k: row[k] for k in ("gpu", "torch", "cuda", "commit", "date") if k in row}


# ---- a measured timeline: EP over gloo processes (CPU) ------------------------------------------


def gloo_phases_rank(rank: int, world_size: int, case: dict) -> dict:
    """One rank of run_local_ep: dispatch, the routed experts (L0), combine, each timed (perf_counter
    after a barrier). case: x, topk_idx, topk_weights, w_gate, w_up, w_down (global), tokens_per_rank,
    precision. Returns out_local, timings (tidy rows) and the rows sent to each rank."""
    import torch.distributed as dist

    from mok import comm, reference

    lo = sum(case["tokens_per_rank"][:rank])
    tokens = slice(lo, lo + case["tokens_per_rank"][rank])
    num_experts = case["w_gate"].shape[0]
    e_local = num_experts // world_size
    experts = slice(rank * e_local, (rank + 1) * e_local)
    x, idx = case["x"][tokens].contiguous(), case["topk_idx"][tokens].contiguous()  # [T_r, H], [T_r, K]
    w = case["topk_weights"][tokens].contiguous()  # [T_r, K]
    w_gate, w_up, w_down = (case[n][experts].contiguous() for n in ("w_gate", "w_up", "w_down"))

    dist.barrier()
    t0 = time.perf_counter()
    state = comm.ep_dispatch(x, idx, num_experts)
    t1 = time.perf_counter()
    y_rows = state.x_recv.new_empty(state.x_recv.shape)  # [N_recv, H]
    start = 0
    for e, n in enumerate(state.num_tokens_per_expert):
        if n:
            y_rows[start:start + n] = reference.expert_forward(
                state.x_recv[start:start + n], w_gate[e], w_up[e], w_down[e], precision=case["precision"])[0]
        start += n
    t2 = time.perf_counter()
    out = comm.ep_combine(y_rows, state, w)  # [T_r, H]
    t3 = time.perf_counter()
    timings = [_task(f"rank {rank}", p, 0, (a - t0) * 1e6, (b - a) * 1e6)
               for p, a, b in (("dispatch", t0, t1), ("compute", t1, t2), ("combine", t2, t3))]
    return {"out": out, "timings": timings, "send_splits": state.send_splits}
