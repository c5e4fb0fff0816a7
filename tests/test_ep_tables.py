"""The megakernel's int32 tables (mok.ep_tables) and the twin run from them alone (mok.ep_twin_tables), on the plan
tests' irregular cases (tests/test_ep_plan.py CASES: uneven ranks, a rank without tokens at R = 3, a hot expert,
E = 5 and E = 3 so that E % R != 0, bf16 and mxfp8 with a swiglu limit, with and without a shared expert).

Grid: R = 1, 2, 3, and R = 4 for E = 3 (a rank without experts), both passes, every buffer of every rank compared
bit for bit with mok.ep_twin.run_pass (torch's mm: both twins make the same GEMM calls). Random plans (those of
tests/test_ep_plan.py) pass check_tables. Mutations: one per rule of check_tables, and the runner without the checker
(the kernel's view) on three of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mok import ep_plan, ep_tables, ep_twin, ep_twin_tables
from mok.ep_tables import DIMS, TABLES, TASK_FIELDS, TASK_KINDS, WHICH, check_tables, plan_tables
from tests.test_ep_plan import CASES, plan_of, random_plan

DOCS = Path(__file__).resolve().parents[1] / "docs" / "megakernel.md"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def both_twins(c, R):
    """(run_pass's buffers, run_tables_pass's buffers) after the forward and the backward."""
    plan = plan_of(c, R)
    want = [ep_twin.rank_buffers(plan, r, c) for r in range(R)]
    got = [ep_twin.rank_buffers(plan, r, c) for r in range(R)]
    for pass_ in ("forward", "backward"):
        ep_twin.run_pass(plan, pass_, want, precision=c["precision"], swiglu_limit=c["limit"])
        tables = [plan_tables(plan, r, pass_) for r in range(R)]
        ep_twin_tables.run_tables_pass(tables, pass_, got, precision=c["precision"], swiglu_limit=c["limit"])
    return want, got


@pytest.mark.parametrize("name,R", [(name, R) for name in CASES for R in (1, 2, 3)] + [("mxfp8-E3", 4)])
def test_twin_from_tables_equals_run_pass_bitwise(name, R):  # E = 3 at R = 4: a rank without experts
    want, got = both_twins(CASES[name](), R)
    for r in range(R):
        assert sorted(got[r]) == sorted(want[r])
        for buf in want[r]:  # every input, saved activation, row buffer, output and gradient of every rank
            assert same_bits(got[r][buf], want[r][buf]), f"{name}, R={R}, rank {r}, {buf}"
    assert not torch.cat([b["out"].flatten() for b in got]).isnan().any()


def test_random_plans_give_tables_that_pass_the_checker():
    gen = torch.Generator().manual_seed(0)
    empty = ep_plan.make_ep_plan(torch.zeros(0, 2, dtype=torch.int64), [0, 0, 0], 4, hidden=32, intermediate=32,
                                 shared_intermediate=32, block_m=4, block_n=32)  # no tokens: weight gradients only
    for plan in [empty] + [random_plan(gen) for _ in range(25)]:
        for pass_ in ep_plan.PHASES:
            check_tables([plan_tables(plan, r, pass_) for r in range(plan.ep_size)], pass_)


def test_the_twin_from_tables_cannot_read_the_plan():
    plan = plan_of(CASES["bf16-shared"](), 2)
    run = ep_twin_tables.TablesRun([plan_tables(plan, r, "forward") for r in range(2)], "forward", [{}, {}],
                                   "bf16", None)
    assert run.plan is None


@pytest.mark.parametrize("name,R", [("bf16-shared", 3), ("hot-expert-E5", 2), ("mxfp8-E3", 3)])
def test_tables_int32_contiguous_with_the_spec_sentinels(name, R):
    plan = plan_of(CASES[name](), R)
    for pass_ in ep_plan.PHASES:
        tables = [plan_tables(plan, r, pass_) for r in range(R)]
        check_tables(tables, pass_)
        for r, (tb, rp) in enumerate(zip(tables, plan.ranks)):
            assert tuple(tb) == TABLES
            assert all(t.dtype == torch.int32 and t.is_contiguous() for t in tb.values())
            d = dict(zip(DIMS, tb["dims"].tolist()))
            assert (d["rank"], d["num_tokens"], d["num_rows"], d["num_local_experts"]) == (
                r, rp.num_tokens, rp.num_rows, len(rp.experts))
            assert tb["combine_rank"].shape == (rp.num_tokens, plan.num_topk)  # [0, K] on the empty rank
            padding = rp.row_to_route < 0
            for table in ("pull_rank", "pull_token", "pull_k"):  # -1 exactly on the padding rows
                assert torch.equal(tb[table] == -1, padding), table
            assert torch.equal(tb["pull_k"][~padding].long(), rp.row_to_route[~padding] % plan.num_topk)
            # the task table decodes to the plan's tasks: kind, fields, wait, target, signals
            off = tb["task_signal_offsets"].tolist()
            for i, t in enumerate(rp.tasks[pass_]):
                kind, m, n, e, w = (int(tb[f"task_{f}"][i]) for f in ("kind", "m", "n", "expert", "which"))
                assert TASK_KINDS[kind] == t.kind and (m, n) == (t.m, t.n)
                assert e == (t.expert - rp.experts.start if t.expert >= 0 else -1)
                assert (WHICH[w] if w >= 0 else "") == t.which
                fields = TASK_FIELDS[t.kind]
                assert ((m >= 0) == ("m" in fields or "c" in fields)) and ((n >= 0) == ("n" in fields))
                assert ((e >= 0) == ("e" in fields)) and ((w >= 0) == ("w" in fields))
                assert int(tb["task_wait"][i]) == t.wait
                assert int(tb["task_target"][i]) == (rp.targets[pass_][t.wait] if t.wait >= 0 else 0)
                signals = list(zip(tb["signal_rank"][off[i]: off[i + 1]].tolist(),
                                   tb["signal_counter"][off[i]: off[i + 1]].tolist()))
                assert signals == list(t.signals)


def test_spec_and_docs_name_every_table_and_enum():
    listed = re.findall(r"^  (\w+) +\[", ep_tables.__doc__, flags=re.M)
    assert tuple(listed) == TABLES, "the module docstring lists every table, in TABLES order"
    docs = DOCS.read_text()
    assert len(docs.splitlines()) <= 300
    docs = " ".join(docs.split())  # wrapped lines read as one
    for table in TABLES:
        assert f"`{table}`" in docs, table
    for names in (TASK_KINDS, WHICH, DIMS):  # the enums, numbered as the kernel reads them
        assert ", ".join(f"{i} `{k}`" for i, k in enumerate(names)) in docs, names


# ---- mutated tables -----------------------------------------------------------------------------------------------


def mutated(tables: list, rank: int, **edits) -> list:
    """A deep copy of tables, with edits[name](tensor) applied to rank `rank`'s table `name` (in place or returned)."""
    out = [{k: v.clone() for k, v in tb.items()} for tb in tables]
    for name, edit in edits.items():
        new = edit(out[rank][name])
        out[rank][name] = out[rank][name] if new is None else new
    return out


