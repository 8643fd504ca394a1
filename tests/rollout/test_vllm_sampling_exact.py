"""vLLM samples exactly as the trainer assumes, in both modes, without starting an engine: engines and servers
start with generation_config=vllm, every request (colocated SamplingParams, a server's /v1/completions body)
sends neutral values for what vLLM would take from the checkpoint and no seed, and enforce_eager defaults to
verl's false. The real engines over a checkpoint with sampling defaults: test_vllm_engine.py and
test_vllm_servers.py (test_the_checkpoints_sampling_defaults_are_not_applied, ..._neutral_values_...)."""

from __future__ import annotations

import yaml

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.rollout.vllm.contract import NEUTRAL_SAMPLING
from megatron_rl_testing.vllm_support import skip_without_vllm

skip_without_vllm()

PARAMS = SamplingParams(temperature=0.7, top_p=1.0, top_k=-1, do_sample=True, max_response_length=8,
                        eos_token_ids=(95,), stop_token_ids=(), pad_token_id=0, seed=7)


def test_colocated_engines_and_servers_start_with_vllms_neutral_generation_config():
    import torch

    from megatron_rl.rollout.vllm.engine import engine_args
    from megatron_rl.servers.vllm_server import VLLMServerSettings, server_command

    rollout = RolloutConfig(name="vllm")
    args = engine_args(rollout, "/m", max_model_len=64, dtype=torch.float32, on_cpu=True)
    assert args["generation_config"] == "vllm", "the engine would take the checkpoint's generation_config.json"
    command = " ".join(server_command(VLLMServerSettings.from_rollout(rollout, "/m", max_model_len=64), port=9))
    assert "--generation-config vllm" in command, command


def test_every_request_sends_neutral_sampling_and_no_seed():
    """meta_info['seed'] (PARAMS.seed) gives no request a seed: vLLM would give each such request a
    torch.Generator and sample those rows one at a time (vllm/v1/sample/ops/topk_topp_sampler.py
    random_sample, 'for i, generator in generators.items()'), and skip FlashInfer (forward_cuda)."""
    from megatron_rl.rollout.vllm.engine import vllm_sampling_params
    from megatron_rl.rollout.vllm.server import params_request

    colocated = vllm_sampling_params(PARAMS)
    assert colocated.seed is None
    assert {k: getattr(colocated, k) for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING
    body = params_request("m", [1, 2, 3], PARAMS)
    assert "seed" not in body
    assert {k: body[k] for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING
    assert NEUTRAL_SAMPLING == {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                "min_p": 0.0}


def test_every_field_vllm_takes_from_a_checkpoint_is_sent():
    """Every field vLLM 0.32 looks up in a checkpoint's generation config (vllm/config/model.py
    get_diff_sampling_param, asked of a config that records the lookups) is in every request, neutral or ours."""
    from types import SimpleNamespace

    from vllm.config.model import ModelConfig

    from megatron_rl.rollout.vllm.server import params_request

    class Recording(dict):
        def __init__(self) -> None:
            super().__init__()
            self.asked: set[str] = set()

        def __contains__(self, key) -> bool:
            self.asked.add(key)
            return super().__contains__(key)

    checkpoint = Recording()
    ModelConfig.get_diff_sampling_param(SimpleNamespace(generation_config="auto", override_generation_config={},
                                                        try_get_generation_config=lambda: checkpoint))
    assert {"repetition_penalty", "min_p", "max_new_tokens"} <= checkpoint.asked
    sent = {"max_new_tokens" if k == "max_tokens" else k for k in params_request("m", [1], PARAMS)}
    assert checkpoint.asked <= sent, f"a checkpoint can still set {sorted(checkpoint.asked - sent)}"


def test_enforce_eager_defaults_to_verls_false_and_cpu_engines_run_eager():
    """verl 0.9.1's rollout default (verl/trainer/config/rollout/rollout.yaml, pinned in our compat config): CUDA
    graphs on GPUs. vLLM-CPU has none (vllm/platforms/cpu.py empties cudagraph_capture_sizes): there false would
    only compile the model with inductor at every start, so the CPU engine runs eager whatever the key says."""
    import torch

    from megatron_rl.compat.verl.keys import VERL_CONFIG
    from megatron_rl.rollout.vllm.engine import engine_args

    verl = yaml.safe_load(VERL_CONFIG.read_text())["actor_rollout_ref"]["rollout"]["enforce_eager"]
    assert RolloutConfig().enforce_eager is verl is False
    rollout = RolloutConfig(name="vllm")
    on = {cpu: engine_args(rollout, "/m", max_model_len=64, dtype=torch.float32, on_cpu=cpu)["enforce_eager"]
          for cpu in (False, True)}
    assert on == {False: False, True: True}, on
