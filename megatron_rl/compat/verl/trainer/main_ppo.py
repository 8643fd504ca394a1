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
from typing import Any

from megatron_rl import train
from megatron_rl.compat.verl.defaults import chosen_preset, preset_note, verl_defaults
from megatron_rl.compat.verl.keys import Translation, bare, command_line_settings, ours_has, translate_key, truthy
from megatron_rl.config import ConfigError
from megatron_rl.models.hf_config import HFModelConfig, UnsupportedModelError, causal_lm_architecture, parse_hf_config
from megatron_rl.models.vision import is_vision_language
from megatron_rl.plan.vision import vision_run_problem
from megatron_rl.trainer.signals import EXIT_CONFIG_ERROR

BASE_CONFIG_NAME = "ppo_megatron_trainer"  # verl's config that megatron-rl's base config stands for
_CONFIG_NAMES = (BASE_CONFIG_NAME, f"{BASE_CONFIG_NAME}.yaml", "ppo_trainer", "ppo_trainer.yaml")
_CONFIG_FLAGS = ("--config-path", "--config-name", "-cp", "-cn")
_CONFIG_NAME_REFUSAL = ("megatron-rl composes one base config (configs/ppo_trainer.yaml, the analogue of verl's "
                        "ppo_megatron_trainer)")
_ACTOR, _REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"


def without_config_flags(argv: list[str], names: tuple[str, ...] = _CONFIG_NAMES,
                         what: str = _CONFIG_NAME_REFUSAL) -> list[str]:
    """The arguments without verl's config selection; a config name not in ``names`` is refused with ``what``
    (this entry's and the SFT entry's, each with its own names)."""
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
        if flag in ("--config-name", "-cn") and value not in names:
            raise ConfigError(f"{flag}={value}: {what}; known: {list(names)}")
    return rest


def _check_model_family(seen: dict[str, str]) -> HFModelConfig | None:
    """The model first: a family megatron-rl does not build (models/unbuilt.py) is refused by its architecture,
    with what is missing, before its script's keys are read (they would otherwise be refused one by one); so is
    what a vision-language model lacks here (plan/vision.py: Qwen3-VL's interleaved mRoPE and DeepStack, context
    parallelism). Returns a vision-language model's facts (None for a text model, or no config.json here)."""
    key = "actor_rollout_ref.model.path"
    config = Path(bare(seen.get(key, ""))).expanduser() / "config.json"
    if not seen.get(key) or not config.is_file():
        return None  # preflight reads the model when it is there
    try:
        raw = json.loads(config.read_text())
        source = f"{key}={config.parent}"
        if not is_vision_language(raw):
            causal_lm_architecture(raw, source)
            return None
        facts = parse_hf_config(raw, source)
    except (UnsupportedModelError, ValueError) as err:  # (ValueError: config.json that is not JSON: preflight's)
        if isinstance(err, UnsupportedModelError):
            raise ConfigError(str(err)) from None
        return None
    actor_cp = bare(seen.get(f"{_ACTOR}.megatron.context_parallel_size", "1"))
    cp = {f"{_ACTOR}.megatron.context_parallel_size": actor_cp,  # the ref follows the actor's unless given
          f"{_REF}.megatron.context_parallel_size": bare(seen.get(f"{_REF}.megatron.context_parallel_size", actor_cp))}
    problem = vision_run_problem(facts, {k: int(v) if v.isdigit() else 1 for k, v in cp.items()})
    if problem is not None:
        raise ConfigError(problem)
    return facts


_REMOVE_PADDING = "actor_rollout_ref.model.use_remove_padding"


def _unpacked_for_vision(facts: HFModelConfig, seen: dict[str, str]) -> tuple[list[str], list[str]]:
    """verl's use_remove_padding=True (its default; packed THD sequences here) with a vision-language model: its
    mRoPE positions [3, b, t] and images ride with padded rows only (workers/engine.py), so it runs padded
    micro-batches, with one logged line naming the key. (overrides placed last, the note)"""
    value = seen.get(_REMOVE_PADDING)
    roles = [_ACTOR, _REF] + (["critic"] if "critic.model.path" not in seen else [])  # the critic: the actor's model
    overrides = [f"{role}.megatron.packed_sequences=false" for role in roles]
    if value is not None and not truthy(value):
        return overrides, []  # asked for padded rows already: nothing to say
    note = (f"verl key {_REMOVE_PADDING}={bare(value) if value is not None else 'True (verl default)'}: "
            f"{facts.architecture} is a vision-language model, whose mRoPE positions and images ride with padded "
            f"micro-batches only: it runs unpacked ({', '.join(f'{r}.megatron.packed_sequences=false' for r in roles)})")
    return overrides, [note]


def translate_with_notes(argv: list[str], with_verl_defaults: bool = True) -> Translation:
    """verl's main_ppo arguments -> megatron_rl.train arguments and the log lines saying what changed
    (ConfigError naming a refused key). ``with_verl_defaults=False``: the arguments' own rewrites only."""
    args = without_config_flags(list(argv))
    seen = command_line_settings(args)
    vision = _check_model_family(seen)
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
    if vision is not None:
        unpacked, note = _unpacked_for_vision(vision, seen)
        out.extend(unpacked)
        if note:  # the one line naming the key, in place of its packed rewrite's
            notes = [n for n in notes if not n.startswith(f"verl key {_REMOVE_PADDING}=")] + note
    return Translation(out, notes)


def translate(argv: list[str], with_verl_defaults: bool = True) -> list[str]:
    """verl's main_ppo arguments -> megatron_rl.train arguments (ConfigError naming a refused key)."""
    return translate_with_notes(argv, with_verl_defaults).overrides


def main(argv: list[str] | None = None) -> None:
    launch(translate_with_notes, argv)


def launch(translator: Callable[[list[str]], Translation], argv: list[str] | None = None,
           start: Callable[..., Any] | None = None, notes_on_rank0: bool = False) -> None:
    """A verl entry's main (this one's, the async entries' in compat/verl/experimental, the SFT entry's):
    ``translator`` turns its arguments into megatron_rl.train's (a refusal exits with the config-error code), the
    notes are logged (``notes_on_rank0``: by rank 0 only, where torchrun starts every rank), then megatron_rl.train's
    CLI runs ``start`` (its RL run by default)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        translation = translator(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    if not notes_on_rank0 or train.is_rank0():
        for note in translation.notes:
            print(f"[megatron_rl.compat.verl] {note}", file=sys.stderr)
    sys.argv = [sys.argv[0], *translation.overrides]
    train.main(start)


if __name__ == "__main__":
    main()
