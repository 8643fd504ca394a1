"""The SFT role (workers/sft.py) against transformers: the loss is the NLL per assistant token of the whole batch, its
gradient that of the same loss on the HF model (norm, and every weight after one Adam step), at TP1 (whole batch,
micro-batches, token budgets, packed sequences), TP2, PP2, DP2 and CP2. A tiny Qwen2 with perturbed norms and biases (non-trivial init).

Tolerances (fp32) as tests/workers/test_workers_roles.py: log-probs 1e-5; loss and gradient norm relative 1e-4;
weights after one Adam step 1e-3 (Adam's first step moves an element by lr * g / (|g| + eps): a wrong gradient
moves it by up to 2 * lr = 2e-2).
"""

from __future__ import annotations

import pytest
import sft_jobs as jobs
import torch

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed

VOCAB = 300  # the tiny config's (its special tokens sit at 256-258)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("sft") / "qwen2", "qwen2", with_tokenizer=False))


@pytest.fixture(scope="module")
def hf_step(model_dir) -> dict:
    """The oracle: the same batch, loss and Adam step on the transformers model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = jobs.conversations(VOCAB)
    ids, attention = data.batch["input_ids"], data.batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=attention, position_ids=data.batch["position_ids"]).logits
    log_probs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = data.batch["response_mask"].float()
    loss = -(log_probs * mask).sum() / mask.sum()
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    torch.optim.Adam(model.parameters(), lr=jobs.LR, betas=(0.9, 0.999), eps=1e-8).step()
    return {"log_probs": (log_probs * mask).detach(), "mask": mask, "loss": loss.item(), "grad_norm": grad_norm,
            "weights": {name: p.detach().clone() for name, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def one_rank(model_dir):
    return run_multiprocess(jobs.one_rank_job, 1, model_dir, VOCAB, timeout_s=400)[0]


@pytest.fixture(scope="module")
def two_ranks(model_dir):
    return run_multiprocess(jobs.two_rank_job, 2, model_dir, VOCAB, timeout_s=400)[0]


def check_step(result: dict, hf: dict, where: str) -> None:
    torch.testing.assert_close(result["log_probs"] * hf["mask"], hf["log_probs"], atol=1e-5, rtol=0, msg=where)
    metrics = result["metrics"]
    assert metrics["train/loss"] == pytest.approx(hf["loss"], rel=1e-4), where
    assert metrics["train/grad_norm"] == pytest.approx(hf["grad_norm"], rel=1e-4), where
    assert metrics["train/lr"] == pytest.approx(jobs.LR), where
    assert set(result["weights"]) == set(hf["weights"]), where
    for name, tensor in result["weights"].items():
        torch.testing.assert_close(tensor, hf["weights"][name], atol=1e-3, rtol=0, msg=f"{where}: {name}")


@pytest.mark.parametrize("split", ["whole", "micro3", "dynamic", "packed"])
def test_one_rank_step_equals_transformers(one_rank, hf_step, split):
    check_step(one_rank[split], hf_step, split)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "cp2"])
def test_parallel_step_equals_transformers(two_ranks, hf_step, layout):
    check_step(two_ranks[layout], hf_step, layout)


def test_the_loss_is_not_a_mean_of_micro_batch_means(one_rank, hf_step):
    """Rows hold different numbers of assistant tokens: a mean over micro-batches of their own token means would
    differ from the batch's token mean; the role's equals the batch's (checked above), and the oracle is not
    trivially that mean."""
    mask = hf_step["mask"]
    per_row = (hf_step["log_probs"].sum(-1) / mask.sum(-1))
    assert abs(-per_row.mean().item() - hf_step["loss"]) > 1e-4
