"""What a GPU cluster has and a CPU box lacks: nodes, physical GPUs, and one scheduler per GPU.

Environment (read when an Engine is built or a payload is serialized):
- ``SGLANG_STAND_IN_ROOT``: directory of the per-node GPU registry and the logs (required by Engine);
- ``SGLANG_STAND_IN_NODE``: node identity (default: the hostname);
- ``SGLANG_STAND_IN_GPUS_PER_NODE``: physical GPUs on the node (default 8);
- ``CUDA_VISIBLE_DEVICES``: visible physical ids (default: all);
- ``MEGATRON_RL_DEVICE_INDEX``: the process's current device index (default 0 = visible[0]).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "SGLANG_STAND_IN_ROOT"
NODE_ENV = "SGLANG_STAND_IN_NODE"
GPUS_ENV = "SGLANG_STAND_IN_GPUS_PER_NODE"
DEVICE_INDEX_ENV = "MEGATRON_RL_DEVICE_INDEX"


@dataclass(frozen=True)
class ProducerTag:
    """Where a serialized payload was made: like a CUDA IPC handle, it names the producer's GPU."""

    node: str
    physical_gpu: int
    pid: int


def node_name() -> str:
    return os.environ.get(NODE_ENV) or socket.gethostname()


def gpus_per_node() -> int:
    return int(os.environ.get(GPUS_ENV, "8"))


def visible_devices() -> list[int]:
    """Physical GPU ids this process can see (CUDA_VISIBLE_DEVICES, else all of the node's)."""
    total = gpus_per_node()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(total))
    ids = [int(x) for x in raw.split(",") if x.strip() != ""]
    bad = [i for i in ids if not 0 <= i < total]
    if bad:
        raise RuntimeError(
            f"CUDA_VISIBLE_DEVICES={raw} names GPUs {bad} but node {node_name()} has {total} "
            f"({GPUS_ENV}={total})"
        )
    return ids


def current_physical_gpu() -> int:
    """The physical GPU of this process's current device (torch.cuda.current_device() on a cluster)."""
    visible = visible_devices()
    index = int(os.environ.get(DEVICE_INDEX_ENV, "0"))
    if not 0 <= index < len(visible):
        raise RuntimeError(
            f"{DEVICE_INDEX_ENV}={index} but only {len(visible)} GPUs are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"
        )
    return visible[index]


def producer_tag() -> ProducerTag:
    return ProducerTag(node_name(), current_physical_gpu(), os.getpid())


def stand_in_root() -> Path:
    root = os.environ.get(ROOT_ENV)
    if not root:
        raise RuntimeError(
            f"the SGLang stand-in needs {ROOT_ENV} (a directory for its per-node GPU registry and logs)"
        )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_gpu(root: Path, node: str, gpu: int, engine_id: str, rank: int) -> Path:
    """Claim one physical GPU of a node for one scheduler (a second live claim is an error)."""
    folder = root / node
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"gpu{gpu}"
    record = json.dumps({"pid": os.getpid(), "engine_id": engine_id, "tp_rank": rank})
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                owner = {}
            pid = owner.get("pid")
            if isinstance(pid, int) and not _alive(pid):
                try:
                    path.unlink()  # stale claim of a dead process
                except FileNotFoundError:
                    pass
                continue
            raise RuntimeError(
                f"GPU {gpu} on node {node} already holds an SGLang scheduler (owner pid {pid}, engine "
                f"{owner.get('engine_id')}, tp rank {owner.get('tp_rank')}); one scheduler per GPU — "
                f"registry file {path}"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(record)
        return path
    raise RuntimeError(f"could not claim GPU {gpu} on node {node} ({path})")


def release_gpu(path: Path, engine_id: str) -> None:
    try:
        owner = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return
    if owner.get("engine_id") == engine_id:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------------------------- trainer cache
# torch's caching allocator in the trainer processes that share a GPU with a scheduler: memory training freed
# stays reserved by that process until it calls torch.cuda.empty_cache(). On a GPU the engine's resume of the
# KV cache and CUDA graphs then runs out of memory; here a scheduler refuses the resume while any live process
# holds cache on its GPU (stricter: no headroom at all). Records: <root>/<node>/trainer_cache/gpu<g>.<pid>.
TRAINER_CACHE_DIR = "trainer_cache"


def _trainer_cache_folder(root: Path, node: str) -> Path:
    return root / node / TRAINER_CACHE_DIR


def hold_trainer_cache(nbytes: int) -> None:
    """Test hook, in a trainer process: its training left ``nbytes`` reserved but free on its current GPU. From
    now on this process's ``torch.cuda.empty_cache()`` gives them back (and nothing else does)."""
    import torch

    folder = _trainer_cache_folder(stand_in_root(), node_name())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"gpu{current_physical_gpu()}.{os.getpid()}").write_text(str(int(nbytes)))
    empty_cache = torch.cuda.empty_cache
    if getattr(empty_cache, "stand_in_model", False):
        return

    def empty_cache_model() -> None:
        empty_cache()
        for path in _trainer_cache_folder(stand_in_root(), node_name()).glob(f"gpu*.{os.getpid()}"):
            path.unlink(missing_ok=True)

    empty_cache_model.stand_in_model = True
    torch.cuda.empty_cache = empty_cache_model


def trainer_cache_on(root: Path, node: str, gpu: int) -> dict[int, int]:
    """pid -> bytes held reserved by live trainer processes on one GPU."""
    held: dict[int, int] = {}
    for path in _trainer_cache_folder(root, node).glob(f"gpu{gpu}.*"):
        pid = int(path.suffix[1:])
        try:
            nbytes = int(path.read_text() or 0)
        except (OSError, ValueError):
            continue
        if nbytes > 0 and _alive(pid):
            held[pid] = nbytes
    return held
