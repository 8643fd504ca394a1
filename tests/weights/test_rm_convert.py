"""megatron-rl-convert takes a reward model (<Family>ForSequenceClassification) both ways, scores verified."""

from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import load_file

from megatron_rl.weights.convert_cli import main
from megatron_rl_testing.reward_models import make_tiny_reward_model

pytestmark = pytest.mark.distributed


def test_reward_model_round_trip_through_megatron_checkpoint(tmp_path, capsys):
    rm = make_tiny_reward_model(tmp_path / "rm", "llama")
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--hf-dir", str(rm), "--out", str(mcore), "--tp", "2", "--verify"]) == 0
    diff = float(re.search(r"max \|logit diff\| = (\S+) \(ok", capsys.readouterr().out).group(1))
    assert diff <= 1e-4  # the score at every position, against transformers' backbone + score head
    # the way back is checked tensor by tensor (stronger than scores)
    assert main(["mcore-to-hf", "--mcore-dir", str(mcore), "--out", str(back), "--pp", "2"]) == 0
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    original, converted = load_file(rm / "model.safetensors"), load_file(back / "model.safetensors")
    assert original.keys() == converted.keys()  # score.weight, and no score.bias
    for name, tensor in original.items():
        assert (converted[name] == tensor).all(), name
