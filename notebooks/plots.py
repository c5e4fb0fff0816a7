"""Figure helpers for the notebooks: one seaborn theme, titles, axes with units, legends, PNG files.

Every helper draws into a new figure (or a given Axes) and returns the Figure; `save(fig, out_dir,
name)` writes `<out_dir>/<name>.png` (`<name>_smoke.png`, stamped, for a smoke run). Data comes in as tidy
pandas DataFrames.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

DPI = 150
PHASE_COLORS = {"dispatch": "#0173b2", "compute": "#029e73", "combine": "#de8f05"}


def theme() -> None:
    """The one look of every mok figure."""
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind",
                  rc={"figure.dpi": 100, "axes.titleweight": "bold", "axes.titlesize": 12,
                      "legend.fontsize": 9, "legend.title_fontsize": 9})


def save(fig, out_dir, name: str, *, smoke: bool = False) -> Path:
    """Write fig to <out_dir>/<name>.png (folders created) and return the path.

    A smoke run's figure (tiny sizes, not the result) is stamped "SMOKE" and written to <name>_smoke.png, so it
    never overwrites the full figure, whatever out_dir is.
    """
    if not name or "/" in name or name.endswith(".png"):
        raise ValueError(f"name: expected a bare file stem like '01_padding', got {name!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if smoke:
        fig.text(0.5, 0.5, "SMOKE RUN: tiny sizes, not the result", ha="center", va="center", fontsize=20,
                 color="red", alpha=0.35, rotation=20, fontweight="bold", transform=fig.transFigure)
        name += "_smoke"
    path = out / f"{name}.png"
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def label(ax, title: str, xlabel: str, ylabel: str, legend_title: str | None = None):
    """Title and axis labels (say the unit: 'time (µs)'); a legend title if there is a legend."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if legend_title is not None and ax.get_legend() is not None:
        ax.get_legend().set_title(legend_title)
    return ax


def _axes(ax, figsize):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
        return fig, ax
    return ax.figure, ax


# ---- generic ------------------------------------------------------------------------------------


def line(df: pd.DataFrame, x: str, y: str, *, hue=None, style=None, title: str, xlabel: str, ylabel: str,
         legend_title=None, logx=False, logy=False, ax=None, figsize=(6.4, 4.0), **kw):
    """Lines with markers, one per hue (and style)."""
    fig, ax = _axes(ax, figsize)
    kw = {"markers": True, "dashes": style is not None, "palette": "colorblind" if hue is not None else None, **kw}
    sns.lineplot(df, x=x, y=y, hue=hue, style=style, ax=ax, **kw)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    label(ax, title, xlabel, ylabel, legend_title)
    return fig


def bars(df: pd.DataFrame, x: str, y: str, *, hue=None, title: str, xlabel: str, ylabel: str,
         legend_title=None, logy=False, annotate: str | None = None, ax=None, figsize=(7.0, 4.0), **kw):
    """Grouped bars; annotate="{:.0f}" writes each bar's value on it."""
    fig, ax = _axes(ax, figsize)
    kw = {"palette": "colorblind" if hue is not None else None, "errorbar": None, **kw}
    sns.barplot(df, x=x, y=y, hue=hue, ax=ax, **kw)
    if logy:
        ax.set_yscale("log")
    if annotate:
        for c in ax.containers:
            ax.bar_label(c, fmt=annotate.format, fontsize=7, padding=1)
    label(ax, title, xlabel, ylabel, legend_title)
    return fig


def heatmap(table: pd.DataFrame, *, title: str, xlabel: str, ylabel: str, cbar_label: str, fmt=".2f",
            cmap="viridis", center=None, ax=None, figsize=(6.4, 4.0), **kw):
    """An annotated heatmap of a 2D table (index = rows, columns = columns)."""
    fig, ax = _axes(ax, figsize)
    sns.heatmap(table, annot=True, fmt=fmt, cmap=cmap, center=center, ax=ax,
                cbar_kws={"label": cbar_label}, linewidths=0.5, **kw)
    label(ax, title, xlabel, ylabel)
    return fig


# ---- readable figures (notebooks 01, 02) ------------------------------------------------------------

