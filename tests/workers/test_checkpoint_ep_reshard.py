"""Resuming a MoE actor at another expert-parallel layout (issue 38): a checkpoint saved at EP=2 resumes at EP=1
(and at PP=2, so at another DP size), one saved at EP=1 resumes at EP=2, with every expert's weights, Adam moments
(exp_avg, exp_avg_sq), fp32 master weights (bf16 parameters) and Adam step equal to the saved ones.

Megatron keeps the experts' Adam state in a second optimizer of a ChainedOptimizer at EP > 1 only (their
parameters are not all-reduced over DP there), so the optimizer part of the checkpoint changes shape with EP:
workers/checkpoint.py maps it onto the resuming layout. Two gloo ranks on CPU, one spawn for all cases.
"""

from __future__ import annotations

import math

import pytest
import torch

from ckpt_ep_jobs import reshard_job
from megatron_rl.distributed import run_multiprocess
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

STATE = ("weight", "exp_avg", "exp_avg_sq", "fp32_master")


def _tiny_moe(path, seed):
    return make_tiny_hf_checkpoint(path, "qwen3_moe", seed=seed, with_tokenizer=True, norm_topk_prob=False)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def resumed(request, tmp_path_factory):
    """fp32 (the CPU default: the weights are Adam's master) and bf16 (fp32 master copies; the norms stay fp32)."""
    tmp = tmp_path_factory.mktemp(f"ep_reshard_{request.param}")
    model, other = _tiny_moe(tmp / "hf", 0), _tiny_moe(tmp / "other", 1)
    saves = [(1, 2), (1, 1)]  # (pp, ep); 2 ranks: DP=2 both
    loads = [("pp1ep2", 1, 1), ("pp1ep2", 2, 1), ("pp1ep1", 1, 2)]  # EP 2->1, EP 2->1 at PP=2 (DP 1), EP 1->2
    rank0, _ = run_multiprocess(reshard_job, 2, str(model), str(other), str(tmp), request.param, saves, loads,
                                timeout_s=900)
    return request.param, rank0


@pytest.mark.parametrize("name, pp, ep", [("pp1ep2", 1, 1), ("pp1ep2", 2, 1), ("pp1ep1", 1, 2)])
def test_resume_at_another_ep_restores_weights_and_adam_state_per_expert(resumed, name, pp, ep):
    dtype, resumed = resumed
    saved, loaded = resumed["saved"][name], resumed["loaded"][(name, pp, ep)]
    assert not isinstance(loaded, str), f"{name} -> PP={pp} EP={ep}: {loaded}"
    saved_t, loaded_t = saved["tensors"], loaded["tensors"]
    # every expert of both MoE layers, fc1 and fc2, with its weights, both moments and its fp32 master copy
    experts = {(what, key, offsets) for what, key, offsets in saved_t if ".experts." in key}
    for what in STATE if dtype == "bf16" else STATE[:3]:
        assert len({(key, offsets) for w, key, offsets in experts if w == what}) == 2 * 4 * 2, what
    # the gradients were not trivial: every expert's second moment is non-zero
    assert all(saved_t[k].abs().sum() > 0 for k in experts if k[0] == "exp_avg_sq")
    # EP changes which of Megatron's chained optimizers holds the experts, not their keys and offsets
    assert saved["optimizers"] != loaded["optimizers"]
    assert loaded_t.keys() == saved_t.keys()
    differing = [key for key, tensor in saved_t.items() if not torch.equal(loaded_t[key], tensor)]
    assert not differing, differing[:5]
    assert loaded["steps"] == saved["steps"] == [2]
    assert loaded["next_steps"] == [3] and all(math.isfinite(v) for v in loaded["next"].values() if isinstance(v, float))


# ------------------------------------------------------------- what cannot be resharded: a clear error
LAYOUTS = "saved at {'tp': 1, 'pp': 1, ...} {'ep': 2, 'etp': 1} with 2 chained optimizer(s), resumed at ... with 1"


def test_a_state_tensor_the_checkpoint_lacks_is_named():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_rl.workers.checkpoint_optimizer import remap_keys

    asked = {"optimizer": {"state": {0: {"exp_avg": ShardedTensor.from_rank_offsets(
        "chained_1.optimizer.state.exp_avg.decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight",
        torch.zeros(2))}}}}
    stored = {"optimizer.state.exp_avg.decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
              "decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight"}
    with pytest.raises(ValueError) as err:
        remap_keys(asked, stored, "/ckpt/actor", LAYOUTS)
    message = str(err.value)
    assert message.startswith("/ckpt/actor: the checkpoint holds no optimizer state "
                              "'optimizer.state.exp_avg.decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight'")
    assert LAYOUTS in message


def test_state_keys_follow_the_checkpoint_whatever_the_chain_prefix():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_rl.workers.checkpoint_optimizer import remap_keys

    name = "optimizer.state.exp_avg.decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    for asked_key, stored_key in ((f"chained_1.{name}", name), (name, f"chained_1.{name}"),
                                  (f"chained_0.{name}", f"chained_1.{name}")):
        tensor = ShardedTensor.from_rank_offsets(asked_key, torch.zeros(2))
        remap_keys({"x": [tensor]}, {stored_key, "decoder.other"}, "/ckpt", LAYOUTS)
        assert tensor.key == stored_key


def test_the_distributed_optimizer_at_another_chain_is_refused_naming_both_layouts():
    from megatron_rl.workers.checkpoint_optimizer import check_chain_change

    check_chain_change(False, 2, 1, "/ckpt/actor", LAYOUTS)  # the plain optimizer reshards
    check_chain_change(True, 2, 2, "/ckpt/actor", LAYOUTS)  # the same chain: Megatron's own load
    with pytest.raises(ValueError) as err:
        check_chain_change(True, 2, 1, "/ckpt/actor", LAYOUTS)
    assert str(err.value).startswith("/ckpt/actor: its distributed-optimizer state was saved by 2 chained "
                                     "optimizer(s) and this engine has 1 (" + LAYOUTS + ")")
    assert "load_optimizer=False" in str(err.value)
