"""Context parallelism equals CP=1 (fp32): log-probs, entropies, values, reward-model scores, every loss
aggregation mode's loss, the gradients and the step they make, at TP=1 x CP=2 (2 ranks), TP=2 x CP=2
with and without sequence parallelism and PP=2 x VPP=2 x CP=2 (4 ranks). Packed sequences of uneven lengths, several shorter than
the 2 x CP chunks they are split into; the reference is one rank at TP=CP=1."""

from __future__ import annotations

import pytest
import torch
from cp_jobs import AGG_MODES, cp_job, window_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed
# name -> (CP, TP, sequence parallel, PP, VPP)
LAYOUTS = {"tp1_cp2": (2, 1, False, 1, None), "tp2_cp2": (2, 2, False, 1, None), "tp2_cp2_sp": (2, 2, True, 1, None),
           "pp2_vpp2_cp2": (2, 1, False, 2, 2)}
ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    """(LM, critic with a random value head and bias: loaded identically at every TP)."""
    from megatron_rl_testing.tiny_models import make_tiny_critic_checkpoint, make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("cp")
    model = make_tiny_hf_checkpoint(root / "qwen2", "qwen2", num_layers=4, with_tokenizer=False)  # 4: PP2 x VPP2
    return str(model), str(make_tiny_critic_checkpoint(model, root / "qwen2_critic"))


@pytest.fixture(scope="module")
def reference(model_dirs):
    return run_multiprocess(cp_job, 1, *model_dirs, 1, 1, timeout_s=600)[0]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, model_dirs):
    cp, tp, sp, pp, vpp = LAYOUTS[request.param]
    return request.param, run_multiprocess(cp_job, cp * tp * pp, *model_dirs, cp, tp, sp, pp, vpp, timeout_s=900)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=ATOL, msg=lambda m: f"{what}: {m}")


def test_the_batch_has_sequences_shorter_than_the_chunks():
    from cp_jobs import cp_batch

    lengths = cp_batch().batch["attention_mask"].sum(dim=1)
    assert (lengths < 4).any() and (lengths % 4 != 0).any() and len(set(lengths.tolist())) > 3, lengths


def test_forward_outputs_equal_cp1(reference, layout):
    name, ranks = layout
    for rank, out in enumerate(ranks):  # every CP (and TP) rank holds the whole batch's results
        for key in ("log_probs", "entropys", "values", "rm_scores"):
            _close(out[key], reference[key], f"{name} rank {rank} {key}")
    assert reference["values"].abs().max() > 0.01 and reference["rm_scores"].abs().max() > 0.01


@pytest.mark.parametrize("mode", AGG_MODES)
def test_losses_gradients_and_the_step_equal_cp1(reference, layout, mode):
    name, ranks = layout
    out = ranks[-1]
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert out[f"{mode}/metrics"][key] == pytest.approx(reference[f"{mode}/metrics"][key], rel=ATOL, abs=ATOL), key
    # after Adam's step: Adam divides each gradient by its own running scale, so the float noise of a near-zero
    # gradient (equal to 1e-5 here, checked below) moves its weight by up to ~lr (1e-2). On 2026-12-07's machines one
    # log-prob of 80 moved 1.3e-4 apart (the same at the code of 2026-12-06, which passed at 1e-5 then)
    torch.testing.assert_close(out[f"{mode}/log_probs_after"], reference[f"{mode}/log_probs_after"], atol=5e-4,
                               rtol=0, msg=lambda m: f"{name} {mode} after the step: {m}")
    if name == "tp1_cp2":  # unsharded weights: each parameter's gradient, on both CP ranks
        for rank in ranks:
            assert rank[f"{mode}/grads"].keys() == reference[f"{mode}/grads"].keys()
            for param, grad in reference[f"{mode}/grads"].items():
                assert grad.abs().max() > 0, param
                _close(rank[f"{mode}/grads"][param], grad, f"{name} {mode} grad {param}")


def test_critic_loss_and_gradients_equal_cp1(reference, layout):
    name, ranks = layout
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
        assert ranks[-1]["critic/metrics"][key] == pytest.approx(reference["critic/metrics"][key], rel=ATOL, abs=ATOL)
    if name == "tp1_cp2":
        for param, grad in reference["critic/grads"].items():
            _close(ranks[0]["critic/grads"][param], grad, f"critic grad {param}")


def test_token_budget_is_per_gpu(reference, layout):
    """use_dynamic_bsz: the budget is per GPU, a micro-batch over CP ranks holds CP x as many tokens;
    however it is cut, the step is the same."""
    name, ranks = layout
    if LAYOUTS[name][4] is not None:
        pytest.skip("the interleaved schedule takes only some micro-batch counts: no token budget at VPP")
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert ranks[-1]["dynamic/metrics"][key] == pytest.approx(reference["dynamic/metrics"][key], rel=ATOL, abs=ATOL)


def test_sliding_window_equals_cp1(tmp_path):
    """Mistral's window (3 tokens here, shorter than most sequences): each chunk's queries see only the keys
    within it, whichever CP rank computed them."""
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = str(make_tiny_hf_checkpoint(tmp_path / "mistral", "mistral", sliding_window=3, with_tokenizer=False))
    reference = run_multiprocess(window_job, 1, model, 1, timeout_s=600)[0]
    for rank in run_multiprocess(window_job, 2, model, 2, timeout_s=600):
        _close(rank, reference, "sliding window at CP=2")
