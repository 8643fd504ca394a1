"""Which HF tensor(s) each Megatron parameter holds, and how a TP shard is cut from / glued back to them.

Rules (REFERENCE.md §3):
* ``linear_qkv`` rows are grouped per query group: [q (heads/groups * head_dim); k; v] for each
  group. TP ranks hold contiguous row ranges of that grouped tensor (also when TP > groups).
* ``linear_fc1`` holds per TP rank [gate shard; up shard].
* column-parallel layers and the embedding shard dim 0, row-parallel (``linear_proj``,
  ``linear_fc2``) dim 1; norms and the value head are replicated.
* the embedding / output layer have ``padded_vocab`` rows; rows past the real vocabulary are zero on
  load and dropped on export.
* MoE layers (models/moe.py): the router is replicated; each expert's fc1 (gate|up) / fc2 are split like a
  dense MLP's, but over the expert-tensor-parallel group (ETP), and only the EP rank that owns the
  expert holds it (``TensorGroup.expert``). Local expert i is global expert ``EP rank * E / EP + i``, its
  weights ``experts.local_experts.<i>.linear_fc1.weight`` (SequentialMLP) or ``experts.linear_fc1.weight<i>``
  (TEGroupedMLP), the same shard either way (models/moe_experts.py: ``expert_weight``). A shared expert
  (Qwen2-MoE) is split over TP like a dense MLP (Megatron's ``SharedExpertMLP``) and its sigmoid gate
  [1, hidden] is replicated. Dense layers of an MoE model (``MoESpec.is_moe_layer``) map like a dense model's.
  DeepSeek-V3's router bias (``e_score_correction_bias``) is the router's ``expert_bias`` buffer, replicated.
* Names: the groups are built in a text model's checkpoint names (``model.embed_tokens``, ``model.layers.{i}.``,
  ``model.norm``); ``hf_tensor_groups`` and ``chunk_mappings`` hand them out in the checkpoint's own
  (``checkpoint_group``): Qwen3-VL's language model is ``model.language_model.*`` (models/vision.py
  ``language_prefix``), the names transformers' Qwen3VLForConditionalGeneration and the rollout engines load.
* Multi-latent attention (models/mla.py): one HF tensor per Megatron weight, the same row order; the projections
  column-parallel but the down projections (q_a, kv_a: whole on every TP rank, models/mla_layers.py), o_proj
  row-parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.lora import LoRAAdapter, adapter_of
from megatron_rl.models.mla import mla_attention_tensors
from megatron_rl.models.moe import local_experts
from megatron_rl.models.moe_experts import expert_weight
from megatron_rl.models.value_head import ValueHead
from megatron_rl.models.vision_model import vision_tensor_shapes


class Kind(Enum):
    REPLICATED = "replicated"
    COLUMN = "column"  # dim 0 split across TP
    ROW = "row"  # dim 1 split across TP
    VOCAB = "vocab"  # dim 0 split across TP, padded past the real vocabulary
    QKV = "qkv"
    GATE_UP = "gate_up"
    # dim 0 split across TP, the two halves of dim 1 swapped: MiMo's MTP input_proj takes [hidden | embedding],
    # Megatron's eh_proj [embedding | hidden] (models/mtp.py)
    COLUMN_SWAPPED_INPUTS = "column_swapped_inputs"


@dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorGroup:
    """One Megatron parameter's worth of HF tensors (q/k/v and gate/up come in groups)."""

    kind: Kind
    tensors: tuple[HFTensor, ...]
    expert: int | None = None  # global expert index of an MoE expert's tensors (split over ETP, owned by one EP rank)

    @property
    def key(self) -> str:
        return self.tensors[0].name


@dataclass(frozen=True)
class ParamMapping:
    """A local Megatron parameter and the HF tensors it is a shard of."""

    param: torch.nn.Parameter
    group: TensorGroup
    export: bool = True  # False for the tied output-layer copy on the last stage
    load: bool = True  # False for the checkpoint's copies of a weight held once (DeepSeek's MTP embed / head)
    adapter: LoRAAdapter | None = None  # a LoRA adapter on this (frozen) weight: exported merged

    def value(self) -> torch.Tensor:
        """What is exported: the weight, with its LoRA adapter merged in (W + alpha / r B A) when it has one."""
        return self.param.detach() if self.adapter is None else self.adapter.merged(self.param)


