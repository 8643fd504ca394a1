"""A checkpoint write that runs out of disk says so (issue 33): the device, the path and "No space left on
device", where torch's writer reports it as ``[enforce fail at inline_container.cc] ... unexpected pos 704 vs
598`` (its stream writer turns ENOSPC into a size mismatch) or Megatron wraps it in its own error.

``checked_save`` checks the free space against this rank's share of the state before writing (a run that would
fill the disk fails before it half-writes anything) and turns a failure of the write into ``OSError(ENOSPC)``
when the file system is full (or the error says so).
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Callable

# Below this many free bytes after a failed write, the failure is taken to be the full disk.
NEARLY_FULL_BYTES = 1 << 20
FULL_DISK_SIGNS = ("No space left on device", "unexpected pos", "file write failed", "ENOSPC")


def _device_of(path: Path) -> str:
    """``<device> mounted at <mount point>`` for ``path``'s file system (from /proc/mounts), else the mount point."""
    path = path.resolve()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    best, device = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2:
                    mount = parts[1].replace("\\040", " ")
                    if (str(probe) == mount or str(probe).startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                        best, device = mount, parts[0]
    except OSError:
        pass
    return f"{device} mounted at {best}" if device else str(probe)


def _free_bytes(path: Path) -> int | None:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (sharded) state dict: what this rank writes, roughly."""
    import torch

    total, stack, seen = 0, [state], set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "data") and isinstance(getattr(item, "data", None), torch.Tensor):  # ShardedTensor
            stack.append(item.data)
    return total


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.2f} MiB"


def full_disk_error(directory: Path, needed: int | None = None, free: int | None = None) -> OSError:
    detail = f"; about {_gib(needed)} to write on this rank, {_gib(free)} free" if needed is not None and \
        free is not None else (f"; {_gib(free)} free" if free is not None else "")
    return OSError(errno.ENOSPC, f"No space left on device: writing the checkpoint {directory} on "
                   f"{_device_of(directory)}{detail}; free space there or point trainer.default_local_dir at a larger "
                   f"disk", str(directory))


def checked_save(save: Callable[[Any, str], Any], state: Any, directory: str | os.PathLike) -> None:
    """``save(state, str(directory))``, with the disk's free space checked before and a full disk named after."""
    directory = Path(directory)
    needed, free = state_bytes(state), _free_bytes(directory)
    if free is not None and needed > free:
        raise full_disk_error(directory, needed, free)
    try:
        save(state, str(directory))
    except Exception as err:
        free_after = _free_bytes(directory)
        is_enospc = isinstance(err, OSError) and err.errno == errno.ENOSPC
        text = f"{err} {err.__cause__ or ''}"
        if is_enospc or (free_after is not None and free_after < NEARLY_FULL_BYTES) or \
                any(sign in text for sign in FULL_DISK_SIGNS[:1]):
            raise full_disk_error(directory, free=free_after) from err
        if any(sign in text for sign in FULL_DISK_SIGNS[1:]) and free_after is not None and \
                free_after < max(needed, NEARLY_FULL_BYTES):
            raise full_disk_error(directory, needed, free_after) from err
        raise
