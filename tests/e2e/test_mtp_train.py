"""GRPO through the real trainer on a tiny MiMo model with one multi-token-prediction layer (issue 52 item 3), as
verl's run_mimo_7b_mtp_megatron.sh asks (model.mtp.enable, enable_train, detach_encoder): the actor at TP 2 on two
gloo ranks, the HF engine colocated and serving MiMo's main model (as Qwen2); every sync verified. The MTP loss is
logged each step, the engine's log-probs equal the trainer's, and the HF export holds the trained MTP layer."""
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
    from transformers import AutoTokenizer

    from megatron_rl_testing.mtp_models import make_mtp_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    model_dir = make_mtp_checkpoint(
        tmp_path_factory.mktemp("mimo") / "mimo", "mimo", vocab_size=len(tokenizer), hidden_size=64,
        intermediate_size=128, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
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
