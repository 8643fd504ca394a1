"""Config and response-batch builders shared by the reward tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_rl.config.schema import CustomRewardFunctionConfig, RewardConfig
from megatron_rl.protocol import DataProto


def reward_config(
    num_workers: int = 0,
    timeout_s: float = 10.0,
    path: Path | None = None,
    name: str = "compute_score",
    manager: str = "naive",
) -> RewardConfig:
    return RewardConfig(
        reward_manager=manager,
        num_workers=num_workers,
        timeout_s=timeout_s,
        custom_reward_function=CustomRewardFunctionConfig(str(path) if path else None, name),
    )


def response_batch(
    tokenizer,
    responses: Sequence[str],
    truths: Sequence[str],
    width: int = 8,
    data_source: str = "synthetic/copy",
) -> DataProto:
    """Each response text + eos, right-padded to ``width``; the mask covers text and eos."""
    ids = torch.full((len(responses), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(responses), width), dtype=torch.long)
    for i, text in enumerate(responses):
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = 1
    non_tensor: dict[str, Any] = {
        "data_source": [data_source] * len(responses),
        "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
        "extra_info": [{"index": i} for i in range(len(responses))],
    }
    return DataProto.from_dict({"responses": ids, "response_mask": mask}, non_tensor)
