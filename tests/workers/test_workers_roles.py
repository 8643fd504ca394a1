"""Actor / reference / critic roles on Megatron (gloo, CPU, tiny Qwen2): numbers against the HF model,
split invariance over micro-batches, data, tensor and pipeline parallelism, PPO progress, checkpoints.

Three spawns run everything (see jobs.py): one rank (reference numbers), two ranks (TP=2, DP=2,
PP=2, PP=2 x VPP=2 in turn), and a fresh single rank that loads the checkpoints.

Tolerances (fp32): log-probs vs HF 1e-5 absolute. Parameters after one AdamW step across
splits/layouts 1e-3 absolute: Adam's first step is lr * g / (|g| + 1e-8), so a wrongly weighted
gradient moves an element by up to 2 * lr = 2e-2, while summation-order noise only matters for
elements with |g| near 1e-8. Adam's step hides a uniformly mis-scaled gradient, so the loss and the
gradient norm are compared too (relative 1e-4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import workers_jobs as jobs

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed

LOG_PROB_ATOL = 1e-5
WEIGHT_ATOL = 1e-3
METRIC_RTOL = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str, str, str]:
    """(LM, 4-layer LM, critic, work directory)."""
    from megatron_rl_testing.tiny_models import make_tiny_critic_checkpoint, make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("workers")
    model = make_tiny_hf_checkpoint(root / "qwen2", "qwen2", with_tokenizer=False)
    deep = make_tiny_hf_checkpoint(
        root / "qwen2_4layers", "qwen2", num_layers=4, seed=1, with_tokenizer=False
    )
    critic = make_tiny_critic_checkpoint(model, root / "qwen2_critic")
    return str(model), str(deep), str(critic), str(root)


@pytest.fixture(scope="module")
def single(model_dirs):
    return run_multiprocess(jobs.single_rank_job, 1, *model_dirs, timeout_s=500)[0]


@pytest.fixture(scope="module")
def two_ranks(model_dirs):
    return run_multiprocess(jobs.two_rank_job, 2, *model_dirs, timeout_s=500)


@pytest.fixture(scope="module")
def resumed(model_dirs, single, two_ranks):
    model, _, _, workdir = model_dirs
    return run_multiprocess(jobs.resume_job, 1, model, workdir, timeout_s=300)[0]


def hf_log_probs(model_dir: str, data) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the response tokens under the HF model (full-vocab softmax)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl_testing.hf_reference import hf_response_log_softmax

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    log_softmax = hf_response_log_softmax(model, data, jobs.TEMPERATURE)
    log_probs = log_softmax.gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def hf_values(critic_dir: str, data) -> torch.Tensor:
    """Values of the states before each response token under HF's token-classification critic."""
    from transformers import AutoModelForTokenClassification

    from megatron_rl_testing.hf_reference import hf_predictor_outputs

    model = AutoModelForTokenClassification.from_pretrained(critic_dir, dtype=torch.float32)
    return hf_predictor_outputs(model, data).squeeze(-1)


def masked(x: torch.Tensor, data) -> torch.Tensor:
    return x * data.batch["response_mask"]


def assert_same_weights(a: dict, b: dict, atol: float = WEIGHT_ATOL) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        torch.testing.assert_close(tensor, b[name], atol=atol, rtol=0, msg=f"{name} differs")


def assert_same_metrics(
    a: dict, b: dict, names=("actor/pg_loss", "actor/grad_norm", "actor/entropy")
) -> None:
    for name in names:
        assert a[name] == pytest.approx(b[name], rel=METRIC_RTOL), name


# ------------------------------------------------------------------ log-probs against HF
def test_log_probs_and_entropy_match_hf(model_dirs, single):
    data = jobs.training_batch()
    expected, entropy = hf_log_probs(model_dirs[0], data)
    torch.testing.assert_close(
        masked(single["log_probs"], data), masked(expected, data), atol=LOG_PROB_ATOL, rtol=0
    )
    torch.testing.assert_close(
        masked(single["entropys"], data), masked(entropy, data), atol=LOG_PROB_ATOL, rtol=0
    )
    # response padding is never computed: exactly 0
    assert (
        single["log_probs"][data.batch["attention_mask"][:, -data.batch["responses"].shape[1] :] == 0] == 0
    ).all()


def test_dynamic_batching_and_reference_give_the_same_log_probs(single):
    torch.testing.assert_close(single["log_probs_dynamic"], single["log_probs"], atol=LOG_PROB_ATOL, rtol=0)
    torch.testing.assert_close(single["ref_log_prob"], single["log_probs"], atol=LOG_PROB_ATOL, rtol=0)


