"""The actor on a tiny Qwen2.5-VL: log-probs of response tokens after prompts with images and a video (verl's
multi_modal_inputs column) equal transformers' (fp32) at TP 1, TP 2 and PP 2, an image token sampled into a response counting as text;
one PPO update trains the vision tower too and moves the log-probs."""

from __future__ import annotations

import pytest
import torch
from vision_actor_jobs import TEMPERATURE, actor_job, vision_rl_batch

from megatron_rl.distributed import run_multiprocess
from megatron_rl_testing.vl_models import IMAGE, VIDEO, make_tiny_qwen2_5_vl, mm_token_types

LAYOUTS = [(1, 1), (2, 1), (1, 2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl_actor") / "tiny"))


@pytest.fixture(scope="module")
def expected(model_dir) -> torch.Tensor:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron_rl.models.vision_inputs import collate_visual_inputs

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = vision_rl_batch()
    ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
    prompt_len = ids.shape[1] - data.batch["responses"].shape[1]
    in_prompt = torch.arange(ids.shape[1]) < prompt_len  # the responses' image and video tokens are text
    visual = collate_visual_inputs(list(data.non_tensor_batch["multi_modal_inputs"]))
    with torch.no_grad():  # transformers would take every image token for a placeholder: its features placed here
        embeds = model.get_input_embeddings()(ids)
        for token, features_of, pixels, grid in ((IMAGE, model.model.get_image_features, "pixel_values", "image_grid_thw"),
                                                 (VIDEO, model.model.get_video_features, "pixel_values_videos",
                                                  "video_grid_thw")):
            features = torch.cat(features_of(visual[pixels], visual[grid]).pooler_output)
            embeds = embeds.masked_scatter(((ids == token) & in_prompt)[..., None], features)
        types = mm_token_types(ids) * in_prompt
        positions, _ = model.model.get_rope_index(ids, types, image_grid_thw=visual["image_grid_thw"],
                                                  video_grid_thw=visual["video_grid_thw"],
                                                  second_per_grid_ts=visual["second_per_grid_ts"], attention_mask=mask)
        logits = model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits
    response_len = data.batch["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -response_len - 1:-1] / TEMPERATURE, -1)
    return log_probs.gather(-1, data.batch["responses"][..., None])[..., 0] * data.batch["response_mask"]


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda layout: f"tp{layout[0]}_pp{layout[1]}")
def results(request, model_dir):
    tp, pp = request.param
    return request.param, run_multiprocess(actor_job, 2, model_dir, tp, pp, timeout_s=600)


@pytest.mark.distributed
def test_log_probs_with_images_equal_transformers(results, expected):
    (tp, pp), ranks = results
    mask = vision_rl_batch().batch["response_mask"].bool()
    for rank in ranks:
        diff = (rank["log_probs"] - expected)[mask].abs().max().item()
        print(f"TP={tp} PP={pp}: max |log-prob diff| {diff:.2e}")
        assert diff <= 1e-5


@pytest.mark.distributed
def test_an_update_trains_the_vision_tower(results):
    (tp, pp), ranks = results
    first_stage = [r for r in ranks if r["vision_moved"]]
    assert len(first_stage) == 2 // pp
    for rank in first_stage:
        assert all(rank["vision_moved"].values()), [n for n, moved in rank["vision_moved"].items() if not moved]
        mask = vision_rl_batch().batch["response_mask"].bool()
        assert (rank["log_probs_after"] - rank["log_probs"])[mask].abs().max() > 1e-4
