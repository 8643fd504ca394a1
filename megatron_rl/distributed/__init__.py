"""Process-group and Megatron parallel-state set-up, plus the CPU compatibility layer."""

from megatron_rl.distributed.cpu_compat import CpuCompatHandle, cpu_compat_installed, install_cpu_compat
from megatron_rl.distributed.model_parallel import (
    ParallelLayout,
    check_parallel_sizes,
    destroy_model_parallel,
    init_model_parallel,
)
from megatron_rl.distributed.process_group import LaunchEnv, init_distributed, read_launch_env
from megatron_rl.distributed.spawn import free_port, run_multiprocess

__all__ = [
    "CpuCompatHandle",
    "LaunchEnv",
    "ParallelLayout",
    "check_parallel_sizes",
    "cpu_compat_installed",
    "destroy_model_parallel",
    "free_port",
    "init_distributed",
    "init_model_parallel",
    "install_cpu_compat",
    "read_launch_env",
    "run_multiprocess",
]
