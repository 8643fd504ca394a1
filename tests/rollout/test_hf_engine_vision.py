"""HFEngine on a tiny Qwen2.5-VL and Qwen3-VL (DeepStack; megatron_rl.data.vision_checkpoint): prompts with images from the dataset (verl's
multi_modal_inputs column) generate, their rollout log-probs equal a recomputation and transformers' own forward
(fp32), the n samples of a prompt share its prefill while token-identical prompts with other images do not, the
released checkpoint names load, and a text model refuses images."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.data import load_tokenizer
from megatron_rl.data.dataset import RLDataset
from megatron_rl.data.loader import collate_to_dataproto
from megatron_rl.data.tasks import task_texts, write_task
from megatron_rl.data.vision_checkpoint import build_tiny_vl_checkpoint
from megatron_rl.models.vision_inputs import MULTI_MODAL_INPUTS, collate_visual_inputs
from megatron_rl.rollout.hf_engine import HFEngine

R = 6


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def model_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    paths = write_task("shapes", out / "data", n_train=16, n_val=4, seed=0)
    rows = [row for path in paths.values() for row in pq.read_table(path).to_pylist()]
    return build_tiny_vl_checkpoint(out / "model", task_texts(rows), seed=0, family=request.param), paths["train"]


@pytest.fixture(scope="module")
def engine(model_dir):
    directory, _ = model_dir
    return HFEngine(RolloutConfig(name="hf", temperature=1.0), directory, response_length=R, device="cpu",
                    weights_path=directory)


def prompts(model_dir, rows: list[int], **meta):
    directory, train = model_dir
    dataset = RLDataset(train, load_tokenizer(directory), max_prompt_length=64)
    batch = collate_to_dataproto([dataset[i] for i in rows]).pop_for_generation()
    batch.meta_info.update(temperature=1.0, **meta)
    return batch


def test_rollout_log_probs_equal_recomputation_and_transformers(engine, model_dir):
    gen = prompts(model_dir, [0, 1, 2, 3]).repeat(2, interleave=True)
    out = engine.generate_sequences(gen)
    mask = out.batch["response_mask"].bool()
    recomputed = engine.compute_log_probs(out)
    assert (recomputed - out.batch["rollout_log_probs"])[mask].abs().max() <= 1e-5
    # transformers' own placement of the features (every image token) where no response sampled one
    image = engine.model.config.image_token_id
    clean = ~(out.batch["responses"] == image).any(-1)
    ids, attention = out.batch["input_ids"][clean], out.batch["attention_mask"][clean]
    rows = [r for r, keep in zip(out.non_tensor_batch[MULTI_MODAL_INPUTS], clean.tolist()) if keep]
    with torch.no_grad():  # (Qwen3-VL: its DeepStack features too)
        logits = engine.model(input_ids=ids, attention_mask=attention, mm_token_type_ids=(ids == image).int(),
                              **collate_visual_inputs(rows)).logits[:, -R - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, out.batch["responses"][clean][..., None])[..., 0]
    assert (expected - out.batch["rollout_log_probs"][clean])[mask[clean]].abs().max() <= 1e-5


def test_token_identical_prompts_with_other_images_are_not_shared(engine, model_dir):
    """Every shapes prompt has the same tokens (text + 4 image tokens): only the images differ. Greedy answers of
    a batch equal each prompt's alone; the n copies of one prompt still share one prefill (same answers)."""
    batch = prompts(model_dir, [0, 1, 2, 3], do_sample=False)
    assert torch.equal(batch.batch["input_ids"][0], batch.batch["input_ids"][1])
    together = engine.generate_sequences(batch).batch["responses"]
    alone = torch.cat([engine.generate_sequences(prompts(model_dir, [i], do_sample=False)).batch["responses"]
                       for i in range(4)])
    assert torch.equal(together, alone)
    repeated = engine.generate_sequences(batch.repeat(3, interleave=True)).batch["responses"]
    assert torch.equal(repeated, together.repeat_interleave(3, dim=0))


