"""Rank jobs of test_deepseek_v3.py and test_glm4_moe.py (importable by spawned ranks): logits and export of tiny
checkpoints at several (TP, EP) layouts (``layout_checks``, with each family's own checks at the first), the router
bias of DeepSeek-V3, and transformers' reference logits; of test_deepseek_v3_grads.py and test_glm4_moe_grads.py: one MoE
layer's gradients at several (TP, EP) layouts (``layer_grads``), and the helpers those tests run in their own process
(transformers' gradients, the comparison)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_testing.tiny_models import padded_batch as batch


def _packed_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits of the rows' real tokens laid end to end in one THD pack ([T, vocab], the rows in order)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = attention_mask.sum(-1)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).int()
    tokens = input_ids[attention_mask.bool()][None, :]
    positions = torch.cat([torch.arange(int(n)) for n in lengths])[None, :]
    longest = int(lengths.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    model.eval()
    with torch.no_grad():
        return model(tokens, positions, None, packed_seq_params=params)[0, :, : model.hf_config.vocab_size]


def layout_checks(dirs: dict[str, str], layouts: list[tuple[int, int, int, int | None]],
                  first_layout: Callable[[str, list, dict[str, Any]], None]) -> dict[str, Any]:
    """For each (TP, PP, EP, ETP) layout (ETP None = TP) and each checkpoint whose layer count PP divides: gathered
    logits (last stage) and every exported tensor; at TP=2 the logits under sequence parallelism; at the first
    layout ``first_layout(name, chunks, out)`` records a family's own checks (and the THD-packed logits here)."""
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, compute_full_logits
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.weights import export_hf_weights

    input_ids, attention_mask = batch()
    out: dict[str, Any] = {"logits": {}, "export": {}, "packed": {}}
    for tp, pp, ep, etp in layouts:
        init_model_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
        for name, directory in dirs.items():
            if load_hf_config(directory).num_layers % pp:
                continue
            chunks = build_from_hf(directory)
            logits = compute_full_logits(chunks, input_ids, attention_mask)
            if logits is not None:  # the last pipeline stage
                out["logits"][name, tp, pp, ep] = logits
            out["export"][name, tp, pp, ep] = [(n, t.clone()) for n, t in export_hf_weights(chunks)]
            if tp > 1 and pp == 1 and ep == 1:  # sequence parallel: MLA gathers / scatters its latents itself
                sp_chunks = build_from_hf(directory, sequence_parallel=True)
                out["logits"][name, tp, pp, ep, "sp"] = compute_full_logits(sp_chunks, input_ids, attention_mask)
            if (tp, pp, ep, etp) == layouts[0]:
                out["packed"][name] = _packed_logits(chunks[0], input_ids, attention_mask)
                first_layout(name, chunks, out)
    return out


def deepseek_checks(
    dirs: dict[str, str], layouts: list[tuple[int, int, int, int | None]], with_mtp: str
) -> dict[str, Any]:
    """``layout_checks``, and at the first layout how the router bias is held (requires_grad, gradient after a
    training backward), whether shared prompts' RoPE refuses the model, and the logits of ``with_mtp`` (the q_lora checkpoint
    plus stored multi-token-prediction tensors)."""
    from megatron_rl.models import build_from_hf, causal_padding_mask, compute_full_logits, position_ids_from_mask
    from megatron_rl.models.rope_positions import check_rope_positions

    input_ids, attention_mask = batch()

    def first_layout(name: str, chunks: list, out: dict[str, Any]) -> None:
        if name == "q_lora":  # the same checkpoint with a multi-token-prediction layer stored
            out["logits"]["q_lora_mtp"] = compute_full_logits(build_from_hf(with_mtp), input_ids, attention_mask)
        model = chunks[0]
        model.train()
        logits = model(input_ids, position_ids_from_mask(attention_mask), causal_padding_mask(attention_mask))
        (logits * attention_mask[..., None]).sum().backward()
        try:  # shared prompts (RoPE at given positions): a refusal is recorded
            check_rope_positions(model)
        except ValueError as err:
            out.setdefault("rope_positions", {})[name] = str(err)
        router = model.decoder.layers[1].mlp.router
        out.setdefault("router_bias", {})[name] = dict(
            is_parameter=any(p is router.expert_bias for p in model.parameters()),
            requires_grad=router.expert_bias.requires_grad,
            grad=router.expert_bias.grad,
            router_weight_grad_nonzero=bool(router.weight.grad.abs().sum() > 0),
        )

    return layout_checks(dirs, layouts, first_layout)


