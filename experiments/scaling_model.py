"""Scaling model (not a measurement): data-parallel efficiency from step time and all-reduce cost.

    .venv/bin/python experiments/scaling_model.py                  # table, JSON and PNG
    .venv/bin/python experiments/scaling_model.py --resnet50-step-ms 51 --overlap 0.5
    .venv/bin/python experiments/scaling_model.py --bench-json experiments/results/<gpu run>.json

Weak scaling: every GPU keeps its batch, so its step's compute t_c does not change with the GPU
count n; the exposed part t_x of the gradient all-reduce is the new cost:
efficiency(n) = t_c / (t_c + t_x(n)). All-reduce of S bytes (nccl-tests' busbw B):

* n <= g (one node of g = 8 GPUs, NVLink):  t_ar = 2(n-1)/n * S / B_nvl + k * 2(n-1) * a_nvl
* n > g (N = n/g nodes, hierarchical, not pipelined: reduce-scatter in the node, all-reduce of
  each GPU's S/g shard across nodes through its own NIC, all-gather in the node):
  t_ar = 2(g-1)/g * S / B_nvl + 2(N-1)/N * (S/g) / B_ib + k * (2(g-1) * a_nvl + 2(N-1) * a_ib)

with a ring's latency (a per step, 2(r-1) steps for r ranks, once per bucket, k = ceil(S /
bucket); a tree, ~2 log2(r) steps, is a sensitivity row). Exposed part: t_x = t_ar without
overlap (jddp's compiled CPU step), else t_x = max((1 - overlap) * t_ar, t_ar - 2/3 t_c). Not
modelled: contention, stragglers, input pipelines, BatchNorm sync: an upper bound.

Inputs (printed and stored with their sources): gradient bytes from the parameter counts of
``jddp.models`` (:func:`benchlib.model_figures`; x 4 float32, x 2 bfloat16); the single-GPU step
time, an ASSUMPTION unless ``--bench-json`` names a ``bench.py`` file with a 1x1 jddp record;
bandwidths, latencies, bucket and overlap, ASSUMPTIONS (flags). Checks: this VM's measured
2-process CPU numbers (``results/``) and two published anchors (NVIDIA's ResNet-50 on 8x A100,
Horovod's 512 GPUs) run through the same formula. Writes ``results/scaling-model-<date>.json``
and ``.png``; the results and caveats are in ``experiments/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import benchlib
from benchlib import RESULTS_DIR

GPU_COUNTS = (8, 64, 512)
PLOT_COUNTS = tuple(2**i for i in range(11))  # 1 .. 1024
BYTES = {"float32": 4, "bfloat16": 2}
# Parameter count and forward GMAC per 224x224 image of jddp's ImageNet ResNets (1000
# classes), filled by read_models() from jddp.models.
PARAMS: dict[str, int] = {}
FWD_GMAC: dict[str, float] = {}


def read_models() -> None:
    for model in ("resnet50", "resnet18", "resnet101"):
        figures = benchlib.model_figures(model, "imagenet", 64, 1000, 224)
        PARAMS[model], FWD_GMAC[model] = figures["params"], figures["forward_macs"] / 1e9


# ASSUMPTION: ResNet-50, bf16 mixed precision, 256 images per GPU on one H100 SXM at ~3,000 img/s.
# Basis: 2,470 img/s on one A100 80GB (NVIDIA DeepLearningExamples, PyTorch AMP) x ~1.2 for H100;
# vendor figures for H100 vision training go up to ~2x A100 (~5,000 img/s = 51 ms, see the
# sensitivity rows of the JSON).
DEFAULT_RESNET50_STEP_MS = 85.0
DEFAULT_BATCH_PER_GPU = 256
CPU_FILES = {
    "allreduce": "allreduce-2026-11-21-vm.json",
    "one_process_b64": "2026-11-21-vm-noynnconv-b64.json",
    "two_process_noynnconv": "2026-11-21-vm-noynnconv.json",
    "two_process_main": "2026-11-21-vm.json",
}


@dataclass
class Fabric:
    """Where the GPUs sit and how fast their all-reduce is (bus bandwidths in GB/s)."""

    name: str
    gpus_per_node: int
    busbw_intra: tuple[float, float, float]  # low, mid, high (nccl-tests busbw in the node)
    busbw_inter_per_gpu: tuple[float, float, float]  # one GPU's share of the cross-node links
    alpha_intra_us: float  # per ring step
    alpha_inter_us: float
    bucket_mb: float
    note: str


def _latency_steps(ranks: int, tree: bool) -> float:
    """Latency-bound steps of one all-reduce over ``ranks``: ring 2(r-1), tree ~2 log2(r)."""
    return 2 * math.log2(ranks) if tree else 2 * (ranks - 1)


def allreduce_s(
    nbytes: float, n: int, f: Fabric, bw: int = 1, pipelined: bool = False, tree: bool = False
) -> float:
    """Modelled all-reduce time of ``nbytes`` over ``n`` GPUs; ``bw`` 0/1/2 = low/mid/high."""
    if n <= 1:
        return 0.0
    g = min(n, f.gpus_per_node)
    b_intra = f.busbw_intra[bw] * 1e9
    b_inter = f.busbw_inter_per_gpu[bw] * 1e9
    buckets = math.ceil(nbytes / (f.bucket_mb * 1e6))
    steps_latency = _latency_steps(g, tree) * f.alpha_intra_us * 1e-6
    nodes = n // g
    if n > g:
        steps_latency += _latency_steps(nodes, tree) * f.alpha_inter_us * 1e-6
    if pipelined:
        bottleneck = b_intra if n <= g else min(b_intra, g * b_inter)
        return 2 * (n - 1) / n * nbytes / bottleneck + buckets * steps_latency
    t = 2 * (g - 1) / g * nbytes / b_intra
    if n > g:
        t += 2 * (nodes - 1) / nodes * (nbytes / g) / b_inter
    return t + buckets * steps_latency


def exposed_s(t_ar: float, t_c: float, overlap: float) -> float:
    """The part of the all-reduce not hidden under the backward pass (2/3 of the step)."""
    if overlap <= 0:
        return t_ar
    return max((1 - overlap) * t_ar, t_ar - 2 / 3 * t_c)


def efficiency(t_c: float, t_x: float) -> float:
    return t_c / (t_c + t_x)


def gpu_rows(args, fabric: Fabric, steps: dict) -> list[dict]:
    """One row per model x gradient dtype x overlap: efficiency at 8, 64, 512 GPUs."""
    rows = []
    for model in ("resnet50", "resnet18"):
        t_c = steps[model]["step_ms"] / 1e3
        for dtype in ("float32", "bfloat16"):
            nbytes = PARAMS[model] * BYTES[dtype]
            for overlap in (0.0, args.overlap):
                row = {
                    "model": model,
                    "grad_dtype": dtype,
                    "grad_mb": nbytes / 1e6,
                    "step_ms": steps[model]["step_ms"],
                    "step_source": steps[model]["source"],
                    "overlap": overlap,
                    "by_gpus": {},
                }
                for n in GPU_COUNTS:
                    t_ar = [allreduce_s(nbytes, n, fabric, bw) for bw in (0, 1, 2)]
                    eff = [efficiency(t_c, exposed_s(t, t_c, overlap)) for t in t_ar]
                    t_pipe = allreduce_s(nbytes, n, fabric, 1, pipelined=True)
                    row["by_gpus"][str(n)] = {
                        "allreduce_ms": 1e3 * t_ar[1],
                        "allreduce_ms_low_high_bw": [1e3 * t_ar[0], 1e3 * t_ar[2]],
                        "allreduce_ms_if_pipelined": 1e3 * t_pipe,
                        "exposed_ms": 1e3 * exposed_s(t_ar[1], t_c, overlap),
                        "efficiency": eff[1],
                        "efficiency_low_high_bw": [eff[0], eff[2]],
                        "efficiency_if_pipelined": efficiency(t_c, exposed_s(t_pipe, t_c, overlap)),
                        "speedup": n * eff[1],
                    }
                rows.append(row)
    return rows


def curve(model: str, dtype: str, overlap: float, t_c: float, fabric: Fabric, bw: int = 1):
    nbytes = PARAMS[model] * BYTES[dtype]
    return [
        efficiency(t_c, exposed_s(allreduce_s(nbytes, n, fabric, bw), t_c, overlap))
        for n in PLOT_COUNTS
    ]


# ------------------------------------------------------------------------------ the anchors
A100_NODE = Fabric(
    name="DGX A100: 8x A100 80GB, NVLink3/NVSwitch",
    gpus_per_node=8,
    busbw_intra=(200.0, 230.0, 260.0),
    busbw_inter_per_gpu=(0.0, 0.0, 0.0),
    alpha_intra_us=2.0,
    alpha_inter_us=0.0,
    bucket_mb=25.0,
    note="ASSUMPTION: nccl-tests all_reduce busbw of a DGX A100 ~230 GB/s (NVLink3: 300 GB/s "
    "per direction per GPU); PyTorch DDP's 25 MB buckets",
)
HOROVOD_P100 = Fabric(
    name="Horovod 2017: 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE per server",
    gpus_per_node=4,
    busbw_intra=(8.0, 10.0, 12.0),
    busbw_inter_per_gpu=(2.5 / 4, 2.8 / 4, 3.0 / 4),
    alpha_intra_us=5.0,
    alpha_inter_us=10.0,
    bucket_mb=64.0,
    note="ASSUMPTION: PCIe 3 x16 in the server (~10 GB/s busbw); one 25 Gbit/s (3.1 GB/s) NIC "
    "shared by 4 GPUs (~2.8 GB/s achieved: 0.7 GB/s per GPU); Horovod's 64 MB fusion buffer",
)


def anchors(overlap: float) -> list[dict]:
    """The published numbers, and the model run on the set-ups that produced them."""
    out = []
    rn50_f32 = PARAMS["resnet50"] * 4
    for label, img_s_1, img_s_8 in (("mixed precision", 2470, 16621), ("TF32", 938, 7248)):
        t_c = 256 / img_s_1
        t_ar = allreduce_s(rn50_f32, 8, A100_NODE)
        out.append(
            {
                "anchor": f"NVIDIA ResNet-50 v1.5, 1 -> 8 A100 80GB, {label}",
                "source": "NVIDIA DeepLearningExamples PyTorch/Classification/ConvNets/"
                "resnet50v1.5 README, 'Training performance: NVIDIA DGX A100 (8x A100 80GB)', "
                "pytorch-21.03 NGC container; 256 images per GPU (configs.yml)",
                "gpus": 8,
                "published_img_s": [img_s_1, img_s_8],
                "published_efficiency": img_s_8 / (8 * img_s_1),
                "model_inputs": {
                    "step_ms": 1e3 * t_c,
                    "step_source": f"256 / {img_s_1} img/s (the published 1-GPU rate)",
                    "grad_mb": rn50_f32 / 1e6,
                    "grad_dtype": "float32 (PyTorch AMP keeps float32 gradients)",
                    "fabric": asdict(A100_NODE),
                    "allreduce_ms": 1e3 * t_ar,
                },
                "model_efficiency": {
                    "no_overlap": efficiency(t_c, t_ar),
                    f"overlap_{overlap}": efficiency(t_c, exposed_s(t_ar, t_c, overlap)),
                },
            }
        )
    rn101_f32 = PARAMS["resnet101"] * 4
    t_c = 64 * 16 / 1656.82
    t_ar = allreduce_s(rn101_f32, 512, HOROVOD_P100)
    out.append(
        {
            "anchor": "Horovod, 512 Pascal GPUs, ResNet-101 (and Inception V3)",
            "source": "Horovod docs/benchmarks: 128 servers x 4 Pascal GPUs, RoCE 25 Gbit/s, "
            "'90% scaling efficiency for both Inception V3 and ResNet-101'",
            "gpus": 512,
            "published_efficiency": 0.90,
            "model_inputs": {
                "step_ms": 1e3 * t_c,
                "step_source": "ASSUMPTION: Horovod docs' example output for ResNet-101, batch 64, "
                "16 GPUs: 'total images/sec: 1656.82' -> 103.6 img/s per GPU (includes 16-GPU "
                "communication, so t_c is if anything too long)",
                "grad_mb": rn101_f32 / 1e6,
                "grad_dtype": "float32",
                "fabric": asdict(HOROVOD_P100),
                "allreduce_ms": 1e3 * t_ar,
            },
            "model_efficiency": {
                "no_overlap": efficiency(t_c, t_ar),
                f"overlap_{overlap}": efficiency(t_c, exposed_s(t_ar, t_c, overlap)),
            },
        }
    )
    return out


# -------------------------------------------------------------------------- the CPU check
def _record(path: Path, config: str, dtype: str = "float32") -> dict:
    data = json.loads(path.read_text())
    return next(r for r in data["records"] if r["config"] == config and r["dtype"] == dtype)


def cpu_check(results: Path) -> dict | None:
    """This VM's measured numbers through the same formula: 2 processes, n = 2, no overlap."""
    paths = {k: results / v for k, v in CPU_FILES.items()}
    if not all(p.exists() for p in paths.values()):
        return None
    ar = json.loads(paths["allreduce"].read_text())

    def ar_rec(backend, layout):
        return next(
            r
            for r in ar["records"]
            if r["backend"] == backend and r["layout"] == layout and r["dtype"] == "float32"
        )

    gloo = ar_rec("gloo", "flat")  # the compiled step has one combined all-reduce: a flat buffer
    mpi = ar_rec("mpi4jax", "leaves")  # dist.backend=mpi reduces leaf by leaf
    cases = []
    for flags, one, two_cfg in (
        ("XLA defaults", "jddp-1x1-pin", "jddp-2x1-pin"),
        ("-noynnconv", "jddp-1x1-pin-noynnconv", "jddp-2x1-pin-noynnconv"),
    ):
        t_c = _record(paths["one_process_b64"], one)["median_step_s"]
        measured = [
            (CPU_FILES["two_process_noynnconv"], _record(paths["two_process_noynnconv"], two_cfg))
        ]
        if flags == "XLA defaults":
            measured.append(
                (CPU_FILES["two_process_main"], _record(paths["two_process_main"], two_cfg))
            )
        t_ar = gloo["median_ms"] / 1e3
        cases.append(
            {
                "xla_flags": flags,
                "t_c_s": t_c,
                "t_c_source": f"{CPU_FILES['one_process_b64']}: {one}, 64 images, 1 pinned "
                "process, no communication",
                "allreduce_s": t_ar,
                "allreduce_source": f"{CPU_FILES['allreduce']}: gloo (XLA) flat float32 "
                f"{gloo['bytes'] / 1e6:.1f} MB, median (p10-p90 {gloo['p10_ms']:.0f}-"
                f"{gloo['p90_ms']:.0f} ms)",
                "predicted_step_s": t_c + t_ar,
                "predicted_efficiency": efficiency(t_c, t_ar),
                "predicted_efficiency_mpi_backend": efficiency(t_c, mpi["median_ms"] / 1e3),
                "measured": [
                    {
                        "file": f,
                        "config": r["config"],
                        "step_s": r["median_step_s"],
                        "step_s_p10_p90": [r["p10_step_s"], r["p90_step_s"]],
                        "efficiency": t_c / r["median_step_s"],
                    }
                    for f, r in measured
                ],
            }
        )
    main = paths["two_process_main"]
    one_proc, two_proc = _record(main, "jddp-1x1"), _record(main, "jddp-2x1")
    two_pin = _record(main, "jddp-2x1-pin")
    return {
        "what": "2 processes x 1 CPU core, ResNet-18 CIFAR, 64 images per process (global 128), "
        "float32; efficiency = 1-process step at 64 images / 2-process step",
        "mpi_allreduce_ms": mpi["median_ms"],
        "cases": cases,
        "same_run_speedup": {
            "file": CPU_FILES["two_process_main"],
            "note": "images/s of 2 processes x 1 core over 1 process x 2 threads, both global "
            "batch 128 in one interleaved run: strong scaling on the same 2 cores, not the "
            "model's quantity",
            "jddp-2x1 / jddp-1x1": two_proc["img_per_s"] / one_proc["img_per_s"],
            "jddp-2x1-pin / jddp-1x1": two_pin["img_per_s"] / one_proc["img_per_s"],
        },
    }


