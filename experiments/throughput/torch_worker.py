"""One PyTorch DDP worker process: the peer in ``experiments/peers/torch_ddp.py``, serving the
driver's timing commands (:mod:`.protocol`)."""

from __future__ import annotations

import os
import sys

from .common import PEERS_DIR
from .protocol import send, serve, threads_now
from .specs import Workload


def worker_torch(spec: dict) -> None:
    """One PyTorch DDP process (the peer in ``experiments/peers/torch_ddp.py``)."""
    sys.path.insert(0, str(PEERS_DIR))
    import torch
    import torch.distributed as dist
    import torch_ddp

    w = Workload(**spec["work"])
    cfg = torch_ddp.PeerConfig(
        model=w.model,
        stem=w.stem,
        width=w.width,
        num_classes=w.num_classes,
        image_size=w.image_size,
        global_batch=w.global_batch,
        dtype=w.dtype,
        device="cuda" if w.platform == "gpu" else "cpu",
        threads=spec["threads"],
    )
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

    send(
        {
            "rank": runner.rank,
            "compile_s": None,
            "warmup_s": [t for t, _ in warm],
            "warmup_loss": [loss for _, loss in warm],
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "threads": threads_now(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "backend": dist.get_backend(),
            "mkldnn": torch.backends.mkldnn.is_available(),
        }
    )

    def finish() -> dict:
        dist.destroy_process_group()
        return {}

    serve(runner.step, profile_once, finish)
