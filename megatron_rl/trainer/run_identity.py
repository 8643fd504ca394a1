"""What a checkpoint was trained with, so that a resume with something else is refused before start-up (issue 33).

Every checkpoint holds ``run_identity.json`` (hashed in its manifest): the model directory, the sha256 of its
``config.json`` (and the fields), ``model.override_config``, the sha256 of the tokenizer's files, and a fingerprint
of its weights (``weights_fingerprint.py``: sizes, safetensors headers, sampled bytes; issue 56). Before Ray or
any worker starts (``preflight``, the dry run too), the checkpoint a resume would take is compared with this start:

- another model (its ``config.json`` or tokenizer differs, whatever its path) is refused naming both paths and
  what differs. Same shapes would otherwise train the checkpoint's weights under the new config and tokenizer
  without a word; other shapes would fail late inside Megatron's checkpoint load.
- other base weights (same config.json and tokenizer: two fine-tunes of one base) under LoRA
  (``actor_rollout_ref.model.lora.rank`` > 0) are refused naming both paths and fingerprints: the checkpoint holds
  the adapters only, which would go on training, and be exported, on the new base. Full fine-tuning restores the
  actor's weights from the checkpoint, so it resumes, with a warning (a reference policy is built from the new
  base).
- data-loader state that cannot resume (``data.train_batch_size``, ``data.shuffle``, ``data.seed`` changed: the
  saved position would point at other prompts) is refused naming the key, where the loader would refuse it
  only after start-up.

A model moved to another path with the same files resumes (with a note); a checkpoint saved before issue 56 has
no weights fingerprint: it resumes with a warning that its base weights cannot be compared. The way out is always
named: resume with what the checkpoint was trained with, or start anew in another directory.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.config.access import is_unset, plain
from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.config.worker_rules import check_resume_setting
from megatron_rl.trainer.checkpointing import TRAINER_STATE_FILE, TrainerCheckpointer, check_resume_from_path
from megatron_rl.trainer.weights_fingerprint import fingerprint_differences, weights_fingerprint

logger = logging.getLogger(__name__)

IDENTITY_FILE = "run_identity.json"
# The files that make a tokenizer (what load_tokenizer / AutoTokenizer read), hashed together in this order.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja")
# The data loader's state that fixes which prompts its saved position points at, and the key that sets each.
LOADER_KEYS = {"batch_size": "data.train_batch_size", "shuffle": "data.shuffle", "seed": "data.seed"}


def _sha256_bytes(chunks: list[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def _model_path(cfg: PPOTrainerConfig) -> Path | None:
    model = cfg.actor_rollout_ref.model
    if is_unset(model, "path") or not model.path:
        return None
    return Path(model.path).expanduser()


def model_identity(cfg: PPOTrainerConfig) -> dict[str, Any]:
    """The model and tokenizer this config trains, as recorded in a checkpoint."""
    path = _model_path(cfg)
    identity: dict[str, Any] = {"model_path": str(path.resolve()) if path is not None else None}
    config_json = path / "config.json" if path is not None else None
    if config_json is not None and config_json.is_file():
        raw = config_json.read_bytes()
        identity["config_sha256"] = _sha256_bytes([raw])
        try:
            identity["config"] = json.loads(raw)
        except ValueError:
            identity["config"] = None
    if path is not None:
        identity["weights"] = weights_fingerprint(path)  # None: no weight files there (a hub name)
    identity["override_config"] = plain(cfg.actor_rollout_ref.model.override_config)
    tokenizer = cfg.data.tokenizer or (str(path) if path is not None else None)
    tokenizer_dir = Path(tokenizer).expanduser() if tokenizer else None
    if tokenizer_dir is not None and tokenizer_dir.is_dir():
        files = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
        identity["tokenizer_path"] = str(tokenizer_dir.resolve())
        identity["tokenizer_files"] = files
        identity["tokenizer_sha256"] = _sha256_bytes(
            [part for name in files for part in (name.encode(), b"\0", (tokenizer_dir / name).read_bytes())])
    elif tokenizer:
        identity["tokenizer_path"] = str(tokenizer)  # a hub name: the name is all there is to compare
    return identity


def write_identity(directory: Path, cfg: PPOTrainerConfig) -> None:
    """Into a checkpoint being saved (before its manifest, which then holds its hash)."""
    (Path(directory) / IDENTITY_FILE).write_text(json.dumps(model_identity(cfg), indent=1, sort_keys=True))


def _config_differences(saved: dict | None, now: dict | None) -> list[str]:
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return []
    keys = sorted(set(saved) | set(now))
    return [f"{k}: {saved.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}" for k in keys
            if saved.get(k) != now.get(k)]


def model_problem(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between the checkpoint's model and this start's, or None."""
    problems = []
    if saved.get("config_sha256") and now.get("config_sha256") and saved["config_sha256"] != now["config_sha256"]:
        fields = _config_differences(saved.get("config"), now.get("config"))
        problems.append("config.json differs" + (f" ({'; '.join(fields[:8])}"
                                                  f"{'; ...' if len(fields) > 8 else ''})" if fields else
                                                  " (same fields, other bytes)"))
    if (saved.get("override_config") or {}) != (now.get("override_config") or {}):
        problems.append(f"actor_rollout_ref.model.override_config differs ({saved.get('override_config')} -> "
                        f"{now.get('override_config')})")
    if saved.get("tokenizer_sha256") and now.get("tokenizer_sha256"):
        if saved["tokenizer_sha256"] != now["tokenizer_sha256"]:
            problems.append(f"the tokenizer differs ({saved.get('tokenizer_path')}: {saved.get('tokenizer_files')} "
                            f"vs {now.get('tokenizer_path')}: {now.get('tokenizer_files')}, other contents)")
    elif saved.get("tokenizer_path") != now.get("tokenizer_path") and not saved.get("tokenizer_sha256"):
        problems.append(f"the tokenizer differs ({saved.get('tokenizer_path')} -> {now.get('tokenizer_path')})")
    return "; ".join(problems) or None


