"""rollout.name=vllm is checked before Ray or any engine starts (issue 34): vLLM's engine arguments in
rollout.engine_kwargs.vllm, the CPU thread binding of a TP > 1 engine, vLLM being installed and a head size its
CPU attention runs. Validation and preflight only: no vLLM engine starts here."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate
from megatron_rl.rollout.vllm import contract

BASE = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.device=cpu", "actor_rollout_ref.rollout.name=vllm"]
KWARGS = "actor_rollout_ref.rollout.engine_kwargs"


def cfg_with(*overrides: str):
    return load_config(overrides=[*BASE, *overrides])


def _model(root: Path, hidden: int, heads: int) -> Path:
    """config.json and a tokenizer, as preflight reads a model directory."""
    from megatron_rl.data import build_tiny_tokenizer

    model = root / f"model_h{hidden}_n{heads}"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "num_attention_heads": heads, "num_key_value_heads": heads,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "vocab_size": 256, "num_hidden_layers": 2}))
    build_tiny_tokenizer(model, ["hi there 1 2 3"])
    return model


def start_cfg(tmp_path: Path, model: Path, *overrides: str):
    """A config a start can check against the world: data, model, a fresh output directory."""
    train = tmp_path / "train.jsonl"
    row = {"prompt": [{"role": "user", "content": "hi"}], "data_source": "synthetic/copy",
           "reward_model": {"ground_truth": "1"}}
    train.write_text((json.dumps(row) + "\n") * 8)
    return cfg_with(f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}",
                    f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=2", *overrides)


@pytest.fixture
def vllm_installed(monkeypatch):
    """The pinned vLLM counts as installed, whatever this machine has (the head-size checks come after it)."""
    monkeypatch.setattr(contract, "vllm_missing", lambda: None)


# ---------------------------------------------------------------------------- engine_kwargs
def test_an_unknown_engine_kwargs_vllm_key_is_refused_with_the_nearest_name():
    with pytest.raises(ConfigError) as err:
        validate(cfg_with(f"+{KWARGS}.vllm.enable_sleep_mod=true"))
    message = str(err.value)
    assert f"{KWARGS}.vllm.enable_sleep_mod is not a vLLM {contract.VLLM_PIN} engine argument" in message
    assert "did you mean enable_sleep_mode?" in message
    validate(cfg_with(f"+{KWARGS}.vllm.enable_sleep_mode=true", f"+{KWARGS}.vllm.block_size=16"))


@pytest.mark.parametrize("arg, owner", [
    ("tensor_parallel_size=2", "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    ("max_model_len=64", "data.max_prompt_length + the response length"),
    ("seed=3", "actor_rollout_ref.rollout.seed"),
])
def test_an_engine_argument_megatron_rl_sets_is_refused_naming_the_key_that_sets_it(arg, owner):
    name = arg.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(f"{KWARGS}.vllm.{name} is set by megatron-rl: {owner}")):
        validate(cfg_with(f"+{KWARGS}.vllm.{arg}"))


@pytest.mark.parametrize("overrides, message", [
    (("actor_rollout_ref.rollout.name=hf", f"+{KWARGS}.vllm.block_size=16"),
     rf"{KWARGS}.vllm=\{{'block_size': 16\}} are arguments of the vllm engine, but actor_rollout_ref.rollout.name=hf"),
    ((f"+{KWARGS}.sglang.mem_fraction_static=0.5",),
     rf"{KWARGS}.sglang=\{{'mem_fraction_static': 0.5\}} are arguments of the sglang engine, but "
     r"actor_rollout_ref.rollout.name=vllm"),
    (("actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.server_urls=[http://h:1]",
      f"+{KWARGS}.vllm.block_size=16"), rf"{KWARGS}.vllm=.* cannot reach vLLM servers started elsewhere"),
    (("actor_rollout_ref.rollout.name=sglang", "trainer.device=cuda", f"+{KWARGS}.sglang.mem_fraction_static=0.5"),
     rf"{KWARGS}.sglang.mem_fraction_static is set by megatron-rl: actor_rollout_ref.rollout.gpu_memory_utilization"),
])
def test_engine_kwargs_that_would_do_nothing_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


# ---------------------------------------------------------------------------- vLLM's own settings
@pytest.mark.parametrize("overrides, message", [
    (("actor_rollout_ref.rollout.vllm.cpu_kv_cache_mb=0",),
     r"actor_rollout_ref.rollout.vllm.cpu_kv_cache_mb=0 must be an integer >= 1"),
    (("actor_rollout_ref.rollout.enable_chunked_prefill=false", "actor_rollout_ref.rollout.max_num_batched_tokens=100"),
     r"max_num_batched_tokens=100 is smaller than the engine's max_model_len=1024 .*enable_chunked_prefill=false"),
    (("actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_servers=2", "trainer.launcher=ray",
      "actor_rollout_ref.rollout.servers_per_node=1", "ray_init.address=10.0.0.1:6379"),
     r"actor_rollout_ref.rollout.servers_per_node=1 with rollout.name=vllm: .* cannot spread over nodes"),
    (("actor_rollout_ref.rollout.vllm.cpu_threads_bind=all",),
     r"actor_rollout_ref.rollout.vllm.cpu_threads_bind='all' must be 'auto' or one CPU list per rollout TP rank"),
])
def test_vllm_settings_the_engine_would_refuse_are_refused_by_validate(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


def test_rollout_tp_2_on_cpu_needs_one_cpu_list_per_rank():
    """vLLM's automatic binding gives TP rank i the i-th NUMA node; a one-node host fails at engine start."""
    tp2 = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    with pytest.raises(ConfigError) as err:
        validate(cfg_with(tp2))
    message = str(err.value)
    assert "actor_rollout_ref.rollout.vllm.cpu_threads_bind=auto with actor_rollout_ref.rollout." \
           "tensor_model_parallel_size=2 on CPU" in message
    assert "actor_rollout_ref.rollout.vllm.cpu_threads_bind='0|1'" in message  # the fix
    with pytest.raises(ConfigError, match=r"cpu_threads_bind='0-1' names 1 CPU list\(s\), but .*=2"):
        validate(cfg_with(tp2, "actor_rollout_ref.rollout.vllm.cpu_threads_bind='0-1'"))
    validate(cfg_with(tp2, "actor_rollout_ref.rollout.vllm.cpu_threads_bind='0|1'"))
    validate(cfg_with(tp2, "trainer.device=cuda"))  # GPUs: vLLM's own TP workers, nothing to bind


