"""What verl's async entries share: their config name checked, then compat/verl/trainer/main_ppo.py's translation
(verl's defaults, every core key's fate) for the arguments it knows, and the entry's own keys
(async_keys.py) through their rules, after it, so that what they set wins:

1. ``--config-name=<the entry's config>`` stands for megatron-rl's base config as ``ppo_megatron_trainer`` does
   for main_ppo; another name is refused.
2. The core keys verl's async config sets (``algorithm.rollout_correction.bypass_mode=True``) come before the
   user's arguments, which win (logged).
3. The entry's keys the command line does not set take verl's config-file value (or what verl's trainer requires,
   ``hybrid_engine=False``, the mode): they go through their rules as if written, so each rewrite is logged.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.compat.verl.experimental import async_keys
from megatron_rl.compat.verl.keys import Rule, Translation, command_line_settings, rule_for, translate_key
from megatron_rl.compat.verl.trainer import main_ppo
from megatron_rl.config import ConfigError


@dataclass(frozen=True)
class AsyncEntry:
    verl_module: str  # the module verl's shells run
    mode: str  # async_training.mode
    config_names: tuple[str, ...]  # --config-name values verl's entry takes
    rules: tuple[Rule, ...]  # the entry's own keys (async_keys.py)
    implied: tuple[tuple[str, str, str], ...]  # (key, value, why): entry keys unset on the command line
    config_defaults: tuple[tuple[str, str, str], ...]  # (key, value, why): core keys verl's config sets

    def translate_with_notes(self, argv: list[str], with_verl_defaults: bool = True) -> Translation:
        """verl's arguments of this entry -> megatron_rl.train arguments and the log lines saying what changed
        (ConfigError naming a refused key)."""
        return _translate_with_notes(self, argv, with_verl_defaults)

    def translate(self, argv: list[str], with_verl_defaults: bool = True) -> list[str]:
        return self.translate_with_notes(argv, with_verl_defaults).overrides

    def main(self, argv: list[str] | None = None) -> None:
        """The entry's main: main_ppo's launch with this entry's translation."""
        main_ppo.launch(self.translate_with_notes, argv)


def _names(stem: str) -> tuple[str, ...]:
    return tuple(f"{s}{ext}" for s in (f"{stem}_megatron_trainer", f"{stem}_trainer") for ext in ("", ".yaml"))


ONE_STEP_OFF = AsyncEntry("verl.experimental.one_step_off_policy.main_ppo", "one_step_off",
                          _names("one_step_off_ppo"), async_keys.ONE_STEP_OFF_RULES,
                          async_keys.ONE_STEP_OFF_IMPLIED, async_keys.ASYNC_CONFIG_DEFAULTS)
FULLY_ASYNC = AsyncEntry("verl.experimental.fully_async_policy.fully_async_main", "fully_async",
                         _names("fully_async_ppo"), async_keys.FULLY_ASYNC_RULES,
                         async_keys.FULLY_ASYNC_IMPLIED, async_keys.ASYNC_CONFIG_DEFAULTS)

_NAME_FLAGS = ("--config-name", "-cn")


def _as_base_config(entry: AsyncEntry, argv: list[str]) -> list[str]:
    """The entry's --config-name checked and replaced by main_ppo's base name (main_ppo drops the config flags)."""
    out = list(argv)
    for i, arg in enumerate(argv):
        flag = next((f for f in _NAME_FLAGS if arg == f or arg.startswith(f + "=")), None)
        if flag is None:
            continue
        at = i if "=" in arg else i + 1
        value = (arg.split("=", 1)[1] if "=" in arg else (argv[at] if at < len(argv) else "")).strip().strip("'\"")
        if value not in entry.config_names:
            raise ConfigError(f"{flag}={value}: `python -m megatron_rl.compat.verl.{entry.verl_module[5:]}` takes "
                              f"verl's {entry.mode} configs, known: {list(entry.config_names)} (verl's "
                              "ppo_megatron_trainer runs through megatron_rl.compat.verl.trainer.main_ppo)")
        if at < len(out):
            out[at] = f"{flag}={main_ppo.BASE_CONFIG_NAME}" if at == i else main_ppo.BASE_CONFIG_NAME
    return out


def _own(entry: AsyncEntry, arg: str) -> bool:
    key, sep, _ = arg.partition("=")
    return bool(sep) and not key.startswith(("-", "~")) and rule_for(key.lstrip("+"), entry.rules) is not None


def _translate_with_notes(entry: AsyncEntry, argv: list[str], with_verl_defaults: bool = True) -> Translation:
    """AsyncEntry.translate_with_notes."""
    args = _as_base_config(entry, list(argv))
    user = command_line_settings(args)
    implied = [(key, value, why) for key, value, why in entry.implied if key not in user]
    seen = {**{key: value for key, value, _ in implied}, **user}
    before = [(key, value, why) for key, value, why in entry.config_defaults if key not in user]
    core = [*(f"{k}={v}" for k, v, _ in before), *(a for a in args if not _own(entry, a))]
    base = main_ppo.translate_with_notes(core, with_verl_defaults)
    out, notes = list(base.overrides), list(base.notes)
    notes += [f"verl {entry.mode} config {key}={value}: {why}" for key, value, why in before]
    own = [(f"verl {entry.mode} entry sets ", f"{key}={value}", why) for key, value, why in implied]
    own += [("verl key ", arg, "") for arg in args if _own(entry, arg)]
    for prefix, arg, why in own:
        key, _, value = arg.partition("=")
        bare = key.lstrip("+")
        replaced, note = translate_key(bare, value, seen, entry.rules)
        out.extend(replaced or [])
        notes.append(f"{prefix}{note}" + (f" ({why})" if why else ""))
    return Translation(out, notes)
