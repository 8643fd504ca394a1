"""Is the engine serving what the trainer sent? A fixed probe answered greedily by the engine, scored again by
the trainer: ``rollout/logprob_diff_mean|max`` (engine's sampler log-probs vs trainer's). Above the threshold
``WeightSyncError`` names the first tensors whose checksums differ between what the trainer sent and what the
engine holds. Going through generation (not a separate scoring call) checks the path samples actually take and
works for every engine, SGLang included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from megatron_rl.protocol import DataProto
from megatron_rl.rollout.base import RolloutEngine
from megatron_rl.rollout.checksum import TensorChecksum, mismatched_tensors
from megatron_rl.weights.sync import WeightSyncError

__all__ = [
    "check_logprob_diff", "default_threshold", "explain_mismatch", "logprob_diff", "probe_rollout", "resolve_threshold",
    "verify_sync",
]

# Default abort thresholds of the mean |engine - trainer| log-prob over the probe's tokens, by the dtypes compared
# (docs/rollout.md, "Verification": measured on the tiny model, fp32 trainer vs fp32 engine ~1e-7, vs a bf16
# engine ~1e-2; bf16 SGLang vs bf16 Megatron on GPUs is reported of the same order). A wrong or stale tensor
# gives differences of order 0.1-1 and more.
FP32_THRESHOLD = 1e-3  # both sides fp32: summation order only
LOW_PRECISION_THRESHOLD = 0.1  # bf16 / fp16 on either side: rounding of every weight and activation


def default_threshold(trainer_dtype: torch.dtype | None, engine_dtypes: Iterable[torch.dtype | None]) -> float:
    """The abort threshold when ``rollout.weight_sync.verify_max_logprob_diff`` is null (auto): tight when trainer
    and every engine compute in fp32 (or fp64), loose as soon as one side is 16-bit (or is unknown)."""
    wide = (torch.float32, torch.float64)
    dtypes = [trainer_dtype, *engine_dtypes]
    return FP32_THRESHOLD if all(d in wide for d in dtypes) else LOW_PRECISION_THRESHOLD


def resolve_threshold(configured: float | None, trainer_dtype: torch.dtype | None,
                      engine_dtypes: Iterable[torch.dtype | None]) -> float:
    """An explicit ``verify_max_logprob_diff`` is used as is; null picks ``default_threshold``."""
    if configured is None or (isinstance(configured, str) and configured == "auto"):
        return default_threshold(trainer_dtype, engine_dtypes)
    if configured <= 0:
        raise ValueError(f"rollout.weight_sync.verify_max_logprob_diff must be > 0 or null (auto), got {configured}")
    return float(configured)


def probe_rollout(engine: RolloutEngine, probe_prompts: DataProto) -> DataProto:
    """The engine's greedy answer to the fixed probe prompts (its ``rollout_log_probs`` at T = 1)."""
    probe = probe_prompts.select(meta_info_keys=[])
    probe.meta_info.update(do_sample=False, temperature=1.0)  # greedy log-probs are at T = 1
    return engine.generate_sequences(probe)


def logprob_diff(probe_batch: DataProto, trainer_lp: torch.Tensor) -> dict[str, float]:
    """``rollout/logprob_diff_mean|max``: |engine - trainer| log-prob over the valid response tokens."""
    engine_lp = probe_batch.batch["rollout_log_probs"].float().cpu()
    trainer_lp = trainer_lp.float().cpu()
    if engine_lp.shape != trainer_lp.shape:
        raise WeightSyncError(
            f"log-prob shapes differ: engine {tuple(engine_lp.shape)}, trainer {tuple(trainer_lp.shape)}"
        )
    mask = probe_batch.batch["response_mask"].bool().cpu()
    if not bool(mask.any()):
        raise WeightSyncError("the probe batch has no valid response token (response_mask is all zero)")
    diff = (engine_lp - trainer_lp).abs()[mask]
    return {"rollout/logprob_diff_mean": float(diff.mean()), "rollout/logprob_diff_max": float(diff.max())}


def check_logprob_diff(metrics: Mapping[str, float], threshold: float, what: str, explain: Callable[[], str]) -> None:
    """Raise WeightSyncError when the mean difference exceeds ``threshold``; ``explain`` says why."""
    if metrics["rollout/logprob_diff_mean"] > threshold:
        raise WeightSyncError(
            f"rollout and trainer disagree after {what}: mean |logprob diff| "
            f"{metrics['rollout/logprob_diff_mean']:.3g} > {threshold:g} "
            f"(max {metrics['rollout/logprob_diff_max']:.3g}; "
            "threshold: rollout.weight_sync.verify_max_logprob_diff, null picks it by dtype); "
            + explain()
        )


def verify_sync(
    trainer_log_prob_fn: Callable[[DataProto], torch.Tensor],
    engine: RolloutEngine,
    probe_prompts: DataProto,
    *,
    threshold: float | None,
    source_checksums: Mapping[str, TensorChecksum] | None = None,
    trainer_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Generate greedily for ``probe_prompts`` (left-padded prompts, kept fixed across steps), score the
    result with ``trainer_log_prob_fn`` (DataProto -> [B, R], at meta_info temperature, here 1.0) and
    compare with the engine's ``rollout_log_probs``. Returns ``rollout/logprob_diff_mean|max`` over valid
    response tokens (and ``rollout/logprob_diff_threshold``); raises WeightSyncError when the mean exceeds
    ``threshold`` (None: ``default_threshold(trainer_dtype, [engine.dtype])``). (One engine in this process;
    ``weights.replica.RolloutReplica`` verifies every replica of a mesh.)
    """
    probe_batch = probe_rollout(engine, probe_prompts)
    with torch.no_grad():
        metrics = logprob_diff(probe_batch, trainer_log_prob_fn(probe_batch))
    threshold = resolve_threshold(threshold, trainer_dtype, [getattr(engine, "dtype", None)])
    metrics["rollout/logprob_diff_threshold"] = threshold
    check_logprob_diff(metrics, threshold, f"weight sync v{engine.weight_version}",
                       lambda: explain_mismatch(engine, source_checksums))
    return metrics


def explain_mismatch(engine: RolloutEngine | None, source: Mapping[str, TensorChecksum] | None) -> str:
    if source is None:
        return "no sender checksums were recorded (run sync_weights with compute_checksums=True to name the tensor)"
    held = engine.weight_checksums() if engine is not None else None
    if held is None:
        return f"{type(engine).__name__} cannot report per-tensor checksums, so the tensor cannot be named"
    bad = mismatched_tensors(source, held)
    if bad:
        return f"checksums differ for {len(bad)} tensors, first: {bad[:5]}"
    return (
        f"all {len(source)} tensor checksums agree, so the engine holds exactly what the trainer sent: "
        "look at the export (Megatron -> HF conversion) or at the engine's numerics"
    )
