"""The megakernel's input format (docs/megakernel.md): an EPPlan lowered, per rank and pass, to flat int32 arrays
that the persistent kernel reads as they are. `plan_tables(plan, rank, pass_)` returns them by name (the names of
the kernel's struct fields, as mok/ops pass tensors); `check_tables` checks every rank's tables of a pass by
check_plan's rules and the row lists' invariants; mok.ep_twin_tables runs a pass from the tables alone.

Every array is int32 and contiguous: each value is an id or a count of one rank's rows, tokens, tiles, tasks or
counters, all below 2^31 (plan_tables raises otherwise). Element offsets (row · hidden: 1.5 G at dsv4pro × 8) can
exceed 2^31: the kernel forms them in int64. The same names in both passes. -1 means "none".

  name                 shape                   meaning
  dims                 [len(DIMS)]             the scalars, in DIMS order (on the device: no host read needed)
  task_kind            [num_tasks]             TASK_KINDS index, in ticket order
  task_phase           [num_tasks]             the kind's phase (index into PHASES[pass_]); non-decreasing
  task_m               [num_tasks]             row tile m, or local token tile c (TASK_FIELDS); -1: weight gradients
  task_n               [num_tasks]             output column tile (weight gradients: output row tile); -1: none
  task_expert          [num_tasks]             owned expert, local index (weights [E_r, ...]); -1: not routed
  task_which           [num_tasks]             WHICH index of a weight gradient; -1 otherwise
  task_wait            [num_tasks]             the counter of this rank the task waits on; -1: none
  task_target          [num_tasks]             the value task_wait must reach (counter_target[task_wait]); 0: none
  task_signal_offsets  [num_tasks + 1]         task i increments signals [off[i], off[i + 1]); off[0] = 0
  signal_rank          [num_signals]           the rank holding the counter (this rank: a local increment)
  signal_counter       [num_signals]           the counter's id on that rank
  counter_target       [num_counters]          increments the counter receives in the pass, from every rank
  tile_num_rows        [num_rows / block_m]    real rows of row tile m (a prefix)
  pull_rank            [num_rows]              rank holding the row's token; -1: padding row
  pull_token           [num_rows]              the token's local id there; -1: padding row
  pull_k               [num_rows]              the route's k (pull_dy reads topk_weights[token, k]); -1: padding row
  combine_rank         [num_tokens, num_topk]  owner rank of route (t, k)
  combine_row          [num_tokens, num_topk]  the route's row in its owner's row buffer
  expert_offsets       [num_local_experts + 1] owned expert e's segment: rows [off[e], off[e + 1]), BLOCK_M-aligned
  tokens_per_expert    [num_local_experts]     real rows of each segment (its first ones)
  tokens_per_rank      [ep_size]               T_r of every rank (shared_wgrad's K: every rank's tokens, in order)
  shared_wgrad_tiles   [num_shared_tiles, 3]   (which, n, rank) of each shared weight-gradient tile (the gather)

Counters: ids 0 .. num_counters - 1 per rank and pass, a flat int32 array in the rank's symmetric counter buffer; a
counter's id is its family's base plus its index (mok.ep_plan.COUNTERS). mok.ep_build builds the same tables by tensor
ops.
A signal names (signal_rank, signal_counter): a local one is an add at the rank's own base, a remote one at the
peer's base from the pointer table, at the same id.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from mok.checks import check_int, fail
from mok.ep_plan import PHASE_OF, PHASES, WHICH, EPPlan

__all__ = ["DIMS", "TABLES", "TASK_FIELDS", "TASK_KINDS", "WHICH", "check_tables", "plan_tables"]

TASK_KINDS = tuple(kind for phases in PHASES.values() for kinds in phases for kind in kinds)  # task_kind's names
DIMS = ("ep_size", "rank", "num_topk", "hidden", "intermediate", "shared_intermediate", "block_m", "block_n",
        "num_tokens", "num_rows", "num_local_experts", "num_tasks", "num_signals", "num_counters", "num_shared_tiles")
TABLES = ("dims", "task_kind", "task_phase", "task_m", "task_n", "task_expert", "task_which", "task_wait",
          "task_target", "task_signal_offsets", "signal_rank", "signal_counter", "counter_target", "tile_num_rows",
          "pull_rank", "pull_token", "pull_k", "combine_rank", "combine_row", "expert_offsets", "tokens_per_expert",
          "tokens_per_rank", "shared_wgrad_tiles")
# The fields each kind sets, the others -1: m (row tile), c (token tile, in task_m), n, e (expert), w (which).
TASK_FIELDS = {"pull_x": "m", "shared_gate_up": "cn", "gate_up": "mne", "shared_down": "cn", "down": "mne",
               "notify_y": "m", "combine": "c", "pull_dy": "m", "shared_dgrad_down": "cn", "dgrad_down": "mne",
               "shared_dgrad_gate_up": "cn", "dgrad_gate_up": "mne", "notify_dx": "m", "wgrad": "new",
               "shared_wgrad": "nw", "combine_dx": "c"}
GLOBAL_DIMS = ("num_topk", "hidden", "intermediate", "shared_intermediate", "block_m", "block_n", "num_shared_tiles")
INT32 = torch.iinfo(torch.int32)


def plan_tables(plan: EPPlan, rank: int, pass_: str) -> dict[str, torch.Tensor]:
    """Every array rank `rank`'s kernel reads in pass_, by name (TABLES, the spec above): int32, contiguous, CPU."""
    if pass_ not in PHASES:
        fail("pass_", f"one of {tuple(PHASES)}", repr(pass_))
    check_int("rank", rank, 0, plan.ep_size - 1)
    rp, K = plan.ranks[rank], plan.num_topk
    tasks, targets = rp.tasks[pass_], rp.targets[pass_]
    signals = [s for t in tasks for s in t.signals]
    tab = {"task_kind": [TASK_KINDS.index(t.kind) for t in tasks], "task_phase": [t.phase for t in tasks],
         "task_m": [t.m for t in tasks], "task_n": [t.n for t in tasks],
         "task_expert": [t.expert - rp.experts.start if t.expert >= 0 else -1 for t in tasks],
         "task_which": [WHICH.index(t.which) if t.which else -1 for t in tasks],
         "task_wait": [t.wait for t in tasks], "task_target": [targets[t.wait] if t.wait >= 0 else 0 for t in tasks],
         "task_signal_offsets": [0, *accumulate(len(t.signals) for t in tasks)],
         "signal_rank": [r for r, _ in signals], "signal_counter": [c for _, c in signals],
         "counter_target": targets, "tile_num_rows": rp.tile_num_rows, "pull_rank": rp.pull_rank,
         "pull_token": rp.pull_token, "pull_k": torch.where(rp.row_to_route >= 0, rp.row_to_route % K, -1),
         "combine_rank": rp.combine_rank, "combine_row": rp.combine_row, "expert_offsets": rp.expert_offsets,
         "tokens_per_expert": rp.tokens_per_expert, "tokens_per_rank": plan.tokens_per_rank,
         "shared_wgrad_tiles": [[WHICH.index(w), n, r] for w, n, r in plan.shared_wgrad_tiles]}
    dims = {"ep_size": plan.ep_size, "rank": rank, "num_topk": K, "hidden": plan.hidden,
            "intermediate": plan.intermediate, "shared_intermediate": plan.shared_intermediate,
            "block_m": plan.block_m, "block_n": plan.block_n, "num_tokens": rp.num_tokens, "num_rows": rp.num_rows,
            "num_local_experts": len(rp.experts), "num_tasks": len(tasks), "num_signals": len(signals),
            "num_counters": len(targets), "num_shared_tiles": len(plan.shared_wgrad_tiles)}
    tab["dims"] = [dims[name] for name in DIMS]
    out = {}
    for name in TABLES:
        v = torch.as_tensor(tab[name], dtype=torch.int64)  # exact, before the narrowing check
        if v.numel() and (int(v.min()) < INT32.min or int(v.max()) > INT32.max):
            fail(name, "values that fit int32", f"[{int(v.min())}, {int(v.max())}]")
        out[name] = v.reshape(-1, 3) if name == "shared_wgrad_tiles" else v
        out[name] = out[name].to(torch.int32).contiguous()
    return out


