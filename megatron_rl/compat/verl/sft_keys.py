"""The fate of every key of verl's SFT trainer (``python3 -m verl.trainer.sft_trainer``, its Megatron engine) on
megatron-rl's SFT (``python -m megatron_rl.sft``): one table that the SFT compat entry
(``trainer/sft_trainer.py``) and the documentation (``sft_key_table.py`` -> docs/sft.md) both read.

verl's SFT config (``verl_sft_trainer_megatron.yaml``, pinned: sft_trainer_engine.yaml with model=hf_model,
engine=megatron, optim=megatron) keeps the model, the Megatron engine, the optimizer, the checkpoint and the
profiler at the top level; megatron-rl's SFT reads them where its RL trainer does, on the actor. So a key is, in
this order:

1. a rule of ``SFT_RULES`` (the keys whose meaning is the SFT trainer's own: the data's micro-batching, the
   warm-up ratio, the schedule's style, ``after_each_epoch``, ...), with verl's SFT default;
2. else its analogue on the actor (``model.*`` -> ``actor_rollout_ref.model.*``, ``engine.*`` ->
   ``actor_rollout_ref.actor.megatron.*``, ``optim.*`` -> ``actor_rollout_ref.actor.optim.*``, ...) meets the
   fate the RL compat gives it (``keys.RULES``, docs/configuration.md): the same reasons, the same rewrites;
   ``default`` values are compared with verl's SFT defaults;
3. a key of neither verl's SFT config nor megatron-rl's is refused, naming the nearest verl SFT keys.
Refusals name the verl key as written.
"""

from __future__ import annotations

import difflib
import functools
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from megatron_rl.compat.verl.keys import (ABSENT, Fate, Rule, Translation, apply_fate, bare, default_in, fate_of,
                                          is_null, ours_has, refuse, rule_for, truthy)
from megatron_rl.config import ConfigError

VERL_SFT_CONFIG = Path(__file__).with_name("verl_sft_trainer_megatron.yaml")
_ACTOR = "actor_rollout_ref.actor"
_OPTIM = f"{_ACTOR}.optim"

# verl's SFT sections -> where megatron-rl's SFT reads the same settings (the RL actor's)
SECTIONS = (("model.", "actor_rollout_ref.model."), ("engine.", f"{_ACTOR}.megatron."), ("optim.", f"{_OPTIM}."),
            ("checkpoint.", f"{_ACTOR}.checkpoint."), ("profiler.", f"{_ACTOR}.profiler."))
# verl's SFT keys whose megatron-rl key has another name
RENAMED = {"data.micro_batch_size_per_gpu": f"{_ACTOR}.ppo_micro_batch_size_per_gpu",
           "data.max_token_len_per_gpu": f"{_ACTOR}.ppo_max_token_len_per_gpu",
           "data.use_dynamic_bsz": f"{_ACTOR}.use_dynamic_bsz",
           "data.num_workers": "data.dataloader_num_workers",
           "model.tokenizer_path": "data.tokenizer"}
# free-form dicts: verl's scripts add their entries with +
FREE_FORM = ("engine.override_transformer_config", "engine.override_ddp_config", "engine.override_mcore_model_config",
             "optim.override_optimizer_config", "model.override_config", "data.apply_chat_template_kwargs")


@functools.lru_cache(maxsize=1)
def verl_sft_config() -> DictConfig:
    return OmegaConf.load(VERL_SFT_CONFIG)


def verl_sft_default(key: str) -> Any:
    """verl's SFT default of ``key`` (``ABSENT`` when verl's SFT config has no such key)."""
    return default_in(verl_sft_config(), key)


def is_verl_sft_key(key: str) -> bool:
    """A key of verl's SFT config, or an entry of one of its free-form dicts."""
    return verl_sft_default(key) is not ABSENT or any(key.startswith(f + ".") for f in FREE_FORM)


def analogue(key: str) -> str:
    """The megatron-rl (RL compat) key that stands for verl's SFT ``key``."""
    if key in RENAMED:
        return RENAMED[key]
    for verl, ours in SECTIONS:
        if key.startswith(verl):
            return ours + key[len(verl):]
    return key


# ---------------------------------------------------------------------------------------------- the run's steps

