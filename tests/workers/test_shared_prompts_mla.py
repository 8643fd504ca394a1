"""Shared prompts (megatron.share_prompts) on multi-latent attention (DeepSeek-V3, its YaRN RoPE built inside every
MLASelfAttention layer, models/rope_positions.py): each response continues its prompt's RoPE positions in the
shared [prompt | responses...] row, so the log-probs and entropies equal the padded layout's (fp32, 1e-5), at TP 1
and TP 2 with sequence parallelism. Before, shared prompts were refused for MLA."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed


def shared_vs_padded_job(model_dir: str) -> dict:
    from packed_jobs import PROMPT_GROUP, _actor
    from workers_jobs import actor_config, training_batch

    from megatron_rl.distributed import init_model_parallel

    data = training_batch(group=PROMPT_GROUP)
    out = {}
    for tp in (1, 2):
        init_model_parallel(tp=tp)
        for layout, keys in (("padded", {}), ("shared", {"share_prompts": True})):
            actor = _actor(model_dir, actor_config(tp=tp), sequence_parallel=tp > 1, **keys)
            result = actor.compute_log_prob(data)
            out[tp, layout] = (result.batch["old_log_probs"], result.batch["entropys"])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("mla_shared") / "dsv3", "deepseek_v3",
                                    with_tokenizer=False)
    return run_multiprocess(shared_vs_padded_job, 2, str(model), timeout_s=900)


@pytest.mark.parametrize("tp", [1, 2])
def test_shared_prompts_equal_the_padded_layout_on_mla(results, tp):
    for rank in results:
        for shared, padded in zip(rank[tp, "shared"], rank[tp, "padded"], strict=True):
            torch.testing.assert_close(shared, padded, atol=1e-5, rtol=0)
