"""Images through SGLang: the adapter sends a row's images as the request's ``image_data`` (base64 PNG data URLs) with
one image token per image in ``input_ids`` (SGLang expands it) and checks the prompt SGLang served has the trainer's
length; the strict stand-in (tests/stand_ins/sglang) refuses what SGLang would fail on: image tokens without images,
an already expanded prompt, image_data of the wrong shape, images for a text model, images to an engine started
with skip_tokenizer_init."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.sglang.adapter import SGLangEngine
from megatron_rl.rollout.sglang.contract import SGLANG_CONTRACT, checked

PAD, IMAGE = 0, 7


class RecordingTransport:
    """An SGLang transport that records each /generate and answers like SGLang: ``prompt_tokens`` the length of
    the prompt after expanding each image token into ``expand`` tokens."""

    tp_size, async_loads, version, colocated, routed_experts = 1, False, "0.5.23", True, False

    def __init__(self, expand: int) -> None:
        self.expand = expand
        self.calls: list[dict] = []

    def generate(self, input_ids, sampling, **kwargs):
        checked("engine", "generate", {"input_ids": input_ids, "sampling_params": sampling, **kwargs})
        self.calls.append({"input_ids": input_ids, **kwargs})
        return [{"meta_info": {"output_token_logprobs": [[-0.5, 2, None]],
                               "prompt_tokens": len(ids) + ids.count(IMAGE) * (self.expand - 1)}}
                for ids in input_ids]


def engine(transport, image_token_id=IMAGE) -> SGLangEngine:
    return SGLangEngine(RolloutConfig(name="sglang", response_length=3), transport, eos_token_id=2, pad_token_id=PAD,
                        needs_sync=None, compute_device="cpu", image_token_id=image_token_id)


def batch(rows: list[list[int]], images: list[list[Image.Image] | None]) -> DataProto:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    data = np.array([{"image": i} if i else None for i in images], dtype=object)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               non_tensors={"multi_modal_data": data})


def decode(url: str) -> Image.Image:
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_image_rows_go_as_image_data_with_one_image_token_per_image():
    red, blue = Image.new("RGB", (28, 56), (200, 10, 10)), Image.new("RGB", (56, 28), (10, 10, 200))
    transport = RecordingTransport(expand=4)
    rows = [[1, 5, IMAGE, IMAGE, IMAGE, IMAGE, 6, 3], [1, 3, 4], [5, IMAGE, IMAGE, IMAGE, IMAGE, 6, 5, IMAGE, IMAGE,
                                                                  IMAGE, IMAGE, 6]]
    out = engine(transport).generate_sequences(batch(rows, [[red], None, [red, blue]]))
    sent = transport.calls[0]
    assert sent["input_ids"] == [[1, 5, IMAGE, 6, 3], [1, 3, 4], [5, IMAGE, 6, 5, IMAGE, 6]]
    image_data = sent["image_data"]
    assert image_data[1] is None and len(image_data[0]) == 1 and len(image_data[2]) == 2
    for url, image in ((image_data[0][0], red), (image_data[2][0], red), (image_data[2][1], blue)):
        assert np.array_equal(np.asarray(decode(url).convert("RGB")), np.asarray(image))  # lossless
    assert out.batch["responses"].shape == (3, 3)
    assert "image_data" in SGLANG_CONTRACT["http_routes"]["/generate"][1]
    # a text-only batch sends no image_data at all
    transport.calls.clear()
    engine(transport).generate_sequences(batch([[1, 3, 4]], [None]))
    assert "image_data" not in transport.calls[0]


def test_a_prompt_served_at_another_length_is_refused():
    image = Image.new("RGB", (28, 28))
    transport = RecordingTransport(expand=9)  # SGLang made 9 tokens of the image, the trainer's processor 4
    with pytest.raises(RuntimeError, match="served prompt row 0 as 13 tokens, the trainer's prompt has 8"):
        engine(transport).generate_sequences(batch([[1, 5, IMAGE, IMAGE, IMAGE, IMAGE, 6, 3]], [[image]]))


def test_images_for_a_text_model_or_without_placeholders_are_refused():
    image = Image.new("RGB", (28, 28))
    with pytest.raises(ValueError, match="row 0 has images .* text model"):
        engine(RecordingTransport(4), image_token_id=None).generate_sequences(batch([[1, 2, 3]], [[image]]))
    with pytest.raises(ValueError, match="row 0: the prompt has 0 image placeholder run"):
        engine(RecordingTransport(4)).generate_sequences(batch([[1, 2, 3]], [[image]]))
    with pytest.raises(ValueError, match="row 1 has image tokens .* but no image"):
        engine(RecordingTransport(4)).generate_sequences(batch([[1, IMAGE, 3], [1, IMAGE, 3]], [[image], None]))


# ---------------------------------------------------------------------------------------------- the stand-in
@pytest.fixture
def stand_in_engine(sglang_stand_in, tmp_path):
    from megatron_rl.rollout.sglang import build_sglang_engine
    from megatron_rl_testing.rollout_models import tiny_qwen2_config

    model = tmp_path / "model"
    tiny_qwen2_config().save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "image_token_id": IMAGE}))  # the stand-in reads it
    engine = build_sglang_engine(RolloutConfig(name="sglang", response_length=3, dtype="float32"), str(model),
                                 eos_token_id=2, pad_token_id=PAD)
    yield engine
    engine.shutdown()


def test_the_stand_in_refuses_image_requests_sglang_would_fail_on(stand_in_engine):
    url = "data:image/png;base64," + base64.b64encode(b"not checked here").decode()
    sampling = [{"max_new_tokens": 2}] * 2

    def generate(rows, image_data):
        return stand_in_engine.transport.generate(rows, sampling[: len(rows)], image_data=image_data)

    with pytest.raises(ValueError, match=r"request 0: 1 image tokens .* for 0 image"):
        generate([[1, IMAGE, 3], [1, 2]], [None, None])  # image tokens but no image_data
    with pytest.raises(ValueError, match=r"request 0: 3 image tokens .* for 1 image"):
        generate([[1, IMAGE, IMAGE, IMAGE, 3]], [[url]])  # an expanded prompt
    with pytest.raises(ValueError, match="one entry per request"):
        generate([[1, IMAGE, 3], [1, 2]], [[url]])
    with pytest.raises(ValueError, match=r"image_data\[0\] must be a list of images as strings"):
        generate([[1, IMAGE, 3]], [[b"raw"]])
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        generate([[1, IMAGE, 3], [1, 2]], [[url], None])  # well formed: SGLang needs its tokenizer for images


def test_the_stand_in_of_a_text_model_takes_no_images(sglang_stand_in, tmp_path):
    from megatron_rl.rollout.sglang import build_sglang_engine
    from megatron_rl_testing.rollout_models import tiny_qwen2_config

    tiny_qwen2_config().save_pretrained(tmp_path / "text")
    engine = build_sglang_engine(RolloutConfig(name="sglang", response_length=3, dtype="float32"),
                                 str(tmp_path / "text"), eos_token_id=2, pad_token_id=PAD)
    try:
        with pytest.raises(ValueError, match="the model takes no images"):
            engine.transport.generate([[1, 2]], [{"max_new_tokens": 2}], image_data=[["data:image/png;base64,AA=="]])
    finally:
        engine.shutdown()