def test_log_probs_match_hf_at_tp2_dp2_pp2_vpp(model_dirs, single, two_ranks):
    data = jobs.training_batch()
    rank0 = two_ranks[0]
    for key in ("tp2/log_probs", "pp2/log_probs"):
        torch.testing.assert_close(rank0[key], single["log_probs"], atol=LOG_PROB_ATOL, rtol=0, msg=key)
    dp2 = torch.cat([two_ranks[0]["dp2/log_probs"], two_ranks[1]["dp2/log_probs"]])
    torch.testing.assert_close(dp2, single["log_probs"], atol=LOG_PROB_ATOL, rtol=0)
    deep_expected, _ = hf_log_probs(model_dirs[1], data)
    torch.testing.assert_close(
        masked(single["deep/log_probs"], data), masked(deep_expected, data), atol=LOG_PROB_ATOL, rtol=0
    )
    torch.testing.assert_close(rank0["vpp/log_probs"], single["deep/log_probs"], atol=LOG_PROB_ATOL, rtol=0)
    # every pipeline rank returns the last stage's answer
    torch.testing.assert_close(two_ranks[1]["pp2/log_probs"], rank0["pp2/log_probs"])


# ------------------------------------------------------------------ split invariance
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("split", ["micro1", "dynamic"])
def test_update_is_invariant_to_micro_batching(single, mode, split):
    assert_same_metrics(single[f"{mode}/{split}/metrics"], single[f"{mode}/micro4/metrics"])
    assert_same_weights(single[f"{mode}/{split}/weights"], single[f"{mode}/micro4/weights"])


def test_update_is_invariant_to_data_tensor_and_pipeline_parallelism(single, two_ranks):
    reference = "token-mean/micro4"
    for layout in ("dp2", "tp2", "pp2"):
        for rank in two_ranks:
            assert_same_metrics(rank[f"{layout}/metrics"], single[f"{reference}/metrics"])
        assert_same_weights(two_ranks[0][f"{layout}/weights"], single[f"{reference}/weights"])
    assert_same_metrics(two_ranks[0]["vpp/metrics"], single["deep/metrics"])


def test_update_metrics_have_verl_names(single):
    metrics = single["token-mean/micro4/metrics"]
    expected = {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
    }
    assert expected <= metrics.keys()
    assert metrics["actor/lr"] == pytest.approx(1e-2)
    assert (
        0.0 < metrics["actor/pg_clipfrac"] < 1.0
    )  # the perturbed old log-probs make the clip bind somewhere


# ------------------------------------------------------------------ learning
def test_ppo_updates_raise_log_probs_of_positive_advantage_tokens(single):
    mask = single["ppo/mask"].bool()
    before, after = single["ppo/before"][mask], single["ppo/after"][mask]
    assert after.mean() > before.mean() + 0.05
    assert (after > before).float().mean() > 0.9
    losses = [m["actor/pg_loss"] for m in single["ppo/metrics"]]
    assert losses[-1] < losses[0]


def test_critic_values_match_hf_and_value_loss_decreases(model_dirs, single, two_ranks):
    data = jobs.training_batch()
    values = single["critic/values"]
    torch.testing.assert_close(
        values, masked(hf_values(model_dirs[2], data), data), atol=LOG_PROB_ATOL, rtol=0
    )
    torch.testing.assert_close(two_ranks[0]["tp2/values"], values, atol=LOG_PROB_ATOL, rtol=0)
    losses = [m["critic/vf_loss"] for m in single["critic/metrics"]]
    assert losses[-1] < 0.9 * losses[0]
    assert {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
    } <= single["critic/metrics"][0].keys()


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_saved_at_tp2_loads_at_tp1(two_ranks, resumed):
    torch.testing.assert_close(
        resumed["tp2_ckpt/log_probs"], two_ranks[0]["tp2/log_probs_after"], atol=LOG_PROB_ATOL, rtol=0
    )
    # and differs from the initial weights, so the load did something
    assert (resumed["tp2_ckpt/log_probs"] - two_ranks[0]["tp2/log_probs"]).abs().max() > 1e-3


def test_resume_gives_the_same_next_step(single, resumed):
    assert resumed["resume/extra"] == {"data_position": 17}
    for name, value in single["resume/step2_metrics"].items():
        assert resumed["resume/step2_metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert_same_weights(resumed["resume/step2_weights"], single["resume/step2_weights"], atol=0)


def test_interrupted_save_leaves_the_previous_checkpoint(model_dirs, resumed):
    assert resumed["crash/error"] == "disk full (simulated)"
    assert Path(model_dirs[3], "resume_ckpt.tmp").is_dir()  # the partial write, never renamed
    assert resumed["crash/metrics_after_reload"] == resumed["resume/step2_metrics"]


# ------------------------------------------------------------------ errors
def test_bad_batches_fail_naming_the_field(single):
    assert "missing ['advantages']" in single["error/missing"] and "update_actor" in single["error/missing"]
    assert "batch['old_log_probs'] has shape (16, 4)" in single["error/shape"]
    assert "meta_info['temperature'] is missing" in single["error/temperature"]