# ---------------------------------------------------------------------------- step times
def measured_step(path: str) -> tuple[str, dict]:
    """(model, step entry) from a bench.py results file: its 1-process x 1-device jddp record."""
    data = json.loads(Path(path).read_text())
    work = data["workload"]
    ones = [
        r
        for r in data["records"]
        if r["framework"] == "jddp" and r["nproc"] == r["per_proc"] == 1 and "median_step_s" in r
    ]
    ones.sort(key=lambda r: r["dtype"] != "bfloat16")  # prefer the bf16 (mixed precision) step
    if work["model"] not in FWD_GMAC or not ones:
        sys.exit(f"{path}: no 1x1 jddp record of resnet50/resnet18 to use")
    r = ones[0]
    notes = []
    if r["global_batch"] != DEFAULT_BATCH_PER_GPU:
        notes.append(f"{r['global_batch']} images per device, not {DEFAULT_BATCH_PER_GPU}")
    if work.get("stem") != "imagenet" or work.get("image_size") != 224:
        notes.append(f"{work.get('stem')} stem at {work.get('image_size')}px, not ImageNet 224px")
    if work.get("platform") == "cpu":
        notes.append("a CPU time with GPU bandwidths: illustration only")
    for note in notes:
        print(f"note: --bench-json: {note}", file=sys.stderr)
    return work["model"], {
        "step_ms": 1e3 * r["median_step_s"],
        "source": f"measured: {path} {r['name']} {r['dtype']} median "
        f"({data['machine'].get('name')}, {data['date_utc'][:10]})"
        + "".join(f"; {n}" for n in notes),
    }


