"""Every input checked before the first step (issue 15, items 5-10): unknown keys, optimizer and schedule
values, TP against the model, data files and their data sources — in validate() / preflight(), which both
the real start and --dry-run call before Ray."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate

BASE = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]


def cfg_with(*overrides: str):
    return load_config(overrides=[*BASE, *overrides])


# ---------------------------------------------------------------------------- 6. unknown keys
@pytest.mark.parametrize("override, message", [
    ("+trainer.val_only=true", r"trainer.val_only is not a known key.*known under trainer: .*val_before_train"),
    ("+actor_rollout_ref.actor.optim.lr_warmup_ratio=0.1", r"actor.optim.lr_warmup_ratio.*lr_warmup_steps"),
    ("+trainer.lr=1e-5", r"trainer.lr is not a known key.*actor_rollout_ref.actor.optim.lr"),
    ("+data.train_file=x", r"data.train_file .*train_files"),
    ("+foo=1", r"foo is not a known key"),
])
def test_unknown_plus_keys_are_rejected_with_the_nearest_names(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(override))


def test_free_form_dicts_still_take_any_key():
    validate(cfg_with("+actor_rollout_ref.model.override_config.rope_theta=10000",
                      "+plan.architecture.hidden_size=64"))


# ---------------------------------------------------------------------------- 7. optimizer and schedule
@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.optim.lr=0", r"actor_rollout_ref.actor.optim.lr must be > 0, got 0"),
    ("critic.optim.lr=-1e-5 algorithm.adv_estimator=gae critic.ppo_micro_batch_size_per_gpu=2",
     r"critic.optim.lr must be > 0"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,1.0]", r"actor_rollout_ref.actor.optim.betas.*\[0, 1\)"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", r"betas must be two numbers"),
    ("actor_rollout_ref.actor.optim.weight_decay=-0.1", r"optim.weight_decay must be >= 0"),
    ("actor_rollout_ref.actor.optim.clip_grad=0", r"optim.clip_grad must be > 0"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio=2", r"optim.min_lr_ratio must lie in \[0, 1\]"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps=-1", r"lr_warmup_steps must be >= 0"),
])
def test_optimizer_values_are_rejected_with_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*override.split()))


def test_warm_up_longer_than_training_is_rejected():
    with pytest.raises(ConfigError, match=r"lr_warmup_steps=50 is longer than the 10 training steps"):
        validate(cfg_with("trainer.total_training_steps=10", "actor_rollout_ref.actor.optim.lr_warmup_steps=50"))


# ---------------------------------------------------------------------------- 10. impossible or empty runs
def test_zero_training_steps_is_an_error():
    with pytest.raises(ConfigError, match=r"trainer.total_training_steps=0 would train nothing"):
        validate(cfg_with("trainer.total_training_steps=0"))


def test_reward_timeout_applies_inline_too():
    validate(cfg_with("reward.num_workers=0", "reward.timeout_s=5"))  # inline scoring honours it (issue 56)
    with pytest.raises(ConfigError, match=r"reward.timeout_s must be > 0, got 0"):
        validate(cfg_with("reward.num_workers=0", "reward.timeout_s=0"))
    with pytest.raises(ConfigError, match=r"reward.max_failed_steps must be >= 0"):
        validate(cfg_with("reward.max_failed_steps=-1"))


# ---------------------------------------------------------------------------- 9. choices from the schema
def test_choice_fields_are_typed_and_errors_list_the_options():
    from megatron_rl.config import schema
    import importlib

    validate_module = importlib.import_module("megatron_rl.plan.validate")  # the package exports the function

    for name in ("KNOWN_ROLLOUT_ENGINES", "KNOWN_LAUNCHERS", "KNOWN_LR_SCHEDULERS", "KNOWN_REWARD_MANAGERS",
                 "KNOWN_TRUNCATIONS", "KNOWN_MALFORMED_ROW_POLICIES"):
        assert not hasattr(validate_module, name), f"{name} duplicates the schema"
    assert schema.choices_of(schema.TrainerConfig, "launcher") == ["ray", "torchrun"]
    assert schema.choices_of(schema.DataConfig, "truncation") == ["error", "left", "right", "middle"]
    with pytest.raises(ConfigError, match=r"trainer.launcher.*'slurm'.*\['ray', 'torchrun'\]"):
        validate(cfg_with("trainer.launcher=slurm"))
    with pytest.raises(ConfigError, match=r"actor.optim.lr_scheduler.*'linear'.*\['constant', 'cosine'\]"):
        validate(cfg_with("actor_rollout_ref.actor.optim.lr_scheduler=linear"))


def test_component_configs_are_typed_as_their_schema_classes():
    import typing

    from megatron_rl.config import schema

    from megatron_rl.data.dataset import RLDataset
    from megatron_rl.reward.manager import RewardManager

    for cls in (schema.PPOTrainerConfig, schema.ActorRolloutRefConfig, schema.ActorConfig, schema.TrainerConfig):
        hints = typing.get_type_hints(cls)
        assert typing.Any not in hints.values(), f"{cls.__name__} has Any-typed fields"
    # the components take their section of the schema, not Any
    assert RewardManager.__init__.__annotations__["cfg"] == "RewardConfig"
    assert RLDataset.from_config.__annotations__["data_cfg"] == "DataConfig"
    assert typing.get_type_hints(schema.TrainerConfig)["resume_mode"] is schema.ResumeMode


# Every closed-choice string of the schema is an enum with verl's spellings; registries stay strings (issue 31).
CHOICE_FIELDS = [
    ("actor_rollout_ref.actor.megatron.params_dtype", "fp16", ["auto", "fp32", "float32", "bf16", "bfloat16"]),
    ("critic.megatron.params_dtype", "half", None),
    ("actor_rollout_ref.actor.loss_agg_mode", "mean", None),
    ("critic.loss_agg_mode", "token_mean", None),
    ("algorithm.kl_penalty", "k4", None),
    ("actor_rollout_ref.actor.kl_loss_type", "low-var-kl", None),
    ("actor_rollout_ref.actor.strategy", "fsdp", ["megatron"]),
    ("actor_rollout_ref.rollout.dtype", "int8", None),
    ("reward_model.judge.dtype", "int8", None),
    ("reward_model.judge.engine", "trtllm", ["hf", "sglang", "vllm"]),
    ("actor_rollout_ref.rollout.sglang.weight_transport", "http", ["distributed", "tensor"]),
    ("actor_rollout_ref.rollout.sglang.update_group_backend", "mpi", ["nccl", "gloo"]),
    ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side", "center", ["left", "right", "middle"]),
    ("actor_rollout_ref.rollout.multi_turn.format", "gpt-oss", ["hermes"]),
    ("algorithm.rollout_correction.rollout_is", "seq", ["token", "sequence"]),
    ("algorithm.rollout_correction.loss_type", "ppo", ["ppo_clip", "reinforce"]),
    ("reward_model.combine.mode", "max", ["rm", "sum", "gate"]),
]


@pytest.mark.parametrize("key, bad, options", CHOICE_FIELDS)
def test_closed_choices_refuse_a_bad_value_naming_key_and_options(key, bad, options):
    import re

    with pytest.raises(ConfigError, match=re.escape(f"{key}={bad!r} is unknown; known: ") +
                       (re.escape(str(options)) if options else "")):
        cfg_with(f"{key}={bad}")


def test_choice_enums_keep_the_spellings_the_code_accepts():
    """The schema's options are exactly what the algorithms, the engines and the agent loop take."""
    import torch

    from megatron_rl.algos import KL_PENALTIES, LOSS_AGG_MODES
    from megatron_rl.algos.rollout_corr import IS_LEVELS, LOSS_TYPES
    from megatron_rl.config import schema
    from megatron_rl.reward.model.combine import MODES
    from megatron_rl.rollout.hf_engine import resolve_dtype
    from megatron_rl.workers.engine import PARAMS_DTYPES

    assert [m.value for m in schema.LossAggMode] == list(LOSS_AGG_MODES)
    assert [m.value for m in schema.KLPenalty] == list(KL_PENALTIES)
    assert [m.value for m in schema.ParamsDType] == list(PARAMS_DTYPES)
    assert [m.value for m in schema.RolloutIS] == list(IS_LEVELS)
    assert [m.value for m in schema.RolloutCorrectionLoss] == list(LOSS_TYPES)
    assert [m.value for m in schema.CombineMode] == list(MODES)
    for dtype in schema.EngineDType:
        resolve_dtype(dtype, torch.device("cpu"))  # every option resolves
    # verl's spellings compose (OmegaConf takes an enum by member name: the names are the values)
    cfg = cfg_with("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.kl_penalty=low_var_kl+",
                   "actor_rollout_ref.actor.kl_loss_type=k3+", "actor_rollout_ref.rollout.dtype=bfloat16",
                   "algorithm.rollout_correction.rollout_is=null")
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.algorithm.kl_penalty == "low_var_kl+" and f"{cfg.actor_rollout_ref.actor.kl_loss_type}" == "k3+"
    assert cfg.algorithm.rollout_correction.rollout_is is None
    # open registries stay strings: users register their own
    for cls, name in ((schema.AlgorithmConfig, "adv_estimator"), (schema.ActorConfig, "policy_loss"),
                      (schema.MultiTurnConfig, "default_agent")):
        assert schema.choices_of(cls, name) is None


