"""Context parallelism on an MoE model (issue 51) equals CP=1 (fp32): CP 2 x EP 2 on two ranks (the experts split
over the CP ranks' expert-parallel group) against one rank at CP = EP = 1, the load-balancing loss on. Tokens are
split over CP and each router sees its rank's chunks; Megatron's router reduces the expert counts over TP x CP, and
the pad tokens the CP split adds (each sequence rounded to 2 x CP, several sequences shorter than that) are left out
of the router's losses and counts by the padding mask the engine passes (models/moe_training.py moe_padding).
Before that mask, the load-balancing loss read 1.0831 here against 1.0908 at CP 1 and the gradients differed by 4e-3."""

from __future__ import annotations

import pytest
import torch
from cp_jobs import moe_cp_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed
ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("moe_cp") / "m", "qwen3_moe", num_layers=2,
                                        with_tokenizer=False))
    reference = run_multiprocess(moe_cp_job, 1, model, 1, 1, timeout_s=600)[0]
    return reference, run_multiprocess(moe_cp_job, 2, model, 2, 2, timeout_s=600)


def test_log_probs_losses_and_router_metrics_equal_cp1(runs):
    reference, ranks = runs
    for rank in ranks:
        torch.testing.assert_close(rank["log_probs"], reference["log_probs"], atol=ATOL, rtol=ATOL)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/moe_aux_loss", "actor/moe_aux_loss/layer_0",
                    "actor/moe_expert_load", "actor/moe_expert_load/layer_1"):
            assert rank["metrics"][key] == pytest.approx(reference["metrics"][key], rel=ATOL, abs=ATOL), key
    assert reference["metrics"]["actor/moe_aux_loss"] > 1.0  # on, and not trivially balanced
    assert reference["metrics"]["actor/moe_expert_load"] > 1.1


def test_every_gradient_and_the_step_equal_cp1(runs):
    """Dense weights on both ranks, each expert on the rank that holds it (global index), non-zero everywhere; the
    step compared as the HF weights' change (Adam divides each gradient by its own running scale, so a float-noise
    difference in a near-zero gradient moves a weight by up to ~lr: 1e-4 of lr 1e-2 here)."""
    reference, ranks = runs
    seen = set()
    for rank in ranks:
        for name, grad in rank["grads"].items():
            expected = reference["grads"][name]
            assert expected.abs().max() > 0, name
            torch.testing.assert_close(grad, expected, atol=ATOL, rtol=ATOL, msg=lambda m: f"{name}: {m}")
            seen.add(name)
        for name, change in rank["step"].items():
            torch.testing.assert_close(change, reference["step"][name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(rank["log_probs_after"], reference["log_probs_after"], atol=1e-4, rtol=0)
    assert seen == set(reference["grads"])  # every expert's gradient was compared on one of the ranks
