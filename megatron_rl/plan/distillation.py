"""Before launch: the ``distillation:`` section (config/distillation_schema.py; docs/distillation.md) against what
the run builds: one teacher, a frozen Megatron engine of its checkpoint on the actor's ranks and layout."""

from __future__ import annotations

from megatron_rl.algos.distillation import DistillationLossConfig
from megatron_rl.config.distillation_schema import ENGINE_TEACHERS
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema import PPOTrainerConfig

KEY = "distillation"


def teacher_path(cfg: PPOTrainerConfig) -> str:
    """The one teacher's checkpoint (``distillation.teacher_models.<name>.model_path``), refused naming the key
    when there is not exactly one."""
    named = {name: t.model_path for name, t in cfg.distillation.teacher_models.items() if t.model_path}
    if len(named) != 1:
        raise ConfigError(f"{KEY}.enabled=true needs exactly one teacher with {KEY}.teacher_models.<name>.model_path "
                          f"set, got {sorted(named) or 'none'} (several teachers routed by {KEY}.teacher_key are "
                          "not built)")
    return next(iter(named.values()))


def check_distillation(cfg: PPOTrainerConfig) -> None:
    """Raise ConfigError naming the key for a distillation setting the run cannot honour."""
    section = cfg.distillation
    if not section.enabled:
        return
    teacher_path(cfg)
    for key in ("n_gpus_per_node", "nnodes"):
        if getattr(section, key):
            raise ConfigError(f"{KEY}.{key}={getattr(section, key)}: a GPU pool of the teacher's own is not built; "
                              "the teacher runs on the actor's ranks at the reference's layout (leave it 0)")
    for name, teacher in section.teacher_models.items():
        where = f"{KEY}.teacher_models.{name}"
        if teacher.num_replicas:
            raise ConfigError(f"{where}.num_replicas={teacher.num_replicas}: a teacher on replicas of its own is not "
                              "built; it runs on the actor's ranks (leave it 0)")
        _check_inference(where, dict(teacher.inference))
    try:
        loss = DistillationLossConfig.from_config(section.distillation_loss)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{KEY}.distillation_loss: {err}") from None
    mode = cfg.async_training.mode
    if mode != "sync":
        raise ConfigError(f"{KEY}.enabled=true with async_training.mode={mode} is not built (the teacher scores in "
                          "the synchronous loop); use async_training.mode=sync")
    if loss.use_policy_gradient and cfg.algorithm.rollout_correction.bypass_mode:
        raise ConfigError(f"{KEY}.distillation_loss.use_policy_gradient=true weighs by the old log-probs, which "
                          "algorithm.rollout_correction.bypass_mode=true replaces by the rollout's: set one false")


def _check_inference(where: str, inference: dict) -> None:
    """``inference``: empty (the Megatron teacher) or ``{name: hf}`` (an HF engine on the rollout leaders)."""
    if not inference:
        return
    name, rest = inference.get("name"), sorted(set(inference) - {"name"})
    if name not in ENGINE_TEACHERS:
        raise ConfigError(f"{where}.inference.name={name!r}: a teacher served by {name or 'an unnamed engine'} is not "
                          f"built; {where}.inference.name=hf serves it by an HF engine on the rollout replicas' "
                          "leaders, an empty inference runs it as a frozen Megatron engine on the actor's ranks")
    if rest:
        raise ConfigError(f"{where}.inference: {rest} set for the HF engine teacher, which takes only name (it runs "
                          "one whole copy on each rollout replica's leader)")
