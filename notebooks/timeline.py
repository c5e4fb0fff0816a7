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


# ---- the megakernel's forward on a persistent grid (mok.ep_plan): a model ----------------------------------------


def task_cost_ns(plan, rank: int, task, *, flops_per_ns: float, bytes_per_ns: float, notify_ns: float) -> float:
    """Model of one forward task's time on one CTA (ns): a GEMM tile its FLOPs (every BLOCK_M row, padding too) at
    flops_per_ns, a pull or a combine the BF16 rows it moves at bytes_per_ns, a notify notify_ns (it moves no data)."""
    rp, bm, row = plan.ranks[rank], plan.block_m, bytes_per_row(plan.hidden, "bf16")

    def width(size):  # the columns of output tile n
        return min(plan.block_n, size - task.n * plan.block_n)

    def tokens(c):  # real tokens of token tile c
        return min(bm, rp.num_tokens - c * bm)

    gemm = {"gate_up": 2 * 2 * bm * plan.hidden * width(plan.intermediate) if task.n >= 0 else 0,  # gate and up
            "shared_gate_up": 2 * 2 * bm * plan.hidden * width(plan.shared_intermediate) if task.n >= 0 else 0,
            "down": 2 * bm * plan.intermediate * width(plan.hidden) if task.n >= 0 else 0,
            "shared_down": 2 * bm * plan.shared_intermediate * width(plan.hidden) if task.n >= 0 else 0}
    if task.kind in gemm:
        return gemm[task.kind] / flops_per_ns
    if task.kind == "pull_x":  # the tile's real rows
        return int(rp.tile_num_rows[task.m]) * row / bytes_per_ns
    if task.kind == "combine":  # K routed rows per token, and the shared expert's
        return tokens(task.m) * (plan.num_topk + (plan.shared_intermediate > 0)) * row / bytes_per_ns
    if task.kind == "notify_y":
        return notify_ns
    fail("task.kind", "a forward kind of mok.ep_plan.PHASES", task.kind)


def simulate_grid(plan, pass_: str, grid: int, cost) -> pd.DataFrame:
    """Every rank a persistent grid of `grid` CTAs: a free CTA takes its rank's next ticket, holds it until the
    task's counter reaches its target (seen the moment the last producer ends), then runs it for cost(rank, task)
    ns. Tidy rows, one per task: rank, cta, ticket, kind, phase, take_ns, start_ns, end_ns (the CTA waits on the
    counter from take to start). Raises RuntimeError on a deadlock."""
    tasks = [rp.tasks[pass_] for rp in plan.ranks]
    counts = [[0] * len(rp.targets[pass_]) for rp in plan.ranks]
    free = [list(range(grid)) for _ in tasks]  # idle CTAs of each rank
    next_ticket, held, running, rows, now = [0] * len(tasks), [], [], [], 0.0  # held: [rank, cta, ticket, take]
    while len(rows) < sum(map(len, tasks)):
        for r, ts in enumerate(tasks):
            while free[r] and next_ticket[r] < len(ts):
                held.append((r, free[r].pop(0), next_ticket[r], now))
                next_ticket[r] += 1
        for h in [h for h in held if tasks[h[0]][h[2]].wait < 0 or counts[h[0]][tasks[h[0]][h[2]].wait]
                  >= plan.ranks[h[0]].targets[pass_][tasks[h[0]][h[2]].wait]]:
            held.remove(h)
            running.append((now + cost(h[0], tasks[h[0]][h[2]]), *h, now))
        if not running:
            raise RuntimeError(f"{pass_} deadlock with grid={grid} at {now:.1f} ns: {len(held)} CTAs wait")
        now = min(run[0] for run in running)
        for run in sorted(run for run in running if run[0] == now):
            end, r, cta, i, take, start = run
            running.remove(run)
            free[r] = sorted(free[r] + [cta])
            for rank, c in tasks[r][i].signals:
                counts[rank][c] += 1
            rows.append({"rank": r, "cta": cta, "ticket": i, "kind": tasks[r][i].kind, "phase": tasks[r][i].phase,
                         "take_ns": take, "start_ns": start, "end_ns": end})
    return pd.DataFrame(rows)


def critical_path_ns(plan, pass_: str, cost, order) -> float:
    """The longest chain of producer → consumer through the pass (ns): no grid finishes sooner. order: a
    topological order of (rank, ticket), e.g. mok.ep_plan.task_order(plan, pass_, grid=None)."""
    tasks = [rp.tasks[pass_] for rp in plan.ranks]
    ready = {}  # (rank, counter) -> time its last producer so far ends
    end = 0.0
    for r, i in order:
        t = tasks[r][i]
        done = ready.get((r, t.wait), 0.0) + cost(r, t)
        for rank, c in t.signals:
            ready[(rank, c)] = max(ready.get((rank, c), 0.0), done)
        end = max(end, done)
    return end


def overlap_share(runs: pd.DataFrame, kinds_a, kinds_b) -> float:
    """Share of the time some CTA of a rank runs a task of kinds_a while another CTA of the same rank runs one of
    kinds_b (e.g. pulls against GEMM tiles), over all ranks."""
    def union(df):  # merged [start, end) intervals
        out = []
        for s, e in sorted(zip(df.start_ns, df.end_ns)):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    both = total = 0.0
    for _, g in runs.groupby("rank"):
        a, b = union(g[g.kind.isin(kinds_a)]), union(g[g.kind.isin(kinds_b)])
        total += sum(e - s for s, e in a)
        both += sum(max(0.0, min(e, f) - max(s, t)) for s, e in a for t, f in b)
    return both / total if total else 0.0
