"""The actor's update with multi-token prediction (``actor_rollout_ref.model.mtp``, workers/mtp_loss.py) on a tiny
MiMo checkpoint at TP=2 with sequence parallelism:
- frozen (enable only): the MTP layer is loaded and exported but never changes; the main model trains as without it;
- joint (enable_train): the MTP layer trains, and its loss moves the main model too;
- detach_encoder: the MTP layer trains, the main model moves exactly as without MTP;
- the MTP loss is the same in the padded and the packed (THD) layout (its targets are built in both);
- the weight sync leaves the MTP layer out (the engines do not draft with it), the HF export keeps it;
- a checkpoint holds the MTP layer and its optimizer state: a resumed actor's next update equals the original's."""

from __future__ import annotations

import pytest
import torch
from mtp_training_jobs import mtp_update_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rl_testing.mtp_models import make_mtp_checkpoint

    model = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "mimo", "mimo", vocab_size=300)
    return run_multiprocess(mtp_update_job, 2, str(model), 2, str(tmp_path_factory.mktemp("ckpt")),
                            timeout_s=900)[0]


def _split(weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    mtp = {n: t for n, t in weights.items() if n.startswith("model.mtp_layers.")}
    return mtp, {n: t for n, t in weights.items() if n not in mtp}


def _changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[n], after[n]) for n in before)


def test_without_mtp_the_layer_is_neither_built_nor_exported(results):
    mtp, main = _split(results["padded", "off"]["after"])
    assert not mtp and main
    assert not any("mtp_loss" in key for key in results["padded", "off"]["metrics"])


def test_frozen_mtp_layer_is_exported_unchanged_and_the_main_model_trains_as_without_it(results):
    frozen = results["padded", "frozen"]
    before_mtp, _ = _split(frozen["before"])
    after_mtp, after_main = _split(frozen["after"])
    assert len(before_mtp) == 16  # the MTP layer's own 4 tensors and its Qwen2 decoder layer's 12
    assert not _changed(before_mtp, after_mtp)
    _, off_main = _split(results["padded", "off"]["after"])
    for name, tensor in off_main.items():
        torch.testing.assert_close(after_main[name], tensor, atol=0, rtol=0)
    assert not any("mtp_loss" in key for key in frozen["metrics"])


@pytest.mark.parametrize("case", ["joint", "detached"])
def test_trained_mtp_layer_changes_and_reports_its_loss(results, case):
    run = results["padded", case]
    before_mtp, _ = _split(run["before"])
    after_mtp, _ = _split(run["after"])
    assert _changed(before_mtp, after_mtp)
    loss = run["metrics"]["actor/mtp_loss"]
    assert loss == run["metrics"]["actor/mtp_loss/depth_1"] and 0.0 < loss < 20.0


def test_detach_encoder_keeps_the_main_model_update_and_joint_training_moves_it(results):
    _, off_main = _split(results["padded", "off"]["after"])
    _, detached_main = _split(results["padded", "detached"]["after"])
    _, joint_main = _split(results["padded", "joint"]["after"])
    for name, tensor in off_main.items():
        torch.testing.assert_close(detached_main[name], tensor, atol=0, rtol=0)
    assert max((joint_main[n] - off_main[n]).abs().max().item() for n in off_main) > 1e-4


@pytest.mark.parametrize("case", ["joint", "detached"])
def test_packed_layout_has_the_padded_mtp_loss(results, case):
    padded = results["padded", case]["metrics"]["actor/mtp_loss"]
    packed = results["packed", case]["metrics"]["actor/mtp_loss"]
    assert abs(padded - packed) <= 1e-5 * max(1.0, padded)


def test_weight_sync_leaves_the_mtp_layer_out(results):
    run = results["padded", "joint"]
    assert run["sync_names"] and not any(n.startswith("model.mtp_layers.") for n in run["sync_names"])
    assert set(run["sync_names"]) == set(_split(run["after"])[1])


def test_checkpoint_resumes_the_mtp_layer_and_its_optimizer_state(results):
    resume = results["resume"]
    saved = results["padded", "joint"]["after"]
    assert set(resume["loaded"]) == set(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(resume["loaded"][name], tensor, atol=0, rtol=0)
    (continued_metrics, continued), (resumed_metrics, resumed) = resume["continued"], resume["resumed"]
    assert continued_metrics["actor/mtp_loss"] == resumed_metrics["actor/mtp_loss"]
    for name, tensor in continued.items():
        torch.testing.assert_close(resumed[name], tensor, atol=0, rtol=0)