def _rows(path: str) -> int:
    """Rows of one parquet or jsonl file, from the parquet footer (nothing tokenized)."""
    import pyarrow.parquet as pq  # only for a key that needs the step count

    p = Path(bare(path)).expanduser()
    if p.suffix.lower() == ".parquet":
        return pq.read_metadata(p).num_rows
    with p.open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def _train_files(seen: Mapping[str, str]) -> list[str]:
    value = seen.get("data.train_files", "")
    value = value.strip()
    items = value.strip("[]").split(",") if value.startswith("[") else [value]
    return [bare(item) for item in items if bare(item)]


def steps_per_epoch(key: str, seen: Mapping[str, str]) -> int:
    """verl's SFT steps per epoch: the training rows // data.train_batch_size (its loader drops the last partial
    batch), counted from data.train_files; refused, naming ``key``, where the files cannot be read."""
    batch = int(bare(seen.get("data.train_batch_size", str(verl_sft_default("data.train_batch_size")))))
    try:
        rows = sum(_rows(path) for path in _train_files(seen))
    except (OSError, ValueError) as err:
        raise ValueError(f"verl counts it from the training rows, which cannot be read here ({err}); give it as a "
                         "number of steps") from None
    if rows < batch:
        raise ValueError(f"data.train_files hold {rows} rows, fewer than one batch of data.train_batch_size={batch}")
    return rows // batch


def run_steps(key: str, seen: Mapping[str, str]) -> int:
    """verl's SFT step count: trainer.total_training_steps, else steps per epoch x trainer.total_epochs."""
    given = seen.get("trainer.total_training_steps")
    if given is not None and not is_null(given):
        return int(bare(given))
    epochs = int(bare(seen.get("trainer.total_epochs", str(verl_sft_default("trainer.total_epochs")))))
    return steps_per_epoch(key, seen) * epochs


# ---------------------------------------------------------------------------------------------- rewrites

