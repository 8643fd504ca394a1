"""Issue 56 item 7: sequence length against the model's positions refused before launch (every engine), NaN rewards
stopping the run at their first step, tensor shards hashed in the checkpoint's manifest, and damaged adapter files
and trainer state refused naming the file and key. Fast: preflight and unit level, no Ray, no engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    from megatron_rl.demo import prepare_assets

    return prepare_assets(tmp_path_factory.mktemp("assets"), n_train=64, n_val=8)  # a model of 64 positions


def _preset(tmp_path: Path, assets, *overrides: str):
    train, val, model = assets
    return load_config(overrides=["+experiment=grpo_tiny_cpu", f"data.train_files=[{train}]",
                                  f"data.val_files=[{val}]", f"actor_rollout_ref.model.path={model}",
                                  f"trainer.default_local_dir={tmp_path / 'run'}", *overrides])


# ---------------------------------------------------------------------------- prompt + response vs positions
@pytest.mark.parametrize("engine", ["hf", "vllm", "sglang"])
def test_prompt_plus_response_longer_than_the_models_positions_is_refused_in_preflight(tmp_path, tiny_assets,
                                                                                      engine):
    """Before: the HF engine generated past max_position_embeddings without a word (vLLM refused only once
    started). The check runs whatever the engine; here it is called alone (an engine need not be installed)."""
    from megatron_rl.trainer.preflight import check_sequence_positions

    cfg = _preset(tmp_path, tiny_assets, "data.max_prompt_length=40", "data.max_response_length=30",
                  f"actor_rollout_ref.rollout.name={engine}")
    with pytest.raises(ConfigError) as err:
        check_sequence_positions(cfg)
    message = str(err.value)
    for part in ("data.max_prompt_length=40", "data.max_response_length=30", "= 70 tokens", "64 positions",
                 "max_position_embeddings=64", "config.json", "override_config"):
        assert part in message, message


def test_positions_check_runs_in_preflight_and_honours_overrides_and_linear_rope(tmp_path, tiny_assets):
    from megatron_rl.trainer.preflight import preflight

    too_long = ("data.max_prompt_length=40", "data.max_response_length=30")
    with pytest.raises(ConfigError, match="64 positions"):
        preflight(_preset(tmp_path, tiny_assets, *too_long))
    # the response budget a rollout sets is the one counted
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.response_length=60 = 76 tokens"):
        preflight(_preset(tmp_path, tiny_assets, "actor_rollout_ref.rollout.response_length=60"))
    preflight(_preset(tmp_path, tiny_assets, *too_long,
                      "+actor_rollout_ref.model.override_config.max_position_embeddings=128"))
    # linear RoPE scaling multiplies the positions (vllm/config/model.py _get_and_verify_max_len); llama3's
    # max_position_embeddings is the extended length already (transformers 5 writes rope_parameters)
    rope = "+actor_rollout_ref.model.override_config.rope_parameters={rope_theta: 10000.0, rope_type: %s, factor: 2.0}"
    preflight(_preset(tmp_path, tiny_assets, *too_long, rope % "linear"))
    with pytest.raises(ConfigError, match="64 positions"):
        preflight(_preset(tmp_path, tiny_assets, *too_long, rope % "llama3"))


# ---------------------------------------------------------------------------- NaN rewards
def test_a_nan_or_inf_reward_stops_the_first_step_naming_source_row_and_scorer(tmp_path):
    """Before: a non-finite score became an error scoring 0, and the run stopped only after
    reward.max_failed_steps (3) steps in which EVERY sample failed; one NaN sample a step never stopped it."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "reward"))
    from reward_batches import response_batch, reward_config

    from megatron_rl.data.tasks import make_rows, task_texts
    from megatron_rl.data.tokenizer import build_tiny_tokenizer
    from megatron_rl.reward import RewardManager

    scorer = tmp_path / "my_reward.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'1': float('nan'), '2': float('inf')}.get(solution_str, 1.0)\n")
    tokenizer = build_tiny_tokenizer(tmp_path / "tok", task_texts(make_rows("copy", 20, seed=0, split="train")),
                                     vocab_size=60)
    manager = RewardManager(tokenizer, reward_config(path=scorer))
    for bad, value in (("1", "nan"), ("2", "inf")):
        batch = response_batch(tokenizer, ["3", "4", bad, "5"], ["3", "4", "5", "5"])
        batch.non_tensor_batch["extra_info"][2] = {"index": 17}
        with pytest.raises(ValueError) as err:
            manager(batch)
        message = str(err.value)
        for part in (f"non-finite score {value}", "sample 2", "extra_info index 17", "'synthetic/copy'",
                     f"{scorer}", "compute_score"):
            assert part in message, message
    assert list(manager(response_batch(tokenizer, ["3", "4"], ["3", "5"])).non_tensor_batch["score"]) == [1.0, 1.0]