def _moe_groups(hf: HFModelConfig, i: int, experts: range) -> dict[str, TensorGroup]:
    """Router and the ``experts``' fc1/fc2 groups of MoE layer ``i``, keyed by role."""
    moe, h, f = hf.moe, hf.hidden_size, hf.moe.ffn_hidden_size
    groups = {"router": TensorGroup(Kind.REPLICATED, (HFTensor(moe.router_name(i), (moe.num_experts, h)),))}
    if moe.expert_bias:  # DeepSeek-V3's e_score_correction_bias: Megatron's Router.expert_bias buffer
        groups["router_bias"] = _single(Kind.REPLICATED, moe.router_bias_name(i), (moe.num_experts,))
    for e in experts:
        gate, up = (HFTensor(moe.expert_name(i, e, role), (f, h)) for role in ("gate", "up"))
        groups[f"expert{e}.gate_up"] = TensorGroup(Kind.GATE_UP, (gate, up), expert=e)
        groups[f"expert{e}.down"] = TensorGroup(
            Kind.ROW, (HFTensor(moe.expert_name(i, e, "down"), (h, f)),), expert=e
        )
    if moe.shared_expert_size is not None:  # after the experts, as HF's block holds them
        s = moe.shared_expert_size
        gate, up = (HFTensor(moe.shared_expert_name(i, role), (s, h)) for role in ("gate", "up"))
        groups["shared.gate_up"] = TensorGroup(Kind.GATE_UP, (gate, up))
        groups["shared.down"] = _single(Kind.ROW, moe.shared_expert_name(i, "down"), (h, s))
        if moe.shared_expert_gate:
            score = moe.shared_expert_name(i, "gate_score")
            groups["shared.gate_score"] = _single(Kind.REPLICATED, score, (1, h))
    return groups


def _layer_groups(
    hf: HFModelConfig, i: int, experts: range | None = None, prefix: str | None = None, moe: bool | None = None
) -> dict[str, TensorGroup]:
    """HF groups of layer ``i`` keyed by role, in HF's own order; of an MoE layer's experts only
    ``experts`` (default all). ``prefix`` (default ``model.layers.{i}.``) and ``moe`` (default: the model's
    layer pattern) for an MTP layer's decoder layer (models/mtp.py)."""
    p, h = prefix or f"model.layers.{i}.", hf.hidden_size

    def qkv(suffix: str, *rest: int) -> tuple[HFTensor, ...]:
        sizes = (("q_proj", hf.q_size), ("k_proj", hf.kv_size), ("v_proj", hf.kv_size))
        return tuple(HFTensor(f"{p}self_attn.{proj}.{suffix}", (size, *rest)) for proj, size in sizes)

    groups = {"input_norm": TensorGroup(Kind.REPLICATED, (HFTensor(f"{p}input_layernorm.weight", (h,)),))}
    if hf.mla is not None:
        for role, name, shape, split in mla_attention_tensors(hf.mla, i, h, hf.num_attention_heads):
            groups[role] = _single(Kind(split), name, shape)
        return _mlp_groups(hf, i, experts, groups, p, moe)
    groups["qkv"] = TensorGroup(Kind.QKV, qkv("weight", h))
    if hf.qkv_bias:
        groups["qkv_bias"] = TensorGroup(Kind.QKV, qkv("bias"))
    if hf.qk_norm:
        groups["q_norm"] = TensorGroup(
            Kind.REPLICATED, (HFTensor(f"{p}self_attn.q_norm.weight", (hf.head_dim,)),)
        )
        groups["k_norm"] = TensorGroup(
            Kind.REPLICATED, (HFTensor(f"{p}self_attn.k_norm.weight", (hf.head_dim,)),)
        )
    groups["o_proj"] = TensorGroup(Kind.ROW, (HFTensor(f"{p}self_attn.o_proj.weight", (h, hf.q_size)),))
    return _mlp_groups(hf, i, experts, groups, p, moe)


