"""Multi-turn GRPO through the trainer with rollout.name=sglang against the strict SGLang 0.5.23 stand-in (4 Ray
ranks, actor TP 2, rollout TP 2 -> 2 engines): every model turn is a generate call on the engine leaders, the
trainer's log-probs equal the engines' on every model token, syncs verified, validation multi-turn too."""

from __future__ import annotations

import pytest
from sglang_runs import check_run, sglang_overrides

from megatron_rl.config import load_config
from megatron_rl.train import run
from megatron_rl.trainer.tracking import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    from megatron_rl.demo import prepare_assets

    train, val, model = prepare_assets(tmp_path_factory.mktemp("tool_assets"), task="tool_multiply", n_train=64,
                                       n_val=8, tokenizer_kwargs={"vocab_size": 200}, max_positions=512)
    return {"train": train, "val": val, "model": model}


def test_multi_turn_grpo_on_two_sglang_engines(sglang_stand_in, tool_assets, tmp_path):
    result = run(load_config(overrides=sglang_overrides(
        tool_assets, tmp_path,
        "trainer.total_training_steps=2",
        "data.max_prompt_length=192",
        "data.max_response_length=96",
        f"actor_rollout_ref.rollout.stop_token_ids={list(range(40, 52))}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    )))
    check_run(result.metrics_path, 2)
    for record in read_metrics(result.metrics_path):
        if record["step"] == 0:
            continue
        assert record["num_turns/max"] >= 5 and record["num_turns/mean"] > 3
        assert record["training/rollout_probs_diff_max"] < 1e-5


def test_stand_in_retries_a_shm_manager_timeout(sglang_stand_in, monkeypatch):
    """Torch's shm manager answers within a hard-coded 1 s or fails; on a loaded machine the stand-in retries
    that (and only that) error instead of failing the run (issue 33)."""
    import torch
    from sglang.srt.utils import common

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("Shared memory manager connection has timed out")
        return "ok"

    assert common._retry_shm(flaky) == "ok" and len(calls) == 3
    with pytest.raises(RuntimeError, match="something else"):
        common._retry_shm(lambda: (_ for _ in ()).throw(RuntimeError("something else")))
    monkeypatch.setattr(common, "SHM_RETRY_S", 0.0)
    with pytest.raises(RuntimeError, match="timed out"):
        common._retry_shm(lambda: (_ for _ in ()).throw(RuntimeError("Shared memory manager connection has timed out")))
    t = torch.arange(4.0)
    out = common.MultiprocessingSerializer.deserialize(common.MultiprocessingSerializer.serialize({"w": t}))
    assert torch.equal(out["w"], t) and t.is_shared()