def step_times(args) -> dict:
    """Single-GPU step time per model: given on the command line, measured, or assumed."""
    steps = {
        "resnet50": {
            "step_ms": DEFAULT_RESNET50_STEP_MS,
            "source": "ASSUMPTION: ~3,000 img/s per H100 at 256 images, bf16 (no GPU measured "
            "here; 1 A100 80GB: 2,470 img/s AMP per NVIDIA DeepLearningExamples, H100 ~1.2x)",
        }
    }
    fixed = set()
    if args.bench_json:
        model, entry = measured_step(args.bench_json)
        steps[model] = entry
        fixed.add(model)
    for model, given in (("resnet50", args.resnet50_step_ms), ("resnet18", args.resnet18_step_ms)):
        if given:
            steps[model] = {"step_ms": given, "source": f"given (--{model}-step-ms)"}
            fixed.add(model)
    if "resnet18" not in fixed:
        ratio = FWD_GMAC["resnet18"] / FWD_GMAC["resnet50"]
        steps["resnet18"] = {
            "step_ms": steps["resnet50"]["step_ms"] * ratio,
            "source": f"ASSUMPTION: ResNet-50's step ({steps['resnet50']['source'].split(':')[0]})"
            f" x {ratio:.3f} (forward GMAC per 224 px image {FWD_GMAC['resnet18']:.2f} / "
            f"{FWD_GMAC['resnet50']:.2f}, jddp.models); ResNet-18 "
            "usually runs at a lower fraction of peak, so its real step is likely longer",
        }
    return steps


