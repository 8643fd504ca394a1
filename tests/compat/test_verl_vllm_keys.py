"""verl's vLLM rollout keys through megatron_rl.compat.verl.trainer.main_ppo (issue 34): rollout.name=vllm and
verl's vLLM settings are taken (they were refused: "megatron-rl has no vLLM adapter"), engine_kwargs with or
without verl's `+`, and verl's keys kept elsewhere here are refused saying where."""
from __future__ import annotations

import pytest

from megatron_rl.compat.verl.trainer.main_ppo import translate
from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate

ROLLOUT = "actor_rollout_ref.rollout"
SIZES = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "data.train_batch_size=8", f"{ROLLOUT}.n=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "trainer.device=cpu"]
# verl's vLLM rollout keys as its example scripts set them
VERL_VLLM = [f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.mode=async", f"{ROLLOUT}.gpu_memory_utilization=0.6",
             f"{ROLLOUT}.enforce_eager=False", f"{ROLLOUT}.max_num_batched_tokens=4096", f"{ROLLOUT}.max_num_seqs=256",
             f"{ROLLOUT}.enable_chunked_prefill=True", f"{ROLLOUT}.enable_prefix_caching=True",
             f"{ROLLOUT}.free_cache_engine=True", f"{ROLLOUT}.load_format=dummy_megatron"]


def test_verls_vllm_rollout_keys_are_taken():
    args = translate(VERL_VLLM, with_verl_defaults=False)
    assert f"{ROLLOUT}.name=vllm" in args and f"{ROLLOUT}.load_format=dummy" in args
    assert f"{ROLLOUT}.mode=colocated" in args
    cfg = load_config(overrides=[*SIZES, *args])
    validate(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.name, rollout.gpu_memory_utilization, rollout.enforce_eager) == ("vllm", 0.6, False)
    assert (rollout.max_num_batched_tokens, rollout.max_num_seqs, rollout.load_format) == (4096, 256, "dummy")


@pytest.mark.parametrize("spelling", ["+", "", "++"])
def test_engine_kwargs_are_added_with_or_without_verls_plus(spelling):
    args = translate(with_verl_defaults=False, argv=[*VERL_VLLM, f"{spelling}{ROLLOUT}.engine_kwargs.vllm.block_size=16",
                      f"{spelling}{ROLLOUT}.engine_kwargs.vllm.compilation_config.mode=0"])
    assert f"++{ROLLOUT}.engine_kwargs.vllm.block_size=16" in args
    cfg = load_config(overrides=[*SIZES, *args])
    validate(cfg)
    assert dict(cfg.actor_rollout_ref.rollout.engine_kwargs.vllm) == {"block_size": 16,
                                                                      "compilation_config": {"mode": 0}}


def test_engine_kwargs_are_checked_against_vllms_engine_arguments():
    args = translate(with_verl_defaults=False, argv=[*VERL_VLLM, f"+{ROLLOUT}.engine_kwargs.vllm.swap_space=4"])  # gone from vLLM 0.32
    with pytest.raises(ConfigError, match=rf"{ROLLOUT}.engine_kwargs.vllm.swap_space is not a vLLM 0.32.0 engine"):
        validate(load_config(overrides=[*SIZES, *args]))
    args = translate(with_verl_defaults=False, argv=[f"{ROLLOUT}.name=sglang", f"+{ROLLOUT}.engine_kwargs.vllm.block_size=16"])
    with pytest.raises(ConfigError, match=r"engine_kwargs.vllm=.* but actor_rollout_ref.rollout.name=sglang"):
        validate(load_config(overrides=[*SIZES, "trainer.device=cuda", *args]))


@pytest.mark.parametrize("arg, where", [
    (f"{ROLLOUT}.max_model_len=100", r"is shorter than a prompt and its response \(512 \+ 512\)"),
    (f"{ROLLOUT}.disable_log_stats=False", rf"\+{ROLLOUT}.engine_kwargs.vllm.disable_log_stats"),
    (f"{ROLLOUT}.cudagraph_capture_sizes=[1,2]", rf"\+{ROLLOUT}.engine_kwargs.vllm.cudagraph_capture_sizes"),
])
def test_verls_vllm_keys_kept_elsewhere_here_are_refused_saying_where(arg, where):
    """compat/verl/keys.py: refused at translation (before composing), naming where the setting lives here."""
    for spelling in ("", "+"):
        with pytest.raises(ConfigError, match=where):
            translate(with_verl_defaults=False, argv=[*VERL_VLLM, spelling + arg])


def test_verls_vllm_keys_that_fit_are_taken():
    args = translate(with_verl_defaults=False, argv=[*VERL_VLLM, f"{ROLLOUT}.max_model_len=1024",
                                                     f"{ROLLOUT}.disable_log_stats=True",
                                                     f"{ROLLOUT}.update_weights_bucket_megabytes=256"])
    assert f"{ROLLOUT}.weight_sync.bucket_size_mb=256" in args
    assert not any("max_model_len" in a or "disable_log_stats" in a for a in args)
