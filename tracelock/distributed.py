"""Running a command under torchrun: read the launcher's environment, join the gloo group for the command's life."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def torchrun_group(device: str = "cpu"):
    """Yield ``(rank, world_size, device)`` from torchrun's RANK / WORLD_SIZE / LOCAL_RANK.

    The gloo group is joined only when WORLD_SIZE > 1 (a plain run needs none) and left on exit, also on error.
    ``device="cuda"`` becomes ``cuda:LOCAL_RANK`` under torchrun.
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device == "cuda" and world > 1:
        device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    if world == 1:
        yield rank, world, device
        return
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        yield rank, world, device
    finally:
        dist.destroy_process_group()
