"""Validation: the pass over the validation data (``validate``, on the loop's ``generate``), its metrics and
the samples it logs.

Each prompt gets ``actor_rollout_ref.rollout.val_kwargs.n`` responses, sampled with the val_kwargs
(``do_sample``, ``temperature``, ``top_p``, ``top_k``: they travel in meta_info with ``validate=True``, and
rollout/sampling.py applies them), and is scored by the run's reward function. Metrics: verl's, per data
source (val_metrics.py), over ``reward`` (the summed token-level score) and each column the reward function
returned; a scorer that returns a bare number has ``acc`` = its score, as in verl 0.9.1's reward loop. Ours
besides: ``val-aux/<source>/response_length/mean@<n>`` (tokens, finishing token included: whether a model
learned to stop shows there, not in the score). ``trainer.log_val_generations`` = N logs N (input, output,
score) samples to the loggers each validation, picked as verl picks them.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from megatron_rl.config import ConfigError
from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.data import load_tokenizer
from megatron_rl.protocol import DataProto
from megatron_rl.trainer.steps import Generate, pop_for_generation
from megatron_rl.trainer.val_metrics import compute_validation_metrics

if TYPE_CHECKING:
    from megatron_rl.trainer.loop import Run

logger = logging.getLogger(__name__)

VAL_KWARGS = "actor_rollout_ref.rollout.val_kwargs"
GENERATIONS_SEED = 42  # verl's fixed shuffle of the logged samples


def check_validation_settings(cfg: PPOTrainerConfig) -> None:
    """``rollout.val_kwargs`` and ``trainer.log_val_generations``, refused before start-up naming the key."""
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    problems = []
    if not (isinstance(vk.n, int) and vk.n >= 1):
        problems.append(f"{VAL_KWARGS}.n={vk.n} must be an integer >= 1 (responses per validation prompt)")
    if not (math.isfinite(vk.temperature) and vk.temperature >= 0):
        problems.append(f"{VAL_KWARGS}.temperature={vk.temperature} must be a finite number >= 0 (0: greedy)")
    if not 0 < vk.top_p <= 1:
        problems.append(f"{VAL_KWARGS}.top_p={vk.top_p} must be in (0, 1]")
    if not (vk.top_k == -1 or vk.top_k >= 1):
        problems.append(f"{VAL_KWARGS}.top_k={vk.top_k} must be -1 (off) or >= 1")
    shown = cfg.trainer.log_val_generations
    if not (isinstance(shown, int) and shown >= 0):
        problems.append(f"trainer.log_val_generations={shown} must be an integer >= 0 (samples logged per validation)")
    if problems:
        raise ConfigError("; ".join(problems))
    if vk.n > 1 and (not vk.do_sample or vk.temperature == 0):
        logger.warning("%s.n=%d with greedy decoding (do_sample=%s, temperature=%s): the %d responses of a "
                       "prompt are the same; set do_sample=true and temperature > 0 to sample them",
                       VAL_KWARGS, vk.n, vk.do_sample, vk.temperature, vk.n)


class _Collected:
    """What the metrics and the logged samples need of every validation response, batch by batch (plain lists:
    batches may differ in width and in the reward function's columns)."""

    def __init__(self) -> None:
        self.sources: list[Any] = []
        self.uids: list[Any] = []
        self.rewards: list[float] = []
        self.lengths: list[float] = []
        self.columns: dict[str, list[Any]] = {}
        self.num_turns: list[float] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []

    def add(self, full: DataProto, scores: DataProto) -> None:
        rows, before = len(full), len(self.rewards)
        self.sources += list(full.non_tensor_batch.get("data_source", ["unknown"] * rows))
        self.uids += list(full.non_tensor_batch["uid"])
        self.rewards += scores.batch["token_level_scores"].sum(-1).tolist()
        if "response_mask" in full.batch.keys():
            self.lengths += full.batch["response_mask"].sum(-1).tolist()
        for key, column in scores.non_tensor_batch.items():  # a column new in this batch is None before it
            self.columns.setdefault(key, [None] * before).extend(list(column))
        for column in self.columns.values():  # and one missing from this batch is None in it
            column.extend([None] * (before + rows - len(column)))
        if "__num_turns__" in full.non_tensor_batch:
            self.num_turns += [float(t) for t in full.non_tensor_batch["__num_turns__"]]

    def infos(self) -> dict[str, list[Any]]:
        """verl's reward_extra_infos_dict: reward, then the reward function's columns; a scorer that returned
        a bare number (only the ``score`` column) reports it as ``acc``, as verl's reward loop does."""
        if set(self.columns) == {"score"}:
            return {"reward": self.rewards, "acc": self.columns["score"]}
        return {"reward": self.rewards, **self.columns}


def validate(run: Run, generate: Generate, tracking: Any = None) -> dict[str, float]:
    """``rollout.val_kwargs.n`` responses per validation prompt, sampled with the val_kwargs, scored; the
    metrics. With ``trainer.log_val_generations`` > 0 and a ``tracking`` (the rank that logs), samples too."""
    cfg = run.cfg
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    shown = cfg.trainer.log_val_generations
    decode = _decoder(cfg) if shown > 0 and tracking is not None else None
    collected = _Collected()
    for index, batch in enumerate(run.val_batches()):
        if "uid" not in batch.non_tensor_batch:  # one group per prompt (verl gives each a uuid)
            batch.non_tensor_batch["uid"] = np.array([f"val-{index}-{i}" for i in range(len(batch))], dtype=object)
        batch.meta_info.update(validate=True, do_sample=vk.do_sample, temperature=vk.temperature,
                               top_p=vk.top_p, top_k=vk.top_k, seed=cfg.actor_rollout_ref.rollout.seed)
        gen = pop_for_generation(cfg, batch)
        out = generate(gen.repeat(vk.n, interleave=True))
        if len(out) != len(gen) * vk.n:
            raise ValueError(f"validation batch {index}: the rollout returned {len(out)} responses for {len(gen)} "
                             f"prompts x {VAL_KWARGS}.n={vk.n}")
        full = batch.repeat(vk.n, interleave=True).union(out)
        scores = run.reward_fn(full)
        scores.meta_info.pop("reward_metrics", None)
        collected.add(full, scores)
        if decode is not None:
            prompts = out.batch["prompts"] if "prompts" in out.batch.keys() else gen.batch["input_ids"].repeat_interleave(vk.n, 0)
            collected.inputs += decode(prompts)
            collected.outputs += decode(out.batch["responses"])
    if not collected.rewards:
        return {}
    metrics = validation_metrics(collected.sources, collected.uids, collected.infos(), collected.lengths, vk.n)
    if collected.num_turns:  # verl's val-aux/num_turns/{min,max,mean} of multi-turn rollouts
        turns = np.asarray(collected.num_turns)
        metrics |= {"val-aux/num_turns/min": float(turns.min()), "val-aux/num_turns/max": float(turns.max()),
                    "val-aux/num_turns/mean": float(turns.mean())}
    if decode is not None:
        tracking.log_generations(pick_generations(collected.inputs, collected.outputs, collected.rewards, shown),
                                 run.state.global_steps)
    return metrics


def validation_metrics(data_sources: Sequence[Any], uids: Sequence[Any], infos: dict[str, Sequence[Any]],
                       lengths: Sequence[float] = (), n: int = 1) -> dict[str, float]:
    """verl's metrics (val_metrics.py) plus ``val-aux/<source>/response_length/mean@<n>`` when ``lengths``
    (one per response) are given."""
    metrics = compute_validation_metrics(data_sources, uids, infos)
    if len(lengths):
        if len(lengths) != len(data_sources):
            raise ValueError(f"validation: {len(lengths)} response lengths for {len(data_sources)} responses")
        by_source: dict[str, list[float]] = {}
        for source, length in zip(data_sources, lengths):
            by_source.setdefault(str(source), []).append(float(length))
        metrics |= {f"val-aux/{s}/response_length/mean@{n}": float(np.mean(v)) for s, v in by_source.items()}
    return metrics


def pick_generations(inputs: Sequence[str], outputs: Sequence[str], scores: Sequence[float],
                     count: int) -> list[tuple[str, str, float]]:
    """verl's choice of the logged samples: sorted by input, shuffled with RandomState(42), the first ``count``."""
    if not len(inputs) == len(outputs) == len(scores):
        raise ValueError(f"validation samples: {len(inputs)} inputs, {len(outputs)} outputs, {len(scores)} scores")
    samples = sorted(zip(inputs, outputs, scores), key=lambda s: s[0])
    np.random.RandomState(GENERATIONS_SEED).shuffle(samples)
    return samples[:count]


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str, trust_remote_code: bool) -> Any:
    return load_tokenizer(path, trust_remote_code)


def _decoder(cfg: PPOTrainerConfig):
    """Token ids -> text, special tokens (padding) skipped, with the run's tokenizer (loaded once)."""
    tokenizer = _tokenizer(str(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path), cfg.data.trust_remote_code)
    return lambda ids: tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)