@functools.cache
def hf_logits(directory: str) -> torch.Tensor:
    """transformers' fp32 logits of the test batch for the checkpoint in ``directory`` (the reference)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.api import position_ids_from_mask

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    input_ids, attention_mask = batch()
    with torch.no_grad():
        return model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
        ).logits


def assert_logits_match(dirs: dict[str, str], results: list[dict[str, Any]], name: str, tp: int, pp: int, ep: int,
                        tolerance: float) -> None:
    """Every last-stage rank's logits of ``name`` at (TP, PP, EP) equal transformers' over the real tokens."""
    expected = hf_logits(dirs[name])
    valid = batch()[1].bool()
    last_stage = [r["logits"][name, tp, pp, ep] for r in results if (name, tp, pp, ep) in r["logits"]]
    assert len(last_stage) == 2 // pp
    for logits in last_stage:
        assert logits.shape == expected.shape
        diff = (logits - expected)[valid].abs().max().item()
        print(f"{name} TP={tp} PP={pp} EP={ep}: max |logit diff| {diff:.2e}")
        assert diff <= tolerance, f"{name} TP={tp} PP={pp} EP={ep}: max |logit diff| {diff:.2e}"


# ---------------------------------------------------------------- gradients of one MoE layer across layouts

GRAD_LAYER = 1  # the first MoE layer of the tiny checkpoints (first_k_dense_replace=1), not the last layer


def gradient_loss(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The fixed scalar every layout (and transformers) back-propagates: the mean negative log-softmax of fixed
    random target tokens over the batch's real tokens ([B, T, >= vocab] logits, vocabulary padding dropped)."""
    input_ids, attention_mask = batch()
    targets = torch.randint(0, vocab_size, input_ids.shape, generator=torch.Generator().manual_seed(7))
    log_probs = torch.log_softmax(logits[..., :vocab_size].float(), dim=-1)
    picked = log_probs.gather(-1, targets[..., None])[..., 0]
    valid = attention_mask.to(picked.dtype)
    return -(picked * valid).sum() / valid.sum()


def _full_layer_grads(model, layer: int) -> dict[str, Any]:
    """The gradients (DDP main_grad, after finalize_model_grads) of every parameter of ``layer`` as full HF-named
    tensors: TP shards gathered over the TP group (experts: the expert-TP group) and laid out as the checkpoint's
    tensors by the weight layout's groups; experts by their global index, on the EP rank that owns them. Also the
    layer's parameters no group covers, and how the router's expert bias is held."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl.models.layout import Kind, chunk_mappings, hf_from_shards

    prefix = f"model.layers.{layer}."
    module = model.decoder.layers[layer]
    router = module.mlp.router
    grads: dict[str, torch.Tensor] = {}
    covered = set()
    for mapping in chunk_mappings(model):
        if not mapping.group.key.startswith(prefix) or mapping.param is router.expert_bias:
            continue
        covered.add(id(mapping.param))
        grad = mapping.param.main_grad.detach().clone()
        shards = [grad]
        if mapping.group.kind is not Kind.REPLICATED:
            group = (parallel_state.get_expert_tensor_parallel_group() if mapping.group.expert is not None
                     else parallel_state.get_tensor_model_parallel_group())
            shards = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, grad.contiguous(), group=group)
        for tensor, full in zip(mapping.group.tensors, hf_from_shards(model.hf_config, mapping.group, shards),
                                strict=True):
            assert tuple(full.shape) == tuple(tensor.shape), (tensor.name, full.shape, tensor.shape)
            grads[tensor.name] = full.contiguous()
    return {
        "grads": grads,
        "uncovered": [n for n, p in module.named_parameters() if id(p) not in covered],
        "expert_bias": dict(is_parameter=any(p is router.expert_bias for p in model.parameters()),
                            requires_grad=router.expert_bias.requires_grad, grad=router.expert_bias.grad),
    }


def layer_grads(dirs: dict[str, str], layouts: list[tuple[int, int, int | None]],
                layer: int = GRAD_LAYER) -> dict[tuple[str, int, int], dict[str, Any]]:
    """For each (TP, EP, ETP) layout (ETP None = TP; sequence parallel at TP > 1, as MoE training requires) and
    each checkpoint: one training forward + backward of ``gradient_loss`` through Megatron's DDP wrapper as the
    engine sets it up (gradients summed over DP, each DP rank back-propagating its 1 / DP share of the loss: every
    rank holds the whole batch), finalize_model_grads, then ``layer``'s full gradients (``_full_layer_grads``)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
        finalize_model_grads

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, causal_padding_mask, position_ids_from_mask

    input_ids, attention_mask = batch()
    out: dict[tuple[str, int, int], dict[str, Any]] = {}
    for tp, ep, etp in layouts:
        init_model_parallel(tp=tp, ep=ep, etp=etp)
        dp = parallel_state.get_data_parallel_world_size()
        for name, directory in dirs.items():
            model = build_from_hf(directory, sequence_parallel=tp > 1)[0]
            model.config.calculate_per_token_loss = True  # as the engine: DDP sums over DP, no rescaling
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                          model)
            ddp.train()
            ddp.zero_grad_buffer()
            logits = ddp(input_ids, position_ids_from_mask(attention_mask), causal_padding_mask(attention_mask),
                         runtime_gather_output=True)
            loss = gradient_loss(logits, model.hf_config.vocab_size)
            (loss / dp).backward()
            finalize_model_grads([ddp], None)
            out[name, tp, ep] = {"loss": loss.item(), **_full_layer_grads(model, layer)}
    return out