def test_released_names_load_and_text_models_refuse_images(engine, model_dir, tmp_path):
    from safetensors.torch import load_file

    directory, _ = model_dir
    stored = load_file(f"{directory}/model.safetensors")
    if engine.model.config.model_type == "qwen2_5_vl":  # released as visual.* / model.layers.*; Qwen3-VL nested
        assert any(n.startswith("visual.") for n in stored) and any(n.startswith("model.layers.") for n in stored)
    engine.update_weights(list(stored.items()), version=1)  # the names our export writes
    assert engine.weight_version == 1

    from megatron_rl_testing.rollout_models import make_engine

    text_engine = make_engine()
    batch = prompts(model_dir, [0])
    with pytest.raises(ValueError, match="is a text model; the prompt batch has images"):
        text_engine.generate_sequences(batch)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_prompts_with_videos_generate_with_transformers_log_probs(family, tmp_path):
    """A batch with images and a video (Qwen3-VL: its temporal patches behind timestamps): rollout log-probs equal a
    recomputation and transformers' own forward (its placement, positions and DeepStack) on the rows whose responses
    sampled no placeholder token; the n samples of the video prompt share its prefill."""
    import numpy as np

    from megatron_rl.protocol import DataProto
    from megatron_rl_testing.vl_models import (QWEN3_VL_PATCH, make_tiny_qwen2_5_vl, make_tiny_qwen3_vl,
                                             mm_token_types, visual_text_batch)

    qwen3 = family == "qwen3_vl"
    directory = (make_tiny_qwen3_vl if qwen3 else make_tiny_qwen2_5_vl)(tmp_path / family)
    engine = HFEngine(RolloutConfig(name="hf", temperature=1.0), directory, response_length=R, device="cpu",
                      weights_path=directory, eos_token_id=159, pad_token_id=0)
    ids, mask, rows = visual_text_batch(QWEN3_VL_PATCH, frames_apart=True) if qwen3 else visual_text_batch()
    real = [ids[i][mask[i].bool()] for i in range(len(rows))]  # left-padded prompts, as the dataset gives them
    width = max(len(r) for r in real)
    prompt_ids = torch.zeros(len(real), width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, r in enumerate(real):
        prompt_ids[i, width - len(r):], prompt_mask[i, width - len(r):] = r, 1
    column = np.empty(len(rows), dtype=object)
    column[:] = rows
    batch = DataProto.from_dict({"input_ids": prompt_ids, "attention_mask": prompt_mask,
                                 "position_ids": (prompt_mask.cumsum(1) - 1).clamp(min=0)},
                                non_tensors={MULTI_MODAL_INPUTS: column}, meta_info={"temperature": 1.0})
    out = engine.generate_sequences(batch.repeat(4, interleave=True))
    mask = out.batch["response_mask"].bool()
    assert (engine.compute_log_probs(out) - out.batch["rollout_log_probs"])[mask].abs().max() <= 1e-5
    clean = ~(mm_token_types(out.batch["responses"]) > 0).any(-1)
    assert int(clean[4:8].sum()) >= 2  # rows of the video prompt among the compared
    ids, attention = out.batch["input_ids"][clean], out.batch["attention_mask"][clean]
    kept = [r for r, keep in zip(out.non_tensor_batch[MULTI_MODAL_INPUTS], clean.tolist()) if keep]
    with torch.no_grad():
        logits = engine.model(input_ids=ids, attention_mask=attention, mm_token_type_ids=mm_token_types(ids),
                              **collate_visual_inputs(kept)).logits[:, -R - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, out.batch["responses"][clean][..., None])[..., 0]
    assert (expected - out.batch["rollout_log_probs"][clean])[mask[clean]].abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_dataset_video_rows_generate_through_the_processor(family, tmp_path):
    """verl's video rows read by the dataset with the checkpoint's processor (its video tokens: Qwen3-VL's timestamps)
    reach the engine, whose log-probs equal transformers' forward on the same processor outputs."""
    import json

    from PIL import Image

    texts = ["How many frames are red? 0 1 2 3 <0.2 seconds> <1.2 seconds>"]
    directory = build_tiny_vl_checkpoint(tmp_path / "model", texts, seed=0, family=family)
    rows = []
    for k in range(2):
        frames = []
        for f in range(3 + k):  # an odd count: the last frame repeats to fill the temporal patch
            path = tmp_path / f"v{k}_{f}.png"
            Image.new("RGB", (64, 64), (255 * (f % 2), 40 * f, 0)).save(path)
            frames.append(str(path))
        rows.append({"prompt": [{"role": "user", "content": "<video>How many frames are red?"}],
                     "data_source": "synthetic/shapes", "reward_model": {"ground_truth": "1"},
                     # 8 frames a second: Qwen2.5-VL's temporal positions step by 1 (of its tiny config's 4
                     # tokens a second), below the grid, where transformers 5.19 continues the text as verl does
                     "videos": [{"video": frames, "sample_fps": 8}]})
    train = tmp_path / "videos.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dataset = RLDataset(str(train), load_tokenizer(directory), max_prompt_length=256)
    batch = collate_to_dataproto([dataset[i] for i in range(2)]).pop_for_generation()
    batch.meta_info.update(temperature=1.0)
    assert all("video_grid_thw" in r for r in batch.non_tensor_batch[MULTI_MODAL_INPUTS])
    engine = HFEngine(RolloutConfig(name="hf", temperature=1.0), directory, response_length=R, device="cpu",
                      weights_path=directory)
    out = engine.generate_sequences(batch.repeat(3, interleave=True))
    mask = out.batch["response_mask"].bool()
    assert (engine.compute_log_probs(out) - out.batch["rollout_log_probs"])[mask].abs().max() <= 1e-5
    video, image = engine.model.config.video_token_id, engine.model.config.image_token_id
    responses = out.batch["responses"]
    clean = ~((responses == image) | (responses == video)).any(-1)  # transformers would take those for placeholders
    ids, attention = out.batch["input_ids"][clean], out.batch["attention_mask"][clean]
    types = (ids == image).int() + 2 * (ids == video).int()
    kept = [r for r, keep in zip(out.non_tensor_batch[MULTI_MODAL_INPUTS], clean.tolist()) if keep]
    assert kept
    with torch.no_grad():
        logits = engine.model(input_ids=ids, attention_mask=attention, mm_token_type_ids=types,
                              **collate_visual_inputs(kept)).logits[:, -R - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, out.batch["responses"][clean][..., None])[..., 0]
    assert (expected - out.batch["rollout_log_probs"][clean])[mask[clean]].abs().max() <= 1e-5