def test_verl_keys_without_an_effect_here_are_refused_or_gone():
    from megatron_rl.config import schema

    validate(cfg_with("actor_rollout_ref.model.trust_remote_code=false", "actor_rollout_ref.actor.strategy=megatron"))
    for key in ("actor_rollout_ref.model.trust_remote_code", "critic.model.trust_remote_code"):
        with pytest.raises(ConfigError, match=rf"{key}=true: megatron-rl builds models with its own Megatron builders"):
            validate(cfg_with(f"{key}=true"))
    save = r"actor_rollout_ref.actor.checkpoint(.save_contents)? is a key of verl's config that megatron-rl does not have"
    with pytest.raises(ConfigError, match=save):  # at compose time
        cfg_with("actor_rollout_ref.actor.checkpoint.save_contents=[model]")
    with pytest.raises(ConfigError, match=save):  # added with +, at validation
        validate(cfg_with("+actor_rollout_ref.actor.checkpoint.save_contents=[model]"))
    # trainer.seed was read by nothing: gone, and the error points at the seeds that are
    with pytest.raises(ConfigError, match=r"trainer.seed is not a known key.*a key of that name lives at data.seed"):
        validate(cfg_with("+trainer.seed=3"))
    assert "seed" not in schema.TrainerConfig.__dataclass_fields__
    assert "checkpoint" not in schema.ActorConfig.__dataclass_fields__


