"""The ``distillation:`` section of the config: on-policy distillation (verl's keys and defaults; docs/distillation.md).

The student is the actor: it samples from the prompts as in RL, a teacher scores the student's tokens, and the
student's update minimises the per-token divergence (``distillation_loss``, algos/distillation.py), with or
without the task-reward policy loss mixed in. The teacher is a frozen Megatron engine of its own checkpoint on the
actor's ranks and layout (workers/teacher.py), as the reference is, or with ``teacher_models.<name>.inference.name=hf``
an HF engine on each rollout replica's leader (the rollout mesh's layout). verl's keys for a teacher served on GPUs of
its own (``n_gpus_per_node``, ``nnodes``, ``num_replicas``) and its vLLM / SGLang servers are refused when set
(plan/distillation.py): that placement is not built.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class DistillationLossSection:
    """``distillation.distillation_loss``: algos/distillation.py ``DistillationLossConfig``'s fields, restated
    because config/ imports no domain package (tests/algos/test_distillation_losses.py keeps them equal)."""

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


@dataclass
class TeacherModelConfig:
    """One entry of ``distillation.teacher_models``: the teacher's HF checkpoint (same tokenizer as the student)."""

    model_path: Optional[str] = None
    key: Optional[str] = None  # verl's multi-teacher routing value of distillation.teacher_key; one teacher here
    num_replicas: int = 0  # verl's inference replicas of a served teacher: not built (refused when set)
    # verl's serving engine: {name: hf} serves the teacher by an HF engine on the rollout leaders; the rest refused
    inference: dict[str, Any] = field(default_factory=dict)


@dataclass
class DistillationConfig:
    enabled: bool = False
    distillation_loss: DistillationLossSection = field(default_factory=DistillationLossSection)
    # verl's pool of GPUs for served teachers; 0: none (the teacher is colocated with the actor, the one way here)
    n_gpus_per_node: int = 0
    nnodes: int = 0
    # verl's one default entry, so that ``distillation.teacher_models.teacher_model.model_path=DIR`` sets the teacher
    teacher_models: dict[str, TeacherModelConfig] = field(
        default_factory=lambda: {"teacher_model": TeacherModelConfig()})
    teacher_key: str = "data_source"


ENGINE_TEACHERS = ("hf",)  # inference.name values built (workers/teacher.py EngineTeacher)


def served_teacher(section: DistillationConfig) -> str | None:
    """The engine serving the teacher (``inference.name``), or None for the frozen Megatron engine."""
    named = [t for t in section.teacher_models.values() if t.model_path]
    inference = dict(named[0].inference) if named else {}
    return inference["name"] if "name" in inference else None
