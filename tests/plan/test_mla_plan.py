"""The planner counts multi-latent-attention models (DeepSeek-V3) exactly (issue 52 item 6): parameters
against transformers, the checkpoint and Megatron's built model at TP 2; DeepSeek-V3-671B against its
published size; the attention's saved activations against autograd; the engines' latent KV cache."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import load_hf_config, parse_hf_config
from megatron_rl.plan import memory
from megatron_rl.plan.memory import Layout
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

# DeepSeek-V3's config.json facts (the main model; its multi-token-prediction layer 61 is not loaded)
DEEPSEEK_V3_671B = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
    topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1, norm_topk_prob=True,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    tie_word_embeddings=False, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    num_nextn_predict_layers=1,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("dsv3"), "deepseek_v3", with_tokenizer=False))


def test_tiny_deepseek_v3_counts_equal_transformers_and_the_checkpoint(tiny):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny)
    params = sum(p.numel() for p in hf.parameters())
    # the router bias is a buffer in transformers (and in Megatron): a tensor of the checkpoint all the same
    bias = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    stored = sum(t.numel() for t in load_file(f"{tiny}/model.safetensors").values())
    model = load_hf_config(tiny)
    print(f"\ntiny DeepSeek-V3: transformers {params:,} parameters + {bias} router bias; planner numel "
          f"{memory.numel(model):,}, total_params {memory.total_params(model):,}")
    assert (params, bias) == (207_440, 16)
    assert memory.numel(model) == params + bias == stored
    # the memory rows' part: the matrices (transformers fuses each layer's experts into 3-d tensors)
    assert memory.total_params(model) == sum(p.numel() for p in hf.parameters() if p.dim() >= 2)
    # TP 1, PP 1, untied: every matrix, the vocabulary padded to 128
    padded = memory.padded_vocab_size(model.vocab_size, 1) - model.vocab_size
    assert memory.stage_params(model, Layout(tp=1, pp=1, cp=1, dp=1), "first") == \
        memory.total_params(model) + 2 * padded * model.hidden_size


def test_q_proj_without_q_lora_is_counted():
    from transformers import AutoModelForCausalLM

    from megatron_rl_testing.tiny_models import tiny_hf_config

    config = tiny_hf_config("deepseek_v3", q_lora_rank=None)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    model = parse_hf_config(config.to_dict())
    assert model.mla.q_lora_rank is None
    assert memory.numel(model) == sum(p.numel() for p in hf.parameters()) + memory.router_bias_params(model)


def test_deepseek_v3_671b_total_is_its_published_size():
    model = parse_hf_config(DEEPSEEK_V3_671B)
    h, heads, layers, dense, vocab = 7168, 128, 61, 3, 129280
    q_lora, kv_lora, nope, rope, v = 1536, 512, 128, 64, 128
    # attention per layer: q_a_proj h x q_lora, q_b_proj q_lora x heads (nope + rope), kv_a_proj_with_mqa
    # h x (kv_lora + rope), kv_b_proj kv_lora x heads (nope + v), o_proj heads v x h; norms q_lora + kv_lora
    attention = (h * q_lora + q_lora * heads * (nope + rope) + h * (kv_lora + rope)
                 + kv_lora * heads * (nope + v) + heads * v * h)
    dense_mlp = 3 * h * 18432
    # MoE layer: 256 routed experts and 1 shared expert of 3 h x 2048 (SwiGLU, ungated), the router 256 x h
    moe = 256 * 3 * h * 2048 + 1 * 3 * h * 2048 + 256 * h
    matrices = layers * attention + dense * dense_mlp + (layers - dense) * moe + 2 * vocab * h
    vectors = layers * (2 * h + q_lora + kv_lora) + h + (layers - dense) * 256  # norms; the router bias
    assert memory.attention_params(model) == attention == 187_105_280
    assert memory.total_params(model) == matrices == 671_025_397_760
    assert memory.numel(model) == matrices + vectors
    assert abs(memory.numel(model) / 1e9 - 671.0) < 0.1  # the model card: 671 B (+ 14 B of MTP module)
    # 8 of 256 routed experts per token: the model card's 37 B activated
    assert 37.0 < memory.active_params(model) / 1e9 < 38.0


def test_deepseek_v3_671b_kv_cache_is_the_latent():
    model = parse_hf_config(DEEPSEEK_V3_671B)
    # (kv_lora_rank + qk_rope_head_dim) x bf16 per layer and token, whole on every engine rank
    for tp in (1, 8, 16):
        assert memory.kv_cache_bytes_per_token(model, tp) == 61 * (512 + 64) * 2 == 70_272


def test_deepseek_v3_671b_activation_per_token_layer():
    model = parse_hf_config(DEEPSEEK_V3_671B)
    h, heads, q_lora, kv_lora, rope, qk, v = 7168, 128, 1536, 512, 64, 192, 128
    # the latents (each norm's input and output; the kv norm's input keeps kv_a's rope columns), and per head
    # the core attention's q, k (nope + rope), v and output (v_head_dim)
    latents = 2 * q_lora + 2 * kv_lora + rope
    assert memory.attention_activation_widths(model) == (latents, heads * (2 * qk + 2 * v))
    assert memory.core_attention_heads(model) == (128, 192)
    layout = Layout(tp=8, pp=1, cp=1, dp=1, sequence_parallel=True, ep=8, etp=1)
    per_token = memory.activation_bytes_per_token_layer(model, layout)
    attention = ((4 * h + latents) / 8 + heads * (2 * qk + 2 * v) / 8) * 2
    mlp = sum(memory.mlp_activation_bytes_per_token(model, layout, i) for i in range(61)) / 61
    assert per_token == pytest.approx(attention + mlp)
    print(f"\nDeepSeek-V3-671B, TP 8 + SP, EP 8, ETP 1: {per_token:,.0f} B per token and layer "
          f"(attention and norms {attention:,.0f}, MLP mean {mlp:,.0f})")


# ------------------------------------------------------------------------ Megatron's built model (CPU ranks)
def built_job(model_dir: str, layouts: list[tuple[int, int, int | None]]) -> dict:
    """Per (TP, EP, ETP) layout, the weight matrices on this rank as the planner counts them (norms left
    out), and the rank."""
    import torch.distributed as dist

    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.models.builder import build_gpt_model

    out: dict = {"rank": dist.get_rank()}
    for tp, ep, etp in layouts:
        init_model_parallel(tp=tp, ep=ep, etp=etp)
        chunks = build_gpt_model(load_hf_config(model_dir))
        out[tp, ep, etp] = sum(p.numel() for c in chunks for n, p in c.named_parameters()
                          if "layernorm" not in n and "final_norm" not in n)
        destroy_model_parallel()
    return out


@pytest.mark.distributed
def test_stage_params_equal_megatrons_tensor_parallel_shards(tiny):
    # (TP, EP, ETP): the MLA projections split over TP (the down projections too), the experts over EP x ETP
    layouts = [(2, 1, None), (2, 2, 1), (1, 2, 1)]
    ranks = run_multiprocess(built_job, 2, tiny, layouts, timeout_s=600)
    model = load_hf_config(tiny)
    for tp, ep, etp in layouts:
        layout = Layout(tp=tp, pp=1, cp=1, dp=2 // tp, ep=ep, etp=etp)
        planned = memory.stage_params(model, layout, "first")
        # stage_params splits the router (E x h, replicated in Megatron) over TP like the MoE layer's other
        # non-expert weights: the one gap, as for every MoE family (kept: their plans stay as they were)
        router = model.moe.moe_layers(model.num_layers) * model.moe.num_experts * model.hidden_size
        router_gap = router * (tp - 1) // tp
        assert [rank[tp, ep, etp] for rank in ranks] == [planned + router_gap] * 2, (tp, ep, etp)


def attention_saved_job(model_dir: str, lengths: list[int]) -> dict:
    """Bytes autograd saves in layer 0's MLA attention (fp32, CPU) for one THD pack of ``lengths``, with each
    saved storage's shape, its input (the layer norm's output, counted apart by the planner) excluded."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.models import build_from_hf
    from megatron_rl_testing.saved_activations import SavedActivations

    init_model_parallel(tp=1)
    model = build_from_hf(model_dir)[0]
    model.train()
    attention = model.decoder.layers[0].self_attention
    tokens = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    x = torch.randn(tokens, 1, model.config.hidden_size, requires_grad=True)
    shapes: dict[int, tuple] = {}

    class Recording(SavedActivations):
        def _pack(self, tensor):
            if tensor.untyped_storage().data_ptr() not in self.parameters:
                shapes[tensor.untyped_storage().data_ptr()] = (tuple(tensor.shape), str(tensor.dtype))
            return super()._pack(tensor)

    with Recording(list(attention.parameters()) + [x]) as saved:
        out, _ = attention(x, attention_mask=None, packed_seq_params=packed)
        out.sum().backward()
    destroy_model_parallel()
    return {"bytes": saved.nbytes, "tokens": tokens,
            "storages": sorted((saved.storages[k], shapes[k]) for k in saved.storages)}


