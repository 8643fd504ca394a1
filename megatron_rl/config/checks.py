"""Checks of ``validate()`` that read the schema itself. Those that walk the composed DictConfig by its keys'
strings (unknown keys, what ``+key=value`` slips past OmegaConf; closed choices; verl's values) run on it before
it becomes the typed tree (config/loader.py ``checked_typed_config``); the optimizer and schedule values, and
settings that would silently do nothing, are read from the typed tree."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Iterable, Iterator

from omegaconf import DictConfig, OmegaConf

from megatron_rl.config.optimizer_overrides import check_optimizer_overrides
from megatron_rl.config.schema import ActorConfig, CriticConfig, PPOTrainerConfig, choices_of
from megatron_rl.distributed.device import rollout_on_cpu


class CheckError(ValueError):
    """validate() turns it into a ConfigError."""
    pass


def _schema_fields(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_free_form(hint: Any) -> bool:
    """dict[str, Any] / Any fields take any key (override_config, plan.architecture)."""
    return hint is Any or typing.get_origin(hint) is dict or hint is dict


def _all_paths(cls: type, prefix: str = "") -> Iterator[str]:
    for name, hint in _schema_fields(cls).items():
        path = f"{prefix}{name}"
        yield path
        inner = _dataclass_of(hint)
        if inner is not None:
            yield from _all_paths(inner, path + ".")


def _dataclass_of(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):  # Optional[SomeConfig]
        if dataclasses.is_dataclass(arg):
            return arg
    return None


# Keys of verl's async recipes (recipe/one_step_off_policy, recipe/fully_async_policy) that are not verl's core
# config, and what says the same here: a recipe user's overrides fail on them, so the error says where to go.
_STEP_IS_A_SYNC = ("a step here trains data.train_batch_size prompts (in its ppo_mini_batch_size mini-batches) and "
                   "then syncs the weights: verl's trigger_parameter_sync_step x require_batches x "
                   "ppo_mini_batch_size = data.train_batch_size, the recipe's setting for a fair comparison, is what "
                   "runs; set data.train_batch_size")
VERL_RECIPE_KEYS = {
    "async_training.staleness_threshold": "verl bounds stale samples as a fraction of a sync's samples; here the "
    "bound is in weight versions: async_training.max_staleness (how many versions a sample's oldest token may lag "
    "the policy that trains it) with async_training.buffer_batches batches generated ahead",
    "async_training.trigger_parameter_sync_step": _STEP_IS_A_SYNC,
    "async_training.require_batches": _STEP_IS_A_SYNC,
    "async_training.use_rollout_log_probs": "old log-probs taken from the rollout: "
    "algorithm.rollout_correction.bypass_mode=true (verl's core key)",
    "async_training.compute_prox_log_prob": "log-probs of a proximal policy recomputed by the trainer: "
    "actor_rollout_ref.actor.policy_loss=decoupled_ppo (AReaL's decoupled PPO), or algorithm.rollout_correction."
    "rollout_is with bypass_mode=false",
    "async_training.checkpoint_engine": "weight-sync buckets: actor_rollout_ref.rollout.weight_sync.bucket_size_mb",
    "rollout": "the rollout's own resources are its servers: actor_rollout_ref.rollout.mode=server with "
    "actor_rollout_ref.rollout.num_servers (actor_rollout_ref.rollout.servers_per_node per Ray node); verl's rollout.test_freq is "
    "trainer.test_freq, rollout.total_rollout_steps is trainer.total_training_steps x data.train_batch_size",
    "data.gen_batch_size": "the rollouter generates whole loader batches (data.train_batch_size prompts), which keeps "
    "every group of rollout.n responses whole",
}


# Keys of verl's core config that megatron-rl does not have, and why: refused the same way (compose time and
# +key at validation), never silently dropped.
VERL_CORE_KEYS = {
    "actor_rollout_ref.actor.checkpoint": "a checkpoint here always holds the model, the optimizer and the rest "
    "of the run's state (verl's save_contents model, optimizer, extra), so that a resume continues exactly; the HF "
    "export is trainer.save_hf_at_end (docs/trainer.md)",
    # verl's rollout keys for vLLM that megatron-rl keeps elsewhere (rollout/vllm/contract.py OWNED_ENGINE_ARGS)
    "actor_rollout_ref.rollout.max_model_len": "a rollout engine's context here is data.max_prompt_length + the "
    "response length (actor_rollout_ref.rollout.response_length, null: data.max_response_length); set those",
    "actor_rollout_ref.rollout.disable_log_stats": "it is a vLLM engine argument: "
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_log_stats=<value> (rollout.name=vllm)",
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": "it is a vLLM engine argument: "
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.cudagraph_capture_sizes=[...] (rollout.name=vllm, with "
    "actor_rollout_ref.rollout.enforce_eager=false)",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": "weight-sync buckets: "
    "actor_rollout_ref.rollout.weight_sync.bucket_size_mb",
}


def _hints(paths: Iterable[str], table: dict[str, str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in paths:
        parts = path.split(".")
        entry = next((".".join(parts[:end]) for end in range(len(parts), 0, -1)
                      if ".".join(parts[:end]) in table), None)
        if entry is not None and path not in found.setdefault(entry, []):
            found[entry].append(path)
    return found


def verl_recipe_hints(paths: Iterable[str]) -> list[str]:
    """Where the keys of verl (its async recipes, and its core keys megatron-rl does not have) among ``paths``
    (or sections above them) stand here, one message per table entry naming every path it answers."""
    paths = list(paths)
    recipe = _hints(paths, VERL_RECIPE_KEYS)
    core = _hints(paths, VERL_CORE_KEYS)
    return ([f"{', '.join(named)} {'is a key' if len(named) == 1 else 'are keys'} of verl's async recipes, not of "
             f"its core config: {VERL_RECIPE_KEYS[entry]}" for entry, named in recipe.items()] +
            [f"{', '.join(named)} {'is a key' if len(named) == 1 else 'are keys'} of verl's config that megatron-rl "
             f"does not have: {VERL_CORE_KEYS[entry]}" for entry, named in core.items()])


def check_verl_values(cfg: DictConfig) -> None:
    """verl's keys kept for its configs whose other values megatron-rl does not run (the options of a choice
    field are refused by the schema itself, e.g. actor.strategy=fsdp)."""
    for key in ("actor_rollout_ref.model.trust_remote_code", "critic.model.trust_remote_code"):
        if OmegaConf.select(cfg, key, default=False):
            raise CheckError(f"{key}=true: megatron-rl builds models with its own Megatron builders from config.json "
                             "and loads tokenizers without remote code, so code shipped in a checkpoint never runs; "
                             "set it false (a model family the builders do not know is refused by name: docs/models.md)")


def unknown_keys(cfg: DictConfig, cls: type = PPOTrainerConfig, prefix: str = "") -> list[str]:
    """Messages for every key of ``cfg`` that its schema node does not have, with the nearest known names."""
    fields = _schema_fields(cls)
    messages = []
    every_path = None
    for key in cfg.keys():
        key = str(key)
        path = f"{prefix}{key}"
        if key not in fields:
            every_path = every_path or list(_all_paths(PPOTrainerConfig))
            near = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.6)
            elsewhere = [p for p in every_path if p.rsplit(".", 1)[-1] == key]
            hints = []
            if near:
                hints.append(f"did you mean {', '.join(prefix + n for n in near)}?")
            if elsewhere:
                hints.append(f"a key of that name lives at {', '.join(elsewhere)}")
            hints[:0] = verl_recipe_hints([path])
            node = prefix.rstrip(".") or "the top level"
            known = ", ".join(sorted(fields))
            messages.append(f"{path} is not a known key ({'; '.join(hints) + '; ' if hints else ''}"
                            f"known under {node}: {known})")
            continue
        inner = _dataclass_of(fields[key])
        value = cfg._get_node(key)
        if inner is None or not isinstance(value, DictConfig) or value._is_none():
            continue
        if typing.get_origin(fields[key]) is dict:  # dict[str, SomeConfig]: every entry is one (named by the user)
            for name in value.keys():
                entry = value._get_node(name)
                if isinstance(entry, DictConfig) and not entry._is_none():
                    messages.extend(unknown_keys(entry, inner, f"{path}.{name}."))
            continue
        messages.extend(unknown_keys(value, inner, path + "."))
    return messages


def check_known_keys(cfg: DictConfig) -> None:
    messages = unknown_keys(cfg)
    if messages:
        raise CheckError("; ".join(messages) + " (megatron-rl takes verl's names; verl-only keys are not supported, "
                     "see docs/configuration.md)")


def check_optimizer(cfg: PPOTrainerConfig, role: ActorConfig | CriticConfig, prefix: str,
                    total_steps: int | None) -> None:
    """``<prefix>.optim`` of a trained role (``role``: its section, the actor's or the critic's)."""
    optim = role.optim
    key = f"{prefix}.optim"
    if not optim.lr > 0:
        raise CheckError(f"{key}.lr must be > 0, got {optim.lr}")
    betas = list(optim.betas)
    if len(betas) != 2:
        raise CheckError(f"{key}.betas must be two numbers [beta1, beta2], got {betas}")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise CheckError(f"{key}.betas={betas}: each must lie in [0, 1)")
    if optim.weight_decay < 0:
        raise CheckError(f"{key}.weight_decay must be >= 0, got {optim.weight_decay}")
    if not optim.clip_grad > 0:
        raise CheckError(f"{key}.clip_grad must be > 0, got {optim.clip_grad}")
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        raise CheckError(f"{key}.min_lr_ratio must lie in [0, 1], got {optim.min_lr_ratio}")
    if optim.lr_warmup_steps < 0:
        raise CheckError(f"{key}.lr_warmup_steps must be >= 0, got {optim.lr_warmup_steps}")
    # Megatron's OptimizerConfig fields (verl's CPU Adam): unknown, owned or unrunnable ones refused, naming the key
    check_optimizer_overrides(optim.override_optimizer_config, f"{key}.override_optimizer_config",
                              on_cpu=rollout_on_cpu(cfg),  # trainer.device=cpu, or auto without CUDA
                              distributed_optimizer=bool(role.megatron.use_distributed_optimizer))
    steps = optim.total_training_steps if optim.total_training_steps != -1 else total_steps
    if steps is not None and optim.lr_warmup_steps > steps:
        raise CheckError(f"{key}.lr_warmup_steps={optim.lr_warmup_steps} is longer than the {steps} training steps "
                     f"(trainer.total_training_steps); the learning rate would never reach {key}.lr")


def check_run_settings(cfg: PPOTrainerConfig, uses_critic: bool) -> None:
    trainer, reward = cfg.trainer, cfg.reward
    total = trainer.total_training_steps
    if total is not None and total < 1:
        raise CheckError(f"trainer.total_training_steps={total} would train nothing; set it >= 1, or to null for "
                     f"trainer.total_epochs over the data")
    check_optimizer(cfg, cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor", total)
    if uses_critic:
        check_optimizer(cfg, cfg.critic, "critic", total)
    if reward.max_failed_steps < 0:
        raise CheckError(f"reward.max_failed_steps must be >= 0 (0: never stop), got {reward.max_failed_steps}")
    if trainer.max_ckpt_to_keep < 1:
        raise CheckError(f"trainer.max_ckpt_to_keep must be >= 1, got {trainer.max_ckpt_to_keep}")


def _choice_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, list[str]]]:
    for name, hint in _schema_fields(cls).items():
        choices = choices_of(cls, name)
        if choices is not None:
            yield f"{prefix}{name}", choices
        inner = _dataclass_of(hint)
        if inner is not None:
            yield from _choice_fields(inner, f"{prefix}{name}.")


def check_choices(cfg: DictConfig) -> None:
    """Every choice field holds one of its options (OmegaConf enforces this for configs built on the schema;
    this catches configs built otherwise)."""
    for key, choices in _choice_fields(PPOTrainerConfig):
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        if value is not None and str(value) not in choices:
            raise CheckError(f"{key}={str(value)!r} is unknown; known: {choices}")


def describe_choice_error(message: str, full_key: str, object_type: Any, key: Any) -> str | None:
    """OmegaConf's "Invalid value 'x', expected one of [a, b]" as "<full_key>='x' is unknown; known: ['a', 'b']"."""
    import re

    match = re.match(r"Invalid value '(.*)', expected one of", message)
    if not match or not dataclasses.is_dataclass(object_type):
        return None
    try:
        choices = choices_of(object_type, str(key))
    except KeyError:
        return None
    return f"{full_key}={match.group(1)!r} is unknown; known: {choices}" if choices else None
