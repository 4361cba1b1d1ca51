"""The decode-cost figure (issue 49): per trace, staged bytes per step and modelled TPOT overhead against
decode batch, one line per staging mode (the first profile in the points)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter, ScalarFormatter

STYLE = {"whole": ("k", "o"), "routed": ("tab:blue", "s"), "routed+order": ("tab:green", "^"),
         "routed+cache": ("tab:olive", "v"), "host": ("tab:red", "D"), "auto": ("tab:purple", "x")}


def plot(points: list[dict], path: Path) -> None:
    profile = points[0]["profile"]
    traces = list(dict.fromkeys(p["trace"] for p in points if p["profile"] == profile))
    fig, axes = plt.subplots(2, len(traces), figsize=(4.2 * len(traces), 7.2), squeeze=False)
    for col, trace in enumerate(traces):
        mine = sorted((p for p in points if p["trace"] == trace and p["profile"] == profile),
                      key=lambda p: p["batch"])
        top, bottom = axes[0][col], axes[1][col]
        for mode, (color, marker) in STYLE.items():
            with_mode = [p for p in mine if mode in p["modes"]]
            if not with_mode:
                continue
            line = "--" if mode == "auto" else "-"
            staged = [(p["batch"], p["modes"][mode]["staged_bytes_per_step"] / 1e6) for p in with_mode]
            staged = [(b, mb) for b, mb in staged if mb > 0]  # host stages no weights (activations only)
            if staged:
                top.plot(*zip(*staged, strict=True), color=color, marker=marker, linestyle=line, label=mode)
            overhead = [(p["batch"], max(p["modes"][mode]["tpot_overhead"] * 100, 1e-2)) for p in with_mode]
            bottom.plot(*zip(*overhead, strict=True), color=color, marker=marker, linestyle=line, label=mode)
        title = f"{trace}\n{mine[0]['model']}, TP {mine[0]['tp']}, {mine[0]['offloaded_experts_per_layer']} " \
                f"experts off/layer"
        top.set_title(title, fontsize=9)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks([p["batch"] for p in mine])
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("decode batch (tokens per step)")
        top.set_ylabel("staged MB / step / GPU")
        bottom.set_ylabel(f"modelled TPOT overhead, % ({profile})")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.suptitle("VAMP-15 decode cost by staging mode (no-offload step: HBM roofline floor; "
                 "host: this CPU's cores scaled to one EPYC 9654 socket)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
