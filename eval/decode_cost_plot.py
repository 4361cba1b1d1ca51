"""The decode-cost figure (issue 49): per trace, staged bytes per step and modelled TPOT overhead against
decode batch, one line per staging mode (the first profile in the points)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

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
            batches = [p["batch"] for p in with_mode]
            staged = [max(p["modes"][mode]["staged_bytes_per_step"] / 1e6, 1e-2) for p in with_mode]
            overhead = [max(p["modes"][mode]["tpot_overhead"] * 100, 1e-2) for p in with_mode]
            if mode != "host":  # host stages nothing (activations only)
                top.plot(batches, staged, color=color, marker=marker, label=mode)
            bottom.plot(batches, overhead, color=color, marker=marker, label=mode)
        title = f"{trace}\n{mine[0]['model']}, TP {mine[0]['tp']}, {mine[0]['offloaded_experts_per_layer']} " \
                f"experts off/layer"
        top.set_title(title, fontsize=9)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("decode batch (tokens per step)")
        top.set_ylabel("staged MB per step per GPU")
        bottom.set_ylabel(f"modelled TPOT overhead, % ({profile})")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.suptitle("VAMP-15 decode cost by staging mode (no-offload step: HBM roofline floor; "
                 "host: this CPU's cores scaled to one EPYC 9654 socket)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