# ---------------------------------------------------------------------------- 5, 7, 8. preflight (files, model)
def _write_jsonl(path: Path, sources: list[str]) -> Path:
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "data_source": s, "reward_model": {"ground_truth": "1"}}
            for s in sources]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _model(tmp_path: Path, heads: int = 4, kv_heads: int = 2, architecture: str = "Qwen2ForCausalLM") -> Path:
    """A model directory as preflight reads it: config.json and a tokenizer (the run tokenizes its prompts)."""
    from megatron_rl.data import build_tiny_tokenizer

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": [architecture], "num_attention_heads": heads,
                                                   "num_key_value_heads": kv_heads, "hidden_size": 64,
                                                   "intermediate_size": 128, "vocab_size": 256,
                                                   "num_hidden_layers": 2}))
    if not (model / "tokenizer.json").is_file():
        build_tiny_tokenizer(model, ["hi there 1 2 3"])
    return model


def _scorer(tmp_path: Path) -> Path:
    path = tmp_path / "score.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    return path


def preflight_cfg(tmp_path, *overrides):
    return cfg_with(f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=2", *overrides)


def test_unknown_data_sources_are_rejected_before_ray(tmp_path):
    from megatron_rl.trainer.preflight import preflight

    train = _write_jsonl(tmp_path / "train.jsonl", ["synthetic/copy"] * 8)
    val = _write_jsonl(tmp_path / "val.jsonl", ["synthetic/copy", "my/task", "my/task", "other"])
    cfg = preflight_cfg(tmp_path, f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                        f"actor_rollout_ref.model.path={_model(tmp_path)}")
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    message = str(err.value)
    assert str(val) in message and "'my/task': 2 rows" in message and "'other': 1 row" in message
    assert "synthetic/copy" in message and "registered" in message
    preflight(preflight_cfg(tmp_path, f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                            f"actor_rollout_ref.model.path={_model(tmp_path)}",
                            f"reward.custom_reward_function.path={_scorer(tmp_path)}"))  # scores all


@pytest.mark.parametrize("kind", ["missing", "directory", "unreadable"])
def test_data_files_are_checked(tmp_path, kind):
    from megatron_rl.trainer.preflight import preflight

    path = tmp_path / "train.parquet"
    if kind == "directory":
        path.mkdir()
        expected = r"is a directory, expected a \.parquet or \.jsonl file"
    elif kind == "unreadable":
        path.write_bytes(b"not a parquet file")
        expected = r"cannot be read"
    else:
        expected = r"does not exist"
    cfg = preflight_cfg(tmp_path, f"data.train_files=[{path}]", f"actor_rollout_ref.model.path={_model(tmp_path)}")
    with pytest.raises(ConfigError, match=rf"data.train_files: {path} {expected}"):
        preflight(cfg)


def test_corrupt_config_json_is_named(tmp_path):
    from megatron_rl.trainer.preflight import preflight

    model = _model(tmp_path)
    (model / "config.json").write_text("{\"num_attention_heads\": 4,")
    train = _write_jsonl(tmp_path / "train.jsonl", ["synthetic/copy"])
    with pytest.raises(ConfigError, match=rf"{model / 'config.json'} is not valid JSON"):
        preflight(preflight_cfg(tmp_path, f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}"))


def test_tp_must_divide_heads_and_kv_heads_before_ray(tmp_path):
    from megatron_rl.trainer.preflight import preflight

    train = _write_jsonl(tmp_path / "train.jsonl", ["synthetic/copy"])
    cfg = preflight_cfg(tmp_path, f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={_model(tmp_path, 6, 3)}",
                        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 does not divide .*num_key_value_heads=3"):
        preflight(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
      "+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=2"],
     r"num_layers_in_first_pipeline_stage=2 must lie in \[1, 1\]"),
    (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"],
     r"expert_model_parallel_size=2 needs an MoE model"),
])
def test_the_actors_split_of_the_model_is_refused_before_ray(tmp_path, overrides, message):
    """Layers over the pipeline stages (an uneven split too) and experts against config.json: a real start on CPU
    refused them only in the workers' model build."""
    from megatron_rl.trainer.preflight import preflight

    train = _write_jsonl(tmp_path / "train.jsonl", ["synthetic/copy"])
    cfg = preflight_cfg(tmp_path, f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={_model(tmp_path)}",
                        *overrides)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.megatron \(TP=.*\) does not factor this model: .*"
                                          + message):
        preflight(cfg)


