"""The result tables (printed and markdown, from one row format) and the throughput plot."""

from __future__ import annotations

import sys
from pathlib import Path

# One row format for the printed table and the tables of RESULTS.md: (cell, printed header,
# printed width (negative: left-aligned), markdown header).
TABLE_COLUMNS = (
    ("config", "config", -22, "config"),
    ("dtype", "dtype", -8, "dtype"),
    ("n", "n", 2, "timed steps"),
    ("step", "step s median (p10-p90)", 25, "step s, median (p10-p90)"),
    ("img_s", "img/s", 7, "img/s"),
    ("ratio", "x torch", 7, "jddp / PyTorch DDP img/s"),
    ("ratio_c", "x compiled", 10, "jddp / PyTorch DDP + torch.compile img/s"),
    ("compile", "compile s", 9, "compile s"),
    ("first", "1st step s", 10, "1st step s"),
    ("rss", "RSS MiB/proc", 12, "peak RSS MiB per process"),
    ("gflops", "GFLOP/s", 8, "GFLOP/s (analytic)"),
    ("mfu", "MFU", 6, "MFU (analytic)"),
    ("xla_gflops", "XLA GFLOP/s", 11, "GFLOP/s by XLA's count"),
    ("xla_mfu", "XLA MFU", 7, "MFU by XLA's count"),
)


def _flops_cells(r: dict) -> dict[str, str]:
    """GFLOP/s and MFU by the analytic count and by XLA's. A record written before the analytic
    count (no ``xla_flops_per_step``; ``--recompute`` adds it) held XLA's in the plain fields."""
    fields = {"gflops": "achieved_gflops", "mfu": "mfu"}
    fields |= {"xla_gflops": "xla_achieved_gflops", "xla_mfu": "xla_mfu"}
    if "xla_flops_per_step" not in r:
        fields = {"gflops": "", "mfu": "", "xla_gflops": "achieved_gflops", "xla_mfu": "mfu"}
    cells = {}
    for cell, key in fields.items():
        value = r.get(key) if key else None
        if not value:
            cells[cell] = "-"
        elif cell.endswith("mfu"):
            cells[cell] = f"{100 * value:.1f}%"
        else:
            cells[cell] = f"{value:.1f}"
    return cells


def record_cells(r: dict) -> dict[str, str] | None:
    """The formatted cells of one record (``None``: no timed steps), for every table."""
    if "median_step_s" not in r:
        return None

    def num(key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "-"

    return {
        "config": r["config"],
        "dtype": r["dtype"],
        "n": str(r["timed_steps"]),
        "step": f"{r['median_step_s']:.3f} ({r['p10_step_s']:.3f}-{r['p90_step_s']:.3f})",
        "img_s": f"{r['img_per_s']:.1f}",
        "ratio": num("ratio_img_per_s", ".2f"),
        "ratio_vs": r.get("ratio_vs") or "",
        "ratio_c": num("ratio_img_per_s_compiled", ".2f"),
        "ratio_c_vs": r.get("ratio_vs_compiled") or "",
        "compile": num("compile_s", ".1f"),
        "first": num("first_step_s", ".2f"),
        "rss": "/".join(f"{x:.0f}" for x in r["maxrss_mib_per_process"]),
        **_flops_cells(r),
    }


def print_table(records: list[dict]) -> None:
    def line(cells: dict[str, str]) -> str:
        return " ".join(
            format(cells[k], f"<{-w}" if w < 0 else f">{w}") for k, _, w, _ in TABLE_COLUMNS
        )

    head = line({k: h for k, h, _, _ in TABLE_COLUMNS})
    print(head)
    print("-" * len(head))
    for r in records:
        cells = record_cells(r)
        if cells is None:
            print(f"{r['config']:<22} {r['dtype']:<8} (no timed steps)")
        else:
            print(line(cells))


def markdown_table(records: list[dict]) -> list[str]:
    """``print_table``'s rows as a markdown table (the PyTorch peer named next to each ratio)."""
    lines = [
        "| " + " | ".join(h for _, _, _, h in TABLE_COLUMNS) + " |",
        "|" + "|".join("---" if w < 0 else "---:" for _, _, w, _ in TABLE_COLUMNS) + "|",
    ]
    for r in records:
        cells = record_cells(r)
        if cells is None:
            cells = {k: "-" for k, _, _, _ in TABLE_COLUMNS}
            cells.update(config=r["config"], dtype=r["dtype"], n="0")
        else:
            for cell in ("ratio", "ratio_c"):
                if cells[f"{cell}_vs"]:
                    cells[cell] += f" (vs {cells[f'{cell}_vs']})"
        lines.append("| " + " | ".join(cells[k] for k, _, _, _ in TABLE_COLUMNS) + " |")
    return lines


def plot(records: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    recs = [r for r in records if "img_per_s" in r]
    configs = list(dict.fromkeys(r["config"] for r in recs))
    dtypes = list(dict.fromkeys(r["dtype"] for r in recs))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(configs) + 1.5), 4.5))
    width = 0.8 / max(len(dtypes), 1)
    colors = {"float32": "#4C72B0", "bfloat16": "#DD8452"}
    for j, dtype in enumerate(dtypes):
        xs, ys, lo, hi = [], [], [], []
        for i, c in enumerate(configs):
            r = next((r for r in recs if r["config"] == c and r["dtype"] == dtype), None)
            if r is None:
                continue
            b = r["global_batch"]
            xs.append(i + (j - (len(dtypes) - 1) / 2) * width)
            ys.append(r["img_per_s"])
            lo.append(r["img_per_s"] - b / r["p90_step_s"])
            hi.append(b / r["p10_step_s"] - r["img_per_s"])
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=dtype, color=colors.get(dtype))
        ax.bar_label(bars, fmt="%.1f", padding=2, fontsize=8)
    ax.set_xticks(range(len(configs)), configs, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("images/s (median; bars: p10-p90 step time)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
