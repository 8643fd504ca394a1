"""RewardManager: responses -> scores -> ``token_level_scores`` with the score on the last valid token.

``reward_fn(batch)`` returns a DataProto to ``union`` into the batch:
- ``batch["token_level_scores"]`` [B, R] float32: each sample's score at the last position where
  ``response_mask`` is 1, zeros elsewhere. A zero-length response (mask all 0) gets its score at
  position 0 — masked, so no loss sees it, but ``token_level_scores.sum(-1)`` is every sample's score;
- ``non_tensor_batch["score"]`` and each extra a scorer returns in its dict (e.g. ``acc``, ``pred``),
  ``None`` for samples whose scorer did not return it;
- a sample with a number in ``non_tensor_batch["agent_reward"]`` (its agent program's reward, agent/program.py)
  scores that number instead of its scorer's;
- ``meta_info["reward_metrics"]``: ``reward/score/mean``, ``reward/<extra>/mean`` for numeric extras,
  ``reward/errors`` (samples scored 0 because their scorer raised, timed out or returned a non-numeric
  value), ``reward/timeouts`` (the subset that timed out), ``reward/empty_responses``.

A scorer returning NaN or +-inf stops the run at the step that produced it (ValueError naming the data_source,
the sample, its row's ``extra_info`` index and the scorer): such a score is a scorer bug, not a failed sample.

``reward.reward_manager`` (verl's names): ``naive`` scores per sample; ``batch`` hands the custom function whole
lists; ``dapo`` is naive plus DAPO's overlong penalty (reward/overlong.py) added to the placed score, and ``acc``
(the score) for samples whose scorer returned a bare number, as verl's DAPORewardManager reports; ``prime`` is
verl's PrimeRewardManager: per-sample calls in the worker processes, each with its time limit (which ``reward.
num_workers`` >= 1 gives), a failed or timed-out sample scoring 0, a scorer's tuple or list scoring its first
item, and ``acc`` = the score for every sample.
"""

from __future__ import annotations

import functools
import logging
import numbers
import pickle
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from megatron_rl.agent.program import AGENT_REWARD
from megatron_rl.config.schema import RewardConfig
from megatron_rl.protocol import DataProto
from megatron_rl.reward.custom import load_custom_scorer
from megatron_rl.reward.overlong import OverlongPenalty
from megatron_rl.reward.placement import last_valid_positions, place_scores
from megatron_rl.reward.pool import Call, InlineRunner, InlineTimeout, Outcome, ScoringPool
from megatron_rl.reward.registry import Scorer, get_scorer
from megatron_rl.reward.results import SampleResult, results_of

__all__ = ["REWARD_MANAGERS", "RewardManager", "decode_responses"]

logger = logging.getLogger(__name__)

# naive: every scorer is called per sample. batch: the custom function takes whole lists (verl's
# BatchRewardManager convention); registered scorers keep their own kind either way. dapo, prime: per sample
# as naive, with verl's additions (module docstring).
REWARD_MANAGERS = ("naive", "batch", "dapo", "prime")


def decode_responses(
    tokenizer: PreTrainedTokenizerBase, responses: torch.Tensor, response_mask: torch.Tensor
) -> list[str]:
    """Each response up to its last valid token (masked tokens in between, e.g. tool output, included),
    special tokens skipped."""
    ends = (last_valid_positions(response_mask) + 1).tolist()
    rows = responses.cpu().tolist()
    return tokenizer.batch_decode([row[:end] for row, end in zip(rows, ends, strict=True)], skip_special_tokens=True)


