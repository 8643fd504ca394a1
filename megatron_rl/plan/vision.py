"""A vision-language model (models/vision.py, models/vision_model.py) in the plan and before launch.

What is counted:

- the vision tower's parameters (``vision_params``: a closed form of transformers' Qwen2.5-VL and Qwen3-VL vision
  towers, every tensor, norms and biases included; tests/plan/test_vision_plan.py checks it against
  ``vision_tensor_shapes``).
  The tower lives whole on every tensor-parallel rank of the first pipeline stage, so its weights, grads and
  Adam state are counted there unsplit by TP (Adam's state sharded over DP x CP by the distributed optimizer, as
  the other parameters'); with ``actor.freeze_vision_tower`` only its weights;
- its activations in the actor's update (``vision_activation_bytes``), on the first stage;
- its tensors in the weight sync (plan/traffic.py) and in the rollout engine's weights (memory.rollout_weight_bytes).

What is refused before launch (``vision_run_problem``), naming the key: context parallelism (mRoPE positions and
images ride with padded rows only, workers/engine.py). The compat entry turns verl's use_remove_padding=True (packed
THD) into padded micro-batches for a vision-language model, with one logged line (compat/verl/trainer/main_ppo.py).
DeepStack's layers off the first pipeline stage are refused by the builder (models/vision_model.py).
"""
from __future__ import annotations

from typing import Optional

from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.vision import VisionSpec

# verl's images go through qwen_vl_utils.fetch_image (verl/utils/dataset/vision_utils.py), whose default bound is
# 16384 merged tokens of 28 x 28 pixels per image (MAX_PIXELS = 16384 * 28 * 28, the same as Qwen2.5-VL's
# preprocessor_config.json max_pixels); data.mm_processor_kwargs.max_pixels lowers it
VERL_DEFAULT_MAX_PIXELS = 16384 * 28 * 28
BF16 = 2


def _dims(spec: VisionSpec) -> tuple[int, int, int, int]:
    """(hidden, mlp hidden, depth, input channels) of the tower."""
    fields = spec.config  # config.json's vision_config
    return (spec.hidden_size, int(fields["intermediate_size"]), spec.depth,
            int(fields.get("in_chans", fields.get("in_channels", 3))))


def vision_params(spec: Optional[VisionSpec]) -> int:
    """Every parameter of the vision tower (0 without one).

    Qwen2.5-VL's (transformers' Qwen2_5_VisionTransformerPretrainedModel): the patch embedding (a Conv3d of kernel
    T_p x P x P, no bias), per block two RMSNorms, qkv and proj with biases, a SwiGLU MLP with biases; the merger's
    RMSNorm and its two-layer MLP from the 2 x 2 merged patches (4 h) to the language model's width.
    Qwen2.5-VL-7B: 676,550,144.

    Qwen3-VL's (Qwen3VLVisionModel): the patch embedding with a bias, the learned position grid
    (num_position_embeddings x h), per block two LayerNorms (weight and bias), qkv and proj with biases, a two-layer
    MLP with biases; the merger (LayerNorm of h, then 4 h -> 4 h -> the language model's width) and one DeepStack
    merger per deepstack_visual_indexes entry, the same but normed over the merged 4 h. Qwen3-VL-8B: 576,388,336
    (of 8,767,123,696)."""
    if spec is None:
        return 0
    h, inter, depth, channels = _dims(spec)
    patch = channels * spec.temporal_patch_size * spec.patch_size ** 2 * h
    merged = h * spec.spatial_merge_size ** 2
    merger_mlp = merged * merged + merged + merged * spec.out_hidden_size + spec.out_hidden_size
    attention = (3 * h * h + 3 * h) + (h * h + h)
    if spec.family == "qwen2_5_vl":
        block = 2 * h + attention + 3 * h * inter + 2 * inter + h
        return patch + depth * block + h + merger_mlp
    if spec.family == "qwen3_vl":
        positions = int(spec.config.get("num_position_embeddings", 2304)) * h
        block = 4 * h + attention + 2 * h * inter + inter + h
        deepstack = len(spec.deepstack_visual_indexes) * (2 * merged + merger_mlp)
        return patch + h + positions + depth * block + 2 * h + merger_mlp + deepstack
    raise ValueError(f"the {spec.family} vision tower is not built here (its parameters are not counted)")


def model_vision_params(model: HFModelConfig) -> int:
    return vision_params(model.vision)


def max_pixels(mm_processor_kwargs: Optional[dict]) -> int:
    """The bound on one image's pixels: data.mm_processor_kwargs.max_pixels, else verl's default."""
    given = (mm_processor_kwargs or {}).get("max_pixels")
    return int(given) if given else VERL_DEFAULT_MAX_PIXELS


def patches_per_sample(spec: VisionSpec, pixels: int, max_prompt_length: int) -> int:
    """Vision patches of one sample at most: max_pixels / patch_size**2 (the processor resizes an image to at most
    max_pixels), and no more than the prompt can hold: every spatial_merge_size**2 patches are one image token of
    the prompt, which data.max_prompt_length bounds (verl filters or refuses longer prompts)."""
    by_pixels = pixels // spec.patch_size ** 2
    by_prompt = max_prompt_length * spec.spatial_merge_size ** 2
    return max(1, min(by_pixels, by_prompt))


def vision_activation_bytes_per_patch(spec: VisionSpec) -> int:
    """bf16 activations the tower keeps for its backward, per patch (a simple model, as memory.py's for the
    language layers): per block its two norms' outputs and the residuals (4 h), q, k, v after the 2-D rotary and
    the attention output (4 h, flash / SDPA attention: no scores kept), the proj input (h), the MLP's gate, up,
    activation and product (4 I; Qwen3-VL's gelu MLP: its input projection and activation, 2 I); the patch
    embedding's output and each merger's (Qwen3-VL: also each DeepStack merger's) input, normed, and hidden
    (3 x 4 h per 4 patches)."""
    h, inter, depth, _ = _dims(spec)
    mlp = 2 if spec.family == "qwen3_vl" else 4
    return BF16 * (depth * (9 * h + mlp * inter) + 3 * h * (1 + len(spec.deepstack_visual_indexes)))


def vision_activation_bytes(spec: VisionSpec, samples: float, patches: int, in_flight: float) -> float:
    """The tower's activations on the first stage in the actor's update: ``samples`` samples of ``patches`` patches
    per micro-batch, ``in_flight`` micro-batches kept by the pipeline schedule (memory.micro_batches_in_flight)."""
    return samples * patches * vision_activation_bytes_per_patch(spec) * in_flight


def vision_run_problem(model: HFModelConfig, context_parallel: dict[str, int]) -> Optional[str]:
    """Why this vision-language model does not run (None: it does, or it is a text model). ``context_parallel``:
    each built role's ``<role>.megatron.context_parallel_size`` by its key."""
    spec = model.vision
    if spec is None:
        return None
    for key, cp in context_parallel.items():
        if cp > 1:
            return (f"{key}={cp} with a vision-language model ({model.architecture}): context parallelism is not "
                    "built for it (its mRoPE positions and images ride with padded micro-batches, which are not "
                    "split over CP ranks); set it to 1")
    return None