def _mlp_groups(
    hf: HFModelConfig, i: int, experts: range | None, groups: dict[str, TensorGroup], p: str, moe: bool | None
) -> dict[str, TensorGroup]:
    """``groups`` (layer ``i``'s attention) followed by its post-attention norm and MLP (dense or MoE)."""
    h, f = hf.hidden_size, hf.intermediate_size
    groups["post_norm"] = TensorGroup(
        Kind.REPLICATED, (HFTensor(f"{p}post_attention_layernorm.weight", (h,)),)
    )
    if moe is None:
        moe = hf.moe is not None and hf.moe.is_moe_layer(i)
    if moe:
        return {**groups, **_moe_groups(hf, i, range(hf.moe.num_experts) if experts is None else experts)}
    groups["gate_up"] = TensorGroup(
        Kind.GATE_UP,
        (HFTensor(f"{p}mlp.gate_proj.weight", (f, h)), HFTensor(f"{p}mlp.up_proj.weight", (f, h))),
    )
    groups["down"] = TensorGroup(Kind.ROW, (HFTensor(f"{p}mlp.down_proj.weight", (h, f)),))
    return groups


def _single(kind: Kind, name: str, shape: tuple[int, ...]) -> TensorGroup:
    return TensorGroup(kind, (HFTensor(name, shape),))


def embedding_group(hf: HFModelConfig) -> TensorGroup:
    return _single(Kind.VOCAB, "model.embed_tokens.weight", (hf.vocab_size, hf.hidden_size))


def head_groups(hf: HFModelConfig, value_head: bool) -> list[TensorGroup]:
    """Groups after the final norm: lm_head (untied causal LM), score (value model; a sequence-classification
    reward model has no score.bias), or none (tied)."""
    if value_head:
        score = [_single(Kind.REPLICATED, "score.weight", (1, hf.hidden_size))]
        return score if hf.sequence_classifier else score + [_single(Kind.REPLICATED, "score.bias", (1,))]
    if hf.tie_word_embeddings:
        return []
    return [_single(Kind.VOCAB, "lm_head.weight", (hf.vocab_size, hf.hidden_size))]


def _mtp_groups(hf: HFModelConfig, k: int, experts: range | None = None) -> dict[str, TensorGroup]:
    """HF groups of MTP layer ``k`` keyed by role (models/mtp.py): its norms and projection, its decoder layer
    (roles ``layer.<role>``), its final norm, then the checkpoint's copies of the embedding and lm_head."""
    mtp, h = hf.mtp, hf.hidden_size
    names = mtp.tensor_names(k)
    eh_kind = Kind.COLUMN_SWAPPED_INPUTS if mtp.mimo_naming else Kind.COLUMN
    groups = {
        "enorm": _single(Kind.REPLICATED, names["enorm"], (h,)),
        "hnorm": _single(Kind.REPLICATED, names["hnorm"], (h,)),
        "eh_proj": _single(eh_kind, names["eh_proj"], (h, 2 * h)),
    }
    layer = _layer_groups(hf, mtp.hf_index(k), experts, prefix=mtp.prefix(k), moe=mtp.moe_layer)
    groups |= {f"layer.{role}": group for role, group in layer.items()}
    groups["final_norm"] = _single(Kind.REPLICATED, names["final_norm"], (h,))
    copies = mtp.shared_copies(k, hf.tie_word_embeddings)
    groups |= {f"copy.{role}": _single(Kind.VOCAB, name, (hf.vocab_size, h)) for role, name in copies.items()}
    return groups


