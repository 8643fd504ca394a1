"""Megatron side of the reward-model tests: runs on every spawned rank, returns what the checks need."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_rl.protocol import DataProto

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP) on two ranks


def score_sets(directory: str, sets: dict[str, list[list[int]]], tp: int, pp: int, **options) -> dict:
    """Scores of each set of token ``rows`` (one batch per set, right-padded; ``left_pad``: also as
    "<name>/left_pad", left-padded) from one Megatron RM engine at this TP/PP.

    ``options``: micro_batch_size_per_gpu / use_dynamic_bsz / forward_max_token_len_per_gpu / packed_sequences."""
    from omegaconf import OmegaConf

    from megatron_rl.config.schema import MegatronParallelConfig
    from megatron_rl.workers.reward_model_role import RewardModelRole
    from megatron_rl.workers import MegatronEngine

    left_pad = options.pop("left_pad", False)
    parallel = OmegaConf.structured(MegatronParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        packed_sequences=options.get("packed_sequences", False)))
    engine = MegatronEngine(directory, parallel, None, value_head=True, name="reward_model")
    role = RewardModelRole(engine, SimpleNamespace(
        micro_batch_size_per_gpu=options.get("micro_batch_size_per_gpu", 2),
        use_dynamic_bsz=options.get("use_dynamic_bsz", False),
        forward_max_token_len_per_gpu=options.get("forward_max_token_len_per_gpu", 64)))
    out = {}
    for name, rows in sets.items():
        out[name] = role.compute_rm_score(padded_batch(rows)).batch["rm_scores"]
        if left_pad:
            out[f"{name}/left_pad"] = role.compute_rm_score(padded_batch(rows, left=True)).batch["rm_scores"]
    return out


def padded_batch(rows: list[list[int]], left: bool = False) -> DataProto:
    from megatron_rl.reward.model.inputs import right_padded

    batch = right_padded(rows, pad_id=0)
    if left:  # the same rows with their padding in front
        for key in ("input_ids", "attention_mask"):
            batch.batch[key] = torch.stack([row.roll(int((1 - m).sum())) for row, m in
                                            zip(batch.batch[key], batch.batch["attention_mask"])])
    return batch


def rm_checks(dirs: dict[str, str], rows: list[list[int]], extra: dict[str, list[list[int]]]) -> dict:
    """Every family at every layout (left padding too); a token budget and THD packing at TP=2; ``extra``:
    more row sets scored with the ``qwen2`` RM at every layout (e.g. re-tokenized samples)."""
    from megatron_rl.distributed import init_model_parallel

    out: dict = {}
    for tp, pp in LAYOUTS:
        init_model_parallel(tp=tp, pp=pp)
        for name, directory in dirs.items():
            sets = {name: rows, **(extra if name == "qwen2" else {})}
            for key, scores in score_sets(directory, sets, tp, pp, left_pad=True).items():
                out[key, tp, pp] = scores
        if (tp, pp) == (2, 1):
            out["budget"] = score_sets(dirs["qwen2"], {"rows": rows}, tp, pp, use_dynamic_bsz=True,
                                       forward_max_token_len_per_gpu=max(map(len, rows)))["rows"]
            out["thd"] = score_sets(dirs["qwen2"], {"rows": rows}, tp, pp, packed_sequences=True)["rows"]
    return out