def setup_mutations():
    c = CASES["bf16-shared"]()
    plan = plan_of(c, 3)
    fwd = [plan_tables(plan, r, "forward") for r in range(3)]
    kinds = fwd[2]["task_kind"].tolist()
    gate_up = kinds.index(TASK_KINDS.index("gate_up"))  # rank 2: a wait on x_ready, target 1
    combine = kinds.index(TASK_KINDS.index("combine"))
    m = int(fwd[2]["task_m"][gate_up])
    h_ready = plan.ranks[2].counters["forward"].index(f"h_ready[{m}]")
    pull = list(zip(fwd[2]["pull_rank"].tolist(), fwd[2]["pull_token"].tolist()))
    row = next(i for i, p in enumerate(pull) if p[0] >= 0)
    other = next(p for p in pull if p[0] >= 0 and p != pull[row])  # another token: a wrong but valid pull entry
    wrong = {"pull_rank": _set(row, other[0]), "pull_token": _set(row, other[1])}
    return c, plan, fwd, gate_up, combine, h_ready, wrong


def _set(i, v):
    def edit(t):
        t.view(-1)[i] = v
    return edit


def test_check_tables_rejects_each_broken_rule():
    c, plan, fwd, gate_up, combine, h_ready, wrong = setup_mutations()
    wait = int(fwd[2]["task_wait"][gate_up])  # x_ready[m], target 1
    h_target = int(fwd[2]["counter_target"][h_ready])
    padding = int((fwd[2]["pull_rank"] < 0).nonzero()[0])
    columns = ("task_kind", "task_phase", "task_m", "task_n", "task_expert", "task_which", "task_wait", "task_target")
    cases = [
        ({"task_target": _set(gate_up, 2)},
         r"ticket \d+ \(gate_up .*expected a wait on a counter of its rank .* and that counter's target"),
        ({"task_target": lambda t: torch.where(fwd[2]["task_wait"] == wait, 2, t), "counter_target": _set(wait, 2)},
         rf"forward counter {wait} on rank 2: expected a target equal to the signals naming it, 1, got 2"),
        ({"task_wait": _set(gate_up, h_ready), "task_target": _set(gate_up, h_target)},
         r"expected every producer before its consumer .* feeding rank 2 ticket"),
        ({k: lambda t: torch.cat([t[combine:combine + 1], t[:combine], t[combine + 1:]]) for k in columns},
         r"ticket 1 .*expected a forward kind in its phase, phases non-decreasing"),
        (wrong, r"combine route .* expected a row whose pull entry is"),
        ({"combine_row": lambda t: t + 1}, r"tables of rank 2, combine route \(0, 0\): expected a row whose pull"),
        ({"pull_rank": _set(padding, 0)}, rf"row {padding}: expected a pull entry .* -1 on padding rows"),
        ({"task_expert": _set(gate_up, 1 - int(fwd[2]["task_expert"][gate_up]))},
         r"gate_up .* row tile m in expert e's segment"),
        ({"signal_counter": _set(0, 10_000)}, r"expected signals to existing counters"),
        ({"task_m": lambda t: t.long()}, r"task_m: expected int32, contiguous"),
        ({"combine_rank": lambda t: t.t().contiguous().t()}, r"combine_rank: expected int32, contiguous"),
    ]
    check_tables(fwd, "forward")
    for edits, message in cases:
        with pytest.raises(ValueError, match=message):
            check_tables(mutated(fwd, 2, **edits), "forward")