# ------------------------------------------------------------------------------- reporting
def fmt_eff(cell: dict) -> str:
    lo, hi = cell["efficiency_low_high_bw"]
    return f"{100 * cell['efficiency']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f})"


def print_tables(result: dict) -> None:
    f = result["fabric"]
    print(
        f"Scaling model (not a measurement). {f['name']}: NVLink busbw {f['busbw_intra']} GB/s, "
        f"IB busbw per GPU {f['busbw_inter_per_gpu']} GB/s (low, mid, high), latency "
        f"{f['alpha_intra_us']}/{f['alpha_inter_us']} us per ring step, {f['bucket_mb']:.0f} MB "
        f"buckets, overlap {result['assumptions']['overlap']}"
    )
    head = f"{'model':<9} {'grads':<8} {'MB':>6} {'step ms':>7} {'overlap':>7} " + " ".join(
        f"{f'{n} GPUs: eff (low-high bw)':>27}" for n in GPU_COUNTS
    )
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        cells = " ".join(f"{fmt_eff(r['by_gpus'][str(n)]):>27}" for n in GPU_COUNTS)
        print(
            f"{r['model']:<9} {r['grad_dtype']:<8} {r['grad_mb']:>6.1f} {r['step_ms']:>7.1f} "
            f"{r['overlap']:>7.2f} {cells}"
        )
    print("\nall-reduce ms (mid bandwidth; pipelined in brackets):")
    for r in result["rows"]:
        if r["overlap"]:
            continue
        cells = "  ".join(
            f"{n}: {r['by_gpus'][str(n)]['allreduce_ms']:.2f} "
            f"[{r['by_gpus'][str(n)]['allreduce_ms_if_pipelined']:.2f}]"
            for n in GPU_COUNTS
        )
        print(f"  {r['model']:<9} {r['grad_dtype']:<8} {cells}")
    for s in result["sensitivity"]:
        print(f"sensitivity: {s['what']}: {', '.join(f'{k} {v}' for k, v in s['values'].items())}")
    print("\nanchors (published vs this model on the same set-up):")
    for a in result["anchors"]:
        model = ", ".join(f"{k} {100 * v:.1f}%" for k, v in a["model_efficiency"].items())
        print(
            f"  {a['anchor']}: published {100 * a['published_efficiency']:.1f}%; model {model} "
            f"(step {a['model_inputs']['step_ms']:.0f} ms, all-reduce "
            f"{a['model_inputs']['allreduce_ms']:.1f} ms)"
        )
    cpu = result.get("cpu_check")
    if cpu:
        print(f"\nCPU check ({cpu['what']}):")
        for c in cpu["cases"]:
            meas = "; ".join(
                f"{m['config']} {m['step_s']:.2f} s -> {100 * m['efficiency']:.0f}% ({m['file']})"
                for m in c["measured"]
            )
            print(
                f"  {c['xla_flags']}: t_c {c['t_c_s']:.2f} s + gloo {1e3 * c['allreduce_s']:.0f} "
                f"ms -> predicted {c['predicted_step_s']:.2f} s, "
                f"{100 * c['predicted_efficiency']:.1f}%; measured {meas}"
            )
        su = cpu["same_run_speedup"]
        print(
            f"  same run, 2 procs vs 1 proc x 2 threads: jddp-2x1 {su['jddp-2x1 / jddp-1x1']:.2f}x,"
            f" jddp-2x1-pin {su['jddp-2x1-pin / jddp-1x1']:.2f}x"
        )


