"""Determinism you can see: train the same tiny MoE model twice from the same seed on the same batches with each
implementation of the experts, and plot how far the two runs' losses drift apart, step by step.

    python examples/determinism.py                  # CPU: every implementation is deterministic there (all zeros)
    python examples/determinism.py --device cuda --steps 200 --batch 16 --seq 512 --hidden 1024 --intermediate 512 \\
        --experts 32 --topk 4                       # a Hopper GPU: mok's kernels against the float-atomic paths

The model: embedding -> `--layers` × (x + MoE(RMSNorm(x))) -> head, next-token loss on random tokens. Each MoE layer
routes with mok.routing.softmax_topk (fp32 router) and holds fp32 master weights cast to bf16 at the call, as
mok.MoE does; only the experts' implementation changes:
    mok        mok.moe at backend "fused" on a Hopper GPU, "reference" (L0) elsewhere: no float atomics, fixed orders
    torch      mok.moe at L1 (torch._grouped_mm on CUDA): mok's schedule, gathers and a fixed-order combine (it has no
               index_add), so its run-to-run bits depend on torch._grouped_mm alone
    index_add  what training code commonly writes: routes sorted by expert, torch._grouped_mm (a per-expert loop off
               CUDA), scaled, index_add_ into the tokens, all through autograd. On CUDA index_add_ with repeated token
               ids adds with float atomics, in an order that varies (torch lists it as nondeterministic)
    liger      Liger-Kernel's Triton fused MoE (`liger_kernel`, CUDA only; its backward uses float atomics)
Writes data/examples/determinism.csv (impl, step, loss_run1, loss_run2, abs_diff + provenance) and
docs/figures/determinism.png. Needs the notebooks extra (pandas, seaborn, tqdm).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import mok
from mok.routing import softmax_topk
from mok.torch_native import gmm

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("mok", "torch", "index_add", "liger")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS, help="the experts' implementations")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=256, help="each routed expert's width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, default=ROOT / "data" / "examples" / "determinism.csv")
    p.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "determinism.png")
    return p.parse_args(argv)


# ---- the experts' implementations -------------------------------------------------------------------------------
# (x [T, H] bf16, topk_idx [T, K], topk_weights [T, K] fp32, w_gate, w_up [E, I, H], w_down [E, H, I] bf16) -> [T, H]

def index_add_moe(x, topk_idx, topk_weights, w_gate, w_up, w_down):
    num_tokens, num_topk = topk_idx.shape
    order = torch.argsort(topk_idx.flatten(), stable=True)  # [T·K] route ids, expert-major
    token = order // num_topk  # [T·K]
    offs = torch.bincount(topk_idx.flatten(), minlength=w_gate.shape[0]).cumsum(0).to(torch.int32)  # [E] segment ends
    x_rows = x[token]  # [T·K, H]; backward: index_put_ with accumulate (sorted, deterministic on CUDA)
    h = F.silu(gmm(x_rows, w_gate.transpose(1, 2), offs)) * gmm(x_rows, w_up.transpose(1, 2), offs)  # [T·K, I]
    y = gmm(h, w_down.transpose(1, 2), offs).float() * topk_weights.flatten()[order, None]  # [T·K, H] fp32
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
    return out.index_add_(0, token, y).to(x.dtype)  # float atomics on CUDA: each token's K routes, in any order


def liger_moe(x, topk_idx, topk_weights, w_gate, w_up, w_down):
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    w_gate_up = torch.cat([w_gate, w_up], dim=1)  # [E, 2I, H], Liger's (and HF's) concat layout
    return LigerFusedMoEFunction.apply(x, w_gate_up, w_down, topk_idx.int(), topk_weights)


def experts_fn(impl: str, device: torch.device):
    """The impl's function, or a string saying why it cannot run here."""
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    if impl == "mok":
        backend = "fused" if hopper else "reference"
        return functools.partial(mok.moe, backend=backend), backend
    if impl == "torch":
        return functools.partial(mok.moe, backend="torch"), "L1"
    if impl == "index_add":
        return index_add_moe, "grouped_mm + index_add"
    if device.type != "cuda":
        return "needs a CUDA GPU (Triton)", None
    try:
        import liger_kernel.ops.fused_moe  # noqa: F401
    except ImportError as e:
        return f"liger_kernel not importable: {e}", None
    return liger_moe, "Triton"