def _files(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """One path or a list; verl's null val_files: no validation."""
    v = value.strip()
    if is_null(v):
        if key == "data.train_files":
            raise ValueError("SFT needs training conversations")
        return [f"{key}=[]"]
    return [f"{key}={v}" if v.startswith("[") else f"{key}=['{bare(v)}']"]


def _freq(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """A number of steps, or verl's after_each_epoch: the steps of one epoch."""
    if bare(value) == "after_each_epoch":
        return [f"{key}={steps_per_epoch(key, seen)}"]
    return [f"{key}={bare(value)}"]


def _warmup_steps(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl: a positive number of steps; null, 0 or -1 hand the warm-up to lr_warmup_steps_ratio."""
    steps = -1 if is_null(value) else int(bare(value))
    return [f"{_OPTIM}.lr_warmup_steps={steps}"] if steps > 0 else []


def _warmup_ratio(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl's warm-up of int(ratio x the run's steps) when optim.lr_warmup_steps is not positive."""
    ratio = float(bare(value))
    steps = seen.get("optim.lr_warmup_steps", "-1")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError("a ratio of the run's steps lies in [0, 1]")
    if not is_null(steps) and int(bare(steps)) > 0 or ratio == 0.0:
        return []  # verl takes optim.lr_warmup_steps, or no warm-up
    return [f"{_OPTIM}.lr_warmup_steps={int(ratio * run_steps(key, seen))}"]


_STYLES = {"constant": "constant", "cosine": "cosine"}


def _decay_style(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    style = bare(value)
    if style not in _STYLES:
        raise ValueError(f"the schedules here are {', '.join(_STYLES)} (optim.lr_scheduler); verl's linear and "
                         "inverse_square_root are not built")
    return [f"{_OPTIM}.lr_scheduler={_STYLES[style]}"]


_PAD_MODES = ("no_padding", "right", "left_right")


def _pad_mode(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if bare(value) not in _PAD_MODES:
        raise ValueError(f"verl's pad modes are {', '.join(_PAD_MODES)}")
    return []


def _input_ids_mismatch(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    return []


def _keep(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if is_null(value):
        raise ValueError("verl keeps every checkpoint; here give the number to keep (trainer.max_ckpt_to_keep >= 1)")
    return [f"{key}={bare(value)}"]


def _group(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl's Hydra group selections: the Megatron engine's only (``model=hf_model``, ``engine=megatron``,
    ``optim=megatron``, ``profiler=profiler``)."""
    wanted = {"model": "hf_model", "engine": "megatron", "optim": "megatron", "profiler": "profiler"}[key]
    if bare(value) != wanted:
        raise ValueError(f"megatron-rl trains with Megatron-Core, verl's {key}={wanted}; verl's {key} configs "
                         f"for other engines are not taken here: set {key}={wanted} or drop it")
    return []


_SFT_READS_NOT = "verl's SFT trainer does not read it"

SFT_RULES: tuple[Rule, ...] = (
    # --- verl's Hydra group selections and search path
    *(Rule(group, Fate.mapped, f"the Megatron engine's selection ({group}=" +
           {"model": "hf_model", "engine": "megatron", "optim": "megatron", "profiler": "profiler"}[group] +
           "), accepted without effect; another is refused", _group)
      for group in ("model", "engine", "optim", "profiler")),
    Rule("hydra.searchpath", Fate.refused, "verl's configs of other packages (e.g. verl_mlite's engine=mlite) are not "
         "megatron-rl's; megatron-rl composes its own config (configs/ppo_trainer.yaml)"),
    # --- data
    Rule("data.train_files", Fate.mapped, "a single path becomes a one-element list", _files),
    Rule("data.val_files", Fate.mapped, "a single path becomes a one-element list; null: no validation", _files),
    Rule("data.pad_mode", Fate.mapped,
         "how verl's collator hands rows to its engine; the numbers do not depend on it: rows are packed (THD) per "
         "engine.use_remove_padding, here as there (actor_rollout_ref.actor.megatron.packed_sequences); accepted "
         "without effect", _pad_mode),
    Rule("data.ignore_input_ids_mismatch", Fate.mapped,
         "accepted without effect: rows are rendered whole by the chat template and masked from their own prefixes "
         "(data/sft.py); a row whose template renders an earlier turn differently once later turns follow is refused "
         "when read, naming it, as under verl's default (False), where True would train on verl's per-turn "
         "concatenation instead", _input_ids_mismatch),
    Rule("data.custom_cls.*", Fate.default, "a custom SFT dataset class is not taken here; rows are read by "
         "data/sft.py (data.messages_key, or data.prompt_key / response_key)"),
    Rule("data.apply_chat_template_kwargs", Fate.default, "the tokenizer's chat template is applied as it is"),
    Rule("data.enable_thinking_*", Fate.default,
         "no per-row enable_thinking switch here; the chat template's own default applies"),
    Rule("data.balance_dp_token", Fate.default, "not implemented by verl either"),
    Rule("data.use_shm", Fate.default, "data files are read from their paths"),
    Rule("data.*_max_samples", Fate.default, "every row of the files is read"),
    # --- model: the keys verl's SFT reads differently from its RL trainer
    Rule("model.use_remove_padding", Fate.dropped,
         "read by verl's FSDP engine; its Megatron engine packs per engine.use_remove_padding (-> "
         "actor_rollout_ref.actor.megatron.packed_sequences)"),
    # --- optimizer: verl's SFT trainer sets the run's steps; the warm-up ratio and the style follow them
    Rule("optim.total_training_steps", Fate.dropped,
         "verl's SFT trainer sets it to the run's steps (trainer.total_training_steps, else the steps per epoch x "
         "trainer.total_epochs); so does megatron-rl's"),
    Rule("optim.lr_warmup_steps", Fate.mapped,
         "positive: -> actor_rollout_ref.actor.optim.lr_warmup_steps; null, 0 or -1: optim.lr_warmup_steps_ratio "
         "decides", _warmup_steps),
    Rule("optim.lr_warmup_steps_ratio", Fate.mapped,
         "-> actor_rollout_ref.actor.optim.lr_warmup_steps = int(ratio x the run's steps), as verl's Megatron "
         "scheduler: trainer.total_training_steps, else (rows of data.train_files // data.train_batch_size) x "
         "trainer.total_epochs, counted before the start; unused when optim.lr_warmup_steps > 0", _warmup_ratio),
    Rule("optim.lr_decay_style", Fate.mapped,
         "constant | cosine -> actor_rollout_ref.actor.optim.lr_scheduler (the same Megatron scheduler, decaying "
         "over the run's steps to optim.min_lr); linear and inverse_square_root are refused", _decay_style),
    Rule("engine.use_megatron_fsdp", Fate.default,
         "Megatron-FSDP (ZeRO-3: the weights and gradients sharded too) is not built here; the distributed optimizer "
         "(engine.use_distributed_optimizer, verl's default) shards the optimizer state, with the same numbers"),
    Rule("optim.lr_decay_steps", Fate.default, "the decay runs over the run's steps (verl's null)"),
    Rule("optim.lr_warmup_init", Fate.default,
         "the warm-up starts from 0 (verl's default), as megatron-rl's does"),
    # --- trainer
    Rule("trainer.test_freq", Fate.mapped, "steps; verl's after_each_epoch -> the steps of one epoch (rows of "
         "data.train_files // data.train_batch_size)", _freq),
    Rule("trainer.save_freq", Fate.mapped, "as trainer.test_freq", _freq),
    Rule("trainer.max_ckpt_to_keep", Fate.mapped, "a number as it is; verl's null (keep all) is refused: give the "
         "number to keep", _keep),
    Rule("trainer.balance_batch", Fate.dropped, _SFT_READS_NOT),
    Rule("trainer.seed", Fate.dropped, f"{_SFT_READS_NOT}; the data order here follows data.seed"),
    Rule("trainer.default_hdfs_dir", Fate.default, "checkpoints are written to trainer.default_local_dir only"),
    Rule("trainer.profile_interval", Fate.default, "no built-in profiler hooks here"),
)


# ---------------------------------------------------------------------------------------------- one key

def translate_sft_key(key: str, value: str, seen: Mapping[str, str],
                      rl_seen: Mapping[str, str]) -> tuple[list[str] | None, str | None]:
    """(megatron-rl overrides, log note) for one verl SFT ``key=value``; None overrides: megatron-rl's own key, passed
    on as it is. ``seen``: the command line (verl's SFT keys); ``rl_seen``: the same under their RL names (what the
    RL compat's rewrites read). A refusal is a ConfigError naming ``key``."""
    try:
        return _translate(key, value, seen, rl_seen)
    except ValueError as err:  # ConfigError is one: a rewrite's refusal, said again under verl's SFT key
        message = str(err)
        if not message.startswith(f"{key}="):
            message = f"{key}={value}: {message}"
        raise ConfigError(message) from None


def _translate(key: str, value: str, seen: Mapping[str, str],
               rl_seen: Mapping[str, str]) -> tuple[list[str] | None, str | None]:
    rule = rule_for(key, SFT_RULES)
    if rule is not None:
        return apply_fate(key, value, seen, rule.fate, rule.why, rule, verl_sft_default)
    if not is_verl_sft_key(key):
        if ours_has(key) or key.startswith("hydra."):  # Hydra's own settings (hydra.run.dir, ...) as they are
            return None, None  # megatron-rl's own key: its checks apply
        near = difflib.get_close_matches(key, sft_leaf_keys(), n=3, cutoff=0.6)
        refuse(f"{key}={value}: not a key of verl's SFT trainer (verl/trainer/config/sft_trainer_engine.yaml with "
               f"engine=megatron) nor of megatron-rl's config" + (f"; nearest: {', '.join(near)}" if near else ""))
    target = analogue(key)
    fate, why = fate_of(target)
    if bare(value).startswith("[") and bare(value) != value.strip():
        value = bare(value)  # a list the script quoted ('[0.9,0.95]' inside a string it expands): the list
    if fate is Fate.same:
        note = None if target == key else f"{key}={value} -> {target}={value}"
        return [f"{'++' if target != key or _free_form(key) else ''}{target}={value}"], note
    if fate is Fate.mapped:
        out = rule_for(target).rewrite(target, value, rl_seen)
        return out, f"{key}={value} -> {' '.join(out) or '(nothing)'}: {why}"
    return apply_fate(key, value, seen, fate, why, rule_for(target), verl_sft_default)


def _free_form(key: str) -> bool:
    return any(key.startswith(f + ".") for f in FREE_FORM)


def fate_of_sft(key: str) -> tuple[Fate, str]:
    """What happens to verl's SFT ``key`` and why (the table's row)."""
    rule = rule_for(key, SFT_RULES)
    if rule is not None:
        return rule.fate, rule.why
    target = analogue(key)
    fate, why = fate_of(target)
    if fate is Fate.same and target != key:
        return Fate.mapped, f"-> {target}"
    return fate, why


@functools.lru_cache(maxsize=1)
def sft_leaf_keys() -> tuple[str, ...]:
    """Every leaf of verl's SFT config (free-form dicts as one leaf; ``_target_`` skipped)."""
    out: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for name in node.keys():
            key = f"{prefix}.{name}" if prefix else str(name)
            child = node._get_node(name)
            if name == "_target_":
                continue
            if isinstance(child, DictConfig) and len(child) and key not in FREE_FORM:
                walk(child, key)
            else:
                out.append(key)

    walk(verl_sft_config(), "")
    return tuple(out)


__all__ = ["SFT_RULES", "Translation", "analogue", "fate_of_sft", "is_verl_sft_key", "sft_leaf_keys",
           "translate_sft_key", "truthy", "verl_sft_default"]
