"""Process-group and Megatron parallel-state set-up, plus the CPU compatibility layer."""

from importlib import import_module
from typing import Any

# Imported at first use (PEP 562): a process that needs one light module (ports, for a Ray task picking a
# MASTER_PORT) does not import torch and Megatron-Core through this file.
_EXPORTS = {
    "CpuCompatHandle": "cpu_compat", "cpu_compat_installed": "cpu_compat", "install_cpu_compat": "cpu_compat",
    "ParallelLayout": "model_parallel", "check_parallel_sizes": "model_parallel",
    "destroy_model_parallel": "model_parallel", "init_model_parallel": "model_parallel",
    "LaunchEnv": "process_group", "init_distributed": "process_group", "read_launch_env": "process_group",
    "free_port": "ports", "run_multiprocess": "spawn", "save_sharded": "sharded_save",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