# ---- the model ---------------------------------------------------------------------------------------------------

class MoELayer(nn.Module):
    def __init__(self, args, experts):
        super().__init__()
        E, H, I = args.experts, args.hidden, args.intermediate
        self.topk, self.experts = args.topk, experts
        self.norm = nn.RMSNorm(H)
        self.w_router = nn.Parameter(torch.randn(E, H) / H**0.5)
        self.w_gate = nn.Parameter(torch.randn(E, I, H) / H**0.5)
        self.w_up = nn.Parameter(torch.randn(E, I, H) / H**0.5)
        self.w_down = nn.Parameter(torch.randn(E, H, I) / I**0.5)

    def forward(self, h):  # h [T, H] fp32
        x = self.norm(h)  # [T, H]
        topk_idx, topk_weights = softmax_topk(x @ self.w_router.T, self.topk)  # [T, K] each
        bf16 = [w.to(torch.bfloat16) for w in (x, self.w_gate, self.w_up, self.w_down)]
        return h + self.experts(bf16[0], topk_idx.contiguous(), topk_weights.contiguous(), *bf16[1:]).float()


class TinyMoE(nn.Module):
    def __init__(self, args, experts):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.hidden)
        self.layers = nn.ModuleList(MoELayer(args, experts) for _ in range(args.layers))
        self.head = nn.Linear(args.hidden, args.vocab, bias=False)

    def forward(self, ids):  # ids [B, L] -> next-token loss
        h = self.embed(ids[:, :-1]).flatten(0, 1)  # [T, H]
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h), ids[:, 1:].flatten())


def train(args, experts, desc: str) -> list[float]:
    """One run: the model and the batches from args.seed; the loss of every step."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = TinyMoE(args, experts).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    for _ in tqdm(range(args.steps), desc=desc):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        loss = model(ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def plot(df: pd.DataFrame, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind", rc={"axes.titleweight": "bold"})
    zero = df.groupby("impl").abs_diff.max() == 0
    df = df.assign(label=df.impl.map(lambda i: f"{i}: 0 at every step" if zero[i] else i))
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    sns.lineplot(df, x="step", y="abs_diff", hue="label", style="label", markers=True, dashes=False, ax=ax,
                 linewidth=1, markersize=4)
    nonzero = df.abs_diff[df.abs_diff > 0]
    linthresh = float(nonzero.min()) if len(nonzero) else 1e-7
    ax.set_yscale("symlog", linthresh=linthresh)  # linear below the smallest drift: zero stays on the plot
    ax.set_ylim(-0.5 * linthresh, max(1e-2, 5 * df.abs_diff.max()))  # zero just above the axis, not under it
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set(title=title, xlabel="step", ylabel="|loss run 1 − loss run 2| (symlog)")
    ax.legend(title="experts")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> pd.DataFrame:
    from bench.timing import provenance

    args = parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for impl in args.impls:
        experts, what = experts_fn(impl, device)
        if isinstance(experts, str):
            print(f"{impl} skipped: {experts}")
            continue
        name = f"{impl} ({what})"
        run1, run2 = (train(args, experts, f"{name} run {r}") for r in (1, 2))
        rows += [dict(impl=name, step=s, loss_run1=a, loss_run2=b, abs_diff=abs(a - b))
                 for s, (a, b) in enumerate(zip(run1, run2))]
    prov = provenance()
    df = pd.DataFrame(rows).assign(device=prov["gpu"] if device.type == "cuda" else "cpu", torch=prov["torch"],
                                   commit=prov["commit"], date=prov["date"])
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.csv, index=False)
    title = f"Run-to-run drift of the training loss, same seed ({df.device[0]})"
    plot(df, title, args.figure)
    for impl, d in df.groupby("impl", sort=False):
        print(f"{impl}: {int((d.abs_diff > 0).sum())} of {len(d)} steps differ, max |Δloss| {d.abs_diff.max():.3g}")
    print(f"wrote {args.csv} and {args.figure}")
    return df


if __name__ == "__main__":
    main()