def test_dry_run_reports_the_same_errors_as_the_real_start(tmp_path, monkeypatch):
    from megatron_rl import train

    cfg = preflight_cfg(tmp_path, f"data.train_files=[{tmp_path / 'nope.parquet'}]",
                        f"actor_rollout_ref.model.path={_model(tmp_path)}")
    started = []
    monkeypatch.setattr("megatron_rl.trainer.runner.run_training", lambda *a: started.append(a))
    errors = []
    for dry_run in (True, False):
        with pytest.raises(ConfigError) as err:
            train.run(cfg, dry_run=dry_run)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "nope.parquet does not exist" in errors[0] and not started


# ---------------------------------------------------------------------------- the python tool as root (issue 33)
def _sandbox_giving(report):
    from types import SimpleNamespace

    return lambda self: SimpleNamespace(report=report)


def test_python_tool_as_root_without_a_sandbox_is_refused_unless_accepted(monkeypatch):
    from megatron_rl.agent import tools

    python_tool = ("actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.tools=[python]")
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr(tools.PythonTool, "_sandbox",
                        _sandbox_giving(tools.SandboxReport("session", False, False, False, False)))
    with pytest.raises(ConfigError, match=r"python tool would run as root.*multi_turn.python_tool_unsandboxed_ok=true"):
        validate(cfg_with(*python_tool))
    validate(cfg_with(*python_tool, "actor_rollout_ref.rollout.multi_turn.python_tool_unsandboxed_ok=true"))
    validate(cfg_with("actor_rollout_ref.rollout.multi_turn.enable=true"))  # calculator only: nothing to refuse
    monkeypatch.setattr(tools.PythonTool, "_sandbox",
                        _sandbox_giving(tools.SandboxReport("namespaces", True, True, True, True)))
    validate(cfg_with(*python_tool))  # contained: runs as nobody


