"""An uneven pipeline (issue 51; verl's Qwen3-235B script sets num_layers_in_first/last_pipeline_stage): a 3-layer
model at PP=2 with 1 layer on the first stage and 2 on the last equals PP=1 in log-probs, the update's loss and
gradient norm, and the weights after it (fp32). Before, the builder refused any layer count not divisible by PP."""

from __future__ import annotations

import pytest
import torch
from uneven_pipeline_jobs import uneven_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed


def test_pp2_with_one_layer_first_equals_pp1(tmp_path):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = str(make_tiny_hf_checkpoint(tmp_path / "m", "qwen2", num_layers=3, with_tokenizer=False))
    reference = run_multiprocess(uneven_job, 1, model, 1, timeout_s=600)[0]
    ranks = run_multiprocess(uneven_job, 2, model, 2, 1, timeout_s=600)
    assert [rank["layers"] for rank in ranks] == [[1], [2, 3]]  # Megatron's 1-based global layer numbers
    for rank in ranks:
        torch.testing.assert_close(rank["log_probs"], reference["log_probs"], atol=1e-5, rtol=1e-5)
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert rank["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5), key
        assert rank["weights"].keys() == reference["weights"].keys()
        for name, tensor in rank["weights"].items():
            torch.testing.assert_close(tensor, reference["weights"][name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
    assert reference["metrics"]["actor/grad_norm"] > 0
