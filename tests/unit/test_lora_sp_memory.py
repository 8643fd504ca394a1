"""LoRA under sequence parallelism (issue 56): a column-parallel adapter used to gather its input over the whole
sequence and save that copy for its A matmul's backward (h x 2 B per token and adapted linear, which the planner did
not count: 4.3 GB at Llama-3-8B, TP 2, 8k tokens); it now saves only the rank's slice, as the base linear does.
The planner's figure equals the bytes autograd saves in a real adapter's forward at TP 2 (gloo)."""

from __future__ import annotations

import pytest
from lora_sp_jobs import saved_bytes_job
from test_lora_plan import TINY, L, plan_for, row

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.plan import lora_memory, memory

SP = "actor_rollout_ref.actor.megatron.sequence_parallel=true"


def test_the_planner_figure_under_sequence_parallelism_by_hand():
    plan = plan_for(*TINY, SP, f"{L}.rank=4")
    # per token and layer, r 4, bf16, TP 2: A x of q, k, v, gate, up (5 x 4 x 2 B = 40), of proj and fc2
    # reduce-scattered along the sequence (2 x 4 x 2 B / 2 = 8); no input copy; 2 x 32 tokens per micro-batch,
    # 4 layers, one micro-batch in flight
    assert row(plan, "actor LoRA activations") == (40 + 8) * 64 * 4
    assert row(plan_for(*TINY, f"{L}.rank=4"), "actor LoRA activations") == 7 * 4 * 2 * 64 * 4  # no SP: as before


@pytest.mark.parametrize("target", ["linear_qkv", "linear_fc1", "linear_proj", "linear_fc2"])
def test_the_planner_figure_is_what_autograd_saves_in_an_adapter(target):
    seq, batch, rank = 10, 3, 4  # 30 tokens, 15 a rank: no A's row count (4, 8, 12)
    plan = plan_for(*TINY, SP, f"{L}.rank={rank}")
    measured = run_multiprocess(saved_bytes_job, 2, target, seq, batch, 64, 128, rank, timeout_s=300)
    planned = lora_memory.lora_activation_bytes_per_token_layer(plan.model, plan.actor_layout, rank, 0.0, [target],
                                                           memory.BF16, sequence_parallel=True) * seq * batch
    assert measured == [planned, planned]
