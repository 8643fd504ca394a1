"""verl's defaults where megatron-rl's differ and the difference changes memory or numbers: the compat entry
places these before the user's arguments (which win), so a verl command line plans and trains as it does
under verl. Defaults that only name things (project, output directory, loggers) or guard a run (save_freq)
stay megatron-rl's. Each entry says why; the entry logs them.

A command line that picks one of megatron-rl's presets (``+experiment=<name>``) gets none of them: Hydra applies
command-line values after a preset, so verl's defaults would silently replace the preset's own choices (a GRPO
preset would train GAE with a critic). A preset is a whole megatron-rl recipe; the entry says that verl's defaults
were left out, and the user's own arguments still win over the preset."""

from __future__ import annotations

from typing import Mapping

from megatron_rl.compat.verl.keys import bare

_ACTOR = "actor_rollout_ref.actor"
_REF = "actor_rollout_ref.ref"

# verl's ref follows the actor's layout (its megatron_ref.yaml interpolates these from the actor)
_REF_FOLLOWS_ACTOR = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                      "expert_tensor_parallel_size", "param_offload", "seed", "override_transformer_config")

# (key, value, why): always applied
FIXED: tuple[tuple[str, str, str], ...] = (
    *((f"{role}.megatron.packed_sequences", "true", "verl's use_remove_padding defaults to True (packed THD)")
      for role in (_ACTOR, _REF, "critic")),
    *((f"{_REF}.megatron.{name}", f"${{{_ACTOR}.megatron.{name}}}", "verl's ref takes the actor's layout")
      for name in _REF_FOLLOWS_ACTOR),
    (f"{_REF}.log_prob_use_dynamic_bsz", f"${{{_ACTOR}.use_dynamic_bsz}}", "verl: the actor's use_dynamic_bsz"),
    (f"{_REF}.log_prob_max_token_len_per_gpu", f"${{{_ACTOR}.ppo_max_token_len_per_gpu}}",
     "verl: the actor's ppo_max_token_len_per_gpu"),
    ("critic.use_dynamic_bsz", f"${{{_ACTOR}.use_dynamic_bsz}}", "verl: the actor's use_dynamic_bsz"),
    ("critic.loss_agg_mode", f"${{{_ACTOR}.loss_agg_mode}}", "verl: the actor's loss_agg_mode"),
    ("trainer.balance_batch", "true", "verl balances sequence lengths over DP ranks by default"),
    ("actor_rollout_ref.rollout.n", "1", "verl samples one response per prompt by default"),
    ("algorithm.adv_estimator", "gae", "verl's default estimator is GAE (PPO with a critic)"),
    ("data.filter_overlong_prompts", "false", "verl keeps overlong prompts by default (data.truncation decides)"),
    ("actor_rollout_ref.rollout.seed", "42", "verl's rollout seed"),
    ("algorithm.filter_groups.max_num_gen_batches", "0", "verl: 0 = no limit on DAPO's extra generation batches"),
    ("trainer.total_epochs", "30", "verl's default"),
    ("trainer.val_before_train", "true", "verl validates before the first step by default"),
    ("trainer.device", "cuda", "verl's default device (a CPU run says trainer.device=cpu, as under verl)"),
)


def _gpu_run(seen: Mapping[str, str]) -> bool:
    """verl runs on GPUs (trainer.device defaults to cuda there and here under this entry); only trainer.device=cpu
    is not one. A dry run on a CPU login node so plans what the cluster runs; a real start where the distributed
    optimizer cannot be had is refused by the launch check, naming the key (plan/planner.py check_launch)."""
    return bare(seen.get("trainer.device", "cuda")) != "cpu"


def verl_defaults(seen: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(overrides to place before the user's, one note per default applied). ``seen``: the command line's
    key -> value (bare keys)."""
    out = [f"{key}={value}" for key, value, _ in FIXED]
    notes = [f"{key}={value}: {why}" for key, value, why in FIXED]
    for role in (_ACTOR, "critic"):
        # verl's McoreEngineConfig turns sequence parallelism off at TP=1, on otherwise
        tp = int(bare(seen.get(f"{role}.megatron.tensor_model_parallel_size", "1")))
        out.append(f"{role}.megatron.sequence_parallel={'true' if tp > 1 else 'false'}")
        notes.append(f"{out[-1]}: verl's default (sequence parallel when TP > 1)")
        if _gpu_run(seen):
            out.append(f"{role}.megatron.use_distributed_optimizer=true")
            notes.append(f"{out[-1]}: verl's default")
        else:
            notes.append(f"{role}.megatron.use_distributed_optimizer stays false (trainer.device=cpu): verl's default "
                         "needs Transformer Engine or Apex")
    out.append(f"{_REF}.megatron.sequence_parallel=${{{_ACTOR}.megatron.sequence_parallel}}")
    notes.append(f"{out[-1]}: the actor's, as the layout")
    return out, notes


def chosen_preset(args: list[str]) -> str | None:
    """The megatron-rl preset a command line picks (``+experiment=<name>`` / ``experiment=<name>``), if any."""
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") == "experiment":
            return bare(value)
    return None


def preset_note(preset: str) -> str:
    """The log line of a command line with a preset: which verl defaults it does not get."""
    return (f"+experiment={preset}: the preset's values and megatron-rl's defaults stand; verl's defaults are not "
            f"applied (they would override the preset: {', '.join(key for key, _, _ in FIXED[:3])}, ... "
            f"{len(FIXED)} keys, and sequence_parallel / use_distributed_optimizer per role); set any of them on the "
            "command line to choose it")
