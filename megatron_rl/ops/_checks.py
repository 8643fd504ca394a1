"""Input validation shared by the fused ops and their plain-torch reference.

Every error names the argument, what was expected and what was seen, so a bad call fails at the
call site instead of deep inside a kernel or a collective.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
GROUP_MODES = ("grpo", "grpo_mean", "rloo")


def has_values(t: torch.Tensor) -> bool:
    """False while tracing (torch.compile, fake or meta tensors): value checks are skipped there."""
    return not (torch.compiler.is_compiling() or t.device.type == "meta" or is_fake(t))


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32/bfloat16/float16/float64, got {t.dtype} (shape {tuple(t.shape)})"
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def check_log_prob_args(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    vocab_size: int | None,
    vocab_total: int,
    ignore_index: int,
    check_values: bool = True,
) -> None:
    """Shapes, dtypes, temperature, vocab_size; vocab_total = global (all TP shards) vocabulary width.

    ``check_values`` also checks the label values (one host sync on a GPU); a caller
    that validated the whole batch's labels once before cutting it into micro-batches passes False.
    """
    check_tensor("logits", logits)
    check_tensor("labels", labels)
    check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError(f"logits must have a vocabulary dim, got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without its last dim "
            f"{tuple(logits.shape[:-1])} (logits {tuple(logits.shape)})"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 or int32, got {labels.dtype}")
    check_same_device(logits=logits, labels=labels)
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if logits.shape[-1] == 0:
        raise ValueError(f"logits has an empty vocabulary dim: shape {tuple(logits.shape)}")
    if vocab_size is not None and not (0 < vocab_size <= vocab_total):
        raise ValueError(
            f"vocab_size must be in [1, {vocab_total}] (the logits' global vocabulary width), got {vocab_size}"
        )
    if not check_values or not has_values(labels):
        return
    real_vocab = vocab_total if vocab_size is None else vocab_size
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= real_vocab))
    if labels.numel() and bool(bad.any()):
        first = int(bad.flatten().nonzero()[0])
        raise ValueError(
            f"labels must be in [0, {real_vocab}) or equal ignore_index={ignore_index}; "
            f"labels.flatten()[{first}] = {int(labels.flatten()[first])}"
        )


def check_label_values(
    name: str,
    labels: torch.Tensor,
    vocab_size: int,
    *,
    ignore_index: int | None = None,
    mask: torch.Tensor | None = None,
) -> None:
    """A batch's labels, checked once (by the workers, before the micro-batch split): every label (where
    ``mask`` is true, if given) is a token id in [0, vocab_size) or ignore_index.

    ONE host sync on a GPU (the ``any``), two more only to word the error: call it once per batch, not per
    micro-batch. The error names the tensor, its shape, the first offending position and its value.
    """
    check_tensor(name, labels)
    if not has_values(labels) or labels.numel() == 0:
        return
    bad = (labels < 0) | (labels >= vocab_size)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if mask is not None:
        if mask.shape != labels.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} must equal {name} shape {tuple(labels.shape)}")
        bad &= mask.bool()
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        allowed = f" or equal ignore_index={ignore_index}" if ignore_index is not None else ""
        raise ValueError(
            f"{name} must be in [0, {vocab_size}){allowed}; {name}[{', '.join(map(str, where))}] = "
            f"{int(labels[tuple(where)])} (shape {tuple(labels.shape)})"
        )


def check_gae_args(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> None:
    for name, t in (("token_level_rewards", rewards), ("values", values), ("response_mask", mask)):
        check_tensor(name, t)
        if t.dim() != 2:
            raise ValueError(f"{name} must be [B, T], got shape {tuple(t.shape)}")
    check_float("token_level_rewards", rewards)
    check_float("values", values)
    if values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(
            f"token_level_rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and "
            f"response_mask {tuple(mask.shape)} must have the same [B, T] shape"
        )
    check_same_device(token_level_rewards=rewards, values=values, response_mask=mask)
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not isinstance(v, (int, float)) or not 0.0 <= float(v) <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")


def check_masked_args(x: torch.Tensor, mask: torch.Tensor) -> None:
    check_tensor("x", x)
    check_tensor("mask", mask)
    check_float("x", x)
    if x.shape != mask.shape:
        raise ValueError(f"x shape {tuple(x.shape)} and mask shape {tuple(mask.shape)} must be equal")
    check_same_device(x=x, mask=mask)


def check_whiten_count(valid_count: float, mask: torch.Tensor) -> None:
    """verl's masked_var(unbiased=True) refuses fewer than two valid elements."""
    if valid_count == 0:
        raise ValueError(f"masked_whiten: the mask (shape {tuple(mask.shape)}) selects no element")
    if valid_count == 1:
        raise ValueError(
            f"masked_whiten: the mask (shape {tuple(mask.shape)}) selects one element; "
            "the unbiased variance needs at least two"
        )


def check_group_args(scores: torch.Tensor, group_index: torch.Tensor, mode: str, epsilon: float) -> int:
    """Returns the number of groups G = max(group_index) + 1 (0 for no scores)."""
    check_tensor("scores", scores)
    check_tensor("group_index", group_index)
    check_float("scores", scores)
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    if group_index.shape != scores.shape:
        raise ValueError(
            f"group_index shape {tuple(group_index.shape)} must equal scores shape {tuple(scores.shape)}"
        )
    if group_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"group_index must be int64 or int32, got {group_index.dtype}")
    check_same_device(scores=scores, group_index=group_index)
    if mode not in GROUP_MODES:
        raise ValueError(f"mode must be one of {GROUP_MODES}, got {mode!r}")
    if not isinstance(epsilon, (int, float)) or epsilon < 0:
        raise ValueError(f"epsilon must be a non-negative number, got {epsilon!r}")
    if group_index.numel() == 0:
        return 0
    low, high = int(group_index.min()), int(group_index.max())
    if low < 0 or high >= group_index.numel():
        raise ValueError(
            f"group_index must be dense ids in [0, B={group_index.numel()}), got values in [{low}, {high}]; "
            "map uids to ids with torch.unique(..., return_inverse=True) or numpy.unique"
        )
    return high + 1