def hf_tensor_groups(hf: HFModelConfig, value_head: bool = False, mtp: bool = True) -> list[TensorGroup]:
    """Every HF tensor group of the model in checkpoint order (embedding, layers, norm, head, then the MTP layers
    the model builds, unless ``mtp=False``: what the engines that do not draft with them get)."""
    groups = [embedding_group(hf)]
    groups += _vision_groups(hf).values()
    for i in range(hf.num_layers):
        groups += _layer_groups(hf, i).values()
    groups.append(_single(Kind.REPLICATED, "model.norm.weight", (hf.hidden_size,)))
    groups += head_groups(hf, value_head)
    if mtp and hf.mtp is not None and not value_head:
        for k in range(hf.mtp.num_layers):
            groups += _mtp_groups(hf, k).values()
    return [checkpoint_group(hf, g) for g in groups]


def checkpoint_group(hf: HFModelConfig, group: TensorGroup) -> TensorGroup:
    """``group`` under the checkpoint's names: a vision-language model's language tensors named ``model.*`` as a
    text model's are moved under its ``language_prefix`` (Qwen3-VL: ``model.language_model.``); the tower's
    (already under ``vision_prefix``), the head's (``lm_head``, ``score``) and every text model's stay."""
    spec = hf.vision
    if spec is None or spec.language_prefix == "model." or not group.key.startswith("model.") \
            or group.key.startswith(spec.vision_prefix):
        return group
    return replace(group, tensors=tuple(replace(t, name=spec.language_prefix + t.name.removeprefix("model."))
                                        for t in group.tensors))


def _vision_groups(hf: HFModelConfig) -> dict[str, TensorGroup]:
    """A vision-language model's vision tower, by parameter name inside the tower: whole on every TP rank."""
    if hf.vision is None:
        return {}
    prefix = hf.vision.vision_prefix
    return {name: _single(Kind.REPLICATED, prefix + name, shape) for name, shape in vision_tensor_shapes(hf.vision).items()}


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def has_value_head(chunks: list[torch.nn.Module]) -> bool:
    return any(isinstance(getattr(unwrap(c), "output_layer", None), ValueHead) for c in chunks)


def is_value_model(model_chunks: list[torch.nn.Module]) -> bool:
    """Whether the model has a value head, agreed across pipeline stages (collective over PP)."""
    flag = torch.tensor([float(has_value_head(model_chunks))])
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        if dist.get_backend(pp_group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pp_group)
    return bool(flag.item())


def _norm_weight(norm_module: torch.nn.Module, fused_owner: torch.nn.Module) -> torch.nn.Parameter:
    """Local spec: a separate norm module; TE spec: the norm is fused into the next linear layer."""
    weight = getattr(norm_module, "weight", None)
    return weight if weight is not None else fused_owner.layer_norm_weight


def _moe_params(mlp: torch.nn.Module, experts: range) -> dict[str, torch.nn.Parameter]:
    """The router, local experts (SequentialMLP or TEGroupedMLP) and shared expert of a Megatron MoELayer,
    by the roles of ``_moe_groups``."""
    params = {"router": mlp.router.weight}
    if mlp.router.expert_bias is not None:  # a buffer: loaded and exported, never given a gradient
        params["router_bias"] = mlp.router.expert_bias
    held = mlp.experts.num_local_experts
    if held != len(experts):
        raise ValueError(f"{type(mlp.experts).__name__} holds {held} local experts, this EP rank owns "
                         f"{len(experts)} (experts {experts.start}..{experts.stop - 1})")
    for local, e in enumerate(experts):
        params[f"expert{e}.gate_up"] = expert_weight(mlp.experts, local, "linear_fc1")
        params[f"expert{e}.down"] = expert_weight(mlp.experts, local, "linear_fc2")
    shared = mlp.shared_experts
    if shared is not None:
        params["shared.gate_up"] = shared.linear_fc1.weight
        params["shared.down"] = shared.linear_fc2.weight
        params["shared.gate_score"] = shared.gate_weight
    return params


def _mlp_adapters(mlp: torch.nn.Module, role_prefix: str) -> dict[str, LoRAAdapter | None]:
    """The LoRA adapters of an MLP's fc1 / fc2 by the roles of ``_layer_groups`` / ``_moe_groups``."""
    return {f"{role_prefix}gate_up": adapter_of(mlp, "linear_fc1"), f"{role_prefix}down": adapter_of(mlp, "linear_fc2")}


