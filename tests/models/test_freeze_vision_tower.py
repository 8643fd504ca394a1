"""actor.freeze_vision_tower (verl's key): the vision tower of a vision-language model gets requires_grad=False
before the optimizer is built, so one optimizer step leaves it as loaded while the language model trains; a model
without a vision tower refuses the key by name (the engine, and the planner before launch)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.distributed import run_multiprocess
from megatron_rl.workers.engine import freeze_vision_tower
from megatron_rl_testing.vl_models import make_tiny_qwen2_5_vl

sys.path.insert(0, str(Path(__file__).parent))  # the rank job module, for the spawned rank

from freeze_vision_jobs import freeze_job  # noqa: E402


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    return str(make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_vl")))


def test_the_frozen_tower_stays_and_the_language_model_trains(tiny_vl):
    (out,) = run_multiprocess(freeze_job, 1, tiny_vl, True, timeout_s=600)
    assert out["grad_norm"] > 0
    assert out["vision_requires_grad"] and not any(out["vision_requires_grad"].values())
    assert all(out["language_requires_grad"].values())
    assert not any(out["vision_moved"].values())
    moved = out["language_moved"]
    assert moved["decoder.layers.0.self_attention.linear_qkv.weight"] and moved["decoder.final_layernorm.weight"]


def test_without_the_key_the_tower_trains_too(tiny_vl):
    (out,) = run_multiprocess(freeze_job, 1, tiny_vl, False, timeout_s=600)
    assert out["grad_norm"] > 0 and all(out["vision_requires_grad"].values())
    assert out["vision_moved"]["merger.mlp.0.weight"] and out["vision_moved"]["blocks.0.attn.qkv.weight"]


def test_a_text_model_refuses_the_key_by_name():
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.freeze_vision_tower=true, but Qwen2ForCausalLM "
                                         r"has no vision tower"):
        freeze_vision_tower([], SimpleNamespace(vision=None, architecture="Qwen2ForCausalLM"),
                            "actor_rollout_ref.actor.freeze_vision_tower")
