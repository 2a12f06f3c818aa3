"""RESULTS.md's generated throughput tables: rebuilt from every timed throughput results file in
``results/`` between two markers; the text around them is left as it is."""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
from pathlib import Path

from . import common
from .tables import markdown_table

RESULTS_MD_BEGIN = "<!-- bench.py: generated tables begin -->"
RESULTS_MD_END = "<!-- bench.py: generated tables end -->"
RESULTS_MD_SECTION = "## Training throughput: jddp vs PyTorch DDP (CPU)"
# Other scripts' results share the folder; their JSON is told apart by its fields as well.
OTHER_RESULT_PREFIXES = ("allreduce-", "scaling-model-", "precision-", "overhead-")


def is_throughput_result(result: object) -> bool:
    """A timed (not ``--quick``, not ``--profile``) results file written by this script."""
    if not isinstance(result, dict) or result.get("benchmark") != "train-throughput":
        return False
    method, records = result.get("method"), result.get("records")
    if not isinstance(method, dict) or method.get("quick") or method.get("profile"):
        return False
    return isinstance(records, list) and any("median_step_s" in r for r in records)


def throughput_results(results_dir: Path) -> list[tuple[Path, dict]]:
    """Every throughput results file of ``results_dir``, oldest run first."""
    found = []
    for path in sorted(results_dir.glob("*.json")):
        if path.name.startswith(OTHER_RESULT_PREFIXES) or "-quick" in path.name:
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"RESULTS.md: skipping {path.name}: {e}", file=sys.stderr)
            continue
        if is_throughput_result(result):
            found.append((path, result))
    return sorted(found, key=lambda pr: (pr[1].get("date_utc") or "", pr[0].name))