def run(c, plan, tables_of, check=False):
    """Both passes from tables_of(pass_), without the checker: the kernel's view. Returns the buffers."""
    bufs = [ep_twin.rank_buffers(plan, r, c) for r in range(plan.ep_size)]
    for pass_ in ("forward", "backward"):
        ep_twin_tables.run_tables_pass(tables_of(pass_), pass_, bufs, precision=c["precision"],
                                       swiglu_limit=c["limit"], check=check)
    return bufs


def test_the_runner_alone_times_out_or_changes_the_bits():
    c, plan, fwd, gate_up, combine, h_ready, wrong = setup_mutations()
    good = run(c, plan, lambda p: [plan_tables(plan, r, p) for r in range(3)])

    def tables_of(**edits):  # the forward mutated on rank 2, the backward as planned
        return lambda p: mutated(fwd, 2, **edits) if p == "forward" else [plan_tables(plan, r, p) for r in range(3)]

    # a wait target one too high: the counter never gets there, the spin-wait times out with a message
    with pytest.raises(RuntimeError, match=rf"forward: rank 2 ticket {gate_up} \(gate_up m=\d+ n=0\) timed out on "
                                           r"counter \d+ at 1 of target 2"):
        run(c, plan, tables_of(task_target=_set(gate_up, 2)))
    # a target one too low, for the counter and its waiters: they may read early, the counter ends past it
    wait = int(fwd[2]["task_wait"][gate_up])
    with pytest.raises(RuntimeError, match=rf"forward: counter {wait} on rank 2 ended at 1, its target is 0"):
        run(c, plan, tables_of(task_target=lambda t: torch.where(fwd[2]["task_wait"] == wait, 0, t),
                               counter_target=_set(wait, 0)))
    # a pull row pointing at the wrong token: the tables run, the bits change
    bad = run(c, plan, tables_of(**wrong))
    assert not all(torch.equal(b["out"], g["out"]) for b, g in zip(bad, good))