def test_a_tool_the_workers_would_refuse_is_refused_in_validation(monkeypatch, tmp_path):
    """Before: the agent loop built its tools in the workers, after Ray and the models were up; an unknown tool,
    a misspelt tool config or a python tool whose empty root this machine cannot give failed there."""
    multi_turn = "actor_rollout_ref.rollout.multi_turn"
    with pytest.raises(ConfigError, match=rf"{multi_turn}.tools=\['calculator', 'pyhton'\]: unknown tool 'pyhton'"):
        validate(cfg_with(f"{multi_turn}.enable=true", f"{multi_turn}.tools=[calculator,pyhton]"))
    yaml = tmp_path / "tools.yaml"
    yaml.write_text("tools:\n  - class_name: python\n    config: {filesystem: hots}\n")
    with pytest.raises(ConfigError, match=rf"tool_config_path={yaml}: the python tool's config filesystem='hots'"):
        validate(cfg_with(f"{multi_turn}.enable=true", f"{multi_turn}.tool_config_path={yaml}"))

    def no_empty_root(isolate_network, filesystem):
        raise ValueError("the python tool cannot run in an empty root on this machine (no `unshare` on PATH)")

    monkeypatch.setattr("megatron_rl.agent.tools.sandbox_for", no_empty_root)
    with pytest.raises(ConfigError, match=rf"{multi_turn}.tools=\['python'\]: the python tool cannot run in an "
                                          r"empty root on this machine"):
        validate(cfg_with(f"{multi_turn}.enable=true", f"{multi_turn}.tools=[python]"))


# ---------------------------------------------------------------------------- refused too late before (issue 33, 7-10)
RM_OWN_POOL = ("algorithm.adv_estimator=grpo", "reward_model.enable=true", "reward_model.model.path=/rm",
               "reward_model.enable_resource_pool=true", "reward_model.megatron.context_parallel_size=2")


@pytest.mark.parametrize("overrides, message", [
    # 7: the model build refused CP > 1 (SDPAttention) after Ray and the workers were up; since issue 35 CP is
    # built on packed sequences, and padded micro-batches at CP > 1 are refused naming each role's key
    (("actor_rollout_ref.actor.megatron.context_parallel_size=2", "critic.megatron.context_parallel_size=2"),
     r"actor_rollout_ref.actor.megatron.context_parallel_size=2 needs actor_rollout_ref.actor.megatron.packed_sequences=true"),
    (("actor_rollout_ref.actor.megatron.context_parallel_size=2", "actor_rollout_ref.ref.megatron.context_parallel_size=2",
      "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.adv_estimator=grpo",
      "actor_rollout_ref.actor.megatron.packed_sequences=true"),
     r"actor_rollout_ref.ref.megatron.context_parallel_size=2 needs actor_rollout_ref.ref.megatron.packed_sequences=true"),
    (RM_OWN_POOL, r"reward_model.megatron.context_parallel_size=2 needs reward_model.megatron.packed_sequences=true"),
    # 10: the worker refused meta_info['temperature']=0 at step 1
    (("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.temperature=0"),
     r"actor_rollout_ref.rollout.temperature=0.0 makes the training rollout greedy, but algorithm.adv_estimator=grpo"),
    (("algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.do_sample=false"),
     r"actor_rollout_ref.rollout.do_sample=false .* algorithm.adv_estimator=rloo"),
    (("actor_rollout_ref.rollout.response_length=0",), r"actor_rollout_ref.rollout.response_length=0 must be >= 1"),
    (("actor_rollout_ref.rollout.weight_sync.verify_freq=-1",),
     r"actor_rollout_ref.rollout.weight_sync.verify_freq=-1 must be >= 0"),
    # 11: found by tests/unit/test_refusal_guard.py (refused in weights/ at the first sync before)
    (("actor_rollout_ref.rollout.weight_sync.bucket_size_mb=0",),
     r"actor_rollout_ref.rollout.weight_sync.bucket_size_mb=0 must be > 0"),
    (("actor_rollout_ref.rollout.weight_sync.verify_max_logprob_diff=0",),
     r"actor_rollout_ref.rollout.weight_sync.verify_max_logprob_diff=0.0 must be > 0, or null"),
])
def test_settings_refused_after_start_up_before_are_refused_by_validate(overrides, message):
    """Before issue 33 validate() (and so --dry-run) accepted each of these; the start failed after Ray and the
    model build (CP in SDPAttention, temperature in the worker's read_temperature, verify_freq in weights/replica)."""
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