def _wrap(text: str, indent: str = "") -> list[str]:
    """Markdown prose wrapped at 100 columns (never inside a word or an option name)."""
    return textwrap.wrap(
        text, 100, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def _markdown_run(path: Path, result: dict, md_dir: Path, peak_note: bool) -> list[str]:
    """One results file in RESULTS.md: where it came from, then :func:`markdown_table`."""
    m, w, method = result.get("machine", {}), result.get("workload", {}), result["method"]
    rel = Path(os.path.relpath(path, md_dir)).as_posix()
    date = (result.get("date_utc") or "?").replace("T", " ").replace("+00:00", " UTC")
    gpus = m.get("gpus") or []  # nvidia-smi -L lines
    hardware = f"{m.get('cpu_model') or 'unknown CPU'} ({m.get('cpu_count')} CPUs); "
    if not gpus:
        hardware += "no GPU"
    elif len(set(g.split(" (UUID")[0].split(": ", 1)[-1] for g in gpus)) == 1:
        hardware += f"{len(gpus)} × {gpus[0].split(' (UUID')[0].split(': ', 1)[-1]}"
    else:
        hardware += "GPUs: " + ", ".join(g.split(" (UUID")[0] for g in gpus)
    if gpus and m.get("gpu_driver"):
        hardware += f", driver {m['gpu_driver']}"
    versions = ", ".join(
        f"{k} {v}"
        for k, v in (m.get("versions") or {}).items()
        if v and (k in ("jax", "torch", "torchvision") or k.startswith("jax-cuda"))
    )
    dirty = m.get("git_dirty_paths") or []
    commit = f"`{m.get('git_commit')}`" + (
        f" plus {len(dirty)} uncommitted paths (`machine.git_dirty_paths`)" if dirty else ""
    )
    command = result.get("command") or "?"
    if isinstance(command, list):
        command = shlex.join(command)
    load = [f"{x[0]:.1f}" for x in result.get("loadavg_1_5_15") or []]
    warmup = method.get("warmup")
    timing = (
        f"{warmup} warm-up step{'' if warmup == 1 else 's'}, then {method.get('rounds')} "
        f"interleaved rounds × {method.get('steps_per_round')} timed steps"
    )
    lines = [f"#### `{rel}`", ""]
    for bullet in (
        f"**Run**: {date}; machine `{m.get('name')}`: {hardware}; {versions}; commit {commit}",
        None,  # the command: one line, never wrapped
        f"**Workload**: {w.get('model')} ({w.get('stem')} stem, width {w.get('width')}), "
        f"{w.get('image_size')}×{w.get('image_size')} images, {w.get('num_classes')} classes, "
        f"global batch {w.get('global_batch')}, {w.get('platform')}; {timing}"
        + (f"; 1-minute load average (start, after each dtype): {', '.join(load)}" if load else ""),
        *([f"**MFU peak**: {method.get('peak_note') or 'none'}"] if peak_note else []),
    ):
        lines += _wrap(f"- {bullet}", "  ") if bullet else [f"- **Command**: `{command}`"]
    if result.get("failures"):
        failed = ", ".join(k for f in result["failures"] for k in f.get("block", []))
        lines += _wrap(f"- **Failed** (no rows): {failed}; errors in the JSON's `failures`", "  ")
    return [*lines, "", *markdown_table(result["records"]), ""]


def results_md_block(results_dir: Path, md_dir: Path) -> str:
    """The generated part of RESULTS.md, markers included."""
    runs = throughput_results(results_dir)
    lines = [
        RESULTS_MD_BEGIN,
        "<!-- Written by experiments/bench.py from the JSON files in results/ after each",
        "non-quick run and --recompute, or by --regenerate-results-md. Edit outside the",
        "markers. -->",
        "",
        "### Throughput tables (generated from the results files)",
        "",
        *_wrap(
            "One table per timed `bench.py` run in `results/` (`--quick` smoke runs and "
            "`--profile` runs are left out), oldest first. Step s: the slowest rank's wall time "
            "of a step, median (p10-p90) of the timed steps; img/s: global batch / median; "
            "jddp / PyTorch DDP img/s: jddp's images/s over those of the PyTorch configuration "
            "named, same run and dtype (eager, and `-compile`: `torch.compile`, where run); "
            "compile s: jddp's `lower` + `compile` (`jddp-mpi-*`: of the grads stage only, its "
            "update jit compiles in the 1st step; PyTorch: -, `torch.compile` compiles in the 1st "
            "step); 1st step s: the first warm-up step; peak RSS: `ru_maxrss` of each process; "
            "GFLOP/s (analytic): the model's FLOPs per step counted from its architecture (3 x 2 "
            "x the forward MACs of convolutions and dense head x global batch, "
            "`experiments/throughput/flops.py`) / median; GFLOP/s by XLA's count: XLA's "
            "`cost_analysis` of jddp's compiled step instead (used for both sides and for "
            "`jddp-mpi-*`; on GPU it misses cuDNN convolutions); MFU: GFLOP/s over the stated "
            "peak."
        ),
        "",
    ]
    if not runs:
        lines += ["(No throughput results files yet.)", ""]
    peak_notes = {result["method"].get("peak_note") for _, result in runs}
    if len(peak_notes) == 1:  # one note for all, not one per file
        lines += [*_wrap(f"MFU peak of every file below: {peak_notes.pop() or 'none'}."), ""]
    for path, result in runs:
        lines += _markdown_run(path, result, md_dir, peak_note=len(peak_notes) > 1)
    return "\n".join([*lines, RESULTS_MD_END])


def regenerate_results_md(results_dir: Path | None = None, md_path: Path | None = None) -> bool:
    """Rewrite the generated tables of RESULTS.md from ``results_dir``; text outside the markers
    is kept. Without markers the block goes into the throughput section (before its first
    ``###`` subsection; the section is appended if missing). Returns whether the file changed."""
    results_dir = common.RESULTS_DIR if results_dir is None else Path(results_dir)
    md_path = common.RESULTS_MD if md_path is None else Path(md_path)
    text = md_path.read_text() if md_path.exists() else "# Experiment results\n"
    block = results_md_block(results_dir, md_path.parent)
    n_begin, n_end = text.count(RESULTS_MD_BEGIN), text.count(RESULTS_MD_END)
    if (n_begin, n_end) == (1, 1) and text.index(RESULTS_MD_BEGIN) < text.index(RESULTS_MD_END):
        head, rest = text.split(RESULTS_MD_BEGIN)
        new = head + block + rest.split(RESULTS_MD_END)[1]
    elif n_begin or n_end:
        raise ValueError(
            f"{md_path}: expected one {RESULTS_MD_BEGIN!r} before one {RESULTS_MD_END!r}, found "
            f"{n_begin} and {n_end}: fix the markers by hand"
        )
    else:
        lines = text.splitlines()
        try:
            start = lines.index(RESULTS_MD_SECTION)
        except ValueError:
            lines += ["", RESULTS_MD_SECTION, ""]
            start = len(lines) - 2
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith(("## ", "### "))),
            len(lines),
        )
        while end > start + 1 and not lines[end - 1].strip():
            end -= 1
        after = lines[end:]
        while after and not after[0].strip():
            after.pop(0)
        new = "\n".join([*lines[:end], "", block, *([""] + after if after else [])]) + "\n"
    if new == text:
        return False
    tmp = md_path.with_name(md_path.name + ".tmp")
    tmp.write_text(new)
    os.replace(tmp, md_path)
    return True


def update_results_md() -> int:
    """Regenerate RESULTS.md's tables after a run; 1 (with a message) when that fails."""
    md_path = common.RESULTS_MD
    try:
        changed = regenerate_results_md(common.RESULTS_DIR, md_path)
    except (OSError, ValueError) as e:
        print(f"RESULTS.md not regenerated: {e}", file=sys.stderr)
        return 1
    n = len(throughput_results(common.RESULTS_DIR))
    print(f"{'regenerated' if changed else 'unchanged:'} {md_path} ({n} throughput files)")
    return 0
