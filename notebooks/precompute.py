"""The notebooks' heavy experiments, run once and kept as rows under data/notebooks/.

A notebook with `source="precomputed"` (the default) reads these rows; `source="live"` calls the same function
here and recomputes them. Regenerate every CSV (from the repository root, ~25 minutes on 2 CPU cores):

    make notebook-data        # = PYTHONPATH=. .venv/bin/python notebooks/precompute.py

Every row carries its provenance: torch, commit, date, seed, the experiment's sizes and the command.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import mok
from mok import routing

DATA = Path(__file__).resolve().parent.parent / "data" / "notebooks"
ROUNDING_TRAINING = DATA / "01_rounding_training.csv"
COMMAND = "make notebook-data"
PROVENANCE = ["torch", "commit", "date", "seed", "toy_seeds", "toy_steps", "wall_s", "command"]

# Notebook 01's toy: a student MoE (H = I = 64, E = 16, K = 2) learns a teacher MoE's function.
H_TOY, E_TOY, K_TOY, T_TOY, TILE_TOY = 64, 16, 2, 1024, 16


def toy_moe(init_seed: int, route_tile: int | None) -> mok.MoE:
    torch.manual_seed(init_seed)  # mok.MoE draws its weights from torch's global generator
    return mok.MoE(H_TOY, H_TOY, E_TOY, K_TOY, backend="torch", route_tile=route_tile)  # L1: the fast one on a CPU


def rounding_training(seed: int, seeds: int, steps: int) -> pd.DataFrame:
    """Train `seeds` student pairs (plain top-k, rounded to TILE_TOY) for `steps` Adam steps each.

    One row per (seed, routing, logged step): the held-out loss (MSE / var(teacher output), served on plain
    top-k) and the share of the batch's routes that rounding moves at that point.
    """
    every = max(steps // 8, 1)
    teacher = toy_moe(1000, None).requires_grad_(False)
    with torch.no_grad():
        teacher.w_router.mul_(4)  # a confident teacher router: which expert a token visits matters
    x_held = torch.randn(4 * T_TOY, H_TOY, generator=torch.Generator().manual_seed(seed + 7)).bfloat16()
    with torch.no_grad():
        y_held = teacher(x_held).float()

    rows = []
    for s in range(seeds):
        for arm, route_tile in (("top-k", None), ("rounded", TILE_TOY)):
            student = toy_moe(s, route_tile)
            opt = torch.optim.Adam(student.parameters(), lr=1e-2)
            batches = torch.Generator().manual_seed(seed + 100 + s)  # the same batches for both arms
            for step in range(1, steps + 1):
                x = torch.randn(T_TOY, H_TOY, generator=batches).bfloat16()
                with torch.no_grad():
                    y = teacher(x).float()
                loss = (student(x).float() - y).pow(2).mean() / y.var()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step % every == 0 or step == steps:
                    with torch.no_grad():
                        student.route_tile = None  # served on plain top-k
                        held = float((student(x_held).float() - y_held).pow(2).mean() / y_held.var())
                        student.route_tile = route_tile
                        logits = x.float() @ student.w_router.T  # what rounding this batch moves, by now
                        plain = routing.softmax_topk(logits, K_TOY)[0]
                        rounded = routing.softmax_topk(logits, K_TOY, tile=TILE_TOY)[0]
                    moved = routing.moved_routes(plain, rounded)  # [T, K]
                    rows.append({"seed": s, "routing": arm, "step": step, "held-out loss": held,
                                 "routes moved (%)": 100 * float(moved.float().mean())})
    return pd.DataFrame(rows)


def read_rounding_training(seed: int, seeds: int, steps: int,
                           path: Path = ROUNDING_TRAINING) -> tuple[pd.DataFrame, dict]:
    """The precomputed rows of `rounding_training(seed, seeds, steps)` and their provenance.

    Refuses rows taken with other sizes: the figure would not be the one the parameters ask for.
    """
    df = pd.read_csv(path)
    taken = df[["seed", "toy_seeds", "toy_steps"]].drop_duplicates().values.tolist()
    if taken != [[seed, seeds, steps]]:
        raise ValueError(f"{path.name} holds (seed, toy_seeds, toy_steps) = {taken}, asked for "
                         f"{[seed, seeds, steps]}: run with source='live' or regenerate with `{COMMAND}`")
    provenance = df[PROVENANCE].iloc[0].to_dict()
    rows = df.drop(columns=PROVENANCE).rename(columns={"student": "seed"})
    return rows, provenance


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=DATA.parent.parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "mok"], capture_output=True, text=True,
                               cwd=DATA.parent.parent).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="the notebooks' `seed` parameter")
    p.add_argument("--toy-seeds", type=int, default=8, help="notebook 01's `toy_seeds`")
    p.add_argument("--toy-steps", type=int, default=800, help="notebook 01's `toy_steps`")
    args = p.parse_args(argv)

    start = time.perf_counter()
    df = rounding_training(args.seed, args.toy_seeds, args.toy_steps)
    wall = time.perf_counter() - start
    df = df.rename(columns={"seed": "student"})  # "seed" below is the experiment's, the notebooks' `seed`
    extra = sys.argv[1:] if argv is None else argv
    provenance = {"torch": torch.__version__, "commit": _commit(), "date": datetime.date.today().isoformat(),
                  "seed": args.seed, "toy_seeds": args.toy_seeds, "toy_steps": args.toy_steps,
                  "wall_s": round(wall, 1), "command": " ".join([COMMAND, *extra])}
    for k, v in provenance.items():
        df[k] = v
    DATA.mkdir(parents=True, exist_ok=True)
    df.to_csv(ROUNDING_TRAINING, index=False)
    print(f"{ROUNDING_TRAINING}: {len(df)} rows in {wall:.0f} s")


if __name__ == "__main__":
    main()
