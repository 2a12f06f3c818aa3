"""One PyTorch DDP worker process: the peer in ``experiments/peers/torch_ddp.py``, serving the
driver's timing commands (:mod:`.protocol`)."""

from __future__ import annotations

import os
import sys

from .common import PEERS_DIR
from .protocol import send, serve, threads_now
from .specs import Workload


def peer_options(spec: dict) -> dict:
    """``PeerConfig`` fields of one worker. On CPU the model written out in the peer, as the CPU
    results were measured; on GPU what users run there: torchvision's model, ``channels_last``,
    ``cudnn.benchmark`` (bf16 autocast is the peer's ``bfloat16`` either way). ``-compile``:
    ``torch.compile``."""
    w = Workload(**spec["work"])
    gpu = w.platform == "gpu"
    return dict(
        model=w.model,
        stem=w.stem,
        width=w.width,
        num_classes=w.num_classes,
        image_size=w.image_size,
        global_batch=w.global_batch,
        dtype=w.dtype,
        device="cuda" if gpu else "cpu",
        threads=spec["threads"],
        impl="torchvision" if gpu else "own",
        channels_last=gpu,
        cudnn_benchmark=gpu,
        compile="compile" in (spec.get("variant") or "").split("-"),
    )


def _ready(runner, warm: list) -> dict:
    import torch
    import torch.distributed as dist

    cfg = runner.cfg
    return {
        "rank": runner.rank,
        "compile_s": None,  # eager; torch.compile compiles inside the 1st warm-up step
        "warmup_s": [t for t, _ in warm],
        "warmup_loss": [loss for _, loss in warm],
        "model_impl": runner.model_impl,
        "torch_compile": cfg.compile,
        "channels_last": cfg.channels_last,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device_name": torch.cuda.get_device_name() if cfg.device == "cuda" else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "threads": threads_now(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "backend": dist.get_backend(),
        "mkldnn": torch.backends.mkldnn.is_available(),
    }


def worker_torch(spec: dict) -> None:
    """One PyTorch DDP process (the peer in ``experiments/peers/torch_ddp.py``)."""
    sys.path.insert(0, str(PEERS_DIR))
    import torch.distributed as dist
    import torch_ddp

    cfg = torch_ddp.PeerConfig(**peer_options(spec))
    torch_ddp.set_threads(cfg.threads)
    torch_ddp.init_process_group(cfg.device)
    runner = torch_ddp.DDPRunner(cfg)
    warm = [runner.step() for _ in range(spec["warmup"])]

    def profile_once() -> dict:
        from torch.profiler import ProfilerActivity, profile

        from .breakdown import torch_profile_breakdown

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t, _ = runner.step()
        if runner.rank != 0:
            return {"step_s": t}
        return {"step_s": t, **torch_profile_breakdown(prof)}

    send(_ready(runner, warm))

    def finish() -> dict:
        dist.destroy_process_group()
        return {}

    serve(runner.step, profile_once, finish)