def hf_layer_grads(directory: str, layer: int = GRAD_LAYER) -> dict[str, torch.Tensor]:
    """transformers' gradients of ``gradient_loss`` for ``layer``'s parameters, by checkpoint name (run in the test
    process): transformers 5 holds the experts fused ([E, 2 x ffn, hidden] gate|up and [E, hidden, ffn] down), split
    here into the checkpoint's per-expert tensors."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models import position_ids_from_mask

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    input_ids, attention_mask = batch()
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask)).logits
    gradient_loss(logits, model.config.vocab_size).backward()
    prefix, grads = f"model.layers.{layer}.", {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if not name.startswith(prefix):
            continue
        if name == f"{prefix}mlp.experts.gate_up_proj":
            for e, (gate, up) in enumerate(g.chunk(2, dim=0) for g in grad):
                grads[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                grads[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
        elif name == f"{prefix}mlp.experts.down_proj":
            grads.update({f"{prefix}mlp.experts.{e}.down_proj.weight": down for e, down in enumerate(grad)})
        else:
            grads[name] = grad
    return grads


def max_grad_diffs(reference: dict[str, torch.Tensor], ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Max |gradient - reference| per tensor over the ranks holding it (each rank's own copy compared); checks
    that the ranks together hold every reference tensor and nothing else, and that each gradient is non-zero."""
    held = [set(result["grads"]) for result in ranks]
    assert set().union(*held) == set(reference), set().union(*held) ^ set(reference)
    diffs: dict[str, float] = {}
    for result in ranks:
        for name, grad in result["grads"].items():
            assert grad.shape == reference[name].shape, (name, grad.shape, reference[name].shape)
            assert grad.abs().max() > 0, f"{name}: zero gradient"
            diffs[name] = max(diffs.get(name, 0.0), (grad - reference[name]).abs().max().item())
    return diffs


def assert_gradients_close(reference: dict[str, torch.Tensor], ranks: list[dict[str, Any]], label: str,
                           tolerance: float) -> None:
    """Every gradient ``ranks`` hold (full tensors by checkpoint name) equals ``reference``'s within ``tolerance``."""
    diffs = max_grad_diffs(reference, ranks)
    worst = max(diffs, key=diffs.get)
    print(f"{label}: {len(diffs)} gradients, max |grad diff| {diffs[worst]:.2e} ({worst})")
    assert diffs[worst] <= tolerance, {k: v for k, v in diffs.items() if v > tolerance}


def assert_layout_gradients_equal(expected: dict[str, Any], ranks: list[dict[str, Any]], label: str,
                                  tolerance: float) -> None:
    """One layout's ranks against the TP 1 reference: every parameter covered, the same loss, the router bias a
    buffer without gradient, every gradient equal."""
    for held in ranks:
        assert held["uncovered"] == []
        assert abs(held["loss"] - expected["loss"]) <= tolerance
        bias = held["expert_bias"]
        assert not bias["is_parameter"] and not bias["requires_grad"] and bias["grad"] is None
    assert_gradients_close(expected["grads"], ranks, label, tolerance)
