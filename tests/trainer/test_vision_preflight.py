"""A vision-language model on the paths that do not carry its images yet (the agent loop, shared prompts, the HF-engine
servers) is refused before launch naming the key, as are training videos with an engine that does not take them; a
colocated run of it passes the model checks."""
from __future__ import annotations

import json

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.trainer.preflight import check_model
from megatron_rl_testing.vl_models import make_tiny_qwen2_5_vl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl_preflight") / "model")


def _cfg(tmp_path, model_dir, *overrides):
    train = tmp_path / "train.jsonl"
    row = {"prompt": [{"role": "user", "content": "hi"}], "data_source": "synthetic/copy",
           "reward_model": {"ground_truth": "1"}}
    train.write_text(json.dumps(row) + "\n")
    return load_config(overrides=["trainer.device=cpu", "actor_rollout_ref.rollout.name=hf",
                                  f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model_dir}",
                                  *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.multi_turn.enable=true"],
     r"multi_turn.enable=true: the agent loop does not carry the images of a vision-language model"),
    (["actor_rollout_ref.actor.megatron.share_prompts=true"],
     r"actor_rollout_ref.actor.megatron.share_prompts: a vision-language model .* runs padded micro-batches"),
    (["actor_rollout_ref.rollout.mode=server"], r"rollout.mode=server with rollout.name=hf: its servers do not take images"),
])
def test_paths_without_images_are_refused_by_key(tmp_path, model_dir, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_model(_cfg(tmp_path, model_dir, *overrides))


def test_a_colocated_vision_language_run_passes_the_model_checks(tmp_path, model_dir):
    check_model(_cfg(tmp_path, model_dir))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_training_videos_with_an_engine_that_does_not_take_them_are_refused_before_launch(tmp_path, engine):
    """The data are read before launch; their videos need the HF engine."""
    from PIL import Image

    from megatron_rl.data.vision_checkpoint import build_tiny_vl_checkpoint
    from megatron_rl.trainer.preflight import check_training_prompts

    model = build_tiny_vl_checkpoint(tmp_path / "model", ["How many frames? 0 1 2 3"], family="qwen2_5_vl")
    frames = []
    for shade in (0, 255):
        Image.new("RGB", (56, 56), (shade, 0, 0)).save(tmp_path / f"frame{shade}.png")
        frames.append(str(tmp_path / f"frame{shade}.png"))
    train = tmp_path / "videos.jsonl"
    row = {"prompt": [{"role": "user", "content": "<video>How many frames?"}], "data_source": "synthetic/shapes",
           "reward_model": {"ground_truth": "2"}, "videos": [{"video": frames}]}
    train.write_text(json.dumps(row) + "\n")
    cfg = load_config(overrides=["trainer.device=cpu", f"actor_rollout_ref.rollout.name={engine}",
                                 f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}",
                                 "data.train_batch_size=1", "data.max_prompt_length=256"])
    with pytest.raises(ConfigError, match=rf"data.train_files have videos \(column data.video_key=videos\) but "
                                          rf"actor_rollout_ref.rollout.name={engine} does not take videos"):
        check_training_prompts(cfg)
    cfg.actor_rollout_ref.rollout.name = "hf"
    assert check_training_prompts(cfg) == 1
