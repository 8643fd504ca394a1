"""rollout.engine_kwargs.sglang (issue 51): SGLang 0.5.23's own ServerArgs pass through to sglang.Engine after a
check before anything starts (unknown names with the nearest real one, wrong types, values outside a closed
choice, names the adapter sets itself, an expert-parallel layout SGLang cannot build); verl's
rollout.expert_parallel_size becomes SGLang's ep_size, as verl's SGLang server passes it."""
from __future__ import annotations

import re

import pytest

from megatron_rl.compat.verl.trainer.main_ppo import translate
from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.schema import EngineKwargsConfig, RolloutConfig
from megatron_rl.plan.validate import validate
from megatron_rl.rollout.sglang import build_sglang_engine
from megatron_rl_testing.rollout_models import tiny_qwen2_config

KWARGS = "actor_rollout_ref.rollout.engine_kwargs.sglang"
TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"
BASE = ["trainer.nnodes=1", "trainer.n_gpus_per_node=4", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.device=cuda", "actor_rollout_ref.rollout.name=sglang", f"{TP}=4"]


def cfg_with(*overrides: str):
    return load_config(overrides=[*BASE, *overrides])


def test_sglang_server_args_pass_validation():
    validate(cfg_with(f"+{KWARGS}.ep_size=2", f"+{KWARGS}.moe_runner_backend=triton",
                      f"+{KWARGS}.moe_a2a_backend=none", f"+{KWARGS}.disable_cuda_graph=true",
                      f"+{KWARGS}.chunked_prefill_size=null"))


@pytest.mark.parametrize("arg, message", [
    ("ep_sise=2", f"{KWARGS}.ep_sise is not an SGLang 0.5.23 ServerArgs field (did you mean ep_size?)"),
    ("moe_runner_backend=tritonn", f"{KWARGS}.moe_runner_backend='tritonn' is not one of SGLang's choices ['auto', "),
    ("moe_a2a_backend=deep_ep", f"{KWARGS}.moe_a2a_backend='deep_ep' is not one of SGLang's choices ['none', 'deepep'"),
    ("disable_cuda_graph=1", f"{KWARGS}.disable_cuda_graph=1 must be a boolean"),
    ("ep_size=two", f"{KWARGS}.ep_size='two' must be an integer"),
    ("tp_size=2", f"{KWARGS}.tp_size is set by megatron-rl: {TP}"),
    ("mem_fraction_static=0.5", f"{KWARGS}.mem_fraction_static is set by megatron-rl: "
                                "actor_rollout_ref.rollout.gpu_memory_utilization"),
    ("model_path=/m", f"{KWARGS}.model_path is set by megatron-rl: actor_rollout_ref.model.path"),
    ("nccl_port=1234", f"{KWARGS}.nccl_port is set by megatron-rl: actor_rollout_ref.rollout.sglang.port_base"),
])
def test_unknown_mistyped_and_owned_server_args_are_refused_naming_the_key(arg, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg_with(f"+{KWARGS}.{arg}"))


@pytest.mark.parametrize("ep", [3, 8, 0])
def test_an_expert_parallel_layout_sglang_cannot_build_is_refused_naming_both_keys(ep):
    with pytest.raises(ConfigError, match=re.escape(f"{KWARGS}.ep_size={ep} must be >= 1 and divide {TP}=4")) as err:
        validate(cfg_with(f"+{KWARGS}.ep_size={ep}"))
    assert "[1, 2, 4]" in str(err.value)


def test_engine_kwargs_cannot_reach_servers_started_elsewhere():
    with pytest.raises(ConfigError, match=re.escape(f"{KWARGS}={{'ep_size': 2}} cannot reach SGLang servers")):
        validate(cfg_with("actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.server_urls=[http://h:1]",
                          f"+{KWARGS}.ep_size=2"))


def test_verl_expert_parallel_size_becomes_sglangs_ep_size():
    """verl's SGLang server: ``"ep_size": self.config.expert_parallel_size`` (async_sglang_server.py)."""
    args = translate(["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.expert_parallel_size=2"])
    assert "++actor_rollout_ref.rollout.engine_kwargs.sglang.ep_size=2" in args
    assert not [a for a in translate(["actor_rollout_ref.rollout.name=sglang",
                                      "actor_rollout_ref.rollout.expert_parallel_size=1"]) if "ep_size" in a]


# ---------------------------------------------------------------------------- the (stand-in) engine
@pytest.fixture
def model_dir(tmp_path):
    tiny_qwen2_config().save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def engine_with(model_dir: str, tp: int, **server_args):
    config = RolloutConfig(name="sglang", tensor_model_parallel_size=tp, response_length=5, dtype="float32",
                           engine_kwargs=EngineKwargsConfig(sglang=server_args))
    return build_sglang_engine(config, model_dir, eos_token_id=2, pad_token_id=0)


def test_engine_kwargs_and_expert_parallelism_reach_the_engine(sglang_stand_in, model_dir):
    engine = engine_with(model_dir, 2, ep_size=2, moe_runner_backend="triton")
    try:
        given = engine.transport._engine.stand_in_given_args()
        assert given["ep_size"] == 2 and given["moe_runner_backend"] == "triton" and given["tp_size"] == 2
    finally:
        engine.shutdown()


def test_the_builder_refuses_what_validation_refuses(sglang_stand_in, model_dir):
    with pytest.raises(ConfigError, match=re.escape(f"{KWARGS}.ep_size=2 must be >= 1 and divide {TP}=1")):
        engine_with(model_dir, 1, ep_size=2)


def test_the_stand_in_refuses_an_ep_size_that_does_not_divide_tp_size(sglang_stand_in, model_dir):
    import sglang

    with pytest.raises(ValueError, match=re.escape("ep_size=3 must be a positive int dividing tp_size=2")):
        sglang.Engine(model_path=model_dir, tp_size=2, ep_size=3, skip_tokenizer_init=True, load_format="dummy")
    with pytest.raises(ValueError, match=re.escape("moe_a2a_backend='deep_ep' is not one of ['none', ")):
        sglang.Engine(model_path=model_dir, tp_size=2, moe_a2a_backend="deep_ep", skip_tokenizer_init=True,
                      load_format="dummy")
