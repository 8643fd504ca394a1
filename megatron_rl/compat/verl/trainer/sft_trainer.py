"""verl's SFT launch line on megatron-rl: ``python3 -m megatron_rl.compat.verl.trainer.sft_trainer`` takes the
arguments of ``python3 -m verl.trainer.sft_trainer`` unchanged (also under ``torchrun ... -m``), and runs
megatron-rl's SFT (``python -m megatron_rl.sft``, docs/sft.md) on them.

1. ``--config-name=sft_trainer_engine`` (verl's SFT config) is dropped; another config name is refused.
2. The model first: a family megatron-rl does not build is refused by its architecture (as the RL entry does).
3. verl's SFT defaults where megatron-rl's differ in memory or numbers come first (``SFT_DEFAULTS``: the batch,
   token-budget micro-batches, packed sequences, the learning rate, the epochs, the distributed optimizer, ...),
   so the user's arguments override them as they would verl's; with a megatron-rl preset (``+experiment=``) they
   are left out.
4. Every argument meets its fate (compat/verl/sft_keys.py; docs/sft.md, "verl's SFT scripts").
5. Under torchrun, verl's SFT takes its world from torchrun: trainer.launcher=torchrun and trainer.nnodes /
   n_gpus_per_node from WORLD_SIZE / LOCAL_WORLD_SIZE, placed last.
Each default and rewrite is logged; a refusal exits with the config-error code before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megatron_rl import sft
from megatron_rl.compat.verl.defaults import chosen_preset, preset_note
from megatron_rl.compat.verl.keys import Translation, bare, command_line_settings
from megatron_rl.compat.verl.sft_keys import analogue, translate_sft_key, verl_sft_default
from megatron_rl.compat.verl.trainer.main_ppo import _check_model_family, launch, without_config_flags
from megatron_rl.config import ConfigError

CONFIG_NAMES = ("sft_trainer_engine", "sft_trainer_engine.yaml")
_CONFIG_NAME_REFUSAL = ("megatron-rl's SFT composes one config (configs/ppo_trainer.yaml), the analogue of "
                        "verl's SFT config")
_ACTOR = "actor_rollout_ref.actor"

# (key, value, why): verl's SFT defaults where megatron-rl's differ in memory or numbers
SFT_DEFAULTS: tuple[tuple[str, str, str], ...] = (
    ("data.train_batch_size", "256", "verl's SFT default (conversations per optimizer step)"),
    (f"{_ACTOR}.use_dynamic_bsz", "true", "verl's SFT default data.use_dynamic_bsz=True"),
    (f"{_ACTOR}.ppo_max_token_len_per_gpu", "8192", "verl's SFT default data.max_token_len_per_gpu"),
    (f"{_ACTOR}.optim.lr", "1e-3", "verl's SFT default optim.lr (its optim=megatron)"),
    (f"{_ACTOR}.megatron.packed_sequences", "true", "verl's engine.use_remove_padding defaults to True (packed THD)"),
    ("trainer.total_epochs", "4", "verl's SFT default"),
    ("trainer.device", "cuda", "verl's default device (a CPU run says trainer.device=cpu)"),
    ("trainer.nnodes", "1", "verl's SFT default (one process; under torchrun its world decides)"),
    ("trainer.n_gpus_per_node", "1", "verl's SFT default (one process; under torchrun its world decides)"),
)


def _rl_settings(seen: Mapping[str, str]) -> dict[str, str]:
    """The command line under the RL names its rewrites read (verl's SFT learning rate when not given)."""
    rl_seen = {f"{_ACTOR}.optim.lr": str(verl_sft_default("optim.lr"))}
    rl_seen.update({analogue(key): value for key, value in seen.items()})
    return rl_seen


def sft_defaults(seen: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(overrides placed before the user's, one note each): ``SFT_DEFAULTS`` and the layout's."""
    out = [f"{key}={value}" for key, value, _ in SFT_DEFAULTS]
    notes = [f"{key}={value}: {why}" for key, value, why in SFT_DEFAULTS]
    tp = int(bare(seen.get("engine.tensor_model_parallel_size", "1")))
    out.append(f"{_ACTOR}.megatron.sequence_parallel={'true' if tp > 1 else 'false'}")
    notes.append(f"{out[-1]}: verl's default (sequence parallel when TP > 1)")
    if bare(seen.get("trainer.device", "cuda")) != "cpu":
        out.append(f"{_ACTOR}.megatron.use_distributed_optimizer=true")
        notes.append(f"{out[-1]}: verl's default")
    return out, notes


def torchrun_world(seen: Mapping[str, str], env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Under torchrun (WORLD_SIZE and LOCAL_WORLD_SIZE set): verl's SFT runs on torchrun's processes, whatever
    trainer.nnodes / n_gpus_per_node say; so does this run. (overrides placed last, notes)"""
    if "WORLD_SIZE" not in env or "LOCAL_WORLD_SIZE" not in env:
        return [], []
    world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    sizes = {"trainer.nnodes": str(max(world // max(local, 1), 1)), "trainer.n_gpus_per_node": str(local)}
    out = ["trainer.launcher=torchrun", *(f"{key}={value}" for key, value in sizes.items())]
    notes = [f"torchrun's world (WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}) -> {' '.join(out)}"]
    notes += [f"verl key {key}={seen[key]} accepted, no effect: verl's SFT takes its world from torchrun ({value})"
              for key, value in sizes.items() if key in seen and bare(seen[key]) != value]
    return out, notes


def translate_with_notes(argv: list[str], env: Mapping[str, str] | None = None) -> Translation:
    """verl's sft_trainer arguments -> megatron_rl.sft arguments and the log lines saying what changed (ConfigError
    naming a refused key). ``env``: the process environment (torchrun's sizes)."""
    env = os.environ if env is None else env
    args = without_config_flags(list(argv), CONFIG_NAMES, _CONFIG_NAME_REFUSAL)
    seen = command_line_settings(args)
    rl_seen = _rl_settings(seen)
    facts = _check_model_family(rl_seen)
    if facts is not None:
        raise ConfigError(f"model.path={seen.get('model.path', rl_seen.get('actor_rollout_ref.model.path'))}: "
                          f"{facts.architecture} is a vision-language model; megatron-rl's SFT trains on text "
                          "conversations (docs/sft.md)")
    out, notes = sft_defaults(seen)
    notes = [f"verl default {n}" for n in notes]
    if (preset := chosen_preset(args)) is not None:  # the preset's values win over verl's
        out, notes = [], [preset_note(preset)]
    for arg in args:
        key, sep, value = arg.partition("=")
        name = key.lstrip("+~")
        if not sep or key.startswith("~") or name == "experiment":
            out.append(arg)
            continue
        replaced, note = translate_sft_key(name, value, seen, rl_seen)
        if note:
            notes.append(f"verl key {note}")
        out.extend([arg] if replaced is None else replaced)
    world, world_notes = torchrun_world(seen, env)
    return Translation(out + world, notes + world_notes)


def translate(argv: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """verl's sft_trainer arguments -> megatron_rl.sft arguments (ConfigError naming a refused key)."""
    return translate_with_notes(argv, env).overrides


def main(argv: list[str] | None = None) -> None:
    """Translate (a refusal exits with the config-error code), log the notes, then run megatron-rl's SFT."""
    launch(translate_with_notes, argv, sft.run, notes_on_rank0=True)


if __name__ == "__main__":
    main()