@pytest.mark.distributed
def test_mla_attention_activations_against_autograd(tiny):
    lengths = [64, 32]
    measured = run_multiprocess(attention_saved_job, 1, tiny, lengths, timeout_s=600)[0]
    model = load_hf_config(tiny)
    mla, heads, tokens, fp32 = model.mla, model.num_attention_heads, sum(lengths), 4
    latents, split = memory.attention_activation_widths(model)
    planned = (latents + split) * fp32 * tokens  # TP 1: activation_bytes_per_token_layer's attention part
    # What the CPU run keeps beyond it, each named:
    # - the math kernel's softmax probabilities, [heads, s, s] fp32 per sequence: attention_kernel_bytes' term
    #   (the GPU's flash kernels keep none);
    probs = heads * sum(n * n for n in lengths) * fp32
    # - torch's RMSNorm keeps its normalised input (x * rstd, for the weight's gradient) and rstd ([t, 1])
    #   too, for each latent norm (the planner counts a norm's input and output, as for the layer norms);
    norms = (mla.q_lora_rank + mla.kv_lora_rank + 2) * fp32 * tokens
    # - RoPE's cos and sin for q and for k ([t, rope] each), left out by the planner
    rope = 4 * mla.qk_rope_head_dim * fp32 * tokens
    error = planned / (measured["bytes"] - probs) - 1
    print(f"\nMLA attention, layer 0, {tokens} tokens (fp32, CPU): autograd {measured['bytes']:,} B; "
          f"planned {planned:,} B ({error:+.1%} of autograd's without the kernel's probabilities {probs:,} B; "
          f"the rest: RMSNorm's extras {norms:,} B, RoPE's cos / sin {rope:,} B)")
    for nbytes, shape in measured["storages"]:
        print(f"  {nbytes:>8,} B {shape}")
    assert measured["bytes"] == planned + probs + norms + rope
