"""Finds the compiled kernels (`megatron_rl._C`, ops under torch.ops.megatron_rl) for a tensor's device.

When the extension is missing, or was built without CUDA and a CUDA tensor arrives, the ops fall back to
`megatron_rl.ops.reference` with one warning per reason. Fake kernels registered here give every op an
output shape without running it, for torch.compile and FakeTensor tracing.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

import torch

BUILD_HINT = "build it with `pip install --no-build-isolation -e .` (see docs/kernels.md)"


@functools.cache
def _load() -> ModuleType | None:
    try:  # the compiled kernels are optional (an unbuilt checkout): loaded at first use, with one warning
        from megatron_rl import _C
    except ImportError as err:
        warnings.warn(
            f"megatron_rl._C is not available ({err}); megatron_rl.ops uses the slow plain-torch reference. "
            + BUILD_HINT,
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    _register_fakes()
    return _C


@functools.cache
def _warn_no_kernels_for(device_type: str) -> None:
    warnings.warn(
        f"megatron_rl._C has no {device_type} kernels (cuda_compiled={_load().cuda_compiled}); megatron_rl.ops "
        f"uses the plain-torch reference for {device_type} tensors. Rebuild on a machine with nvcc and a CUDA "
        "torch, or set MEGATRON_RL_BUILD_CUDA=1 to make a missing toolchain an error.",
        RuntimeWarning,
        stacklevel=3,
    )


def kernels_for(t: torch.Tensor):
    """torch.ops.megatron_rl when compiled kernels serve `t`'s device, else None (after one warning)."""
    ext = _load()
    if ext is None:
        return None
    device_type = t.device.type
    if device_type in ("cpu", "meta") or (device_type == "cuda" and ext.cuda_compiled):
        return torch.ops.megatron_rl
    _warn_no_kernels_for(device_type)
    return None


def backend_summary() -> str:
    """One line for logs: which kernels megatron_rl.ops runs on this machine."""
    ext = _load()
    if ext is None:
        return "plain-torch reference (megatron_rl._C not built)"
    return f"compiled: cpu ({ext.cpu_isa()})" + (", cuda" if ext.cuda_compiled else "")


def release_cpu_cache() -> int:
    """Frees the large CPU outputs' blocks (log-prob gradients, broadcast advantages) that the kernels keep
    for the next step's outputs (at most two); returns their bytes (0 without the extension)."""
    ext = _load()
    return 0 if ext is None else ext.release_cpu_cache()


@functools.cache  # once per process, even if _load's cache is cleared
def _register_fakes() -> None:
    def acc_dtype(logits: torch.Tensor) -> torch.dtype:
        return torch.float64 if logits.dtype == torch.float64 else torch.float32

    @torch.library.register_fake("megatron_rl::log_prob_stats")
    def _(logits, labels, vocab_start, valid_width, inv_temperature, ignore_index):
        return logits.new_empty((logits.shape[0], 4), dtype=acc_dtype(logits))

    @torch.library.register_fake("megatron_rl::log_prob_merge")
    def _(stats, labels, ignore_index):
        return tuple(stats.new_empty(stats.shape[1]) for _ in range(4))

    @torch.library.register_fake("megatron_rl::log_prob_backward")
    def _(
        logits,
        labels,
        row_max,
        log_sum,
        entropy,
        grad_log_probs,
        grad_entropy,
        vocab_start,
        valid_width,
        inv_temperature,
        ignore_index,
    ):
        return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)

    @torch.library.register_fake("megatron_rl::masked_gae")
    def _(token_level_rewards, values, response_mask, gamma, lam):
        return tuple(
            token_level_rewards.new_empty(token_level_rewards.shape, dtype=torch.float32) for _ in range(2)
        )

    @torch.library.register_fake("megatron_rl::masked_whiten")
    def _(x, mask, shift_mean):
        return x.new_empty(x.shape, dtype=torch.float32)

    @torch.library.register_fake("megatron_rl::group_normalize")
    def _(scores, group_index, num_groups, mode, epsilon):
        return scores.new_empty(scores.shape, dtype=torch.float32)

    @torch.library.register_fake("megatron_rl::masked_broadcast")
    def _(values, mask):
        return mask.new_empty(mask.shape, dtype=torch.float32)

    @torch.library.register_fake("megatron_rl::row_sums")
    def _(x):
        return x.new_empty(x.shape[:1], dtype=torch.float32)