# ---------------------------------------------------------------------------- preflight: the world
def test_head_size_16_on_cpu_is_refused_naming_the_model_and_the_sizes(tmp_path, vllm_installed):
    from megatron_rl.trainer.preflight import preflight

    model = _model(tmp_path, hidden=64, heads=4)
    with pytest.raises(ConfigError) as err:
        preflight(start_cfg(tmp_path, model))
    message = str(err.value)
    assert f"actor_rollout_ref.model.path={model}" in message
    assert "hidden_size=64 / num_attention_heads=4" in message and "head size 16" in message
    assert str(list(contract.CPU_HEAD_SIZES)) in message  # what it runs
    from megatron_rl.trainer.preflight import check_rollout_engine

    check_rollout_engine(start_cfg(tmp_path, model, "trainer.device=cuda"))  # GPU attention takes 16


def test_an_mla_latent_vllm_cpu_cannot_run_is_refused(tmp_path, vllm_installed):
    """MLA (DeepSeek-V3): vLLM's CPU MLA kernel attends over the latent, kv_lora_rank + qk_rope_head_dim, and is
    compiled for 576 only (DeepSeek's 512 + 64); another latent failed when the engine started."""
    from megatron_rl.trainer.preflight import check_rollout_engine

    model = _model(tmp_path, hidden=64, heads=2)
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "kv_lora_rank": 16, "qk_rope_head_dim": 8}))
    with pytest.raises(ConfigError, match=r"kv_lora_rank=16, qk_rope_head_dim=8\) has latent size 24 .*CPU MLA "
                                          r"attention cannot run; it runs \[576\]"):
        check_rollout_engine(start_cfg(tmp_path, model))
    (model / "config.json").write_text(json.dumps({**raw, "kv_lora_rank": 512, "qk_rope_head_dim": 64}))
    check_rollout_engine(start_cfg(tmp_path, model))


def test_vllm_not_installed_is_refused_before_ray_starts(tmp_path, monkeypatch):
    """Through the start itself (dry run and real start alike): the refusal comes before Ray is initialised."""
    import ray

    from megatron_rl import train

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "vllm" else real_find_spec(name, *a, **k))
    ray_inits, started = [], []
    monkeypatch.setattr(ray, "init", lambda *a, **k: ray_inits.append(a))
    monkeypatch.setattr("megatron_rl.trainer.runner.run_training", lambda *a: started.append(a))
    cfg = start_cfg(tmp_path, _model(tmp_path, hidden=64, heads=2))
    errors = []
    for dry_run in (True, False):
        with pytest.raises(ConfigError) as err:
            train.run(cfg, dry_run=dry_run)
        errors.append(str(err.value))
    assert errors[0] == errors[1]
    assert "actor_rollout_ref.rollout.name=vllm needs vLLM" in errors[0] and "vllm is not installed" in errors[0]
    assert "make install-vllm" in errors[0] and "scripts/install_gpu.sh vllm" in errors[0]
    assert not ray_inits and not started


