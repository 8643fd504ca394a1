"""Which expert layer an MoE model builds, and where each local expert's weights live in it.

Two layers compute the same experts (Megatron-Core 0.16.1, ``transformer/moe/experts.py``):
* ``SequentialMLP``: one MLP per local expert, run one after the other; its weights are
  ``experts.local_experts.<i>.linear_fc1.weight`` / ``...linear_fc2.weight``. Plain torch: runs everywhere.
* ``TEGroupedMLP`` (the TE spec with ``moe_grouped_gemm=True``): Transformer Engine's grouped linear runs
  all local experts' GEMMs in one call; its weights are ``experts.linear_fc1.weight<i>`` /
  ``...linear_fc2.weight<i>``, each the same [rows, cols] shard as SequentialMLP's expert i. Needs CUDA
  and TE.
Both hold local expert i of EP rank r as global expert ``r * E / EP + i`` and save the same distributed
checkpoint keys, so only code that names a parameter by its module path sees the difference
(``expert_weight``).

No Megatron import: the planner and the checks before launch read this module.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is not imported for the checks before launch
    import torch

log = logging.getLogger(__name__)

OVERRIDE_KEY = "megatron.override_transformer_config.moe_grouped_gemm"
EXPERT_LINEARS = ("linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class ExpertLayer:
    """The expert layer of the MoE layers, and why."""

    grouped: bool
    reason: str

    @property
    def name(self) -> str:
        return "TEGroupedMLP" if self.grouped else "SequentialMLP"


def check_grouped_gemm_override(value: object, key: str = OVERRIDE_KEY) -> bool | None:
    """``override_transformer_config.moe_grouped_gemm`` as given: None (unset), True or False; anything else
    is refused naming the key (a string "false" would otherwise read as true)."""
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{key}={value!r} must be true or false (or left unset: grouped where CUDA and "
                     "Transformer Engine are there, SequentialMLP otherwise)")


def choose_expert_layer(override: object, *, cuda: bool, te: bool, key: str = OVERRIDE_KEY,
                        lora_on_experts: bool = False) -> ExpertLayer:
    """Grouped experts where they can run (a CUDA device and Transformer Engine's layer spec), SequentialMLP
    otherwise; ``override`` (the user's moe_grouped_gemm) wins where it can run. ``true`` where grouped cannot
    run is refused naming ``key`` (the launch checks refuse it earlier when TE does not import).
    ``lora_on_experts``: LoRA adapters on the experts' linears need one MLP per expert (SequentialMLP)."""
    override = check_grouped_gemm_override(override, key)
    if lora_on_experts:
        if override is True:
            raise ValueError(f"{key}=true with LoRA on the experts (lora.target_modules names linear_fc1 / "
                             "linear_fc2): the adapters sit on each expert's own linears, which TE's grouped "
                             "layer does not have; set it false (or leave it unset), or exclude linear_fc1 and "
                             "linear_fc2 (lora.exclude_modules)")
        return ExpertLayer(False, "LoRA on the experts: one MLP per local expert, each with its adapters")
    missing = [what for what, here in (("no CUDA device", cuda), ("Transformer Engine does not import", te))
               if not here]
    if override is True:
        if missing:
            raise ValueError(f"{key}=true: TE's grouped experts cannot run here ({'; '.join(missing)}); set "
                             "it false or leave it unset (SequentialMLP computes the same experts)")
        return ExpertLayer(True, f"{key}=true")
    if override is False:
        return ExpertLayer(False, f"{key}=false")
    if missing:
        return ExpertLayer(False, f"{'; '.join(missing)}: one plain-torch MLP per local expert")
    return ExpertLayer(True, "CUDA device and Transformer Engine: one grouped GEMM over the local experts")


_logged: set[ExpertLayer] = set()


def log_expert_layer(choice: ExpertLayer) -> None:
    """Log the choice once per process (the actor, reference and critic of a process build the same)."""
    if choice in _logged:
        return
    _logged.add(choice)
    log.info("MoE experts: %s (%s)", choice.name, choice.reason)


# ---------------------------------------------------------------- where a local expert's weights are


def is_grouped(experts: torch.nn.Module) -> bool:
    """Whether an MoE layer's ``experts`` module has the grouped layout (weights ``linear_fc1.weight<i>``)."""
    return not hasattr(experts, "local_experts")


def expert_weight_name(local: int, linear: str, grouped: bool) -> str:
    """The name of local expert ``local``'s ``linear`` (linear_fc1 / linear_fc2) weight inside ``experts``."""
    if linear not in EXPERT_LINEARS:
        raise ValueError(f"expert linear {linear!r} is not one of {EXPERT_LINEARS}")
    return f"{linear}.weight{local}" if grouped else f"local_experts.{local}.{linear}.weight"


def expert_weight(experts: torch.nn.Module, local: int, linear: str) -> torch.nn.Parameter:
    """Local expert ``local``'s ``linear`` weight in either layout."""
    name = expert_weight_name(local, linear, is_grouped(experts))
    try:
        return experts.get_parameter(name)
    except AttributeError:
        # TE's opt-in single_grouped_parameter keeps all experts in one [E, out, in] ``weight`` (Megatron-Core
        # 0.16.1 does not turn it on): one parameter per expert is what loading, export and grads name
        raise ValueError(f"{type(experts).__name__} has no parameter {name!r} (one weight per local expert); "
                         f"it holds {sorted(n for n, _ in experts.named_parameters())[:4]}") from None


_EXPERT_KEY = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts\.|)(?:local_experts\.(?P<seq>\d+)\.(?P<seq_linear>linear_fc[12])\.weight"
    r"|(?P<grp_linear>linear_fc[12])\.weight(?P<grp>\d+))$"
)


def expert_state_key(key: str, grouped: bool) -> str:
    """A state-dict key of either layout (of a model, or of an ``experts`` module) in the ``grouped`` (or
    sequential) one; other keys unchanged."""
    match = _EXPERT_KEY.match(key)
    if match is None:
        return key
    local = int(match["seq"] if match["seq"] is not None else match["grp"])
    linear = match["seq_linear"] or match["grp_linear"]
    return match["prefix"] + expert_weight_name(local, linear, grouped)
