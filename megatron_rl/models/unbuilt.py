"""Model families verl's current examples train that megatron-rl does not build, refused by architecture name before
anything starts, each with what is missing (docs/models.md, "Families not built"). The reasons name the piece
Megatron-Core 0.16.1 lacks, or the kernels its version of the piece needs that do not run on this stack (no
GPU-only package is installed here: flash-linear-attention, mamba_ssm, causal_conv1d, fast_hadamard_transform).

No import beyond the standard library: the checks before launch read it."""

from __future__ import annotations

_GATED_DELTANET = ("hybrid layers: Gated DeltaNet linear attention beside gated full attention. Megatron-Core 0.16.1 "
                   "builds Gated DeltaNet (megatron/core/ssm/gated_delta_net.py) only on flash-linear-attention's "
                   "Triton kernels (the fla package), which need a GPU; the full-attention layers' output gate "
                   "(attention_output_gate) is not built here either")
_VISION = "a vision-language model: its vision encoder and image inputs are not built here"

UNBUILT_ARCHITECTURES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "its softmax routing with greedy / group-limited top-k is not built here "
                             "(DeepseekV3ForCausalLM's multi-latent attention and sigmoid routing are)",
    "DeepseekV32ForCausalLM": "it needs DeepSeek sparse attention (DSA, a lightning indexer over MLA), which is not "
                              "built here (DeepseekV3ForCausalLM is); Megatron-Core 0.16.1's experimental DSA "
                              "(transformer/experimental_attention_variant/dsa.py) needs fast_hadamard_transform's "
                              "CUDA kernel",
    "DeepseekV4ForCausalLM": "compressed sparse and heavily compressed attention (layer_types) and sqrtsoftplus "
                             "routing, which Megatron-Core 0.16.1 does not have",
    "GlmMoeDsaForCausalLM": "GLM-5's DeepSeek sparse attention (DSA: an indexer choosing index_topk tokens per query), "
                            "which is not built here (see DeepseekV32ForCausalLM)",
    "NemotronHForCausalLM": "hybrid Mamba-2 / attention / MLP layers: Megatron-Core builds Mamba layers "
                            "(megatron/core/ssm/mamba_mixer.py) on mamba_ssm's and causal_conv1d's CUDA kernels, "
                            "and megatron-rl's model build and weight layout cover transformer layers only",
    "Qwen3NextForCausalLM": _GATED_DELTANET,
    "Qwen3_5ForCausalLM": _GATED_DELTANET,
    "Qwen3_5MoeForCausalLM": _GATED_DELTANET,
    "Qwen3_5ForConditionalGeneration": f"{_VISION}; its text layers are {_GATED_DELTANET}",
    "Qwen3_5MoeForConditionalGeneration": f"{_VISION}; its text layers are {_GATED_DELTANET}",
    "Kimi_K25ForConditionalGeneration": f"{_VISION} (Kimi-K2.5 / K2.6: a vision encoder before DeepSeek-V3 text "
                                        "layers; the text-only Kimi-K2 is DeepseekV3ForCausalLM, which is built)",
    "Qwen3VLMoeForConditionalGeneration": "a mixture-of-experts vision-language model (Qwen3-VL-30B-A3B / "
                                          "235B-A22B): its Qwen3-VL vision tower with DeepStack (features of "
                                          "deepstack_visual_indexes added after the first language layers) and its "
                                          "interleaved mRoPE (mrope_interleaved) are not built here, nor is a "
                                          "vision tower beside MoE layers (Qwen2_5_VLForConditionalGeneration is "
                                          "built; the text-only Qwen3MoeForCausalLM is too)",
}