def check_weights(cfg: PPOTrainerConfig, path: Path, saved: dict[str, Any], now: dict[str, Any], way_out: str) -> bool:
    """Compare the checkpoint's base weights with this start's: True when they are the same; other weights under
    LoRA refused (ConfigError), under full fine-tuning a warning; False (with a warning) where they cannot be
    compared."""
    if "weights" not in saved:
        logger.warning("checkpoint %s has no weights fingerprint in its %s (saved before issue 56): its base weights "
                       "cannot be compared with actor_rollout_ref.model.path=%s", path, IDENTITY_FILE,
                       now.get("model_path"))
        return False
    before, after = saved["weights"], now.get("weights")
    if not before or not after:
        return False  # no weight files to compare on one side (a hub name): config.json and tokenizer only
    differences = fingerprint_differences(before, after)
    if not differences:
        return True
    both = (f"the checkpoint was trained on actor_rollout_ref.model.path={saved.get('model_path')} (weights "
            f"{before['sha256'][:16]}), this start names {now.get('model_path')} (weights {after['sha256'][:16]}): "
            f"{'; '.join(differences[:8])}{'; ...' if len(differences) > 8 else ''}")
    rank = cfg.actor_rollout_ref.model.lora.rank
    if rank > 0:
        raise ConfigError(
            f"resuming {path} with other base weights under LoRA (actor_rollout_ref.model.lora.rank={rank}): {both}. "
            f"The checkpoint holds the adapters only; they would train on, and be exported with, the new base. "
            f"Resume with actor_rollout_ref.model.path={saved.get('model_path')} (or a copy of its files), {way_out}")
    reference = cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    logger.warning("resuming %s with other base weights: %s. The actor continues from the checkpoint's own weights%s",
                   path, both, "; the reference policy (actor.use_kl_loss / algorithm.use_kl_in_reward) is built "
                   "from the new base" if reference else "")
    return False


