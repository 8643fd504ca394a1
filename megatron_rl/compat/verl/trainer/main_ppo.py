"""verl's launch line on megatron-rl: ``python3 -m megatron_rl.compat.verl.trainer.main_ppo`` takes the
arguments of ``python3 -m verl.trainer.main_ppo`` unchanged.

1. ``--config-path=config --config-name=ppo_megatron_trainer[.yaml]`` (or ``ppo_trainer``) are dropped:
   megatron-rl's base config is the analogue of both; other config names are refused.
2. verl's defaults where megatron-rl's differ in memory or numbers come first (compat/verl/defaults.py:
   packed sequences, sequence parallelism, the distributed optimizer, the ref's layout following the actor's,
   balance_batch, ...), so the user's arguments override them as they would verl's. With one of megatron-rl's
   presets (``+experiment=<name>``) they are left out: the preset's values stand (logged).
3. Every argument then meets its fate (compat/verl/keys.py, the table in docs/configuration.md): rewritten onto
   megatron-rl's keys, accepted without effect, accepted at verl's default, refused with the reason, or passed on
   as is under verl's own name. verl's ``+key=`` on a key megatron-rl has becomes ``++key=`` (Hydra refuses to
   add a key that exists).
Each default applied and each rewrite is logged; a refusal exits with the config-error code before anything
starts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from megatron_rl import train
from megatron_rl.compat.verl.defaults import chosen_preset, preset_note, verl_defaults
from megatron_rl.compat.verl.keys import Translation, bare, command_line_settings, ours_has, translate_key
from megatron_rl.config import ConfigError
from megatron_rl.models.hf_config import UnsupportedModelError, causal_lm_architecture
from megatron_rl.trainer.signals import EXIT_CONFIG_ERROR

BASE_CONFIG_NAME = "ppo_megatron_trainer"  # verl's config that megatron-rl's base config stands for
_CONFIG_NAMES = (BASE_CONFIG_NAME, f"{BASE_CONFIG_NAME}.yaml", "ppo_trainer", "ppo_trainer.yaml")
_CONFIG_FLAGS = ("--config-path", "--config-name", "-cp", "-cn")


def _config_flags(argv: list[str]) -> list[str]:
    """The arguments without verl's config selection (checked)."""
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag = next((f for f in _CONFIG_FLAGS if arg == f or arg.startswith(f + "=")), None)
        if flag is None:
            rest.append(arg)
            i += 1
            continue
        value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
        i += 1 if "=" in arg else 2
        value = value.strip().strip("'\"")
        if flag in ("--config-name", "-cn") and value not in _CONFIG_NAMES:
            raise ConfigError(f"{flag}={value}: megatron-rl composes one base config (configs/ppo_trainer.yaml, the "
                              f"analogue of verl's ppo_megatron_trainer); known: {list(_CONFIG_NAMES)}")
    return rest


def _check_model_family(seen: dict[str, str]) -> None:
    """The model first: a family megatron-rl does not build (models/unbuilt.py) is refused by its architecture,
    with what is missing, before its script's keys are read (they would otherwise be refused one by one)."""
    key = "actor_rollout_ref.model.path"
    config = Path(bare(seen.get(key, ""))).expanduser() / "config.json"
    if not seen.get(key) or not config.is_file():
        return  # preflight reads the model when it is there
    try:
        causal_lm_architecture(json.loads(config.read_text()), f"{key}={config.parent}")
    except (UnsupportedModelError, ValueError) as err:  # (ValueError: config.json that is not JSON: preflight's)
        if isinstance(err, UnsupportedModelError):
            raise ConfigError(str(err)) from None


def translate_with_notes(argv: list[str], with_verl_defaults: bool = True) -> Translation:
    """verl's main_ppo arguments -> megatron_rl.train arguments and the log lines saying what changed
    (ConfigError naming a refused key). ``with_verl_defaults=False``: the arguments' own rewrites only."""
    args = _config_flags(list(argv))
    seen = command_line_settings(args)
    _check_model_family(seen)
    out, notes = verl_defaults(seen) if with_verl_defaults else ([], [])
    notes = [f"verl default {n}" for n in notes]
    if with_verl_defaults and (preset := chosen_preset(args)) is not None:  # the preset's values win over verl's
        out, notes = [], [preset_note(preset)]
    for arg in args:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+~")
        if not sep or key.startswith("~"):
            out.append(arg)
            continue
        replaced, note = translate_key(bare, value, seen)
        if note:
            notes.append(f"verl key {note}")
        if replaced is not None:
            out.extend(replaced)
        elif key.startswith("+") and not key.startswith("++") and ours_has(bare):
            out.append(f"++{bare}={value}")
        else:
            out.append(arg)
    return Translation(out, notes)


def translate(argv: list[str], with_verl_defaults: bool = True) -> list[str]:
    """verl's main_ppo arguments -> megatron_rl.train arguments (ConfigError naming a refused key)."""
    return translate_with_notes(argv, with_verl_defaults).overrides


def main(argv: list[str] | None = None) -> None:
    launch(translate_with_notes, argv)


def launch(translator: Callable[[list[str]], Translation], argv: list[str] | None = None) -> None:
    """A verl entry's main (this one's, the async entries' in compat/verl/experimental): ``translator`` turns its
    arguments into megatron_rl.train's (a refusal exits with the config-error code), the notes are logged, then
    megatron_rl.train runs."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        translation = translator(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    for note in translation.notes:
        print(f"[megatron_rl.compat.verl] {note}", file=sys.stderr)
    sys.argv = [sys.argv[0], *translation.overrides]
    train.main()


if __name__ == "__main__":
    main()