def plot(result: dict, path: Path, fabric: Fabric, steps: dict, overlap: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(11.5, 5.2))
    colors = {
        ("resnet50", "float32"): "#1f77b4",
        ("resnet50", "bfloat16"): "#17becf",
        ("resnet18", "float32"): "#d62728",
        ("resnet18", "bfloat16"): "#ff9896",
    }
    for (model, dtype), color in colors.items():
        t_c = steps[model]["step_ms"] / 1e3
        for ov, style in ((0.0, "--"), (overlap, "-")):
            mid = [100 * e for e in curve(model, dtype, ov, t_c, fabric)]
            lo = [100 * e for e in curve(model, dtype, ov, t_c, fabric, 0)]
            hi = [100 * e for e in curve(model, dtype, ov, t_c, fabric, 2)]
            label = f"{model} {dtype} grads, {steps[model]['step_ms']:.0f} ms/step, " + (
                "no overlap" if ov == 0 else f"{ov:.0%} overlap"
            )
            ax.plot(PLOT_COUNTS, mid, style, color=color, label=label, lw=1.6)
            ax.fill_between(PLOT_COUNTS, lo, hi, color=color, alpha=0.12, lw=0)
    nv = next(a for a in result["anchors"] if "mixed" in a["anchor"])
    nv32 = next(a for a in result["anchors"] if "TF32" in a["anchor"])
    lo, hi = 100 * nv["published_efficiency"], 100 * nv32["published_efficiency"]
    ax.plot([8, 8], [lo, hi], "-", color="k", lw=1)
    ax.plot(
        [8, 8],
        [lo, hi],
        "s",
        color="k",
        ms=7,
        label=f"published: NVIDIA RN50 1->8 A100, AMP {lo:.0f}% (6.72x), TF32 {hi:.0f}% (7.72x)",
    )
    ax.plot([512], [90], "D", color="k", ms=8, label="published: Horovod 512 P100, RN101 (90%)")
    for a in result["anchors"]:
        for key, eff in a["model_efficiency"].items():
            ax.plot(
                [a["gpus"]],
                [100 * eff],
                "x" if key == "no_overlap" else "+",
                color="0.35",
                ms=9,
                mew=2,
            )
    ax.plot([], [], "x", color="0.35", mew=2, label="this model on the anchor set-up, no overlap")
    ax.plot([], [], "+", color="0.35", mew=2, label=f"... with {overlap:.0%} overlap")
    ax.axvline(8, color="0.6", lw=0.8, ls=":")
    ax.text(8.6, 71, "8 GPUs = 1 NVLink node;\nbeyond: InfiniBand", fontsize=7, color="0.4")
    ax.set_xscale("log", base=2)
    ax.set_xticks(PLOT_COUNTS, [str(n) for n in PLOT_COUNTS])
    ax.set_ylim(70, 100.5)
    ax.set_xlabel("GPUs (8 per node)")
    ax.set_ylabel("scaling efficiency, % (weak scaling, per-GPU batch fixed)")
    f = fabric
    ax.set_title(
        "MODEL, not a measurement: t_c / (t_c + exposed all-reduce). H100 step times ASSUMED.\n"
        f"NVLink busbw {f.busbw_intra[1]:.0f} ({f.busbw_intra[0]:.0f}-{f.busbw_intra[2]:.0f}) "
        f"GB/s, IB {f.busbw_inter_per_gpu[1]:.0f} ({f.busbw_inter_per_gpu[0]:.0f}-"
        f"{f.busbw_inter_per_gpu[2]:.0f}) GB/s per GPU; bands: low-high bandwidth",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def triple(text: str) -> tuple[float, float, float]:
    vals = tuple(float(x) for x in text.split(","))
    if len(vals) != 3 or not vals[0] <= vals[1] <= vals[2]:
        raise argparse.ArgumentTypeError("expected LOW,MID,HIGH in increasing order")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--resnet50-step-ms",
        type=float,
        help=f"one GPU's ResNet-50 step (default: ASSUMED {DEFAULT_RESNET50_STEP_MS} ms)",
    )
    ap.add_argument(
        "--resnet18-step-ms", type=float, help="default: ResNet-50's x 1.81/4.09 (ASSUMED)"
    )
    ap.add_argument(
        "--bench-json",
        help="a bench.py results file: its 1x1 jddp record's median replaces the assumption",
    )
    ap.add_argument("--overlap", type=float, default=0.75, help="hideable fraction (0.75)")
    ap.add_argument("--nvlink-busbw", type=triple, default=(350.0, 400.0, 450.0))
    ap.add_argument("--ib-busbw", type=triple, default=(40.0, 44.0, 48.0), help="per GPU")
    ap.add_argument("--alpha-us", default="2,5", help="latency per ring step: NVLink,IB (us)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--out", help="JSON path (default experiments/results/scaling-model-DATE)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if not 0 <= args.overlap < 1:
        ap.error("--overlap must be in [0, 1)")
    read_models()
    a_nvl, a_ib = (float(x) for x in args.alpha_us.split(","))
    fabric = Fabric(
        name="H100 SXM nodes: 8 GPUs on NVLink4/NVSwitch, one InfiniBand NDR 400 Gb/s NIC per GPU",
        gpus_per_node=8,
        busbw_intra=args.nvlink_busbw,
        busbw_inter_per_gpu=args.ib_busbw,
        alpha_intra_us=a_nvl,
        alpha_inter_us=a_ib,
        bucket_mb=args.bucket_mb,
        note="ASSUMPTIONS: NVLink4 all_reduce busbw 350-450 GB/s for large messages (nccl-tests "
        "on 8x H100 SXM; 450 GB/s per direction per GPU is the link limit); NDR 400 Gb/s = 50 "
        "GB/s raw per GPU, 40-48 GB/s busbw; ring latency per step; DDP-sized buckets",
    )
    steps = step_times(args)
    rows = gpu_rows(args, fabric, steps)
    sensitivity = []
    for factor, tree, what in (
        (0.6, False, "ResNet-50 step x 0.6 (~5,000 img/s per H100)"),
        (1.0, True, "ResNet-50, tree latency (2 log2 r steps) instead of ring"),
        (0.6, True, "ResNet-50 step x 0.6 and tree latency"),
    ):
        t_c = steps["resnet50"]["step_ms"] * factor / 1e3
        vals = {}
        for dtype in ("float32", "bfloat16"):
            for ov in (0.0, args.overlap):
                t_ar = allreduce_s(PARAMS["resnet50"] * BYTES[dtype], 512, fabric, tree=tree)
                eff = efficiency(t_c, exposed_s(t_ar, t_c, ov))
                vals[f"512 GPUs {dtype} overlap {ov}"] = f"{100 * eff:.1f}%"
        sensitivity.append({"what": what, "step_ms": 1e3 * t_c, "tree": tree, "values": vals})
    now = dt.datetime.now(dt.UTC)
    result = {
        "benchmark": "scaling-model",
        "not_a_measurement": True,
        "date_utc": now.isoformat(timespec="seconds"),
        "command": " ".join(
            [".venv/bin/python", "experiments/scaling_model.py", *(argv or sys.argv[1:])]
        ),
        "formula": {
            "efficiency": "t_c / (t_c + t_x)",
            "allreduce_intra": "2(n-1)/n * S / B_nvl + k * 2(n-1) * a_nvl, n <= 8",
            "allreduce_hierarchical": "2(g-1)/g * S / B_nvl + 2(N-1)/N * (S/g) / B_ib "
            "+ k * (2(g-1) * a_nvl + 2(N-1) * a_ib), N = n/g nodes, g = 8",
            "allreduce_if_pipelined": "2(n-1)/n * S / min(B_nvl, g * B_ib) + same latency",
            "exposed_no_overlap": "t_x = t_ar",
            "exposed_overlap": "t_x = max((1 - overlap) * t_ar, t_ar - 2/3 * t_c)",
            "latency": "ring: alpha per step, 2(r-1) steps for r ranks, once per bucket "
            "(k = ceil(S / bucket)); linear in the ranks, not log",
        },
        "assumptions": {
            "overlap": args.overlap,
            "overlap_basis": "DDP-style buckets: about one bucket in four (the first layers' "
            "gradients) is ready only when the backward pass ends; backward = 2/3 of the step",
            "step_times": steps,
            "batch_per_gpu": DEFAULT_BATCH_PER_GPU,
            "compute_dtype": "bf16 mixed precision in every GPU row; only the all-reduce "
            "dtype differs between the float32 and bfloat16 rows",
            "params": PARAMS,
        },
        "fabric": asdict(fabric),
        "rows": rows,
        "sensitivity": sensitivity,
        "anchors": anchors(args.overlap),
        "cpu_check": cpu_check(RESULTS_DIR),
    }
    print_tables(result)
    date = now.date().isoformat()
    out = Path(args.out) if args.out else RESULTS_DIR / f"scaling-model-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")
    if not args.no_plot:
        png = out.with_suffix(".png")
        if plot(result, png, fabric, steps, args.overlap):
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
