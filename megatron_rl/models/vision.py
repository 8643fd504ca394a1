"""Vision-language checkpoints (Qwen2.5-VL, Qwen3-VL): the facts of their vision tower, and their language model's
config.json fields in the form the text families are read in.

A Qwen-VL checkpoint is a vision tower (patch embedding, ViT blocks, a patch merger to the language model's width)
plus a Qwen2 (Qwen2.5-VL) or Qwen3 (Qwen3-VL) language model whose RoPE is multimodal (mRoPE): every token has a
(temporal, height, width) position, text tokens the same number three times, an image's tokens their place in the
merged patch grid (models/mrope.py). The language model is Megatron's GPTModel with ``position_embedding_type="mrope"``;
the vision tower is transformers' own module, whole on every tensor-parallel rank of the first pipeline stage
(models/vision_model.py).

Config.json layouts read here: Qwen2.5-VL's as released (the language fields at the top level, ``rope_scaling``
``{"type": "mrope", "mrope_section": ...}``) and transformers 5's (a ``text_config`` section with
``rope_parameters``); Qwen3-VL's ``text_config`` (``mrope_interleaved``, DeepStack's ``deepstack_visual_indexes``).

No Megatron import: hf_config, the planner and validation read this module before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# architecture -> (family, the text family whose block the language model is)
VISION_LANGUAGE_ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "qwen2"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "qwen3"),
}
# the vision tower's tensors in a released checkpoint (Qwen2.5-VL's "visual.*"; Qwen3-VL was released in
# transformers 5's naming, "model.visual.*", with its language model under "model.language_model.")
_CHECKPOINT_PREFIXES = {"qwen2_5_vl": ("visual.", "model."), "qwen3_vl": ("model.visual.", "model.language_model.")}
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_TEXT_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower of a vision-language checkpoint and how its features enter the language model."""

    family: str  # "qwen2_5_vl" | "qwen3_vl"
    config: dict[str, Any] = field(repr=False, compare=False)  # config.json's vision_config, as written
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    spatial_merge_size: int
    patch_size: int
    temporal_patch_size: int
    out_hidden_size: int
    # mRoPE: the rotary frequency pairs of each head given to the (t, h, w) positions, in order (Qwen2.5-VL:
    # sections, [16, 24, 24] of 64) or interleaved t, h, w, t, h, w... (Qwen3-VL's mrope_interleaved)
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool = False
    # Qwen3-VL's DeepStack: features of these vision blocks are added to the hidden states after language layers
    # 0, 1, ... (one each)
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def vision_prefix(self) -> str:
        """Checkpoint name prefix of the vision tower's tensors."""
        return _CHECKPOINT_PREFIXES[self.family][0]

    @property
    def language_prefix(self) -> str:
        """Checkpoint name prefix of the language model's tensors (``model.`` as a text model's; Qwen3-VL's
        ``model.language_model.``, given to the layout's names by models/layout.py ``checkpoint_group``)."""
        return _CHECKPOINT_PREFIXES[self.family][1]

    @property
    def depth(self) -> int:
        return int(self.config["depth"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def tokens_per_second(self) -> float:
        """Qwen2.5-VL's temporal mRoPE positions per second of video (its vision_config; 2 in the released models)."""
        return float(self.config.get("tokens_per_second", 2))

    @property
    def video_frames_apart(self) -> bool:
        """Qwen3-VL's processor puts each temporal patch of a video in its own block behind a timestamp."""
        return self.family == "qwen3_vl"

    def tokens_per_image(self, height: int, width: int) -> int:
        """Language-model tokens of an image of ``height`` x ``width`` pixels already resized to the patch grid."""
        merge = self.patch_size * self.spatial_merge_size
        return (height // merge) * (width // merge)


def is_vision_language(hf_config: dict[str, Any]) -> bool:
    return any(a in VISION_LANGUAGE_ARCHITECTURES for a in hf_config.get("architectures") or [])


def vision_spec_of(hf_config: dict[str, Any], source: str) -> VisionSpec:
    """The vision spec of a vision-language config.json (a dict; transformers' ``PretrainedConfig.to_dict()``
    gives one), its architecture found from ``architectures`` or else ``model_type``."""
    by_type = {family: name for name, (family, _) in VISION_LANGUAGE_ARCHITECTURES.items()}
    found = [a for a in hf_config.get("architectures") or [] if a in VISION_LANGUAGE_ARCHITECTURES]
    architecture = found[0] if found else by_type.get(hf_config.get("model_type"))
    if architecture is None:
        from megatron_rl.models.hf_config import UnsupportedModelError  # cycle: hf_config imports this module

        raise UnsupportedModelError(f"{source}: model_type {hf_config.get('model_type')!r} is not a vision-language "
                                    f"model built here; known: {sorted(VISION_LANGUAGE_ARCHITECTURES)}")
    return split_vision_language(hf_config, architecture, source)[1]


def _mrope(rope: dict[str, Any], head_dim: int, source: str) -> tuple[tuple[int, int, int], bool]:
    from megatron_rl.models.hf_config import UnsupportedModelError  # cycle: hf_config imports this module

    section = rope.get("mrope_section")
    if not isinstance(section, (list, tuple)) or len(section) != 3:
        raise UnsupportedModelError(f"{source}: a vision-language model needs rope mrope_section [t, h, w], got "
                                    f"{section!r}")
    if sum(section) * 2 != head_dim:
        raise UnsupportedModelError(f"{source}: mrope_section {list(section)} covers {sum(section) * 2} dims of "
                                    f"head_dim={head_dim}; mRoPE rotates whole heads")
    return tuple(int(s) for s in section), bool(rope.get("mrope_interleaved", False))


def split_vision_language(hf_config: dict[str, Any], architecture: str, source: str) -> tuple[dict[str, Any],
                                                                                              VisionSpec]:
    """(the language model's fields as a text family's config.json would hold them, the vision tower's spec).

    The language fields keep everything the text reader checks (sizes, norms, RoPE base), with the mRoPE keys
    taken out of the RoPE settings (the vision spec holds them) and ``architectures`` / ``model_type`` of the text
    family, so the Llama-block checks of hf_config apply unchanged."""
    family, text_family = VISION_LANGUAGE_ARCHITECTURES[architecture]
    text = dict(hf_config.get("text_config") or {k: v for k, v in hf_config.items() if k != "vision_config"})
    if "tie_word_embeddings" in hf_config:  # the top level decides (Qwen2.5-VL-3B ties; 7B does not)
        text["tie_word_embeddings"] = hf_config["tie_word_embeddings"]
    rope: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        settings = dict(text.get(key) or {})
        rope.update(settings)
        if settings:
            if settings.get("type") == "mrope" or settings.get("rope_type") == "mrope":
                settings.pop("type", None)
                settings["rope_type"] = "default"
            text[key] = {k: v for k, v in settings.items() if k not in _MROPE_KEYS} or None
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    section, interleaved = _mrope(rope, head_dim, source)
    text["architectures"] = [_TEXT_ARCHITECTURES[text_family]]
    text["model_type"] = text_family
    vision = dict(hf_config.get("vision_config") or {})
    if not vision:
        from megatron_rl.models.hf_config import UnsupportedModelError  # cycle: hf_config imports this module

        raise UnsupportedModelError(f"{source}: {architecture} without a vision_config")
    spec = VisionSpec(
        family=family,
        config=vision,
        image_token_id=int(hf_config.get("image_token_id", text.get("image_token_id", -1))),
        video_token_id=int(hf_config.get("video_token_id", text.get("video_token_id", -1))),
        vision_start_token_id=int(hf_config.get("vision_start_token_id", -1)),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        patch_size=int(vision.get("patch_size", vision.get("spatial_patch_size", 14))),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        out_hidden_size=int(vision.get("out_hidden_size", text["hidden_size"])),
        mrope_section=section,
        mrope_interleaved=interleaved,
        deepstack_visual_indexes=tuple(int(i) for i in vision.get("deepstack_visual_indexes") or ()),
    )
    return text, spec
