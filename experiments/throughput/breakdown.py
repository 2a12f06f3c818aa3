"""``--profile``: where one step's time goes. jddp: the traced step's XLA thunks joined with the
optimised HLO into categories; PyTorch: ``torch.profiler``'s self CPU time per aten op."""

from __future__ import annotations

import collections
import glob
import re
from pathlib import Path


def _hlo_computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    cur, entry = None, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%(\S+) ", line)
        if m and line.rstrip().endswith("{"):
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif cur is not None:
            comps[cur].append(line)
    return comps, entry


def _classify(inst: str, comps: dict[str, list[str]]) -> str:
    """Category of one top-level HLO instruction of the optimised step (a thunk)."""
    called = re.search(r"calls=%([\w.\-]+)", inst)
    body = "\n".join(comps.get(called.group(1), [])) if called else ""
    convs = [ln for ln in (body + "\n" + inst).splitlines() if " convolution(" in ln]
    if convs:
        conv = convs[0]
        if "lhs_dilate" in conv:
            return "conv input-grad (strided)"
        window = re.search(r"size=(\d+)x", conv)
        if window and int(window.group(1)) >= 4:  # the weight gradient: window = feature map
            return "conv weight-grad"
        if "transpose(jvp" in inst or "transpose(jvp" in conv:
            return "conv input-grad"
        return "conv forward"
    head = inst.split("(")[0]
    if " dot(" in body or " dot(" in inst:
        return "dot (fc)"
    if "all-reduce" in head:
        return "all-reduce"
    if "transpose" in head or "copy" in head:
        return "transpose/copy"
    if " reduce(" in body or " reduce(" in inst:
        return "reduce (BN statistics, loss)"
    return "elementwise/other"


def jddp_profile_breakdown(dump_dir: str, trace_dir: str) -> dict:
    """Thunk time per category (summed over threads) of one traced jddp step."""
    from jax._src.lib import _profile_data

    hlo_files = sorted(glob.glob(f"{dump_dir}/*jit_step*cpu_after_optimizations.txt"))
    pb = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not hlo_files or not pb:
        return {"error": f"no HLO dump ({len(hlo_files)}) or trace ({len(pb)})"}
    comps, entry = _hlo_computations(Path(hlo_files[-1]).read_text())
    kinds = {}
    for line in comps.get(entry, []):
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if m:
            kinds[m.group(1)] = _classify(line, comps)
    ms: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    top: collections.Counter = collections.Counter()
    data = _profile_data.ProfileData.from_file(pb[0])
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                if ev.name in kinds:
                    ms[kinds[ev.name]] += ev.duration_ns / 1e6
                    count[kinds[ev.name]] += 1
                    top[f"{ev.name} [{kinds[ev.name]}]"] += ev.duration_ns / 1e6
    ynn = sum(1 for ln in comps.get(entry, []) if "__ynn_fusion" in ln)
    return {
        "thread_ms_by_category": dict(ms.most_common()),
        "ops_by_category": dict(count),
        "top_ops_ms": dict(top.most_common(12)),
        "ynn_fusions_in_entry": ynn,
        "hlo_file": hlo_files[-1],
    }


def torch_profile_breakdown(prof) -> dict:
    """Self CPU time per aten op (summed over threads) of one profiled PyTorch step."""
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    groups: collections.Counter = collections.Counter()
    for e in rows:
        name = e.key
        if "convolution_backward" in name or "mkldnn_convolution_backward" in name:
            cat = "conv backward (input+weight grad)"
        elif "convolution" in name or "conv2d" in name:
            cat = "conv forward"
        elif "batch_norm" in name:
            cat = "batch norm (fwd+bwd)"
        elif "allreduce" in name.lower() or "gloo" in name.lower() or "c10d" in name:
            cat = "DDP all-reduce / c10d"
        elif "sgd" in name.lower() or "_foreach" in name:
            cat = "optimizer"
        else:
            cat = "other"
        groups[cat] += e.self_cpu_time_total / 1e3
    return {
        "self_cpu_ms_by_category": dict(groups.most_common()),
        "top_ops_ms": {e.key: e.self_cpu_time_total / 1e3 for e in rows[:12]},
    }
