"""How a sample's RM score and rule score make its score, per data source (``reward_model.combine``).

- ``rm``: the RM score alone; the rule scorer is not called (verl's behaviour with an RM).
- ``sum``: rule + weight * rm.
- ``gate``: weight * rm where the rule score is above ``gate_threshold`` (e.g. the answer's format or its
  correctness passed), else the rule score: the RM ranks only the samples the rule lets through.

``per_data_source`` overrides ``mode`` / ``weight`` / ``gate_threshold`` for the samples of one data source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.config.schema import RewardCombineConfig

MODES = ("rm", "sum", "gate")
_FIELDS = ("mode", "weight", "gate_threshold")


@dataclass(frozen=True)
class CombineRule:
    mode: str = "rm"
    weight: float = 1.0
    gate_threshold: float = 0.0

    @property
    def needs_rule_score(self) -> bool:
        return self.mode != "rm"

    @classmethod
    def parse(cls, values: Mapping[str, Any], where: str, base: CombineRule | None = None) -> CombineRule:
        unknown = sorted(set(values) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {list(_FIELDS)}")
        merged = {**(base.__dict__ if base else {}), **dict(values)}
        if merged.get("mode", "rm") not in MODES:
            raise ValueError(f"{where}.mode={merged['mode']!r} is unknown; known: {list(MODES)}")
        for key in ("weight", "gate_threshold"):
            if key in merged and not isinstance(merged[key], (int, float)):
                raise ValueError(f"{where}.{key} must be a number, got {merged[key]!r}")
        return cls(**merged)


class CombinePlan:
    """The rule of each data source: ``reward_model.combine`` with its ``per_data_source`` overrides."""

    def __init__(self, cfg: RewardCombineConfig | Mapping[str, Any]) -> None:
        cfg = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)  # the typed section, or a dict
        per_source = dict(cfg.pop("per_data_source", None) or {})
        self.default = CombineRule.parse(cfg, "reward_model.combine")
        self.per_source = {
            str(source): CombineRule.parse(
                dict(values), f"reward_model.combine.per_data_source.{source}", self.default
            )
            for source, values in per_source.items()
        }

    def rule_for(self, data_source: str) -> CombineRule:
        return self.per_source.get(data_source, self.default)

    def rules(self, data_sources: Sequence[str]) -> list[CombineRule]:
        return [self.rule_for(s) for s in data_sources]


def combine_scores(rules: Sequence[CombineRule], rm: torch.Tensor, rule: torch.Tensor) -> torch.Tensor:
    """[B] scores from [B] RM and rule scores (``rule`` is ignored where a sample's mode is ``rm``)."""
    if not (len(rules) == len(rm) == len(rule)):
        raise ValueError(f"combine_scores: {len(rules)} rules, {len(rm)} RM scores, {len(rule)} rule scores")
    out = torch.empty(len(rules), dtype=torch.float32)
    for i, r in enumerate(rules):
        weighted = r.weight * float(rm[i])
        if r.mode == "rm":
            out[i] = weighted
        elif r.mode == "sum":
            out[i] = float(rule[i]) + weighted
        else:  # gate
            out[i] = weighted if float(rule[i]) > r.gate_threshold else float(rule[i])
    return out