def test_greedy_rollout_without_groups_and_remax_baseline_settings_still_validate():
    validate(cfg_with("algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.temperature=0.7"))
    validate(cfg_with("actor_rollout_ref.rollout.response_length=4", "actor_rollout_ref.rollout.weight_sync.verify_freq=0"))


def _bad_start(tmp_path, kind: str) -> tuple[list[str], str]:
    model, train = _model(tmp_path), tmp_path / "train.jsonl"
    _write_jsonl(train, ["synthetic/copy"] * 8)
    base = [f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}"]
    if kind == "logger_unknown":
        return base + ["trainer.logger=[console,neptune]"], r"trainer.logger has unknown backends \['neptune'\]"
    if kind == "logger_missing":
        return base + ["trainer.logger=[console,mlflow]"], \
            r"trainer.logger=.* names 'mlflow', but mlflow does not import here \(ModuleNotFoundError.*pip install mlflow"
    if kind == "architecture":
        other = tmp_path / "other"
        other.mkdir()
        _model(other, architecture="FancyNewForCausalLM")
        return [base[0], f"actor_rollout_ref.model.path={other / 'model'}"], r"FancyNewForCausalLM"
    if kind == "few_rows":
        _write_jsonl(train, ["synthetic/copy"] * 5)
        return base, r"data.train_files give 5 usable prompts .* fewer than data.train_batch_size=8"
    if kind == "no_usable_rows":
        return base + ["data.max_prompt_length=1"], r"data.train_files: no usable prompts in .* 8 longer than " \
                                                    r"data.max_prompt_length=1"
    if kind == "reward_name":
        return base + [f"reward.custom_reward_function.path={_scorer(tmp_path)}",
                       "reward.custom_reward_function.name=score_it"], \
            r"reward.custom_reward_function.name='score_it' is not a function in .*compute_score"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["logger_unknown", "logger_missing", "architecture", "few_rows", "no_usable_rows",
                                  "reward_name"])
def test_dry_run_and_real_start_refuse_alike_before_anything_starts(tmp_path, monkeypatch, kind):
    """One check for both (preflight.check_start). Before issue 33: swanlab was refused by Tracking after the
    workers were built, a missing package was a bare ModuleNotFoundError there; an unknown architecture failed the
    real start in init_model; too few or no usable prompts and a wrong reward function name passed --dry-run and
    failed the real start before Ray with a traceback (exit code 1)."""
    from megatron_rl import train

    if kind == "logger_missing":
        import importlib.util

        if importlib.util.find_spec("mlflow") is not None:
            pytest.skip("mlflow is installed here")
    overrides, message = _bad_start(tmp_path, kind)
    cfg = preflight_cfg(tmp_path, *overrides)
    started = []
    monkeypatch.setattr("megatron_rl.trainer.runner.run_training", lambda *a: started.append(a))
    errors = []
    for dry_run in (True, False):
        with pytest.raises(ConfigError, match=message) as err:
            train.run(cfg, dry_run=dry_run)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and not started


def test_a_plan_without_model_and_data_says_they_are_unset():
    """launch/torchrun.sh +experiment=grpo_tiny_cpu without MODEL_PATH / DATA_DIR: before issue 33 the planner asked
    for plan.architecture ("the planner needs the model's architecture ... plan.architecture is empty")."""
    from megatron_rl.plan import build_plan

    with pytest.raises(ConfigError) as err:
        build_plan(load_config(overrides=["+experiment=grpo_tiny_cpu"]))
    message = str(err.value)
    assert message.startswith("actor_rollout_ref.model.path and data.train_files are not set")
    assert "MODEL_PATH=... DATA_DIR=..." in message