MAX_PX = 1600  # the widest PNG a figure may be: readable when the README shows it at page width


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels of a PNG file, read from its header."""
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG file")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def save_checked(fig, out_dir, name: str, *, smoke: bool = False, max_px: int = MAX_PX) -> Path:
    """`save`, then check that the PNG is at most max_px wide (raises otherwise). Returns the path."""
    path = save(fig, out_dir, name, smoke=smoke)
    width, _ = png_size(path)
    if width > max_px:
        raise ValueError(f"{path.name}: {width} px wide, more than {max_px}: draw it narrower")
    return path


def goal_line(ax, y: float, text: str, *, color="0.25", ls="--", x: float = 0.99, va="bottom", ha="right"):
    """A horizontal reference line with its label written beside it, in axes coordinates along x (no legend to
    look up)."""
    ax.axhline(y, color=color, ls=ls, lw=1.2, zorder=1)
    ax.text(x, y, text, transform=ax.get_yaxis_transform(), ha=ha, va=va, fontsize=9, color=color,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5})
    return ax


# ---- notebook 01: route placement --------------------------------------------------------------


def route_placement(sched, title: str = "Route placement: the expert-major row buffer"):
    """Two panels: (a) the token × k table, each route coloured by its expert and labelled with its
    row; (b) the row buffer as tiles of block_m rows, each row labelled t·k, padding rows hatched."""
    E, bm = sched.num_experts, sched.block_m
    base = sns.color_palette("colorblind", 10)
    colors = [base[i] for i in (0, 1, 2, 4, 9, 5, 6, 8, 3, 7)] * (E // 10 + 1)  # neighbours differ
    idx = sched.row_to_expert.new_zeros(sched.num_tokens, sched.num_topk)  # [T, K]
    real = (sched.row_to_route >= 0).nonzero().squeeze(1)  # real rows
    idx.view(-1)[sched.row_to_route[real]] = sched.row_to_expert[real]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.6, 0.32 * max(sched.num_tokens, 2 * sched.num_tiles) + 1.6),
                               layout="constrained", gridspec_kw={"width_ratios": [1, 1.6]})
    for t in range(sched.num_tokens):
        for k in range(sched.num_topk):
            e = int(idx[t, k])
            a.add_patch(plt.Rectangle((k, t), 1, 1, color=colors[e], alpha=0.75))
            a.text(k + 0.5, t + 0.5, f"e{e}→r{int(sched.route_to_row[t, k])}", ha="center", va="center",
                   fontsize=8)
    a.set(xlim=(0, sched.num_topk), ylim=(sched.num_tokens, 0), xticks=np.arange(sched.num_topk) + 0.5,
          xticklabels=range(sched.num_topk), yticks=np.arange(sched.num_tokens) + 0.5,
          yticklabels=range(sched.num_tokens))
    a.grid(False)
    label(a, "(a) who goes where: topk_idx", "slot k", "token t")
    for row in range(sched.num_rows):
        tile, col = divmod(row, bm)
        e, t = int(sched.row_to_expert[row]), int(sched.row_to_token[row])
        pad = t < 0
        b.add_patch(plt.Rectangle((col, tile), 1, 1, facecolor="white" if pad else colors[e],
                                  edgecolor=colors[e], hatch="//" if pad else None, alpha=0.75, lw=1.5))
        b.text(col + 0.5, tile + 0.5, "pad" if pad else f"t{t}·k{int(sched.row_to_k[row])}",
               ha="center", va="center", fontsize=8)
    b.set(xlim=(0, bm), ylim=(sched.num_tiles, 0), xticks=np.arange(bm) + 0.5, xticklabels=range(bm),
          yticks=np.arange(sched.num_tiles) + 0.5,
          yticklabels=[f"tile {i} (e{int(e)})" for i, e in enumerate(sched.tile_to_expert)])
    b.grid(False)
    label(b, f"(b) row buffer: {sched.num_rows} rows in tiles of BLOCK_M = {bm}", "row within the tile",
          "tile (expert)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[e], alpha=0.75) for e in range(E)]
    b.legend(handles, [f"expert {e}" for e in range(E)], title="expert", loc="upper left",
             bbox_to_anchor=(1.01, 1))
    fig.suptitle(title, fontweight="bold")
    return fig


# ---- notebook 03: timelines ---------------------------------------------------------------------


def gantt(panels: dict, *, title: str, xlabel: str = "time (µs)", figsize=None):
    """One Gantt panel per entry of panels (panel title -> tidy tasks with resource, phase,
    minibatch, start_us, end_us), sharing the time axis; bars coloured by phase, labelled by
    minibatch when there are several."""
    n = len(panels)
    fig, axes = plt.subplots(n, 1, figsize=figsize or (10, 1.2 + 1.35 * n), sharex=True,
                             layout="constrained", squeeze=False)
    for ax, (name, tasks) in zip(axes[:, 0], panels.items()):
        resources = list(dict.fromkeys(tasks["resource"]))
        several = tasks["minibatch"].nunique() > 1
        for _, t in tasks.iterrows():
            y = resources.index(t["resource"])
            w = t["end_us"] - t["start_us"]
            ax.barh(y, w, left=t["start_us"], color=PHASE_COLORS[t["phase"]], edgecolor="white", height=0.6)
            if several and w > 0.03 * tasks["end_us"].max():
                ax.text(t["start_us"] + w / 2, y, str(t["minibatch"]), ha="center", va="center",
                        color="white", fontsize=8, fontweight="bold")
        end = tasks["end_us"].max()
        ax.axvline(end, color="black", lw=1, ls="--")
        ax.text(end, len(resources) - 0.45, f" {end:,.0f} µs", va="bottom", fontsize=9)
        ax.set(yticks=range(len(resources)), yticklabels=resources, ylim=(len(resources) - 0.4, -0.6))
        ax.set_title(name, fontsize=10, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    axes[0, 0].legend(handles, list(PHASE_COLORS), title="phase", loc="upper left", bbox_to_anchor=(1.01, 1))
    axes[-1, 0].set_xlabel(xlabel)
    fig.suptitle(title, fontweight="bold")
    return fig


# ---- marks on a plot: goal lines, points, axes in the values that matter ---------------------------------------


def hline(ax, y: float, text: str, *, color="0.35", style="--", where="right", va="bottom", fontsize=8):
    """A horizontal reference line with its label written on it (what the line means, not a bare number). where:
    "left", "right", or the label's centre as a fraction of the axes' width (to keep it off the data)."""
    ax.axhline(y, color=color, linestyle=style, linewidth=1, zorder=1)
    x, ha = {"right": (0.99, "right"), "left": (0.01, "left")}.get(where, (where, "center"))
    ax.text(x, y, f" {text} ", transform=ax.get_yaxis_transform(), ha=ha, va=va, fontsize=fontsize, color=color)


def mark_point(ax, x: float, y: float, text: str, *, color="black", dx=-8, dy=10, ha="right"):
    """Ring a point and label it with an arrow-free offset annotation (e.g. 'NVL72: 1.10×')."""
    ax.plot([x], [y], marker="o", markersize=10, markerfacecolor="none", markeredgecolor=color, markeredgewidth=1.5,
            zorder=5)
    ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, fontsize=8, color=color,
                fontweight="bold")


def value_ticks(ax, values, *, axis="x", fmt="{:g}"):
    """Ticks at the values themselves (e.g. EP degrees 1, 2, 4, …, 72 on a log axis), not at powers of two."""
    values = list(values)
    if axis == "x":
        ax.set_xticks(values, [fmt.format(v) for v in values])
        ax.xaxis.set_minor_locator(plt.NullLocator())
    else:
        ax.set_yticks(values, [fmt.format(v) for v in values])
        ax.yaxis.set_minor_locator(plt.NullLocator())


# ---- notebook 04: ratios and shares -----------------------------------------------------------------------------


def ratio_heatmap(values: pd.DataFrame, labels: pd.DataFrame, *, ax, norm, title: str, xlabel: str = "",
                  ylabel: str = "", cmap="RdBu", missing: str = "not measured"):
    """Cells coloured by a ratio on a shared norm (pass the same matplotlib norm to every compared panel) and
    written with labels (same index/columns as values; NaN cells are greyed and say `missing`). Returns the image,
    for one colorbar shared by the panels."""
    data = values.to_numpy(dtype=float)
    image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, aspect="auto")
    ax.set_facecolor("0.92")
    for (i, j), v in np.ndenumerate(data):
        text = missing if np.isnan(v) else labels.iat[i, j]
        shade = 0.0 if np.isnan(v) else abs(norm(v) - 0.5)
        ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if shade > 0.33 else "black")
    ax.set_xticks(range(values.shape[1]), values.columns)
    ax.set_yticks(range(values.shape[0]), values.index)
    ax.tick_params(length=0)
    ax.grid(False)
    for edge in np.arange(-0.5, values.shape[0], 1.0):
        ax.axhline(edge, color="white", lw=1.5)
    for edge in np.arange(-0.5, values.shape[1], 1.0):
        ax.axvline(edge, color="white", lw=1.5)
    label(ax, title, xlabel, ylabel)
    return image


def stacked_shares(table: pd.DataFrame, *, ax, colors: dict, title: str, xlabel: str, ylabel: str = "",
                   min_label: float = 0.06):
    """Horizontal stacked bars, one per row of table (columns: the parts, values: shares summing to ~1), each part
    in its colour, parts of at least min_label written with their share."""
    left = np.zeros(len(table))
    for part in table.columns:
        share = table[part].to_numpy(dtype=float)
        ax.barh(range(len(table)), share, left=left, color=colors[part], edgecolor="white", height=0.7, label=part)
        for i, (x0, w) in enumerate(zip(left, share)):
            if w >= min_label:
                ax.text(x0 + w / 2, i, f"{w:.0%}", ha="center", va="center", fontsize=8, color="white",
                        fontweight="bold")
        left += share
    ax.set_yticks(range(len(table)), table.index)
    ax.invert_yaxis()
    ax.set_xlim(0, max(1.0, left.max()))
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    label(ax, title, xlabel, ylabel)
    return ax