# ---------------------------------------------------------------------------- accepted
def test_a_valid_vllm_config_is_accepted(tmp_path, vllm_installed):
    validate(cfg_with(f"+{KWARGS}.vllm.block_size=16", "actor_rollout_ref.rollout.enforce_eager=false",
                      "actor_rollout_ref.rollout.max_num_seqs=64"))
    validate(cfg_with("actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                      "actor_rollout_ref.rollout.vllm.cpu_threads_bind='0|1'"))
    # server mode: servers the run starts (before: only rollout.name=hf could start them), or started elsewhere
    validate(cfg_with("actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_servers=1"))
    validate(cfg_with("actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.server_urls=[http://h:1]"))
    with pytest.raises(ConfigError, match=r"rollout.mode=server needs actor_rollout_ref.rollout.server_urls .*"
                                          r"rollout.name=hf\|vllm with rollout.num_servers >= 1"):
        validate(cfg_with("actor_rollout_ref.rollout.mode=server"))
    from megatron_rl.trainer.preflight import check_rollout_engine

    check_rollout_engine(start_cfg(tmp_path, _model(tmp_path, hidden=64, heads=2)))  # head size 32 runs on CPU


def test_started_servers_get_the_engine_arguments_of_the_colocated_engine():
    """rollout keys and engine_kwargs.vllm reach the servers the run starts, built by the colocated engine's own
    engine_args (they were dropped before: servers ran TP 1 with vLLM's defaults)."""
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.servers.vllm_server import VLLMServerSettings, server_command

    rollout = RolloutConfig(name="vllm", tensor_model_parallel_size=2, enable_prefix_caching=False, max_num_seqs=7)
    rollout.engine_kwargs.vllm = {"max_logprobs": 5}
    cmd = " ".join(server_command(VLLMServerSettings.from_rollout(rollout, "/m", max_model_len=64), port=9, seed=4))
    for flag in ("--tensor-parallel-size 2", "--no-enable-prefix-caching", "--max-num-seqs 7", "--max-logprobs 5",
                 "--seed 4", "--max-model-len 64", "--logprobs-mode processed_logprobs",
                 "--worker-extension-cls megatron_rl.rollout.vllm.server.ServerWorkerExtension"):
        assert flag in cmd, (flag, cmd)


def test_a_tp1_cpu_server_runs_its_model_in_the_engine_core(vllm_installed):
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.servers.vllm_server import VLLMServerSettings, server_command

    one = VLLMServerSettings.from_rollout(RolloutConfig(name="vllm"), "/m", max_model_len=64)
    two = VLLMServerSettings.from_rollout(RolloutConfig(name="vllm", tensor_model_parallel_size=2), "/m",
                                          max_model_len=64)
    assert "--distributed-executor-backend uni" in " ".join(server_command(one, port=9))
    assert "--distributed-executor-backend mp" in " ".join(server_command(two, port=9))  # one process per TP rank


def test_vllm_servers_on_another_host_are_refused_before_ray_starts(tmp_path, vllm_installed, monkeypatch):
    """server_urls of vLLM servers elsewhere: weights could not reach them (/dev/shm of this host); refused by the
    start's checks, not when trainer rank 0 builds its engine under Ray (as before)."""
    import ray

    from megatron_rl import train

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    server = ("actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.server_urls=[http://192.0.2.77:8000]")
    model = _model(tmp_path, hidden=64, heads=2)
    cfg = start_cfg(tmp_path, model, *server)
    with pytest.raises(ConfigError, match=r"server_urls \['http://192.0.2.77:8000'\]: vLLM rollout servers must run on "
                                          r"the host of trainer rank 0 .*/dev/shm"):
        train.run(cfg, dry_run=True)
    import http.server
    import socket
    import threading

    from megatron_rl.trainer.preflight import check_rollout_engine

    # a server on this host passes (any HTTP answer counts: the client's own requests check what it says) ...
    listening = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=listening.serve_forever, daemon=True).start()
    try:
        local = f"http://127.0.0.1:{listening.server_address[1]}"
        check_rollout_engine(start_cfg(tmp_path, model, server[0], f"actor_rollout_ref.rollout.server_urls=[{local}]"))
    finally:
        listening.shutdown()
        listening.server_close()
    # ... a local URL nothing listens at is refused before launch too, naming the engine (as for SGLang / HF servers)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ConfigError, match=rf"actor_rollout_ref.rollout.server_urls: vLLM server {closed}/v1/models "
                                          "unreachable"):
        check_rollout_engine(start_cfg(tmp_path, model, server[0], f"actor_rollout_ref.rollout.server_urls=[{closed}]"))