def resume_checkpoint(cfg: PPOTrainerConfig) -> Path | None:
    """The checkpoint this start would resume from (as ``loop.resume`` picks it), without logging or changing
    anything; None for a start from step 0. A trainer.resume_from_path the loop would refuse (missing, not a
    directory, an incomplete save) is refused here, by the loop's own rule (checkpointing.check_resume_from_path),
    so preflight refuses it before launch."""
    trainer = cfg.trainer
    if trainer.resume_mode == "resume_path":
        try:
            check_resume_setting(trainer.resume_mode, trainer.resume_from_path)
            check_resume_from_path(str(trainer.resume_from_path))
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(str(err)) from None
        return Path(str(trainer.resume_from_path))
    if trainer.resume_mode != "auto":
        return None
    return TrainerCheckpointer(Path(trainer.default_local_dir), max(1, trainer.max_ckpt_to_keep)).newest_intact()[0]


def check_resume(cfg: PPOTrainerConfig, usable_rows: int | None = None) -> None:
    """Refuse (ConfigError) a resume whose checkpoint was trained with another model or tokenizer, or whose data
    loader position cannot be continued with this config; ``usable_rows``: the training prompts this start has."""
    path = resume_checkpoint(cfg)
    if path is None:
        return
    way_out = (f"or start anew: another trainer.default_local_dir (or trainer.resume_mode=disable with "
               f"trainer.overwrite=true to replace {cfg.trainer.default_local_dir})")
    identity_file = path / IDENTITY_FILE
    if identity_file.is_file():
        try:
            saved = json.loads(identity_file.read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"checkpoint {path}: {identity_file} cannot be read ({err})") from err
        try:
            now = model_identity(cfg)
        except ValueError as err:  # a weight file whose safetensors header cannot be read
            raise ConfigError(f"actor_rollout_ref.model.path={_model_path(cfg)}: {err}") from err
        problem = model_problem(saved, now)
        if problem is not None:
            raise ConfigError(
                f"resuming {path} with another model: the checkpoint was trained from actor_rollout_ref.model.path="
                f"{saved.get('model_path')}, this start names {now.get('model_path')}; {problem}. The checkpoint's "
                f"weights would be trained under the new config and tokenizer. Resume with actor_rollout_ref.model."
                f"path={saved.get('model_path')} (and data.tokenizer as it was), {way_out}")
        same_weights = check_weights(cfg, path, saved, now, way_out)
        if saved.get("model_path") != now.get("model_path"):
            logger.info("resuming %s: the model moved from %s to %s (same %s)", path, saved.get("model_path"),
                        now.get("model_path"), "config.json, tokenizer and weights" if same_weights
                        else "config.json and tokenizer")
    else:
        logger.warning("checkpoint %s has no %s (saved before issue 33): its model cannot be compared with "
                       "actor_rollout_ref.model.path=%s", path, IDENTITY_FILE, _model_path(cfg))
    try:
        loader = json.loads((path / TRAINER_STATE_FILE).read_text()).get("dataloader") or {}
    except (OSError, ValueError):
        return  # the loop names an unreadable trainer state
    now_loader = {"batch_size": cfg.data.train_batch_size, "shuffle": cfg.data.shuffle, "seed": cfg.data.seed}
    changed = [f"{LOADER_KEYS[k]}={now_loader[k]!r} (the checkpoint's data loader ran with {loader[k]!r})"
               for k in LOADER_KEYS if k in loader and loader[k] != now_loader[k]]
    if usable_rows is not None and "dataset_size" in loader and loader["dataset_size"] != usable_rows:
        changed.append(f"data.train_files give {usable_rows} usable prompts (the checkpoint's data loader had "
                       f"{loader['dataset_size']})")
    if changed:
        raise ConfigError(
            f"cannot resume the data loader of {path}: {'; '.join(changed)}. Its saved position would point at "
            f"other prompts. Resume with the checkpoint's values, {way_out}")
