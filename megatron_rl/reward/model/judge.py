"""A generative judge: a model served by a rollout engine reads a prompt template filled with the sample and
answers with a verdict, which a parser turns into the sample's score.

Failures never stop training; each one scores the sample 0 with an ``error``, as the rule scorers' do
(``reward.results.SampleResult``): a verdict the parser cannot read, an engine call that raised, or one
that took longer than ``timeout_s`` (``timed_out``). Failed samples are asked again up to ``retries`` times
(only those; a retry is a new engine call). A timed-out call cannot be interrupted: it finishes in its own
thread and its answer is dropped.

    judge = GenerativeJudge(EngineJudgeBackend(engine, tokenizer), "Rate: {response}\\nScore:", VerdictParser())
    results = judge.score(prompts, responses, ground_truths)
"""

from __future__ import annotations

import concurrent.futures
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_rl.protocol import DataProto
from megatron_rl.reward.results import SampleResult

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")


class VerdictParseError(ValueError):
    """The judge's answer holds no verdict the parser can read."""


@dataclass(frozen=True)
class VerdictParser:
    """The first match of ``pattern`` (group 1 a number) times ``scale``, e.g. "Score: 7" with scale 0.1."""

    pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    scale: float = 1.0

    def __post_init__(self) -> None:
        if re.compile(self.pattern).groups < 1:
            raise ValueError(f"judge verdict pattern {self.pattern!r} needs a group capturing the number")

    def __call__(self, answer: str) -> float:
        match = re.search(self.pattern, answer)
        if match is None:
            raise VerdictParseError(f"no verdict matching {self.pattern!r} in the judge's answer {answer!r:.80}")
        return float(match.group(1)) * self.scale


# judge prompts -> the judge's answers, one per prompt
JudgeBackend = Callable[[list[str]], list[str]]


class GenerativeJudge:
    """Args:
    backend: generates one answer per judge prompt (``EngineJudgeBackend`` over a rollout engine).
    template: ``str.format`` template with any of {prompt}, {response}, {ground_truth}.
    parser: the answer -> score.
    timeout_s: the most one engine call may take.
    retries: how many more times a failed sample is asked.
    """

    def __init__(self, backend: JudgeBackend, template: str, parser: Callable[[str], float] = VerdictParser(),
                 timeout_s: float = 60.0, retries: int = 1) -> None:
        unknown = {f for _, f, _, _ in string.Formatter().parse(template) if f} - set(TEMPLATE_FIELDS)
        if unknown:
            raise ValueError(f"judge template fields {sorted(unknown)} are unknown; known: {list(TEMPLATE_FIELDS)}")
        if not timeout_s > 0:
            raise ValueError(f"judge timeout_s must be > 0, got {timeout_s!r}")
        if not (isinstance(retries, int) and retries >= 0):
            raise ValueError(f"judge retries must be an integer >= 0, got {retries!r}")
        self.backend, self.template, self.parser = backend, template, parser
        self.timeout_s, self.retries = timeout_s, retries
        self.last_metrics: dict[str, float] = {}

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              ground_truths: Sequence[Any] | None = None) -> list[SampleResult]:
        """One result per sample; ``last_metrics``: reward/judge/{mean, parse_failures, retries}, reward/errors,
        reward/timeouts (counted over the final results; parse failures over every attempt)."""
        truths = list(ground_truths) if ground_truths is not None else [None] * len(prompts)
        if not (len(prompts) == len(responses) == len(truths)):
            raise ValueError(f"judge: {len(prompts)} prompts, {len(responses)} responses, {len(truths)} ground truths")
        judge_prompts = [self.template.format(prompt=p, response=r, ground_truth=t)
                         for p, r, t in zip(prompts, responses, truths)]
        results: list[SampleResult] = [SampleResult(error="not judged")] * len(prompts)
        pending, parse_failures, retried = list(range(len(prompts))), 0, 0
        for attempt in range(self.retries + 1):
            if not pending:
                break
            retried += len(pending) if attempt else 0
            failed = []
            for i, result in zip(pending, self._attempt([judge_prompts[i] for i in pending]), strict=True):
                results[i] = result
                if result.error is not None:
                    failed.append(i)
                    parse_failures += result.extras.get("parse_failure", False)
            pending = failed
        results = [SampleResult(r.score, {}, r.error, r.timed_out) for r in results]
        scores = [r.score for r in results]
        self.last_metrics = {
            "reward/judge/mean": float(np.mean(scores)) if scores else 0.0,
            "reward/judge/parse_failures": float(parse_failures),
            "reward/judge/retries": float(retried),
            "reward/errors": float(sum(r.error is not None for r in results)),
            "reward/timeouts": float(sum(r.timed_out for r in results)),
        }
        return results

    def _attempt(self, judge_prompts: list[str]) -> list[SampleResult]:
        """One engine call for these prompts, bounded by timeout_s, in a thread of its own (a hung call must
        not hold up the retry)."""
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="judge")
        future = executor.submit(self.backend, judge_prompts)
        executor.shutdown(wait=False)
        try:
            answers = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            error = f"the judge took longer than timeout_s={self.timeout_s:g}"
            return [SampleResult(error=error, timed_out=True) for _ in judge_prompts]
        except Exception as err:  # the engine's failure is the samples' error, not the run's
            return [SampleResult(error=f"the judge's engine raised {type(err).__name__}: {err}") for _ in judge_prompts]
        if not isinstance(answers, (list, tuple)) or len(answers) != len(judge_prompts):
            got = f"{type(answers).__name__} of length {len(answers)}" if hasattr(answers, "__len__") else repr(answers)
            return [SampleResult(error=f"the judge returned {got:.60}; expected {len(judge_prompts)} answers")
                    for _ in judge_prompts]
        return [self._parse(answer) for answer in answers]

    def _parse(self, answer: Any) -> SampleResult:
        try:
            return SampleResult(float(self.parser(str(answer))))
        except Exception as err:
            return SampleResult(error=f"{type(err).__name__}: {err}", extras={"parse_failure": True})


class EngineJudgeBackend:
    """Judge prompts through a rollout engine (``generate_sequences``): each prompt is the user turn of the
    judge tokenizer's chat template, left-padded; the answers are decoded without special tokens.
    ``meta_info`` goes with every call (default: greedy)."""

    def __init__(self, engine: Any, tokenizer: Any, meta_info: dict[str, Any] | None = None) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.meta_info = dict(meta_info if meta_info is not None else {"do_sample": False})

    def __call__(self, judge_prompts: list[str]) -> list[str]:
        rows = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=False) for p in judge_prompts]
        ids = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in rows]
        width = max(map(len, ids))
        input_ids = torch.full((len(ids), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        prompts = DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids},
                                      meta_info=dict(self.meta_info))
        out = self.engine.generate_sequences(prompts)
        responses, response_mask = out.batch["responses"], out.batch["response_mask"]
        return [self.tokenizer.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(responses, response_mask)]
