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
  ``custom_reward_function.path|name`` (verl's top level) -> ``reward.custom_reward_function.path|name``.
- refused with the reason: ``rollout.name=vllm`` (no vLLM adapter: sglang on GPUs, hf on CPU), the values of
  the keys above that megatron-rl cannot honour (use_fused_kernels=False, critic_warmup>0), and any key
  megatron-rl's schema does not have (Hydra's struct check names it).
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


def _rollout_name(value: str) -> str | None:
    v = value.strip().strip("'\"")
    if v == "vllm":
        raise ConfigError("actor_rollout_ref.rollout.name=vllm: megatron-rl has no vLLM adapter; use "
                          "actor_rollout_ref.rollout.name=sglang (GPUs) or hf (CPU)")
    return f"actor_rollout_ref.rollout.name={v}"


VERL_KEYS: dict[str, Callable[[str], str | None]] = {
    # verl keeps the custom scorer at the top level; megatron-rl under reward (with reward_manager and the rest)
    "custom_reward_function.path": lambda value: f"reward.custom_reward_function.path={value}",
    "custom_reward_function.name": lambda value: f"reward.custom_reward_function.name={value}",
    "actor_rollout_ref.rollout.mode": _rollout_mode,
    "actor_rollout_ref.rollout.name": _rollout_name,
    "data.return_raw_chat": lambda value: None,
    "actor_rollout_ref.model.use_fused_kernels": _fused,
    "trainer.critic_warmup": _critic_warmup,
}


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
            if sep and bare in VERL_KEYS:
                try:
                    replaced = VERL_KEYS[bare](value)
                except ValueError as err:
                    if isinstance(err, ConfigError):
                        raise
                    raise ConfigError(f"{bare}={value}: {err}") from None
                if replaced is not None:
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
