"""Per-token on-policy distillation losses with verl 0.9.1's loss modes, clamps and metric names.

The student samples, a teacher scores the student's tokens, and the student minimises a per-token
divergence to the teacher (``distillation.distillation_loss.*`` in verl's config):

- ``forward_kl_topk``: KL(teacher || student) over the teacher's top-k tokens at each position,
  sum_k q_k (log q_k - log p_k), from the student's logits (softmax over the whole vocabulary, which
  tensor parallelism may split: ``tp_group``) and the teacher's top-k ids and log-probs. Negative
  values (both distributions are truncated to k tokens) are clamped to 0, as verl does.
- ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``: a single-sample estimate of the reverse
  KL(student || teacher) from the sampled token's log-probs (algos.kl.kl_penalty).

``compute_distillation_loss`` then clamps each token's loss to [-loss_max_clamp, loss_max_clamp] and
either aggregates it as a supervised loss (loss_agg.agg_loss) or, with ``use_policy_gradient``, feeds its
negative as the advantage of the vanilla PPO loss. ``combine_with_task_loss`` mixes in the task-reward
policy loss (``use_task_rewards``, ``distillation_loss_coef``). ``teacher_topk`` is the teacher's side of
forward_kl_topk. The actor's update calls them (workers/actor.py), the teacher scores in workers/teacher.py.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.algos._checks import check_token_tensors
from megatron_rl.algos.config_view import by_attribute
from megatron_rl.algos.kl import kl_penalty
from megatron_rl.algos.loss_agg import LOCAL_BATCH, GlobalBatchInfo, agg_loss
from megatron_rl.algos.policy_loss_clip import compute_policy_loss_vanilla
from megatron_rl.algos.policy_loss_config import PolicyLossConfig

TOPK_MODES = ("forward_kl_topk",)
ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
DISTILLATION_LOSS_MODES = TOPK_MODES + ESTIMATOR_MODES
_KEY = "distillation.distillation_loss"


@dataclass(frozen=True)
class DistillationLossConfig:
    """verl's ``distillation.distillation_loss`` keys, with the defaults of verl 0.9.1's distillation.yaml
    (what a verl run gets; verl's dataclass defaults differ: topk 128, clamps 10 / -10, use_policy_gradient).

    loss_mode: one of DISTILLATION_LOSS_MODES. topk: the teacher's top-k width (forward_kl_topk).
    use_task_rewards / distillation_loss_coef: add the task-reward policy loss, the distillation loss
        weighted by the coefficient (``combine_with_task_loss``).
    loss_max_clamp: each token's loss clamped to [-c, c] (the minimum is for k1, which can be negative).
    log_prob_min_clamp: top-k log-probs of student and teacher clamped from below (forward_kl_topk).
    use_policy_gradient: the negative per-token loss is the advantage of the PPO loss (policy_loss_mode
        "vanilla", the only one verl takes, with clip_ratio / clip_ratio_low / clip_ratio_high).
    """

    loss_mode: str = "k3"
    topk: Optional[int] = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = None
    log_prob_min_clamp: Optional[float] = None
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self) -> None:
        if self.loss_mode not in DISTILLATION_LOSS_MODES:
            raise ValueError(
                f"unknown {_KEY}.loss_mode {self.loss_mode!r}; known: {list(DISTILLATION_LOSS_MODES)}"
            )
        if self.policy_loss_mode != "vanilla":
            raise ValueError(
                f"{_KEY}.policy_loss_mode={self.policy_loss_mode!r}: only 'vanilla' is supported (as in verl)"
            )
        if not self.use_policy_gradient and self.loss_mode == "k1":
            raise ValueError(
                f"{_KEY}.loss_mode='k1' needs use_policy_gradient=true: the gradient of k1 (log p - log q) "
                "w.r.t. the student does not depend on the teacher"
            )
        bad_topk = isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1
        if self.loss_mode in TOPK_MODES and bad_topk:
            raise ValueError(
                f"{_KEY}.topk must be a positive int for loss_mode={self.loss_mode!r}, got {self.topk!r}"
            )
        if self.loss_max_clamp is not None and not self.loss_max_clamp > 0:
            raise ValueError(f"{_KEY}.loss_max_clamp must be > 0 or null (off), got {self.loss_max_clamp}")

    @property
    def uses_topk(self) -> bool:
        return self.loss_mode in TOPK_MODES

    @classmethod
    def from_config(cls, section: object) -> DistillationLossConfig:
        """Read the keys of the same names from ``distillation.distillation_loss`` of any shape (ours, verl's
        DistillationLossConfig, a DictConfig, a dict); keys it lacks keep their defaults."""
        if isinstance(section, cls):
            return section
        section = by_attribute(section)
        values = {f.name: getattr(section, f.name) for f in fields(cls) if hasattr(section, f.name)}
        return cls(**values)


# ---------------------------------------------------------------- student log-probs, vocabulary TP-split


def _shard(
    logits: torch.Tensor, tp_group: Optional[dist.ProcessGroup], vocab_size: Optional[int]
) -> tuple[int, int, int]:
    """(global vocabulary, this shard's first id, its columns inside the real vocabulary)."""
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    width = logits.shape[-1]
    vocab = width * world if vocab_size is None else vocab_size
    if not 0 < vocab <= width * world:
        raise ValueError(
            f"vocab_size={vocab_size} must be in [1, {width * world}] (the logits' {world} x {width} columns)"
        )
    start = rank * width
    return vocab, start, min(width, max(0, vocab - start))


def _masked_float_logits(logits: torch.Tensor, valid_width: int) -> torch.Tensor:
    x = logits.float()
    if valid_width < x.shape[-1]:  # padded vocabulary columns are outside the softmax
        x = x.clone()
        x[..., valid_width:] = float("-inf")
    return x


class _TopkLogProbs(torch.autograd.Function):
    """log softmax(logits)[ids] over a vocabulary split across ``tp_group``, fp32, replicated on every rank.

    Forward: max and sum-exp all-reduced over the shards, the picked logits summed (each id lives on
    one shard). Backward needs no collective: the loss downstream is replicated, so each rank's gradient
    is its own columns of dL/dz_j = g_j - p_j * sum_k g_k, g_j the upstream gradient summed over the
    k slots holding id j.
    """

    @staticmethod
    def forward(ctx, logits, ids, start, valid_width, tp_group):
        x = _masked_float_logits(logits, valid_width)
        row_max = x.max(dim=-1).values
        if tp_group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        sum_exp = torch.exp(x - row_max.unsqueeze(-1)).sum(dim=-1)
        if tp_group is not None:
            dist.all_reduce(sum_exp, group=tp_group)
        log_z = row_max + sum_exp.log()
        local = (ids >= start) & (ids < start + valid_width)
        local_ids = torch.where(local, ids - start, torch.zeros_like(ids))
        picked = torch.where(local, x.gather(-1, local_ids), torch.zeros((), dtype=x.dtype, device=x.device))
        if tp_group is not None:
            dist.all_reduce(picked, group=tp_group)
        ctx.save_for_backward(logits, log_z, local_ids, local)
        ctx.valid_width = valid_width
        return picked - log_z.unsqueeze(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logits, log_z, local_ids, local = ctx.saved_tensors
        probs = torch.exp(_masked_float_logits(logits, ctx.valid_width) - log_z.unsqueeze(-1))
        grad_logits = -probs * grad.sum(dim=-1, keepdim=True)
        grad_logits.scatter_add_(-1, local_ids, grad * local)
        return grad_logits.to(logits.dtype), None, None, None, None


def topk_log_probs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """The student's log-probs [..., K] (fp32) at global token ``ids`` [..., K], from ``logits``
    [..., V_local]: the whole vocabulary, or with ``tp_group`` rank r's shard of global ids
    [r*V_local, (r+1)*V_local).
    Columns >= ``vocab_size`` (Megatron's vocabulary padding) are outside the softmax; None keeps them all,
    as verl does. Differentiable w.r.t. the logits."""
    vocab, start, valid_width = _shard(logits, tp_group, vocab_size)
    _check_ids("teacher_topk_ids", ids, vocab)
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    return _TopkLogProbs.apply(logits, ids.long(), start, valid_width, tp_group if world > 1 else None)


def _topk_ids(
    logits: torch.Tensor, k: int, tp_group: Optional[dist.ProcessGroup], start: int, valid_width: int
) -> torch.Tensor:
    """Global ids of the k most likely tokens of a vocabulary split across ``tp_group`` (no gradient): the
    student's own top-k (overlap diagnostics) and the teacher's (``teacher_topk``)."""
    with torch.no_grad():
        x = _masked_float_logits(logits, valid_width)
        values, ids = torch.topk(x, k=min(k, x.shape[-1]), dim=-1)
        ids = ids + start
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            world = dist.get_world_size(tp_group)
            all_values = [torch.empty_like(values) for _ in range(world)]
            all_ids = [torch.empty_like(ids) for _ in range(world)]
            dist.all_gather(all_values, values.contiguous(), group=tp_group)
            dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
            values, ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)
            ids = ids.gather(-1, torch.topk(values, k=k, dim=-1).indices)
        return ids


def teacher_topk(
    logits: torch.Tensor,
    k: int,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k at each position: (global ids [..., k] int64, their log-probs [..., k] fp32, highest
    first), from ``logits`` [..., V_local] split over ``tp_group`` as ``topk_log_probs`` takes them (no gradient:
    the teacher is frozen). What forward_kl_topk reads as ``teacher_topk_ids`` / ``teacher_topk_log_probs``."""
    vocab, start, valid_width = _shard(logits, tp_group, vocab_size)
    if not 0 < k <= vocab:
        raise ValueError(f"{_KEY}.topk={k} must be in [1, {vocab}] (the vocabulary)")
    with torch.no_grad():
        ids = _topk_ids(logits, k, tp_group, start, valid_width)
        world = 1 if tp_group is None else dist.get_world_size(tp_group)
        log_probs = _TopkLogProbs.apply(logits, ids, start, valid_width, tp_group if world > 1 else None)
    return ids, log_probs


def _check_ids(name: str, ids: torch.Tensor, vocab: int) -> None:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{name} holds ids outside [0, {vocab}) (min {int(ids.min())}, max {int(ids.max())})"
        )


# ---------------------------------------------------------------- per-token losses


def forward_kl_topk(
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    *,
    log_prob_min_clamp: Optional[float] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """Per-token KL(teacher || student) over the teacher's top-k, before verl's clamp at 0.

    student_logits [B, T, V_local] (with ``tp_group``, this rank's vocabulary shard); teacher_topk_ids and
    teacher_topk_log_probs [B, T, K], global ids. With log_prob_min_clamp both top-k log-probs are clamped
    from below first (a clamped student entry passes no gradient). Returns [B, T] tensors:
    ``distillation_losses``; ``student_mass`` / ``teacher_mass``, the probability each puts on the teacher's
    top-k (before the clamp); ``overlap_count``, how many of the teacher's top-k are among the student's
    top-k; ``overlap_token_advantage``, the mean of -q_k (log q_k - log p_k) over those (0 without any).
    """
    if student_logits.dim() != 3:
        raise ValueError(
            f"student_logits must be [batch, response_length, vocab], got shape {tuple(student_logits.shape)}"
        )
    teacher = {"teacher_topk_ids": teacher_topk_ids, "teacher_topk_log_probs": teacher_topk_log_probs}
    for name, t in teacher.items():
        if tuple(t.shape[:2]) != tuple(student_logits.shape[:2]) or t.dim() != 3:
            raise ValueError(
                f"{name} must be [batch, response_length, topk] = [{student_logits.shape[0]}, "
                f"{student_logits.shape[1]}, topk] to match student_logits {tuple(student_logits.shape)}, "
                f"got {tuple(t.shape)}"
            )
    if teacher_topk_ids.shape != teacher_topk_log_probs.shape:
        raise ValueError(
            f"teacher_topk_ids {tuple(teacher_topk_ids.shape)} and teacher_topk_log_probs "
            f"{tuple(teacher_topk_log_probs.shape)} must have the same shape"
        )
    vocab, start, valid_width = _shard(student_logits, tp_group, vocab_size)
    k = teacher_topk_ids.shape[-1]
    if k > vocab:
        raise ValueError(f"teacher_topk_ids has topk={k} columns, more than the vocabulary's {vocab} tokens")
    student = topk_log_probs(student_logits, teacher_topk_ids, tp_group=tp_group, vocab_size=vocab_size)
    teacher = teacher_topk_log_probs.float()
    student_mass = student.detach().exp().sum(dim=-1)
    teacher_mass = teacher.exp().sum(dim=-1)
    if log_prob_min_clamp is not None:
        student = student.clamp_min(log_prob_min_clamp)
        teacher = teacher.clamp_min(log_prob_min_clamp)
    per_entry = teacher.exp() * (teacher - student)
    student_ids = _topk_ids(student_logits, k, tp_group, start, valid_width)
    overlap = (teacher_topk_ids.unsqueeze(-1) == student_ids.unsqueeze(-2)).any(dim=-1)
    overlap_count = overlap.sum(dim=-1)
    overlap_sum = (-per_entry.detach() * overlap).sum(dim=-1)
    return {
        "distillation_losses": per_entry.sum(dim=-1),
        "student_mass": student_mass,
        "teacher_mass": teacher_mass,
        "overlap_count": overlap_count,
        "overlap_token_advantage": overlap_sum / overlap_count.clamp_min(1),
    }


def _masked_values(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t.detach()[mask.bool()].float()


def _range_metrics(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if not values.numel():  # an all-padding micro-batch has no tokens to report
        return {}
    return {
        prefix: values.mean().item(),
        f"{prefix}_min": values.min().item(),
        f"{prefix}_max": values.max().item(),
    }


def _topk_metrics(out: dict[str, torch.Tensor], mask: torch.Tensor, topk: int) -> dict[str, float]:
    metrics = {
        **_range_metrics("distillation/student_mass", _masked_values(out["student_mass"], mask)),
        **_range_metrics("distillation/teacher_mass", _masked_values(out["teacher_mass"], mask)),
    }
    counts = _masked_values(out["overlap_count"], mask)
    if counts.numel():
        metrics["distillation/overlap_ratio"] = counts.mean().item() / topk
    with_overlap = mask.bool() & (out["overlap_count"] > 0)
    advantages = out["overlap_token_advantage"].detach()[with_overlap]
    metrics["distillation/overlap_token_advantage"] = advantages.mean().item() if advantages.numel() else 0.0
    return metrics


def _topk_losses(
    config: DistillationLossConfig,
    response_mask: torch.Tensor,
    student_logits: Optional[torch.Tensor],
    teacher_topk_ids: Optional[torch.Tensor],
    teacher_topk_log_probs: Optional[torch.Tensor],
    tp_group: Optional[dist.ProcessGroup],
    vocab_size: Optional[int],
) -> tuple[torch.Tensor, dict[str, float]]:
    missing = [n for n, t in (("student_logits", student_logits), ("teacher_topk_ids", teacher_topk_ids),
                              ("teacher_topk_log_probs", teacher_topk_log_probs)) if t is None]
    if missing:
        raise ValueError(f"{_KEY}.loss_mode={config.loss_mode!r} needs {missing}")
    if tuple(student_logits.shape[:2]) != tuple(response_mask.shape):
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} must be [batch, response_length, vocab] with "
            f"[batch, response_length] = response_mask's {tuple(response_mask.shape)}"
        )
    if teacher_topk_ids.dim() and teacher_topk_ids.shape[-1] != config.topk:
        raise ValueError(
            f"{_KEY}.topk={config.topk} but teacher_topk_ids has shape {tuple(teacher_topk_ids.shape)} "
            f"(last dimension {teacher_topk_ids.shape[-1]})"
        )
    vocab = _shard(student_logits, tp_group, vocab_size)[0]
    if config.topk > vocab:
        raise ValueError(f"{_KEY}.topk={config.topk} is larger than the vocabulary ({vocab} tokens)")
    out = forward_kl_topk(
        student_logits, teacher_topk_ids, teacher_topk_log_probs,
        log_prob_min_clamp=config.log_prob_min_clamp, tp_group=tp_group, vocab_size=vocab_size,
    )
    metrics = _topk_metrics(out, response_mask.bool(), config.topk)
    # Both distributions are truncated to k tokens, so the divergence can be negative.
    return out["distillation_losses"].clamp_min(0.0), metrics


def _estimator_losses(
    config: DistillationLossConfig,
    response_mask: torch.Tensor,
    student_log_probs: Optional[torch.Tensor],
    teacher_log_probs: Optional[torch.Tensor],
) -> tuple[torch.Tensor, dict[str, float]]:
    if student_log_probs is None or teacher_log_probs is None:
        raise ValueError(
            f"{_KEY}.loss_mode={config.loss_mode!r} needs student_log_probs and teacher_log_probs"
        )
    if teacher_log_probs.dim() == 3 and teacher_log_probs.shape[-1] == 1:
        teacher_log_probs = teacher_log_probs.squeeze(-1)  # verl stores the sampled token's as [B, T, 1]
    check_token_tensors(student_log_probs=student_log_probs, teacher_log_probs=teacher_log_probs,
                        response_mask=response_mask)
    losses = kl_penalty(student_log_probs, teacher_log_probs, config.loss_mode)
    abs_losses = _masked_values(losses, response_mask).abs()
    metrics = {"distillation/abs_loss": abs_losses.mean().item()} if abs_losses.numel() else {}
    return losses, metrics


def compute_distillation_loss(
    config: DistillationLossConfig | object,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    student_log_probs: Optional[torch.Tensor] = None,
    teacher_log_probs: Optional[torch.Tensor] = None,
    student_logits: Optional[torch.Tensor] = None,
    teacher_topk_ids: Optional[torch.Tensor] = None,
    teacher_topk_log_probs: Optional[torch.Tensor] = None,
    old_log_probs: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    global_batch: Optional[GlobalBatchInfo] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The distillation loss of one micro-batch (verl's ``distillation_loss``) and its metrics.

    config: ``distillation.distillation_loss`` (any shape, see DistillationLossConfig.from_config).
    response_mask [B, T]; loss_agg_mode and global_batch as for the policy losses.
    forward_kl_topk needs student_logits [B, T, V_local] and the teacher's top-k [B, T, K] (K = topk);
    the estimator modes need student_log_probs and teacher_log_probs [B, T] (the sampled tokens; the
    teacher's may be [B, T, 1], verl's layout). use_policy_gradient needs student_log_probs and
    old_log_probs [B, T]; rollout_is_weights [B, T] then weight each token's PPO loss.

    Metrics: distillation/loss_min, loss_max (valid tokens, before loss_max_clamp); forward_kl_topk:
    student_mass, teacher_mass (mean, _min, _max), overlap_ratio, overlap_token_advantage; estimators:
    abs_loss; policy gradient: distillation/pg_clipfrac, pg_clipfrac_lower, ppo_kl.
    """
    config = DistillationLossConfig.from_config(config)
    check_token_tensors(response_mask=response_mask)
    mask = response_mask.bool()
    if config.uses_topk:
        losses, metrics = _topk_losses(
            config, response_mask, student_logits, teacher_topk_ids, teacher_topk_log_probs, tp_group,
            vocab_size,
        )
    else:
        losses, metrics = _estimator_losses(config, response_mask, student_log_probs, teacher_log_probs)
    valid_losses = _masked_values(losses, mask)
    if valid_losses.numel():
        metrics["distillation/loss_min"] = valid_losses.min().item()
        metrics["distillation/loss_max"] = valid_losses.max().item()
    if config.loss_max_clamp is not None:
        losses = losses.clamp(min=-config.loss_max_clamp, max=config.loss_max_clamp)
    global_batch = LOCAL_BATCH if global_batch is None else global_batch
    if not config.use_policy_gradient:
        return agg_loss(losses, response_mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics
    if student_log_probs is None or old_log_probs is None:
        raise ValueError(f"{_KEY}.use_policy_gradient=true needs student_log_probs and old_log_probs")
    # The negative divergence is the reward (https://thinkingmachines.ai/blog/on-policy-distillation/).
    pg_config = PolicyLossConfig(clip_ratio=config.clip_ratio, clip_ratio_low=config.clip_ratio_low,
                                 clip_ratio_high=config.clip_ratio_high)
    loss, pg_metrics = compute_policy_loss_vanilla(
        old_log_probs, student_log_probs, -losses.detach(), response_mask, loss_agg_mode, pg_config,
        rollout_is_weights, global_batch=global_batch,
    )
    metrics.update({f"distillation/{key.removeprefix('actor/')}": value for key, value in pg_metrics.items()})
    return loss, metrics


def combine_with_task_loss(
    config: DistillationLossConfig | object,
    distillation_loss: torch.Tensor,
    distillation_metrics: dict[str, float],
    policy_loss: Optional[torch.Tensor] = None,
    policy_metrics: Optional[dict[str, float]] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``distillation_ppo_loss`` final step: with use_task_rewards, the task-reward policy loss plus
    distillation_loss_coef * the distillation loss; without, the distillation loss alone (the policy
    loss's metrics, when given, are still reported). Adds distillation/loss."""
    config = DistillationLossConfig.from_config(config)
    metrics = dict(policy_metrics or {})
    metrics.update(distillation_metrics)
    metrics["distillation/loss"] = distillation_loss.detach().item()
    if not config.use_task_rewards:
        return distillation_loss, metrics
    if policy_loss is None:
        raise ValueError(f"{_KEY}.use_task_rewards=true needs the task-reward policy_loss to add to")
    return policy_loss + distillation_loss * config.distillation_loss_coef, metrics


__all__ = [
    "DISTILLATION_LOSS_MODES",
    "DistillationLossConfig",
    "ESTIMATOR_MODES",
    "TOPK_MODES",
    "combine_with_task_loss",
    "compute_distillation_loss",
    "forward_kl_topk",
    "teacher_topk",
    "topk_log_probs",
]
