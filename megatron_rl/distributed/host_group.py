"""A CPU (gloo) process group to wait on, not to move data: ranks waiting for work only some of them do (the
leaders building their rollout engines, the leaders generating) wait here, with a long timeout, instead of in
the next NCCL collective, whose timeout (10 minutes, then the watchdog ends the job) a cold engine build or a
long generation can pass. Once every rank has arrived, the real collective starts with nobody left waiting.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["HOST_WAIT_TIMEOUT", "new_host_group", "wait_for_all"]

#: how long a rank waits for the others at a host barrier: longer than any engine build or generation call
#: (the 70B preset's derived generate deadline is about 1.6 h, controller/deadlines.py)
HOST_WAIT_TIMEOUT = timedelta(hours=6)


def new_host_group(timeout: timedelta = HOST_WAIT_TIMEOUT) -> dist.ProcessGroup | None:
    """A gloo group of the whole world (``new_group`` is a collective: every rank calls this, in the same order
    as its other group creations); None without a multi-rank process group."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


def wait_for_all(group: dist.ProcessGroup | None, what: str) -> None:
    """Every rank of ``group`` waits here until all have arrived (``what``: what the slowest is doing)."""
    if group is None:
        return
    try:
        dist.barrier(group=group)
    except RuntimeError as exc:
        raise RuntimeError(f"rank {dist.get_rank()} waited for all ranks ({what}) and gave up: {exc}") from exc
