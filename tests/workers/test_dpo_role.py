"""The DPO role (megatron_rl/workers/preference.py) against a direct autograd DPO on the transformers models of the
same checkpoints (gloo, CPU, tiny Qwen2, fp32). The reference is another random checkpoint, so each pair's margin and
so its loss derivative differ (with the policy as its own reference every pair would weigh the same).

- The loss, TRL's reward metrics and the gradient norm equal the HF computation (loss 1e-6 relative, gradient norm
  1e-4), for sigmoid (DPO), ipo and simpo (length-normalised, reference-free), with micro-batches of 3 rows that
  split pairs (5 pairs, 10 rows), of 10 rows and under a token budget: the surrogate's gradient is the loss's.
- At data parallelism 2 with a pair split between the ranks the step is the one-rank step.
- A LoRA actor's reference is itself with the adapters off: the base model's log-probs before and after training.
- After the step the policy's sequence log-probs equal HF's after torch's Adam step with that gradient (2e-4): the
  per-parameter gradient, not only its norm (Adam's first step moves each weight by lr * sign(g)).
"""

from __future__ import annotations

import pytest
import torch

import dpo_jobs as jobs
from megatron_rl.algos.preference import compute_preference_loss, sequence_log_probs
from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed

LOSS_RTOL = 1e-6
GRAD_NORM_RTOL = 1e-4
LOG_PROB_ATOL = 2e-4
SIGMOID = {"loss_type": "sigmoid", "beta": 0.5}
CASES = {
    "sigmoid/micro3": {"dpo": SIGMOID, "micro_batch": (3, False, 64)},
    "sigmoid/micro10": {"dpo": SIGMOID, "micro_batch": (10, False, 64)},
    "sigmoid/budget": {"dpo": {**SIGMOID, "label_smoothing": 0.1}, "micro_batch": (1, True, 20)},
    "ipo/micro3": {"dpo": {"loss_type": "ipo", "beta": 0.5}, "micro_batch": (3, False, 64)},
    "simpo/micro3": {"dpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.3}, "micro_batch": (3, False, 64)},
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[str, str]:
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("dpo")
    return (str(make_tiny_hf_checkpoint(root / "policy", "qwen2", with_tokenizer=False)),
            str(make_tiny_hf_checkpoint(root / "reference", "qwen2", seed=1, with_tokenizer=False)))


@pytest.fixture(scope="module")
def megatron(dirs) -> dict:
    return run_multiprocess(jobs.dpo_job, 1, *dirs, CASES, timeout_s=500)[0]


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def hf_sequence_log_probs(model, data, average: bool) -> torch.Tensor:
    batch = data.batch
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, :-1]
    tokens = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return sequence_log_probs(tokens, batch["response_mask"], average)


def hf_step(dirs: tuple[str, str], dpo: dict) -> dict:
    """The direct DPO on HF: loss, metrics, gradient norm; the sequence log-probs after one Adam step."""
    policy, reference = hf_model(dirs[0]), hf_model(dirs[1])
    data = jobs.batch()  # rows 2i / 2i + 1: pair i's chosen / rejected side
    average = dpo["loss_type"] in ("ipo", "simpo")
    with torch.no_grad():
        ref = hf_sequence_log_probs(reference, data, average)
    logps = hf_sequence_log_probs(policy, data, average)
    loss, metrics = compute_preference_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], **dpo)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in policy.parameters())).item()
    torch.optim.Adam(policy.parameters(), lr=jobs.LR, eps=1e-8).step()
    with torch.no_grad():
        after = hf_sequence_log_probs(policy, data, average)
    return {"loss": loss.item(), "metrics": metrics, "grad_norm": grad_norm, "before": logps.detach(), "after": after}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_a_direct_dpo_on_hf(megatron, dirs, case):
    got, expected = megatron[case], hf_step(dirs, CASES[case]["dpo"])
    torch.testing.assert_close(got["before"], expected["before"], atol=1e-5, rtol=0)
    metrics = got["metrics"]
    assert metrics["train/loss"] == pytest.approx(expected["loss"], rel=LOSS_RTOL)
    for name, value in expected["metrics"].items():
        assert metrics[f"train/{name}"] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert metrics["train/grad_norm"] == pytest.approx(expected["grad_norm"], rel=GRAD_NORM_RTOL)
    assert expected["grad_norm"] > 1e-3  # a real gradient
    torch.testing.assert_close(got["after"], expected["after"], atol=LOG_PROB_ATOL, rtol=0)
    assert (expected["after"] - expected["before"]).abs().max() > 20 * LOG_PROB_ATOL  # the step moved them


def test_the_split_of_pairs_over_micro_batches_changes_nothing(megatron):
    a, b, c = (megatron[f"sigmoid/{name}"]["metrics"] for name in ("micro3", "micro10", "budget"))
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    assert a["train/loss"] == b["train/loss"]
    assert c["train/loss"] != a["train/loss"]  # label smoothing changes the loss: the case is not a copy


def test_a_lora_actor_is_its_own_reference_with_the_adapters_off(dirs):
    """The reference of a LoRA actor (dpo.reference=auto or adapters_off): the base weights, which never train."""
    out = run_multiprocess(jobs.lora_job, 1, dirs[0], timeout_s=300)[0]
    torch.testing.assert_close(out["ref_before"], out["base"], atol=1e-6, rtol=0)
    torch.testing.assert_close(out["ref_after"], out["base"], atol=1e-6, rtol=0)  # not the trained adapters
    first, second = out["metrics"]
    assert first["train/loss"] == pytest.approx(0.6931472, abs=1e-6)  # B = 0 at init: the policy is the reference
    assert second["train/loss"] < first["train/loss"] and second["train/rewards/margins"] > 0
    assert (out["policy_after"] - out["ref_after"]).abs().max() > 1e-3


def test_data_parallel_ranks_that_split_a_pair_give_the_one_rank_step(megatron, dirs):
    """DP=2 with 5 rows per rank: pair 2's chosen side on rank 0, its rejected side on rank 1 (the ranks gather the
    [2B] sequence log-probs before the loss)."""
    ranks = run_multiprocess(jobs.two_rank_job, 2, *dirs, CASES["sigmoid/micro3"], timeout_s=300)
    assert ranks[0]["pair_index"].tolist()[-1] == ranks[1]["pair_index"].tolist()[0] == 2
    one = megatron["sigmoid/micro3"]
    for rank in ranks:
        assert rank["metrics"]["train/loss"] == pytest.approx(one["metrics"]["train/loss"], rel=1e-6)
        assert rank["metrics"]["train/grad_norm"] == pytest.approx(one["metrics"]["train/grad_norm"], rel=1e-5)
    torch.testing.assert_close(torch.cat([r["after"] for r in ranks]), one["after"], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_policy_and_reference_give_the_one_rank_step(megatron, dirs, tp, pp):
    """The policy and its frozen reference at TP=2 or PP=2: the one-rank step's loss, gradient norm and updated
    sequence log-probs."""
    ranks = run_multiprocess(jobs.two_rank_job, 2, *dirs, CASES["sigmoid/micro3"], tp, pp, timeout_s=300)
    one = megatron["sigmoid/micro3"]
    for rank in ranks:
        assert rank["metrics"]["train/loss"] == pytest.approx(one["metrics"]["train/loss"], rel=1e-5)
        assert rank["metrics"]["train/grad_norm"] == pytest.approx(one["metrics"]["train/grad_norm"], rel=1e-4)
        torch.testing.assert_close(rank["after"], one["after"], atol=1e-4, rtol=0)
