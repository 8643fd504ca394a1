"""Make the SGLang stand-in (tests/stand_ins/sglang) the ``sglang`` of this process and of the processes it
starts, for the duration of a test module or test; put everything back afterwards.

Loaded from its file by tests/support/megatron_rl_testing/rollout_fixtures.py (this folder is on sys.path
only inside such a block, so no test picks the stand-in up by accident).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

STAND_INS = Path(__file__).resolve().parent
ENV_KEYS = (
    "SGLANG_STAND_IN_ROOT",
    "SGLANG_STAND_IN_NODE",
    "SGLANG_STAND_IN_GPUS_PER_NODE",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH",
    "CUDA_VISIBLE_DEVICES",
    "MEGATRON_RL_DEVICE_INDEX",
    "PYTHONPATH",
)


def _remove_orphaned_shared_memory() -> None:
    """Payload buffers travel as /dev/shm/torch_<pid>_* files (sharing strategy file_system); a rank killed
    with its process group takes torch's shm manager along, which would have unlinked them."""
    for path in Path("/dev/shm").glob("torch_*_*"):
        pid = path.name.split("_")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def sglang_stand_in(root: Path, gpus_per_node: int = 4, **env: str) -> Iterator[Path]:
    """The stand-in as ``sglang``: its GPU registry under ``root``, ``gpus_per_node`` GPUs per node."""
    saved_env = {k: os.environ.get(k) for k in (*ENV_KEYS, *env)}
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGQUIT)}
    # Engine() writes variables and the start method into its caller (as 0.5.23 does): none of it outlives the block
    whole_env = dict(os.environ)
    start_method = multiprocessing.get_start_method(allow_none=True)
    sharing = torch.multiprocessing.get_sharing_strategy()
    for key in ENV_KEYS:
        os.environ.pop(key, None)
    os.environ.update(
        SGLANG_STAND_IN_ROOT=str(root),
        SGLANG_STAND_IN_GPUS_PER_NODE=str(gpus_per_node),
        PYTHONPATH=os.pathsep.join(filter(None, [str(STAND_INS), saved_env["PYTHONPATH"]])),
        **env,
    )
    sys.path.insert(0, str(STAND_INS))
    try:
        yield root
    finally:
        _remove_orphaned_shared_memory()
        sys.path.remove(str(STAND_INS))
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        torch.multiprocessing.set_sharing_strategy(sharing)
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for key in [k for k in os.environ if k not in whole_env]:
            del os.environ[key]
        os.environ.update(whole_env)
        multiprocessing.set_start_method(start_method, force=True)
