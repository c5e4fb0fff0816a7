"""Train a small random Qwen3-MoE (Hugging Face transformers) twice from the same seed on the same batches: with its
own experts, and with its experts swapped for mok (mok.integrations.hf); write both loss curves and a figure.

    python examples/train_hf.py                                   # CPU, mok's L1 ("torch"): a few minutes
    python examples/train_hf.py --device cuda --backend fused     # a Hopper GPU, mok's kernels

The data is a random bigram language (each token is followed by one of 4 tokens with probabilities 0.7, 0.1, 0.1,
0.1), so the loss falls from ln(vocab) towards its entropy, drawn as the floor. The model is built from a config in
code (nothing downloaded) and trained in `--dtype` (bf16: both runs' experts compute in bf16, HF's with its default
experts implementation). Needs `pip install -e .[integrations,notebooks]`.
Writes data/examples/train_hf.csv (impl, step, loss + provenance) and docs/figures/train_hf.png.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
SUCCESSOR_PROBS = (0.7, 0.1, 0.1, 0.1)  # each token's next-token distribution over its 4 successors


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="torch", help="mok's level: torch (L1), reference (L0), fused (Hopper)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the model's parameters and compute")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=96, help="each routed expert's width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, default=ROOT / "data" / "examples" / "train_hf.csv")
    p.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "train_hf.png")
    return p.parse_args(argv)


def bigram_batches(args, device):
    """An endless stream of [batch, seq] token batches from a random bigram table fixed by the seed."""
    g = torch.Generator().manual_seed(args.seed + 1)
    successors = torch.randint(0, args.vocab, (args.vocab, len(SUCCESSOR_PROBS)), generator=g)  # [V, 4]
    probs = torch.tensor(SUCCESSOR_PROBS)
    while True:
        tokens = torch.empty(args.batch, args.seq, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
        for t in range(1, args.seq):
            choice = torch.multinomial(probs, args.batch, replacement=True, generator=g)  # [batch]
            tokens[:, t] = successors[tokens[:, t - 1], choice]
        yield tokens.to(device)


def build_model(args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            moe_intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                            num_experts=args.experts, num_experts_per_tok=args.topk, norm_topk_prob=True,
                            max_position_embeddings=args.seq)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return Qwen3MoeForCausalLM(config).to(args.device, dtype)


def train(args, impl: str) -> list[dict]:
    """One run from the seed: impl "hf" (the model's own experts) or "mok" (swapped). Rows of (impl, step, loss)."""
    from mok.integrations import hf

    model = build_model(args)
    label = f"HF ({model.config._experts_implementation})"
    if impl == "mok":
        hf.swap_experts(model, backend=args.backend)
        label = f"mok ({args.backend})"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = bigram_batches(args, args.device)
    rows = []
    for step in tqdm(range(args.steps), desc=label):
        ids = next(batches)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rows.append(dict(impl=label, step=step, loss=loss.item()))
    return rows


def plot(df: pd.DataFrame, floor: float, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind", rc={"axes.titleweight": "bold"})
    fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 1), layout="constrained")
    sns.lineplot(df, x="step", y="loss", hue="impl", ax=ax, linewidth=1)
    ax.axhline(floor, color="gray", linestyle="--", linewidth=1)
    ax.annotate("entropy of the data (the floor)", (0, floor), xytext=(0, 4), textcoords="offset points", fontsize=9,
                color="gray")
    ax.set(title=title, ylabel="training loss (nats)")
    ax.legend(title=None)
    wide = df.pivot(index="step", columns="impl", values="loss")
    diff = (wide[[c for c in wide if c.startswith("mok")][0]] - wide[[c for c in wide if c.startswith("HF")][0]])
    ax_diff.plot(diff.index, diff.values, color="black", linewidth=0.8)
    ax_diff.axhline(0, color="gray", linewidth=0.8)
    ax_diff.set(xlabel="step", ylabel="mok − HF (nats)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> pd.DataFrame:
    import transformers

    from bench.timing import provenance

    args = parse_args(argv)
    df = pd.DataFrame(train(args, "hf") + train(args, "mok"))
    prov = provenance()
    df = df.assign(device=prov["gpu"] if args.device.startswith("cuda") else "cpu", dtype=args.dtype,
                   torch=prov["torch"], transformers=transformers.__version__, commit=prov["commit"], date=prov["date"])
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.csv, index=False)
    floor = -sum(p * math.log(p) for p in SUCCESSOR_PROBS)
    title = (f"Qwen3-MoE ({args.layers} layers, {args.experts} experts top-{args.topk}, {args.dtype}), "
             f"{df.device[0]}: HF's experts vs mok")
    plot(df, floor, title, args.figure)
    last = df[df.step >= args.steps - max(1, args.steps // 10)].groupby("impl").loss.mean()
    print(f"mean loss over the last 10% of steps: {last.round(4).to_dict()}; floor {floor:.4f}")
    print(f"wrote {args.csv} and {args.figure}")
    return df


if __name__ == "__main__":
    main()
