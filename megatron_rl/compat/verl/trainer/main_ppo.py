"""verl's launch line on megatron-rl: ``python3 -m megatron_rl.compat.verl.trainer.main_ppo`` takes the
arguments of ``python3 -m verl.trainer.main_ppo`` unchanged.

Every argument is honoured or refused before anything starts (a refusal names the key; exit code as for
any config error). What this layer does, on top of megatron-rl's own keys (which already carry verl's
names):

- ``--config-path=config --config-name=ppo_megatron_trainer[.yaml]`` (or ``ppo_trainer``): megatron-rl's
  base config is the analogue of both; they are dropped. Other config names are refused.
- keys verl has and megatron-rl implements differently, translated (``VERL_KEYS``):
  ``actor_rollout_ref.rollout.mode=async|sync`` -> colocated (verl's hybrid engine places rollout the same
  way; megatron-rl generates a step's batch synchronously, which is what either mode trains on);
  ``data.return_raw_chat`` (raw prompts always travel in non_tensor_batch["raw_prompt"]);
  ``actor_rollout_ref.model.use_fused_kernels=True`` (the fused log-prob kernel is always used);
  ``trainer.critic_warmup=0`` (no warm-up is what megatron-rl does);
  ``custom_reward_function.path|name`` (verl's top level) -> ``reward.custom_reward_function.path|name``;
  ``actor_rollout_ref.rollout.load_format=dummy_dtensor|dummy_megatron|dummy_hf`` (verl's names for "random
  weights until the first sync") -> ``dummy``, vLLM's name for it;
  ``actor_rollout_ref.model.use_remove_padding`` / ``critic.model.use_remove_padding`` (verl's packed layout) ->
  ``<role>.megatron.packed_sequences`` of the actor and reference / the critic;
  ``model_engine=megatron`` (the only engine here) and ``ray_kwargs.ray_init.runtime_env.py_executable=null`` (Ray
  workers run the driver's Python) are accepted and dropped;
  ``actor_rollout_ref.actor.policy_loss.loss_mode=<name>`` -> ``actor_rollout_ref.actor.policy_loss=<name>`` and
  ``actor_rollout_ref.actor.policy_loss.<param>`` -> ``actor_rollout_ref.actor.<param>`` (the loss's parameters sit
  next to its name here).
- ``actor_rollout_ref.rollout.name=vllm|sglang|hf`` as is (vLLM: docs/rollout.md), and verl's vLLM keys, which
  megatron-rl has under the same names: ``gpu_memory_utilization``, ``enforce_eager``, ``max_num_batched_tokens``,
  ``max_num_seqs``, ``enable_chunked_prefill``, ``enable_prefix_caching``, ``free_cache_engine``, ``load_format``.
  ``actor_rollout_ref.rollout.engine_kwargs.vllm.<arg>=`` / ``.sglang.<arg>=`` (with or without verl's ``+``)
  become ``++...`` (set or add: the dicts start empty), checked by validation against vLLM's engine arguments.
- refused with the reason: the values of the keys above that megatron-rl cannot honour (use_fused_kernels=False,
  critic_warmup>0, model_engine other than megatron, a py_executable), and any key megatron-rl's schema does not have (Hydra's struct check names it; verl's
  ``rollout.max_model_len``, ``disable_log_stats``, ``cudagraph_capture_sizes`` and
  ``update_weights_bucket_megabytes`` say where the same setting lives here: config/checks.py VERL_CORE_KEYS).
"""

from __future__ import annotations

import sys
from typing import Callable

from megatron_rl.config import ConfigError
from megatron_rl.trainer.signals import EXIT_CONFIG_ERROR

_CONFIG_NAMES = ("ppo_megatron_trainer", "ppo_megatron_trainer.yaml", "ppo_trainer", "ppo_trainer.yaml")


def _truthy(value: str) -> bool:
    return value.strip().strip("'\"").lower() in ("true", "1", "yes")


def _rollout_mode(value: str) -> str | None:
    v = value.strip().strip("'\"")
    if v in ("async", "sync"):
        return "actor_rollout_ref.rollout.mode=colocated"
    return f"actor_rollout_ref.rollout.mode={v}"


def _fused(value: str) -> str | None:
    if _truthy(value):
        return None
    raise ConfigError("actor_rollout_ref.model.use_fused_kernels=False: megatron-rl always computes log-probs "
                      "with its fused kernel; drop the key")


def _critic_warmup(value: str) -> str | None:
    if int(value) == 0:
        return None
    raise ConfigError(f"trainer.critic_warmup={value}: megatron-rl has no critic warm-up steps (actor updates start "
                      "at step 1); set it to 0 or drop it")


# verl's load_format names for "random weights until the first weight sync" (FSDP / Megatron / HF workers)
_VERL_DUMMY_FORMATS = ("dummy_dtensor", "dummy_megatron", "dummy_hf")


def _load_format(value: str) -> str | None:
    v = value.strip().strip("'\"")
    return f"actor_rollout_ref.rollout.load_format={'dummy' if v in _VERL_DUMMY_FORMATS else v}"