# ---------------------------------------------------------------------------- tensor shards in the manifest
def test_bytes_changed_inside_a_tensor_shard_are_refused_at_resume_naming_the_file(tmp_path, caplog):
    """Before: *.distcp shards were size-checked only, so a byte flipped inside one resumed silently. With
    trainer.checkpoint_hash_shards (opt-in: one read of the checkpoint per save and resume) they are hashed."""
    import logging

    from megatron_rl.trainer.checkpointing import MANIFEST_FILE, TrainerCheckpointer

    unhashed = TrainerCheckpointer(tmp_path / "default", keep_last=5)
    with unhashed.saving(1) as tmp:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "__0_0.distcp").write_bytes(b"shard")
        unhashed.write_trainer_state(tmp, {"global_steps": 1})
    default = json.loads((unhashed.step_dir(1) / MANIFEST_FILE).read_text())
    assert "actor/__0_0.distcp" not in default["sha256"] and "trainer_state.json" in default["sha256"]
    assert default["files"]["actor/__0_0.distcp"] == 5  # size-checked
    ckpt = TrainerCheckpointer(tmp_path, keep_last=5, hash_shards=True)
    for step in (1, 2):
        with ckpt.saving(step) as tmp:
            (tmp / "actor").mkdir()
            (tmp / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
            ckpt.write_trainer_state(tmp, {"global_steps": step})
    manifest = json.loads((ckpt.step_dir(2) / MANIFEST_FILE).read_text())
    assert "actor/__0_0.distcp" in manifest["sha256"]
    shard = ckpt.step_dir(2) / "actor" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0xFF  # same size, one byte changed
    shard.write_bytes(bytes(data))
    with pytest.raises(FileNotFoundError, match=r"actor/__0_0\.distcp does not match the sha256"):
        ckpt.resume_path("resume_path", str(ckpt.step_dir(2)))
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_path("auto", None) == ckpt.step_dir(1)  # the newest intact one
    assert "global_step_2" in caplog.text and "actor/__0_0.distcp" in caplog.text


# ---------------------------------------------------------------------------- damaged adapter files
def _adapter_dir(tmp_path: Path, tensors: dict) -> Path:
    from safetensors.torch import save_file

    directory = tmp_path / "adapter"
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none",
         "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("damage, message", [
    ("garbage", r"cannot be read as safetensors"),
    ("truncated", r"cannot be read as safetensors"),
    ("nan", rf"tensor '{A_KEY}' holds 3 non-finite values \(NaN or inf\)"),
])
def test_a_damaged_adapter_file_is_refused_in_preflight_naming_file_and_key(tmp_path, damage, message):
    """Before: preflight read adapter_config.json only; a corrupt or truncated adapter_model.safetensors failed in
    the workers with safetensors' own error (no file named), and NaN factors trained on silently."""
    import torch

    from megatron_rl.trainer.preflight import check_lora_files

    factor = torch.ones(8, 32)
    if damage == "nan":
        factor[0, :2], factor[1, 0] = float("nan"), float("inf")
    directory = _adapter_dir(tmp_path, {A_KEY: factor})
    weights = directory / "adapter_model.safetensors"
    if damage == "garbage":
        weights.write_bytes(b"\x00" * 7 + b"not a safetensors file")
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    key = "actor_rollout_ref.model.lora.adapter_path"
    cfg = load_config(overrides=["actor_rollout_ref.model.lora.rank=8", f"{key}={directory}"])
    with pytest.raises(ConfigError, match=message) as err:
        check_lora_files(cfg)
    assert f"{key}: {weights}" in str(err.value)
    _adapter_dir(tmp_path / "intact", {A_KEY: torch.ones(8, 32)})  # an intact one passes
    check_lora_files(load_config(overrides=["actor_rollout_ref.model.lora.rank=8",
                                            f"{key}={tmp_path / 'intact' / 'adapter'}"]))


# ---------------------------------------------------------------------------- trainer_state.json
def test_a_renamed_key_in_trainer_state_is_refused_before_start_up_naming_file_and_key(tmp_path):
    """Before: a checkpoint whose trainer_state.json had a renamed key (global_steps -> global_step, manifest
    rewritten to match, or a checkpoint from before manifests) passed preflight and failed at resume, after Ray and
    the workers were up, with `TypeError: TrainerState.__init__() got an unexpected keyword argument`; a missing
    key restarted silently from its default (global_steps=0)."""
    from megatron_rl.trainer.checkpointing import TrainerCheckpointer
    from megatron_rl.trainer.loop import TrainerState
    from megatron_rl.trainer.preflight import check_resume_state

    ckpt = TrainerCheckpointer(tmp_path / "run", keep_last=2)
    with ckpt.saving(3) as tmp:
        ckpt.write_trainer_state(tmp, {"global_step": 3, "dataloader": {}, "kl_ctrl": {}})
    state_file = ckpt.step_dir(3) / "trainer_state.json"
    cfg = load_config(overrides=[f"trainer.default_local_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as err:
        check_resume_state(cfg)
    message = str(err.value)
    for part in (str(state_file), "no key 'global_steps'", "an unknown key 'global_step'"):
        assert part in message, message
    with pytest.raises(ValueError, match=r"trainer_state.json: no key 'global_steps'"):
        TrainerState.from_saved(json.loads(state_file.read_text()), state_file)  # the loop's own check at resume
    assert TrainerState.from_saved({"global_steps": 3, "dataloader": {}, "kl_ctrl": {}}, state_file).global_steps == 3


def test_a_corrupt_adapter_file_loaded_by_a_worker_names_the_file(tmp_path, monkeypatch):
    """The worker's own load (models/peft_adapter.py), for a file damaged after preflight: before, safetensors'
    `SafetensorError: Error while deserializing header` named no file."""
    import torch
    from megatron.core import parallel_state

    from megatron_rl.models.peft_adapter import load_peft_adapter

    for name, value in (("get_tensor_model_parallel_world_size", 1), ("get_tensor_model_parallel_rank", 0),
                        ("get_pipeline_model_parallel_group", None)):
        monkeypatch.setattr(parallel_state, name, lambda value=value: value)  # one rank, no process group
    directory = _adapter_dir(tmp_path, {A_KEY: torch.ones(8, 32)})
    weights = directory / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{weights}: cannot be read as safetensors"):
        load_peft_adapter([], directory)