class RewardManager:
    """Decode responses, score each with the scorer of its ``data_source`` (or the custom function), and
    place the scores. Scoring runs in ``reward.num_workers`` processes, each call limited to
    ``reward.timeout_s``, a call past it scoring 0; ``num_workers=0``: in this process, where a call past
    ``reward.timeout_s`` cannot be stopped and so stops the run with an error naming the row (pool.InlineRunner).

    ``max_response_length``: the rollout's response length, which ``reward.reward_kwargs.max_resp_len: null``
    stands for (needed by ``reward_manager=dapo`` with the overlong buffer enabled)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, cfg: RewardConfig, max_response_length: int | None = None
    ) -> None:
        if cfg.reward_manager not in REWARD_MANAGERS:
            raise ValueError(
                f"reward.reward_manager={cfg.reward_manager!r} is unknown; known: {list(REWARD_MANAGERS)}"
            )
        if not (isinstance(cfg.num_workers, int) and cfg.num_workers >= 0):
            raise ValueError(f"reward.num_workers must be an integer >= 0, got {cfg.num_workers!r}")
        if not cfg.timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {cfg.timeout_s!r}")
        custom = cfg.custom_reward_function
        if cfg.reward_manager == "batch" and not custom.path:
            raise ValueError(
                "reward.reward_manager=batch needs reward.custom_reward_function.path (a function that "
                "scores whole lists)"
            )
        if cfg.reward_manager == "prime" and cfg.num_workers == 0:
            raise ValueError(
                "reward.reward_manager=prime scores each sample in a worker process with a time limit (verl's "
                "PrimeRewardManager), but reward.num_workers=0 scores in this process without one: set "
                "reward.num_workers >= 1, or use reward.reward_manager=naive"
            )
        self.kind = str(cfg.reward_manager)
        self.overlong = OverlongPenalty.from_config(cfg, max_response_length)
        self.tokenizer = tokenizer
        self.custom: Scorer | None = None
        if custom.path:
            self.custom = Scorer(
                load_custom_scorer(custom.path, custom.name), batched=cfg.reward_manager == "batch"
            )
        self._runner = (
            ScoringPool(cfg.num_workers, cfg.timeout_s) if cfg.num_workers else InlineRunner(cfg.timeout_s)
        )
        self._checked_picklable: set[str] = set()
        box = cfg.sandbox_fusion  # what a code-running scorer (Scorer.sandbox) is given
        self._sandbox_kwargs = {"sandbox_fusion_url": box.url, "memory_limit_mb": box.memory_limit_mb,
                                "max_concurrent": box.max_concurrent, "continuous": box.continuous,
                                "run_timeout_s": box.run_timeout_s, "max_tests": box.max_tests}
        self._with_sandbox: dict[str, Scorer] = {}

    def __call__(self, data: DataProto) -> DataProto:
        data.require("responses", "response_mask", "data_source", "reward_model", where="RewardManager")
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        if responses.dim() != 2 or mask.shape != responses.shape:
            raise ValueError(
                f"RewardManager: responses {tuple(responses.shape)} and response_mask "
                f"{tuple(mask.shape)} must both be [B, R]"
            )
        lengths = self._response_lengths(data) if self.overlong is not None else None
        solutions = self.decode(responses, mask)
        sources = [str(s) for s in data.non_tensor_batch["data_source"]]
        truths = [
            rm.get("ground_truth") if isinstance(rm, dict) else None
            for rm in data.non_tensor_batch["reward_model"]
        ]
        extra_infos = list(data.non_tensor_batch.get("extra_info", [None] * len(data)))
        extra_infos = [info if info is not None else {} for info in extra_infos]

        results, plain = self._score(sources, solutions, truths, extra_infos)
        given = data.non_tensor_batch.get(AGENT_REWARD)
        if given is not None:  # an agent program's own reward of its sample (agent/program.py) is the score
            results = [r if v is None else SampleResult(score=float(v)) for r, v in zip(results, given, strict=True)]
        self._refuse_non_finite(results, sources, extra_infos)
        scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        results, rewards = self._verl_additions(results, plain, scores, lengths)
        empty = int((last_valid_positions(mask) < 0).sum())
        extras = self._collect_extras(results)
        metrics = self._metrics(results, scores, extras, empty)
        self._log_errors(results, sources)
        # "score" stays the scorer's (verl's reward_extra_info["score"]); the placed reward includes the penalty
        non_tensor = {"score": np.array(scores.tolist(), dtype=object), **extras}
        return DataProto.from_dict(
            {"token_level_scores": place_scores(rewards, mask.cpu())}, non_tensor, {"reward_metrics": metrics}
        )

    def _verl_additions(
        self, results: list[SampleResult], plain: list[bool], scores: torch.Tensor, lengths: torch.Tensor | None
    ) -> tuple[list[SampleResult], torch.Tensor]:
        """What verl's dapo and prime managers add: their ``acc`` extras, and dapo's overlong penalty (the placed
        rewards, and with ``log`` the extras ``overlong_reward``, ``overlong``)."""
        if self.kind == "dapo":  # verl's DAPO reports a bare-number score as acc
            results = [
                with_extras(r, acc=r.score) if bare and r.error is None else r
                for r, bare in zip(results, plain, strict=True)
            ]
        elif self.kind == "prime":  # verl's PRIME stores every sample's score (0 when failed) as acc
            results = [with_extras(r, acc=r.score) for r in results]
        if self.overlong is None or lengths is None:
            return results, scores
        penalties = self.overlong(lengths)
        if self.overlong.log:
            results = [
                with_extras(r, overlong_reward=p, overlong=p < 0)
                for r, p in zip(results, penalties.tolist(), strict=True)
            ]
        return results, scores + penalties  # float32, as verl adds them

    @staticmethod
    def _response_lengths(data: DataProto) -> torch.Tensor:
        """[B] real tokens of each response, counted on ``attention_mask`` [B, P+R] as verl's DAPO counts them."""
        data.require("attention_mask", where="RewardManager (reward.reward_kwargs.overlong_buffer_cfg.enable)")
        responses, attention = data.batch["responses"], data.batch["attention_mask"]
        width = responses.shape[1]
        if attention.dim() != 2 or attention.shape[0] != responses.shape[0] or attention.shape[1] < width:
            raise ValueError(
                f"RewardManager: attention_mask {tuple(attention.shape)} must be [B, P+R] for responses "
                f"{tuple(responses.shape)} [B, R] (the overlong penalty counts the response's tokens on it)"
            )
        return attention[:, attention.shape[1] - width :].long().sum(-1).cpu()

    def decode(self, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        return decode_responses(self.tokenizer, responses, response_mask)

    # ------------------------------------------------------------------ scoring
    def _scorer_for(self, data_source: str) -> Scorer:
        scorer = self.custom or get_scorer(data_source)
        if scorer.sandbox:  # one wrapped scorer per function: batched calls group by it
            scorer = self._with_sandbox.setdefault(
                scorer.name, Scorer(functools.partial(scorer.fn, **self._sandbox_kwargs), scorer.batched, True))
        if isinstance(self._runner, ScoringPool) and scorer.name not in self._checked_picklable:
            if scorer.name.startswith("__main__."):
                raise ValueError(
                    f"the scorer {scorer.name} for data_source {data_source!r} is defined in __main__, "
                    f"which scoring worker processes cannot import; move it into a module, or set "
                    f"reward.num_workers=0 to score in this process"
                )
            try:
                pickle.dumps(scorer.fn)
            except Exception as e:
                raise ValueError(
                    f"the scorer {scorer.name} for data_source {data_source!r} cannot be sent to scoring "
                    f"worker processes ({type(e).__name__}: {e}); define it at module level, or set "
                    f"reward.num_workers=0 to score in this process"
                ) from e
            self._checked_picklable.add(scorer.name)
        return scorer

    def _score(
        self, sources: list[str], solutions: list[str], truths: list[Any], extra_infos: list[Any]
    ) -> tuple[list[SampleResult], list[bool]]:
        """Each sample's result, and whether its scorer returned a bare number (not a dict)."""
        results: list[SampleResult | None] = [None] * len(sources)
        plain = [False] * len(sources)
        calls: list[Call] = []
        call_samples: list[list[int]] = []  # call -> the samples it scores
        batched_groups: dict[Scorer, list[int]] = defaultdict(list)
        for i, source in enumerate(sources):
            scorer = self._scorer_for(source)
            if truths[i] is None:
                results[i] = SampleResult(error="reward_model has no 'ground_truth'")
            elif scorer.batched:
                batched_groups[scorer].append(i)
            else:
                calls.append(
                    (
                        scorer.fn,
                        {
                            "data_source": source,
                            "solution_str": solutions[i],
                            "ground_truth": truths[i],
                            "extra_info": extra_infos[i],
                        },
                    )
                )
                call_samples.append([i])
        num_single = len(calls)
        for scorer, idx in batched_groups.items():
            calls.append(
                (
                    scorer.fn,
                    {
                        "data_sources": [sources[i] for i in idx],
                        "solution_strs": [solutions[i] for i in idx],
                        "ground_truths": [truths[i] for i in idx],
                        "extra_infos": [extra_infos[i] for i in idx],
                    },
                )
            )
            call_samples.append(idx)

        try:
            outcomes = self._runner.run(calls)
        except InlineTimeout as hung:
            rows = call_samples[hung.call_index]
            scorer = self._scorer_for(sources[rows[0]]).name
            raise _inline_timeout_error(hung, rows, sources[rows[0]], scorer) from None
        for k, (outcome, idx) in enumerate(zip(outcomes, call_samples, strict=True)):
            batched = k >= num_single
            if self.kind == "prime" and not batched:
                outcome = _first_item(outcome)
            for i, result in zip(idx, results_of(outcome, len(idx), batched=batched), strict=True):
                results[i] = result
            for i, bare in zip(idx, _bare_numbers(outcome, len(idx), batched), strict=True):
                plain[i] = bare
        return results, plain  # type: ignore[return-value]  # every sample got a result above

    # ------------------------------------------------------------------ reporting
    @staticmethod
    def _collect_extras(results: Sequence[SampleResult]) -> dict[str, np.ndarray]:
        keys = sorted({k for r in results for k in r.extras})
        extras = {}
        for key in keys:
            column = np.empty(len(results), dtype=object)
            column[:] = [r.extras.get(key) for r in results]
            extras[key] = column
        return extras

    @staticmethod
    def _metrics(
        results: Sequence[SampleResult], scores: torch.Tensor, extras: dict[str, np.ndarray], empty: int
    ) -> dict[str, float]:
        metrics = {
            "reward/score/mean": scores.mean().item() if len(scores) else 0.0,
            "reward/errors": float(sum(r.error is not None for r in results)),
            "reward/timeouts": float(sum(r.timed_out for r in results)),
            "reward/empty_responses": float(empty),
        }
        for key, column in extras.items():
            values = [float(v) for v in column if isinstance(v, numbers.Real)]
            if values:
                metrics[f"reward/{key}/mean"] = float(np.mean(values))
        return metrics

    def _refuse_non_finite(
        self, results: Sequence[SampleResult], sources: Sequence[str], extra_infos: Sequence[Any]
    ) -> None:
        """Stop at the first step with a NaN / inf score: unlike a failed sample, the scorer is wrong."""
        bad = [i for i, r in enumerate(results) if r.non_finite]
        if not bad:
            return
        first = bad[0]
        index = extra_infos[first].get("index") if isinstance(extra_infos[first], dict) else None
        row = f", extra_info index {index}" if index is not None else ""
        raise ValueError(
            f"reward: {results[first].error} for sample {first}{row} (data_source {sources[first]!r}, "
            f"scorer {self._scorer_for(sources[first]).name}); {len(bad)} of {len(results)} samples of this "
            f"step are non-finite. A NaN or inf reward would poison the advantages: fix the scorer to return "
            f"a finite number"
        )

    @staticmethod
    def _log_errors(results: Sequence[SampleResult], sources: Sequence[str]) -> None:
        failed = [i for i, r in enumerate(results) if r.error is not None]
        if failed:
            first = failed[0]
            logger.warning(
                "reward: %d of %d samples scored 0 because scoring failed; first: sample %d "
                "(data_source %r): %s",
                len(failed),
                len(results),
                first,
                sources[first],
                results[first].error,
            )

    def close(self) -> None:
        """Stop the scoring worker processes."""
        self._runner.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _inline_timeout_error(hung: InlineTimeout, rows: list[int], data_source: str, scorer: str) -> TimeoutError:
    what = f"row {rows[0]}" if len(rows) == 1 else f"rows {rows[0]}..{rows[-1]} (one batched call)"
    return TimeoutError(
        f"reward: scoring {what} of the batch (data_source {data_source!r}, scorer {scorer}) ran past "
        f"reward.timeout_s={hung.timeout_s:g} s in this process (reward.num_workers=0), where a hung scorer "
        f"cannot be stopped. Set reward.num_workers >= 1 to score in worker processes, where a call past the "
        f"limit is killed and scores 0, or raise reward.timeout_s if the scorer is slow, not hung"
    )


def with_extras(result: SampleResult, **extras: Any) -> SampleResult:
    """``result`` with ``extras`` set (replacing the scorer's own of the same name)."""
    return SampleResult(result.score, {**result.extras, **extras}, result.error, result.timed_out)


def _first_item(outcome: Outcome) -> Outcome:
    """verl's PRIME scores a scorer's tuple or list by its first item."""
    value = outcome.value
    if outcome.ok and isinstance(value, (list, tuple)) and value:
        return Outcome(value=value[0])
    return outcome


def _bare_numbers(outcome: Outcome, n: int, batched: bool) -> list[bool]:
    """Per sample of one call: did its scorer succeed with something other than a dict?"""
    if not outcome.ok:
        return [False] * n
    values = outcome.value if batched else [outcome.value]
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != n:
        return [False] * n
    return [not isinstance(v, dict) for v in values]