def _shape(name: str, d: dict) -> tuple:
    """The spec's shape of table `name` given its rank's dims."""
    n = {"dims": (len(DIMS),), "task_signal_offsets": (d["num_tasks"] + 1,),
         "tile_num_rows": (d["num_rows"] // d["block_m"],), "combine_rank": (d["num_tokens"], d["num_topk"]),
         "combine_row": (d["num_tokens"], d["num_topk"]), "expert_offsets": (d["num_local_experts"] + 1,),
         "tokens_per_expert": (d["num_local_experts"],), "tokens_per_rank": (d["ep_size"],),
         "shared_wgrad_tiles": (d["num_shared_tiles"], 3), "counter_target": (d["num_counters"],)}
    return n.get(name) or ((d["num_tasks"],) if name.startswith("task_") else
                           (d["num_signals"],) if name.startswith("signal_") else (d["num_rows"],))


def check_tables(tables: list[dict], pass_: str) -> None:
    """Raise ValueError unless `tables` (plan_tables of every rank, in rank order) are well formed for pass_: the
    spec's names, dtype, shapes and sentinels; valid ids; check_plan's rules (1) every counter_target equals the
    signals naming the counter, (2) each rank's tickets in non-decreasing phase, (3) every producer before its
    consumer (same rank: a smaller ticket; another rank: an earlier phase); and the row lists: -1 exactly on the
    padding rows, each owned expert's real rows where its tokens_per_expert says, and the combine plans the
    inverse of the pull lists (route (t, k) of rank h names a row whose pull entry is (h, t, k))."""
    if pass_ not in PHASES:
        fail("pass_", f"one of {tuple(PHASES)}", repr(pass_))
    R, kinds = len(tables), [TASK_KINDS.index(k) for ks in PHASES[pass_] for k in ks]
    for r, tb in enumerate(tables):
        if sorted(tb) != sorted(TABLES) or tb["dims"].shape != (len(DIMS),):
            fail(f"{pass_} tables of rank {r}", f"the tables {TABLES}, dims [{len(DIMS)}]", sorted(tb))
    L = [{name: tb[name].tolist() for name in TABLES} for tb in tables]  # python lists, for the loops
    dims = [dict(zip(DIMS, lt["dims"])) for lt in L]
    producers = {}  # (rank, counter) -> [(rank, ticket)]
    for r, (tb, lt, d) in enumerate(zip(tables, L, dims)):
        where = f"{pass_} tables of rank {r}"
        if (d["ep_size"] != R or d["rank"] != r or any(d[k] != dims[0][k] for k in GLOBAL_DIMS) or
                any(lt[k] != L[0][k] for k in ("tokens_per_rank", "shared_wgrad_tiles"))):
            fail(f"{where}, dims", f"ep_size {R}, rank {r}, rank 0's {GLOBAL_DIMS}, tokens_per_rank and tiles", d)
        for name in TABLES:
            if tb[name].dtype != torch.int32 or not tb[name].is_contiguous() or tb[name].shape != _shape(name, d):
                fail(f"{where}, {name}", f"int32, contiguous, shape {list(_shape(name, d))}",
                     f"{tb[name].dtype}, strides {tb[name].stride()}, shape {list(tb[name].shape)}")
        bm, off, seg, ctr = d["block_m"], lt["task_signal_offsets"], lt["expert_offsets"], lt["counter_target"]
        if off[0] != 0 or off[-1] != d["num_signals"] or any(a > b for a, b in zip(off, off[1:])):
            fail(f"{where}, task_signal_offsets", f"non-decreasing from 0 to num_signals={d['num_signals']}", off)
        _check_rows(where, lt, d, seg)
        for i, (k, p, m, n, e, w, wait, target) in enumerate(zip(*(lt[f"task_{f}"] for f in (
                "kind", "phase", "m", "n", "expert", "which", "wait", "target")))):
            task = f"{where}, ticket {i} ({TASK_KINDS[k] if k in kinds else k} m={m} n={n})"
            if k not in kinds or p != PHASE_OF[TASK_KINDS[k]] or (i and p < lt["task_phase"][i - 1]):
                fail(task, f"a {pass_} kind in its phase, phases non-decreasing", f"kind {k}, phase {p}")
            f = TASK_FIELDS[TASK_KINDS[k]]
            tiles = len(lt["tile_num_rows"]) if "m" in f else -(-d["num_tokens"] // bm)
            if not ((0 <= m < tiles if "m" in f or "c" in f else m == -1) and (n >= 0 if "n" in f else n == -1)
                    and (0 <= w < len(WHICH) if "w" in f else w == -1)
                    and (0 <= e < d["num_local_experts"] if "e" in f else e == -1)
                    and ("m" not in f or "e" not in f or seg[e] <= m * bm < seg[e + 1])):
                fail(task, f"its fields {f!r} in range, -1 elsewhere, row tile m in expert e's segment",
                     f"expert {e}, which {w}")
            if not (-1 <= wait < len(ctr) and target == (ctr[wait] if wait >= 0 else 0)):
                fail(task, "a wait on a counter of its rank (or -1) and that counter's target (or 0)",
                     f"counter {wait}, target {target}")
            for s in range(off[i], off[i + 1]):
                sr, sc = lt["signal_rank"][s], lt["signal_counter"][s]
                if not (0 <= sr < R and 0 <= sc < dims[sr]["num_counters"]):
                    fail(task, "signals to existing counters", (sr, sc))
                producers.setdefault((sr, sc), []).append((r, i))
    for r, lt in enumerate(L):  # rules (1) and (3)
        for c, target in enumerate(lt["counter_target"]):
            got = len(producers.get((r, c), ()))
            if got != target:
                fail(f"{pass_} counter {c} on rank {r}", f"a target equal to the signals naming it, {got}", target)
        for i, c in enumerate(lt["task_wait"]):
            for pr, pi in producers.get((r, c), ()) if c >= 0 else ():
                if (pi >= i) if pr == r else (L[pr]["task_phase"][pi] >= lt["task_phase"][i]):
                    fail(f"{pass_} tables", "every producer before its consumer (same rank: a smaller ticket; "
                         "another rank: an earlier phase)", f"rank {pr} ticket {pi} feeding rank {r} ticket {i}")
    _check_combine(pass_, L, dims)


def _check_rows(where: str, lt: dict, d: dict, seg: list) -> None:
    """Pull entries -1 exactly on padding rows, in range elsewhere; expert segments as tokens_per_expert says."""
    bm, rows = d["block_m"], range(d["num_rows"])
    real = [i % bm < lt["tile_num_rows"][i // bm] for i in rows]
    if seg[0] != 0 or seg[-1] != d["num_rows"] or any(a > b or a % bm for a, b in zip(seg, seg[1:])):
        fail(f"{where}, expert_offsets", f"BLOCK_M-aligned, non-decreasing from 0 to num_rows={d['num_rows']}", seg)
    in_segment = [False] * d["num_rows"]
    for e, count in enumerate(lt["tokens_per_expert"]):
        if not 0 <= count <= seg[e + 1] - seg[e]:
            fail(f"{where}, tokens_per_expert", "counts within their segments", lt["tokens_per_expert"])
        in_segment[seg[e]: seg[e] + count] = [True] * count
    for i, (src, tok, k) in enumerate(zip(lt["pull_rank"], lt["pull_token"], lt["pull_k"])):
        ok = (0 <= src < d["ep_size"] and 0 <= tok < lt["tokens_per_rank"][src] and 0 <= k < d["num_topk"]
              if real[i] else src == tok == k == -1)
        if not ok or real[i] != in_segment[i]:
            fail(f"{where}, row {i}", "a pull entry (rank, token, k) on each real row (tile_num_rows, "
                 "tokens_per_expert), -1 on padding rows", (src, tok, k))


def _check_combine(pass_: str, L: list, dims: list) -> None:
    """Each route (t, k) of rank h names a row whose pull entry is (h, t, k); as many routes as real rows."""
    routes = real = 0
    for h, lt in enumerate(L):
        for t, (owners, rows) in enumerate(zip(lt["combine_rank"], lt["combine_row"])):
            for k, (o, row) in enumerate(zip(owners, rows)):
                routes += 1
                if not (0 <= o < len(L) and 0 <= row < dims[o]["num_rows"] and
                        (L[o]["pull_rank"][row], L[o]["pull_token"][row], L[o]["pull_k"][row]) == (h, t, k)):
                    fail(f"{pass_} tables of rank {h}, combine route ({t}, {k})",
                         f"a row whose pull entry is ({h}, {t}, {k})", f"rank {o} row {row}")
        real += sum(src >= 0 for src in lt["pull_rank"])
    if routes != real:
        fail(f"{pass_} tables", f"one real row per route ({routes})", real)
