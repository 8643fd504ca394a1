"""megatron.param_offload / optimizer_offload (workers/offload.py): what moves where in each phase of a
colocated step, that the memory is really released (storages emptied), and that two steps with offload
give the numbers of two steps without it (log-probs 1e-6, loss and grad norm 1e-6 relative, weights exact
after the round trips: the bytes come back as they left)."""

from __future__ import annotations

import pytest
import torch
from offload_jobs import offload_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def results(request, tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("offload") / "qwen2", "qwen2", with_tokenizer=False)
    return run_multiprocess(offload_job, request.param, str(model), request.param, timeout_s=500)[0]


def test_offloaded_steps_match_plain_steps(results):
    for name in ("offload", "params_only"):
        for plain, moved in zip(results["plain/steps"], results[f"{name}/steps"]):
            torch.testing.assert_close(moved["log_probs"], plain["log_probs"], atol=1e-6, rtol=0)
            for key in ("actor/pg_loss", "actor/grad_norm"):
                assert moved["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-6)
            assert moved["weights"].keys() == plain["weights"].keys()
            for key, tensor in plain["weights"].items():
                assert torch.equal(moved["weights"][key], tensor), key


def test_memory_is_released_in_the_phases_that_do_not_need_it(results):
    plain, moved = results["plain/steps"], results["offload/steps"]
    assert plain[0]["weights_bytes_in_generate"] > 0 and plain[0]["host_bytes_in_generate"]["weights"] == 0
    for step in moved:
        assert step["weights_bytes_in_generate"] == 0  # the parameters' storages are empty while generating
        assert step["host_bytes_in_generate"]["weights"] == plain[0]["weights_bytes_in_generate"]
        assert step["host_bytes_in_generate"]["grads"] > 0
        assert step["host_bytes_after_update"]["weights"] == 0  # on the device for the export
        assert step["host_bytes_after_update"]["grads"] > 0
    # Adam's m and v exist from the first step on: the second generation sends them away too
    assert moved[1]["host_bytes_in_generate"]["optimizer"] > 0
    assert results["params_only/steps"][1]["host_bytes_in_generate"]["optimizer"] == 0


def test_the_log_says_what_moved_where_in_which_phase(results):
    log = results["offload/log"]
    kinds_by_phase: dict[tuple[str, str], set[str]] = {}
    for phase, kind, to, nbytes in log:
        kinds_by_phase.setdefault((phase, to), set()).add(kind)
    assert kinds_by_phase[("generate", "host")] >= {"weights", "grads", "optimizer"}
    assert kinds_by_phase[("compute", "device")] == {"weights"}
    assert kinds_by_phase[("update", "device")] >= {"grads", "optimizer"}
    assert kinds_by_phase[("after_update", "host")] == {"grads", "optimizer"}
    assert results["plain/log"] == []  # without the flags nothing moves
    assert results["offload/residency"] == {"weights": "device", "grads": "host", "optimizer": "host"}


def test_bf16_master_weights_travel_with_the_optimizer(results):
    """bf16 parameters: Megatron's fp32 master weights are separate storages, offloaded with Adam's state."""
    plain, moved = results["bf16_plain/steps"], results["bf16_offload/steps"]
    assert moved[0]["host_bytes_in_generate"]["optimizer"] > 0  # master weights exist before the first step
    for a, b in zip(plain, moved):
        torch.testing.assert_close(b["log_probs"], a["log_probs"], atol=0, rtol=0)
        for key, tensor in a["weights"].items():
            assert torch.equal(b["weights"][key], tensor), key
