"""Sampling parameters of one generate call, and the token sampler the HF engine uses.

Parameters come from the rollout config and are overridden per call by ``meta_info`` (verl's keys).
``validate=True`` switches to ``rollout.val_kwargs``. Greedy decoding is ``do_sample=False`` or
``temperature == 0``.

Log-prob convention (verl's, and what SGLang returns): the log-prob of a sampled token is taken from
the temperature-scaled **full-vocabulary** distribution, ``log_softmax(logits / T)``; top-k / top-p only
restrict which tokens may be drawn, they do not renormalise the reported log-prob. Greedy decoding
reports ``log_softmax(logits)`` (T = 1), as SGLang does when it turns temperature 0 into top_k = 1.
The trainer's old log-prob is computed the same way, so the two agree when the weights agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.config.schema import RolloutConfig

__all__ = ["SamplingParams", "mask_top_k_top_p", "resolve_sampling_params", "sample_next_token"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float
    top_k: int  # -1: whole vocabulary
    do_sample: bool
    max_response_length: int
    eos_token_ids: tuple[int, ...]
    stop_token_ids: tuple[int, ...]
    pad_token_id: int
    seed: int | None  # None: continue the engine's own generator

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    @property
    def finish_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a response (kept in the response and in its mask)."""
        return tuple(dict.fromkeys(self.eos_token_ids + self.stop_token_ids))


def _as_id_tuple(value: int | Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def resolve_sampling_params(
    cfg: RolloutConfig,
    meta_info: Mapping[str, Any],
    *,
    response_length: int,
    eos_token_id: int | Sequence[int] | None,
    pad_token_id: int | None,
) -> SamplingParams:
    """Merge the rollout config (``cfg``: a RolloutConfig or its DictConfig) with one call's meta_info.

    meta_info keys read: ``validate`` (use ``cfg.val_kwargs``), ``do_sample``, ``temperature``, ``top_p``,
    ``top_k``, ``response_length``, ``eos_token_id``, ``pad_token_id``, ``seed``. Others are ignored.
    """
    source = cfg.val_kwargs if meta_info.get("validate", False) else cfg
    temperature = float(meta_info.get("temperature", source.temperature))
    top_p = float(meta_info.get("top_p", source.top_p))
    top_k = int(meta_info.get("top_k", source.top_k))
    do_sample = bool(meta_info.get("do_sample", source.do_sample))
    length = int(meta_info.get("response_length", response_length))
    eos = _as_id_tuple(meta_info.get("eos_token_id", eos_token_id))
    pad = meta_info.get("pad_token_id", pad_token_id)
    if pad is None:
        pad = eos[0] if eos else None
    seed = meta_info.get("seed")

    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"rollout temperature must be a finite number >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"rollout top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"rollout top_k must be -1 (off) or >= 1, got {top_k}")
    if length < 1:
        raise ValueError(f"max response length must be >= 1, got {length}")
    if pad is None:
        raise ValueError(
            "no pad_token_id: pass it in meta_info['pad_token_id'] or give the engine an eos/pad id"
        )
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        do_sample=do_sample,
        max_response_length=length,
        eos_token_ids=eos,
        stop_token_ids=_as_id_tuple(list(cfg.stop_token_ids)),
        pad_token_id=int(pad),
        seed=None if seed is None else int(seed),
    )


def mask_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (the best token always stays)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V]; return (tokens [B], their log-probs [B] in fp32)."""
    logits = logits.float()
    if params.greedy:
        log_probs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits / params.temperature
        log_probs = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(mask_top_k_top_p(scaled, params.top_k, params.top_p), dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
