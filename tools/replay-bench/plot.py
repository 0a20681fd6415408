#!/usr/bin/env python3
"""Plot TTFT p90 against load for each strategy, one panel per workload.

Usage: plot.py REPORT_DIR   (reads REPORT_DIR/results.json, writes REPORT_DIR/ttft_p90_vs_load.png)

Only the 1 replica x 1 worker points are drawn; workloads run at a single load are drawn as bars.
The value drawn is the median over the seeds of the strict TTFT p90 (rejected requests count as
infinitely late), so shedding never looks like speed, with the seeds' min-max as an error bar; a
point that rejected more than 10 % of its requests has no finite p90 and is drawn as an open
marker on the panel's top edge.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "ours": dict(color="#d62728", linewidth=2.5, marker="o"),
    "ours+flow": dict(color="#ff9896", linewidth=2, marker="o", linestyle="--"),
    "ours-tiers": dict(color="#e377c2", linewidth=1.5, marker="o", linestyle=":"),
    "dynamo": dict(color="#ff7f0e", marker="P"),
    "dynamo-no-kv-events": dict(color="#ffbb78", marker="P", linestyle="--"),
    "oracle": dict(color="#000000", marker=".", linestyle=":"),
    "gie-1-1-1": dict(color="#aec7e8", marker="s", linestyle=":"),
    "gie-default": dict(color="#1f77b4", marker="s"),
    "gie-default+lora": dict(color="#17becf", marker="s", linestyle="--"),
    "sglang": dict(color="#2ca02c", marker="^"),
    "least-request": dict(color="#9467bd", marker="v"),
    "load-only": dict(color="#8c564b", marker="x"),
    "round-robin": dict(color="#7f7f7f", marker="d"),
    "random": dict(color="#bcbd22", marker="*"),
}


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "target/routing-report")
    workloads = json.loads((out / "results.json").read_text())
    n = len(workloads)
    cols = 2 if n > 1 else 1
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.5 * rows), squeeze=False)
    for ax, w in zip([a for row in axes for a in row], workloads):
        runs = [r for r in w["points"] if r["replicas"] == 1 and r["workers"] == 1]
        strategies = list(dict.fromkeys(r["strategy"] for r in runs))
        loads = sorted({r["load"] for r in runs})

        def strict(r, k="median"):
            v = r["ttft_p90_strict_s"].get(k)
            return None if v is None else max(v, 1e-3)

        finite = [strict(r) for r in runs if strict(r) is not None]
        top = max(finite) * 2 if finite else 1.0
        if len(loads) > 1:
            for s in strategies:
                pts = sorted(((r["load"], strict(r), strict(r, "min"), strict(r, "max"))
                              for r in runs if r["strategy"] == s), key=lambda p: p[0])
                style = STYLE.get(s, {})
                ok = [p for p in pts if p[1] is not None]
                ax.plot([p[0] for p in ok], [p[1] for p in ok], label=s, **style)
                bars = [p for p in ok if p[2] is not None and p[3] is not None]
                if bars:
                    ax.errorbar([p[0] for p in bars], [p[1] for p in bars],
                                yerr=[[p[1] - p[2] for p in bars], [p[3] - p[1] for p in bars]],
                                fmt="none", ecolor=style.get("color", "#333333"), alpha=0.5)
                inf = [p[0] for p in pts if p[1] is None]
                if inf:
                    ax.plot(inf, [top] * len(inf), linestyle="none", marker="o", markerfacecolor="none",
                            markersize=10, color=style.get("color", "#333333"))
            ax.set_xlabel("load (x trace arrival rate); open marker at top: > 10 % rejected")
        else:
            vals = [strict(next(r for r in runs if r["strategy"] == s)) or top for s in strategies]
            colors = [STYLE.get(s, {}).get("color", "#333333") for s in strategies]
            ax.bar(strategies, vals, color=colors)
            ax.tick_params(axis="x", rotation=30)
            ax.set_xlabel(f"load {loads[0]:g}")
        ax.set_yscale("log")
        ax.set_ylabel("TTFT p90, rejected = inf (s, log)")
        ax.set_title(f"{w['key']} ({w['requests']} requests, {w['servers']} servers)")
        ax.grid(True, which="both", alpha=0.3)
        if len(loads) > 1:
            ax.legend(fontsize=8)
    for ax in [a for row in axes for a in row][n:]:
        ax.axis("off")
    fig.tight_layout()
    png = out / "ttft_p90_vs_load.png"
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
