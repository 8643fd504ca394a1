"""The DPO loop (issue 55; docs/dpo.md): ``python -m megatron_rl.dpo`` trains the model on preference pairs.

The SFT loop with another step (trainer/sft.py ``SFTTrainer``: the same ``Run``, helpers of trainer/loop.py,
checkpointer, loggers, launchers and final HF export); only the batches (data/preference.py: each pair's chosen and
rejected sides), the worker (workers/preference.py: the DPO step against the reference) and the validation differ.

    for batch in pairs:                             # data.train_batch_size pairs = 2 x as many rows
        metrics = workers.train_batch(batch)        # the preference loss (dpo.loss_type), one optimizer step
        every test_freq steps: val/loss, val/rewards/* on data.val_files
        every save_freq steps: checkpoint (model, optimizer, data position; the reference is rebuilt, never saved)
    hf_final/
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from megatron_rl.algos.preference import preference_pair_loss
from megatron_rl.config import ConfigError, PPOTrainerConfig
from megatron_rl.config.preference_schema import loss_kwargs, reference_free
from megatron_rl.controller.deferred_compile import deferred_compile
from megatron_rl.data.preference import PreferenceDataset, preference_batch
from megatron_rl.data.rows import MalformedRowError
from megatron_rl.protocol import DataProto
from megatron_rl.trainer.sft import PostTraining, SFTTrainer

VAL_PREFIX = "val/"


class DPOTrainer(SFTTrainer):
    """``workers``: the DPO worker group (workers/preference.py ``DPOWorker``); ``val_batches``: the validation
    pairs' batches, or None. SFTTrainer's loop; the validation is the preference loss and TRL's reward metrics."""

    def validation_loss(self) -> dict[str, float]:
        """``val/loss`` (the mean preference loss over every validation pair), ``val/rewards/{chosen, rejected,
        margins, accuracies}``, ``val/logps/{chosen, rejected}``."""
        parts: dict[str, list[torch.Tensor]] = {}
        for offset, batch in _offset_batches(self.val_batches()):
            rows = self.workers.sequence_log_probs(batch).batch
            for key in ("policy_logps", "ref_logps", "chosen"):
                parts.setdefault(key, []).append(rows[key])
            parts.setdefault("pair_index", []).append(rows["pair_index"] + offset)
        whole = {key: torch.cat(values) for key, values in parts.items()}
        reference = None if reference_free(self.run.cfg.dpo.loss_type) else whole["ref_logps"]
        loss, metrics, _ = preference_pair_loss(whole["policy_logps"], reference, whole["pair_index"],
                                                whole["chosen"], **loss_kwargs(self.run.cfg.dpo))
        return {f"{VAL_PREFIX}loss": loss, **{VAL_PREFIX + key: value for key, value in metrics.items()}}


def _offset_batches(batches: Iterator[DataProto]) -> Iterator[tuple[int, DataProto]]:
    """Each batch with the number of pairs before it (its pair_index counts from 0)."""
    offset = 0
    for batch in batches:
        yield offset, batch
        offset += len(batch) // 2


def preference_dataset(cfg: PPOTrainerConfig, tokenizer: Any, files_key: str) -> PreferenceDataset:
    """The pairs of ``data.<files_key>``; a bad row is a ConfigError naming its file and row."""
    data = cfg.data
    try:
        return PreferenceDataset(list(getattr(data, files_key)), tokenizer, max_length=data.max_length,
                                 truncation=str(data.truncation), prompt_key=data.prompt_key,
                                 chosen_key=cfg.dpo.chosen_key, rejected_key=cfg.dpo.rejected_key,
                                 tools_key=data.tools_key)
    except (MalformedRowError, OSError, ValueError) as err:
        raise ConfigError(f"data.{files_key}: {err}") from None


def _dpo_worker() -> type:
    with deferred_compile():  # Megatron-Core's models and fused kernels: compiled at first use
        from megatron_rl.workers.preference import DPOWorker
    return DPOWorker


DPO = PostTraining("dpo", _dpo_worker, preference_dataset, preference_batch, DPOTrainer,
                   ("train/loss", "train/rewards/margins", "val/rewards/accuracies"))
