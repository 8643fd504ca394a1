"""Per-step metrics with verl's names, computed on the driver from the step's DataProto."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from megatron_rl.protocol import DataProto


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def _masked_token_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return _stats(prefix, values[mask.bool()])


def compute_data_metrics(batch: DataProto, use_critic: bool) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one step (verl's `compute_data_metrics`)."""
    response_mask = batch.batch["response_mask"].bool()
    response_length = response_mask.sum(-1).float()
    prompt_length = batch.batch["attention_mask"][:, : -response_mask.shape[1]].sum(-1).float()
    max_response = response_mask.shape[1]

    metrics: dict[str, float] = {}
    metrics |= _stats("critic/score", batch.batch["token_level_scores"].sum(-1))
    metrics |= _stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1))
    metrics |= _masked_token_stats("critic/advantages", batch.batch["advantages"], response_mask)
    metrics |= _masked_token_stats("critic/returns", batch.batch["returns"], response_mask)
    if use_critic and "values" in batch.batch:
        metrics |= _masked_token_stats("critic/values", batch.batch["values"], response_mask)
        returns = batch.batch["returns"][response_mask]
        values = batch.batch["values"][response_mask]
        var_returns = torch.var(returns)
        metrics["critic/vf_explained_var"] = (1.0 - torch.var(returns - values) / (var_returns + 1e-5)).item()
    metrics |= _stats("response_length", response_length)
    metrics["response_length/clip_ratio"] = (response_length == max_response).float().mean().item()
    metrics |= _stats("prompt_length", prompt_length)
    if "acc" in batch.non_tensor_batch:
        metrics["critic/acc/mean"] = float(np.mean(batch.non_tensor_batch["acc"].astype(np.float64)))
    return metrics


def compute_throughput_metrics(batch: DataProto, step_seconds: float, world_size: int) -> dict[str, float]:
    tokens = int(batch.batch["attention_mask"].sum().item())
    return {
        "perf/total_num_tokens": float(tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": tokens / max(step_seconds, 1e-9) / world_size,  # tokens/s per rank, as verl
    }


class StageTimer:
    """Accumulates wall time per stage, reported as `timing_s/<stage>`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def multi_turn_metrics(data: DataProto | Mapping[str, Any]) -> dict[str, float]:
    """verl's ``num_turns/{min,max,mean}`` and ``tool_call_counts/{min,max,mean}`` of a batch (empty when
    the batch is not multi-turn); ours: ``tool_error_counts/{min,max,mean}`` and ``tool_errors/<reason>`` (the
    batch's failed tool calls by reason: timeout, connection, unauthorized, http_503, ...; agent/loop.py),
    ``turn_response_length/{min,max,mean}`` (tokens of each model turn) and ``agent/program_errors``."""
    nt = data.non_tensor_batch if isinstance(data, DataProto) else data
    metrics: dict[str, float] = {}
    for key in ("__num_turns__", "tool_call_counts", "tool_error_counts"):
        if key in nt and len(nt[key]):
            name = key.strip("_")
            values = np.asarray(nt[key], dtype=np.float64)
            metrics |= {f"{name}/min": float(values.min()), f"{name}/max": float(values.max()),
                        f"{name}/mean": float(values.mean())}
    for reasons in nt.get("tool_error_reasons", ()):
        for reason in reasons:
            metrics[f"tool_errors/{reason}"] = metrics.get(f"tool_errors/{reason}", 0.0) + 1.0
    if "agent_error" in nt:  # agent programs (agent/program.py) that raised or outlived their time
        metrics["agent/program_errors"] = float(sum(e is not None for e in nt["agent_error"]))
    if metrics and isinstance(data, DataProto) and "response_mask" in data.batch:
        lengths = turn_lengths(data.batch["response_mask"])
        if lengths:
            metrics |= {"turn_response_length/min": float(min(lengths)),
                        "turn_response_length/max": float(max(lengths)),
                        "turn_response_length/mean": float(np.mean(lengths))}
    return metrics


def turn_lengths(response_mask: torch.Tensor) -> list[int]:
    """The length of every model turn of a batch: the runs of 1 in each row of ``response_mask``."""
    mask = response_mask.bool().cpu()
    padded = torch.nn.functional.pad(mask.int(), (1, 1))
    edges = padded[:, 1:] - padded[:, :-1]  # +1 where a run starts, -1 one past where it ends
    starts, ends = torch.nonzero(edges == 1), torch.nonzero(edges == -1)
    return (ends[:, 1] - starts[:, 1]).tolist()


def rollout_probs_diff(data: DataProto) -> dict[str, float]:
    """verl's ``training/rollout_probs_diff_{max,mean,std}``: |p_rollout - p_trainer| on the trained tokens
    (``response_mask``; observation tokens excluded), from ``rollout_log_probs`` and ``old_log_probs``."""
    b = data.batch
    if "rollout_log_probs" not in b or "old_log_probs" not in b:
        return {}
    mask = b["response_mask"].bool()
    if not bool(mask.any()):
        return {}
    diff = (b["rollout_log_probs"].float().exp() - b["old_log_probs"].float().exp()).abs()[mask]
    return {"training/rollout_probs_diff_max": float(diff.max()), "training/rollout_probs_diff_mean": float(diff.mean()),
            "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0}