# engine_kwargs.<engine> start as empty dicts: verl's `+key=value` (and a plain `key=value`) become `++key=value`,
# which adds the key or sets it, so both spellings compose here.
_ENGINE_KWARGS = ("actor_rollout_ref.rollout.engine_kwargs.vllm", "actor_rollout_ref.rollout.engine_kwargs.sglang")


def _engine_kwargs_key(key: str) -> str | None:
    bare = key.lstrip("+")
    if key.startswith("~") or not any(bare == k or bare.startswith(k + ".") for k in _ENGINE_KWARGS):
        return None
    return "++" + bare


def _remove_padding(*roles: str) -> Callable[[str], list[str]]:
    """verl's ``use_remove_padding=True`` is its packed (THD) layout: megatron-rl's ``megatron.packed_sequences``
    (docs/workers.md, 'Batching'); False is the padded layout, megatron-rl's default."""

    def packed(value: str) -> list[str]:
        return [f"{role}.megatron.packed_sequences={'true' if _truthy(value) else 'false'}" for role in roles]

    return packed


def _model_engine(value: str) -> None:
    if value.strip().strip("'\"") != "megatron":
        raise ConfigError(f"model_engine={value}: megatron-rl trains with Megatron-Core only; set model_engine=megatron "
                          "or drop the key")
    return None


def _py_executable(value: str) -> None:
    """verl's uv launchers pass the interpreter Ray workers should start with. Ray here starts the workers with the
    driver's own Python (the one running this command), so only null fits."""
    if value.strip().strip("'\"").lower() not in ("null", "none", ""):
        raise ConfigError(f"ray_kwargs.ray_init.runtime_env.py_executable={value}: megatron-rl's Ray workers run the "
                          "driver's Python; launch the command inside that environment (e.g. `uv run ... python3 -m "
                          "megatron_rl.compat.verl.trainer.main_ppo ...`) and drop the key, or set it to null")
    return None


VERL_KEYS: dict[str, Callable[[str], str | list[str] | None]] = {
    # verl keeps the custom scorer at the top level; megatron-rl under reward (with reward_manager and the rest)
    "custom_reward_function.path": lambda value: f"reward.custom_reward_function.path={value}",
    "custom_reward_function.name": lambda value: f"reward.custom_reward_function.name={value}",
    "actor_rollout_ref.rollout.mode": _rollout_mode,
    "actor_rollout_ref.rollout.load_format": _load_format,
    "data.return_raw_chat": lambda value: None,
    "actor_rollout_ref.model.use_fused_kernels": _fused,
    "trainer.critic_warmup": _critic_warmup,
    "actor_rollout_ref.model.use_remove_padding": _remove_padding("actor_rollout_ref.actor", "actor_rollout_ref.ref"),
    "critic.model.use_remove_padding": _remove_padding("critic"),
    "model_engine": _model_engine,
    "ray_kwargs.ray_init.runtime_env.py_executable": _py_executable,
}


# verl nests the policy loss: actor.policy_loss.loss_mode picks it, actor.policy_loss.<param> configures it; here
# actor.policy_loss names it and its parameters sit next to it (config/schema.py ActorConfig)
_POLICY_LOSS = "actor_rollout_ref.actor.policy_loss."


def _policy_loss_key(key: str, value: str) -> str | None:
    bare = key.lstrip("+")
    if not bare.startswith(_POLICY_LOSS):
        return None
    name = bare[len(_POLICY_LOSS):]
    return f"actor_rollout_ref.actor.{'policy_loss' if name == 'loss_mode' else name}={value}"


def translate(argv: list[str]) -> list[str]:
    """verl's main_ppo arguments -> megatron_rl.train arguments (ConfigError naming a refused key)."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        for flag in ("--config-path", "--config-name", "-cp", "-cn"):
            if arg == flag or arg.startswith(flag + "="):
                value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
                i += 1 if "=" in arg else 2
                value = value.strip().strip("'\"")
                if flag in ("--config-name", "-cn") and value not in _CONFIG_NAMES:
                    raise ConfigError(f"{flag}={value}: megatron-rl composes one base config (configs/ppo_trainer.yaml, "
                                      f"the analogue of verl's ppo_megatron_trainer); known: {list(_CONFIG_NAMES)}")
                break
        else:
            key, sep, value = arg.partition("=")
            bare = key.lstrip("+~")
            if sep and _engine_kwargs_key(key) is not None:
                out.append(f"{_engine_kwargs_key(key)}={value}")
            elif sep and _policy_loss_key(key, value) is not None:
                out.append(_policy_loss_key(key, value))
            elif sep and bare in VERL_KEYS:
                try:
                    replaced = VERL_KEYS[bare](value)
                except ValueError as err:
                    if isinstance(err, ConfigError):
                        raise
                    raise ConfigError(f"{bare}={value}: {err}") from None
                if isinstance(replaced, list):
                    out.extend(replaced)
                elif replaced is not None:
                    out.append(replaced)
            else:
                out.append(arg)
            i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        translated = translate(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    from megatron_rl import train

    sys.argv = [sys.argv[0], *translated]
    train.main()


if __name__ == "__main__":
    main()