def _moe_adapters(mlp: torch.nn.Module, experts: range) -> dict[str, LoRAAdapter | None]:
    """The adapters of an MoE layer's local experts (SequentialMLP: grouped experts have none) and shared expert."""
    adapters: dict[str, LoRAAdapter | None] = {}
    for local, expert_mlp in enumerate(getattr(mlp.experts, "local_experts", ())):
        adapters |= _mlp_adapters(expert_mlp, f"expert{experts[local]}.")
    if mlp.shared_experts is not None:
        adapters |= _mlp_adapters(mlp.shared_experts, "shared.")
    return adapters


def _mla_params(layer: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """An MLASelfAttention layer's weights by the roles of ``mla_attention_tensors``. The local spec has separate
    norm modules; TE's fuses q_layernorm / kv_layernorm into linear_q_up_proj / linear_kv_up_proj."""
    attn = layer.self_attention
    params = {"input_norm": layer.input_layernorm.weight}
    if attn.config.q_lora_rank is None:
        params["q_proj"] = attn.linear_q_proj.weight
    else:
        params["q_down"] = attn.linear_q_down_proj.weight
        params["q_norm"] = _norm_weight(attn.q_layernorm, attn.linear_q_up_proj)
        params["q_up"] = attn.linear_q_up_proj.weight
    params["kv_down"] = attn.linear_kv_down_proj.weight
    params["kv_norm"] = _norm_weight(attn.kv_layernorm, attn.linear_kv_up_proj)
    params["kv_up"] = attn.linear_kv_up_proj.weight
    params["o_proj"] = attn.linear_proj.weight
    return params


# the roles of mla_attention_tensors and the Megatron linears whose LoRA adapters they export merged
_MLA_ADAPTED = {"q_proj": "linear_q_proj", "q_down": "linear_q_down_proj", "q_up": "linear_q_up_proj",
                "kv_down": "linear_kv_down_proj", "kv_up": "linear_kv_up_proj", "o_proj": "linear_proj"}


def _mla_adapters(attn: torch.nn.Module) -> dict[str, LoRAAdapter | None]:
    """An MLASelfAttention's LoRA adapters by the roles of ``mla_attention_tensors``: each sharded as its weight
    (the down projections' whole on every TP rank, the up projections' B by rows, o_proj's A by columns), so the
    merge is done shard by shard and glued back as the weight is."""
    return {role: adapter_of(attn, linear) for role, linear in _MLA_ADAPTED.items()}


def chunk_mappings(chunk: torch.nn.Module) -> list[ParamMapping]:
    """Mappings for the parameters this model chunk holds (of MoE layers: the local experts), in checkpoint order."""
    model = unwrap(chunk)
    hf: HFModelConfig = model.hf_config
    mappings: list[ParamMapping] = []
    if model.pre_process:
        mappings.append(ParamMapping(model.embedding.word_embeddings.weight, embedding_group(hf)))
        vision = _vision_groups(hf)
        mappings += [ParamMapping(p, vision[name]) for name, p in model.vision.named_parameters()] if vision else []
    experts = None
    if hf.moe is not None:
        experts = local_experts(
            hf.moe,
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_rank(),
        )
    for layer in model.decoder.layers:
        index = layer.layer_number - 1
        groups = _layer_groups(hf, index, experts)
        moe_layer = experts is not None and hf.moe.is_moe_layer(index)
        mappings += _decoder_layer_mappings(hf, layer, groups, experts, moe_layer)
    if model.post_process:
        mappings += _head_mappings(model, hf)
    if getattr(model, "mtp_process", False):
        mappings += _mtp_mappings(model, hf, experts)
    return [m if (g := checkpoint_group(hf, m.group)) is m.group else replace(m, group=g) for m in mappings]


def _decoder_layer_mappings(
    hf: HFModelConfig, layer: torch.nn.Module, groups: dict[str, TensorGroup], experts: range | None, moe_layer: bool
) -> list[ParamMapping]:
    """A Megatron TransformerLayer's parameters against ``groups`` (its HF groups by role)."""
    attn, mlp = layer.self_attention, layer.mlp
    if hf.mla is not None:
        params = _mla_params(layer)
    else:
        params = {
            "input_norm": _norm_weight(layer.input_layernorm, attn.linear_qkv),
            "qkv": attn.linear_qkv.weight,
            "qkv_bias": attn.linear_qkv.bias if hf.qkv_bias else None,
            "q_norm": attn.q_layernorm.weight if hf.qk_norm else None,
            "k_norm": attn.k_layernorm.weight if hf.qk_norm else None,
            "o_proj": attn.linear_proj.weight,
        }
    if moe_layer:
        params["post_norm"] = layer.pre_mlp_layernorm.weight  # never fused into the MoE layer
        params.update(_moe_params(mlp, experts))
    else:
        params["post_norm"] = _norm_weight(layer.pre_mlp_layernorm, mlp.linear_fc1)
        params["gate_up"] = mlp.linear_fc1.weight
        params["down"] = mlp.linear_fc2.weight
    adapters = _mla_adapters(attn) if hf.mla is not None else \
        {"qkv": adapter_of(attn, "linear_qkv"), "o_proj": adapter_of(attn, "linear_proj")}
    adapters |= _moe_adapters(mlp, experts) if moe_layer else _mlp_adapters(mlp, "")
    return [ParamMapping(params[role], group, adapter=adapters.get(role)) for role, group in groups.items()]


def _head_mappings(model: torch.nn.Module, hf: HFModelConfig) -> list[ParamMapping]:
    """The last stage's final norm and head."""
    mappings = [ParamMapping(model.decoder.final_layernorm.weight,
                             _single(Kind.REPLICATED, "model.norm.weight", (hf.hidden_size,)))]
    head = model.output_layer
    if isinstance(head, ValueHead):
        params = (head.weight,) if head.bias is None else (head.weight, head.bias)
        mappings += [ParamMapping(p, g) for p, g in zip(params, head_groups(hf, value_head=True), strict=True)]
    elif not hf.tie_word_embeddings:
        mappings.append(ParamMapping(head.weight, head_groups(hf, value_head=False)[0]))
    elif head.weight is not None:
        # Tied, on a later stage than the embedding: a copy that loads but is not exported.
        mappings.append(ParamMapping(head.weight, embedding_group(hf), export=False))
    return mappings


def _mtp_mappings(model: torch.nn.Module, hf: HFModelConfig, experts: range | None) -> list[ParamMapping]:
    """The MTP layers (Megatron's ``model.mtp.layers``, on the last stage) against their HF groups. The
    checkpoint's embedding / lm_head copies export the shared weights under their names and load nothing."""
    mappings = []
    for k, mtp_layer in enumerate(model.mtp.layers):
        groups = _mtp_groups(hf, k, experts)
        own = {"enorm": mtp_layer.enorm.weight, "hnorm": mtp_layer.hnorm.weight, "eh_proj": mtp_layer.eh_proj.weight,
               "final_norm": mtp_layer.final_layernorm.weight}
        mappings += [ParamMapping(own[role], groups[role]) for role in own]
        layer_groups = {role.removeprefix("layer."): g for role, g in groups.items() if role.startswith("layer.")}
        moe_layer = experts is not None and hf.mtp.moe_layer
        mappings += _decoder_layer_mappings(hf, mtp_layer.transformer_layer, layer_groups, experts, moe_layer)
        shared = {"embedding": model.embedding.word_embeddings.weight,
                  "head": model.embedding.word_embeddings.weight if hf.tie_word_embeddings else model.output_layer.weight}
        mappings += [ParamMapping(shared[role.removeprefix("copy.")], g, load=False)
                     for role, g in groups.items() if role.startswith("copy.")]
    if not model.pre_process:  # Megatron's copy of the embedding on the MTP stage, kept equal to the first stage's
        mappings.append(ParamMapping(model.embedding.word_embeddings.weight, embedding_group(hf), export=False))
    return mappings


# ---------------------------------------------------------------- HF -> local shard


def _swap_input_halves(weight: torch.Tensor) -> torch.Tensor:
    """[out, 2h] with inputs [a | b] -> [b | a] (its own inverse)."""
    a, b = weight.chunk(2, dim=1)
    return torch.cat([b, a], dim=1)

Reader = Callable[[str, int | None, int, int | None], torch.Tensor]


def _qkv_shard(hf: HFModelConfig, group: TensorGroup, read: Reader, rank: int, size: int) -> torch.Tensor:
    q_per_group = hf.num_attention_heads // hf.num_key_value_heads
    group_rows = (q_per_group + 2) * hf.head_dim
    total = group_rows * hf.num_key_value_heads
    start, stop = rank * total // size, (rank + 1) * total // size
    first, last = start // group_rows, -(-stop // group_rows)  # the query groups this range touches
    n = last - first
    q_name, k_name, v_name = (t.name for t in group.tensors)
    q = read(q_name, 0, first * q_per_group * hf.head_dim, last * q_per_group * hf.head_dim)
    k = read(k_name, 0, first * hf.head_dim, last * hf.head_dim)
    v = read(v_name, 0, first * hf.head_dim, last * hf.head_dim)
    rest = q.shape[1:]
    grouped = torch.cat([q.view(n, -1, *rest), k.view(n, -1, *rest), v.view(n, -1, *rest)], dim=1)
    offset = first * group_rows
    return grouped.reshape(n * group_rows, *rest)[start - offset : stop - offset]


def shard_from_hf(
    hf: HFModelConfig, group: TensorGroup, read: Reader, rank: int, size: int, local_rows: int
) -> torch.Tensor:
    """This TP rank's shard of ``group``, reading only the rows/columns it needs."""
    kind, first = group.kind, group.tensors[0]
    if kind is Kind.REPLICATED:
        return read(first.name, None, 0, None)
    if kind is Kind.COLUMN:
        rows = first.shape[0] // size
        return read(first.name, 0, rank * rows, (rank + 1) * rows)
    if kind is Kind.ROW:
        cols = first.shape[1] // size
        return read(first.name, 1, rank * cols, (rank + 1) * cols)
    if kind is Kind.VOCAB:
        start = rank * local_rows
        real = read(first.name, 0, min(start, first.shape[0]), min(start + local_rows, first.shape[0]))
        pad = real.new_zeros(local_rows - real.shape[0], *real.shape[1:])
        return torch.cat([real, pad]) if pad.shape[0] else real
    if kind is Kind.GATE_UP:
        rows = first.shape[0] // size
        return torch.cat([read(t.name, 0, rank * rows, (rank + 1) * rows) for t in group.tensors])
    if kind is Kind.QKV:
        return _qkv_shard(hf, group, read, rank, size)
    if kind is Kind.COLUMN_SWAPPED_INPUTS:
        rows = first.shape[0] // size
        return _swap_input_halves(read(first.name, 0, rank * rows, (rank + 1) * rows))
    raise AssertionError(kind)


# ---------------------------------------------------------------- TP shards -> HF tensors


def hf_from_shards(hf: HFModelConfig, group: TensorGroup, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full HF tensors of ``group`` from all TP shards of its parameter (one shard if replicated)."""
    kind = group.kind
    if kind is Kind.REPLICATED:
        return [shards[0]]
    if kind is Kind.COLUMN:
        return [torch.cat(shards, dim=0)]
    if kind is Kind.ROW:
        return [torch.cat(shards, dim=1)]
    if kind is Kind.VOCAB:
        return [torch.cat(shards, dim=0)[: group.tensors[0].shape[0]]]
    if kind is Kind.COLUMN_SWAPPED_INPUTS:
        return [_swap_input_halves(torch.cat(shards, dim=0))]
    if kind is Kind.GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if kind is Kind.QKV:
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        q_rows = hf.num_attention_heads // hf.num_key_value_heads * hf.head_dim
        grouped = full.view(hf.num_key_value_heads, -1, *rest)
        q, k, v = grouped.split([q_rows, hf.head_dim, hf.head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    raise AssertionError(kind)
