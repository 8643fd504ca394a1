"""Start Ray for the driver: an embedded local instance by default, an existing cluster when asked."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import ray

import megatron_rl

__all__ = ["NOSET_CUDA_VISIBLE_DEVICES", "init_ray", "init_ray_from_config", "shutdown_ray"]

NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def _package_root() -> str | None:
    """The directory holding the megatron_rl package when it runs from a source tree (not site-packages)."""
    root = Path(megatron_rl.__file__).resolve().parents[1]
    return None if root.name in ("site-packages", "dist-packages") else str(root)


def _worker_pythonpath(user_value: str | None) -> str:
    """Workers must import megatron_rl (and the driver's own modules) even when it is not installed."""
    entries = [_package_root(), user_value, os.environ.get("PYTHONPATH")]
    parts: list[str] = []
    for entry in entries:
        for part in (entry or "").split(os.pathsep):
            if part and part not in parts:
                parts.append(part)
    return os.pathsep.join(parts)


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    runtime_env: Mapping[str, Any] | None = None,
    **ray_kwargs: Any,
) -> None:
    """Start an embedded local Ray (``address=None``) or connect to a running cluster (``"auto"`` for
    the one ``ray start`` launched on this node, ``"host:6379"``, ``"ray://host:10001"``). Does nothing
    when Ray is already initialised in this process.

    No dashboard (start-up time, ports); worker output is forwarded to the driver's console; workers
    get PYTHONPATH so they import this package from a source checkout, and see every GPU of their node
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``). ``runtime_env`` is merged
    (its PYTHONPATH entries come after the package's); other keyword arguments go to ``ray.init``.
    """
    if address is not None and num_cpus is not None:
        raise ValueError(f"ray_init.num_cpus={num_cpus} applies only to a local Ray; the cluster at "
                         f"ray_init.address={address!r} already has its resources. Remove one of them")
    if ray.is_initialized():
        return
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars["PYTHONPATH"] = _worker_pythonpath(env_vars.get("PYTHONPATH"))
    # Every worker sees all GPUs of its node: an SGLang engine of rollout TP k spans k of them from one
    # process. Ranks bind the GPU Ray assigned them (worker_group._ray_place_env), not device 0.
    env_vars.setdefault(NOSET_CUDA_VISIBLE_DEVICES, "1")
    env["env_vars"] = env_vars
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "runtime_env": env}
    options |= ray_kwargs
    if address is None:
        # "local" always starts a fresh instance; plain ray.init() would join whatever Ray another
        # program on this machine last started
        ray.init(address="local", num_cpus=num_cpus, **options)
    else:
        ray.init(address=address, **options)


def init_ray_from_config(ray_init: Any) -> None:
    """``init_ray`` with the run's ``ray_init`` section (address, num_cpus, num_gpus); nothing when Ray is up."""
    gpus = {} if ray_init.num_gpus is None else {"num_gpus": ray_init.num_gpus}
    init_ray(ray_init.address, ray_init.num_cpus, **gpus)


def shutdown_ray() -> None:
    """Stop the local Ray (or disconnect from the cluster); safe to call when Ray is not running."""
    if ray.is_initialized():
        ray.shutdown()
