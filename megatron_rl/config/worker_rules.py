"""Rules on config values that the run's own code (the workers, the training loop) and validation both call, so a
setting the run would refuse after start-up is refused before launch by the same words (issue 56 item 6).

A rule here reads settings only (no file, no device): ``plan/validate.py`` calls it in ``check_refused_at_run_time``,
the run where it needs the value. Rules that belong to a module of their own stay there and are called from
validation the same way (``workers/lr_schedule.py`` ``check_optim_config``, ``models/builder.py``
``check_transformer_overrides``); tests/unit/test_refusal_guard.py counts a worker's refusal inside a function that
validation calls as refused before launch.
"""
from __future__ import annotations

__all__ = ["RESUME_MODES", "check_resume_setting", "check_share_prompts_packing"]

RESUME_MODES = ("auto", "disable", "resume_path")  # trainer.resume_mode (config/choices.py ResumeMode)


def check_resume_setting(mode: str, explicit: str | None) -> None:
    """trainer.resume_mode and trainer.resume_from_path as settings (no file read): the rule of the loop's resume
    (trainer/checkpointing.py ``TrainerCheckpointer.resume_path``) and of validation."""
    if str(mode) not in RESUME_MODES:
        raise ValueError(f"trainer.resume_mode={str(mode)!r} is unknown; known: {list(RESUME_MODES)}")
    if str(mode) == "resume_path" and not explicit:
        raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path (the global_step_N "
                         "directory to resume from)")


def check_share_prompts_packing(share_prompts: bool, packed_sequences: bool, prefix: str) -> None:
    """``<prefix>.share_prompts`` needs padded micro-batches: its tree mask is a dense mask the packed (THD) kernels
    do not take. ``prefix``: the role's megatron section (``actor_rollout_ref.actor.megatron``). The rule of the
    engine's batch layout (workers/engine.py ``check_share_prompts``) and of validation (plan/validate.py
    ``_check_packing``)."""
    if share_prompts and packed_sequences:
        raise ValueError(f"{prefix}.share_prompts=true and {prefix}.packed_sequences=true cannot both be on: shared "
                         "prompts need a tree attention mask, which the packed (THD) kernels do not take; set one "
                         "false (packed sequences: no padding; shared prompts: each prompt computed once per group)")
