"""The released config.json facts of the vision-language checkpoints verl's VL example scripts name, for dry runs
through the compat entry and the planner (tests/compat/test_verl_vl_scripts.py, tests/plan/test_vision_plan.py).

- Qwen/Qwen2.5-VL-7B-Instruct: as released (text fields at the top level, rope_scaling type mrope); also what
  tests/models/test_qwen2_5_vl.py reads. 8,292,166,656 parameters, 676,550,144 of them the vision tower.
- Qwen/Qwen3-VL-8B-Instruct and Qwen/Qwen3-VL-30B-A3B-Instruct, Qwen/Qwen3-VL-235B-A22B-Instruct: transformers
  4.57's layout (text_config / vision_config sections; interleaved mRoPE, DeepStack at vision blocks 8, 16, 24).
  Qwen3-VL-8B: 8,767,123,696 parameters (the released 8.77 B), 576,388,336 of them the vision tower.
"""
from __future__ import annotations

QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "use_sliding_window": False, "max_window_layers": 28, "max_position_embeddings": 128000, "vocab_size": 152064,
    "tie_word_embeddings": False, "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "vision_token_id": 151654, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16", "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}
QWEN2_5_VL_7B_PARAMS = 8_292_166_656
QWEN2_5_VL_7B_VISION_PARAMS = 676_550_144

_QWEN3_VL_VISION = {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                    "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
                    "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304, "patch_size": 16,
                    "spatial_merge_size": 2, "temporal_patch_size": 2}
_QWEN3_VL_ROPE = {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}
_QWEN3_VL_TOKENS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                    "vision_end_token_id": 151653}

QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", **_QWEN3_VL_TOKENS,
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
    "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
                    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
                    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 262144,
                    "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": _QWEN3_VL_ROPE,
                    "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936},
    "vision_config": {**_QWEN3_VL_VISION, "out_hidden_size": 4096},
}

QWEN3_VL_8B_PARAMS = 8_767_123_696
QWEN3_VL_8B_VISION_PARAMS = 576_388_336

QWEN3_VL_30B_A3B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe", **_QWEN3_VL_TOKENS,
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
    "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
                    "decoder_sparse_step": 1, "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128,
                    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
                    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_vl_moe_text",
                    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
                    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                    "rms_norm_eps": 1e-06, "rope_scaling": _QWEN3_VL_ROPE, "rope_theta": 5000000,
                    "use_cache": True, "vocab_size": 151936},
    "vision_config": {**_QWEN3_VL_VISION, "out_hidden_size": 2048},
}

QWEN3_VL_235B_A22B = {
    **QWEN3_VL_30B_A3B,
    "text_config": {**QWEN3_VL_30B_A3B["text_config"], "hidden_size": 4096, "intermediate_size": 12288,
                    "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_hidden_layers": 94},
    "vision_config": {**_QWEN3_VL_VISION, "out_hidden_size": 4096},
}
