"""LoRA adapters on Megatron's tensor-parallel linears: ``y = W x + (alpha / r) B A dropout(x)``, W frozen.

Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``; an adapter there is one (A, B)
pair per HF part (q, k, v; gate, up), as PEFT has them on ``q_proj``/``k_proj``/... (so a PEFT adapter loads
and saves exactly), and its output is laid out like the fused weight's rows. Each adapter is sharded the
way its base linear is:

- column-parallel base (linear_qkv, linear_fc1): A [r, in] replicated, B [out / TP, r] split like the output;
  the input is the whole sequence (gathered from the TP ranks under sequence parallelism; without dropout, by
  Megatron's column-parallel matmul, which saves the rank's slice for backward and gathers it again there);
- row-parallel base (linear_proj, linear_fc2): A [r, in / TP] split like the input, B [out, r] replicated;
  A's partial products are summed over TP (reduce-scattered along the sequence under sequence parallelism).

A replicated factor whose gradient each TP rank only sees a part of (A of a column-parallel adapter and B
of a row-parallel one under sequence parallelism) is marked ``sequence_parallel`` so that Megatron's
``finalize_model_grads`` sums it over TP, as it does for the norms. Initial values come from one generator
per factor seeded by the layer and part, drawn at full size and then sliced, so every TP/PP layout starts
from the same adapter.

Multi-latent attention (DeepSeek-V3 / Kimi-K2 / Moonlight; models/mla.py, config/lora.py ``mla_linears``): one
(A, B) pair per linear, PEFT's module of the same name. The up projections (linear_q_up_proj / linear_q_proj,
linear_kv_up_proj) are column-parallel and adapted like linear_qkv (B split by head; under sequence parallelism
MLA hands them the rank's slice of the latent, which the column-parallel matmul gathers); linear_proj like GPT's.
The down projections (linear_q_down_proj, linear_kv_down_proj) are whole on every TP rank (models/mla_layers.py
``DuplicatedLinear``), and so are their adapters (A and B replicated, no communication): under sequence
parallelism each rank applies the adapter to its slice of the sequence, so both factors' gradients are partial
and are marked ``sequence_parallel`` for ``finalize_model_grads`` to sum over TP, as the base weight is; without
it every rank sees the whole sequence (the base's own caveat at TP > 1 applies: MoE layers need it to train).

MoE layers: the attention is adapted as above; a targeted ``linear_fc1`` / ``linear_fc2`` means an adapter on
every routed expert's fc1 / fc2 (one per local expert of SequentialMLP, each MLP of the experts) and on the
shared expert's. An expert adapter is split over the expert-tensor-parallel group (ETP) the way its expert is,
and does no communication of its own: inside the experts Megatron's token dispatcher has already gathered each
expert's tokens over ETP and sums the experts' partial outputs and input gradients over ETP itself. Only the
replicated factor's gradient (A of fc1, B of fc2), which each ETP rank sees a part of, is summed over ETP in the
backward. Its parameters are expert-parallel (``allreduce = False``): DDP reduces their gradients over the
expert-data-parallel group and the distributed optimizer shards them there, as it does the experts' own.
Each expert's adapter is seeded by its global expert index, so every EP/ETP layout starts from the same one.

The adapter is a child of the attention / MLP module (``linear_qkv_lora`` next to ``linear_qkv``), not of
the linear itself, whose checkpoint code would save it as replicated; it joins the linear's output through
a forward hook. ``adapters_disabled`` switches every adapter off: the reference policy is the actor without
them.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    linear_with_grad_accumulation_and_async_allreduce,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from megatron_rl.config.lora import lora_targets, mla_linears
from megatron_rl.config.schema import LORA_TARGET_MODULES, LoRAConfig
from megatron_rl.models.moe import local_experts
from megatron_rl.models.moe_experts import is_grouped

TARGETS = LORA_TARGET_MODULES
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
DUPLICATED = ("linear_q_down_proj", "linear_kv_down_proj")  # MLA's down projections: whole on every TP rank
INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
# the parts of each target, and the HF module of each part inside ``model.layers.<i>.`` (PEFT's names) of a
# dense layer; an MoE layer's expert and shared-expert parts are named by the model's MoESpec (expert_hf_modules)
PARTS = {"linear_qkv": ("q", "k", "v"), "linear_proj": ("",), "linear_fc1": ("gate", "up"), "linear_fc2": ("",)}
HF_PARTS = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
    # multi-latent attention's (linear_proj is o_proj there too)
    "linear_q_proj": ("self_attn.q_proj",),
    "linear_q_down_proj": ("self_attn.q_a_proj",),
    "linear_q_up_proj": ("self_attn.q_b_proj",),
    "linear_kv_down_proj": ("self_attn.kv_a_proj_with_mqa",),
    "linear_kv_up_proj": ("self_attn.kv_b_proj",),
}
PARTS.update({target: ("",) for target in HF_PARTS if target not in PARTS})
_EXPERT_ROLES = {"linear_fc1": ("gate", "up"), "linear_fc2": ("down",)}


def _hf_module(tensor_name: str, layer: int) -> str:
    """``model.layers.<layer>.<module>.weight`` -> ``<module>``."""
    return tensor_name.removeprefix(f"model.layers.{layer}.").removesuffix(".weight")


def expert_hf_modules(moe, layer: int, target: str, expert: int | None) -> tuple[str, ...]:
    """HF modules (inside ``model.layers.<layer>.``) of the parts of an MoE layer's ``target`` (linear_fc1 /
    linear_fc2): routed expert ``expert``'s, or the shared expert's when ``expert`` is None."""
    roles = _EXPERT_ROLES[target]
    if expert is None:
        return tuple(_hf_module(moe.shared_expert_name(layer, role), layer) for role in roles)
    return tuple(_hf_module(moe.expert_name(layer, expert, role), layer) for role in roles)


@dataclass(frozen=True)
class LoRASpec:
    """The adapters to build (from ``<role>.model.lora``, whose aliases the config layer has folded)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    # Megatron names or fnmatch patterns of module names, matched by config.lora.lora_targets (as the planner)
    target_modules: tuple[str, ...] = TARGETS
    exclude_modules: tuple[str, ...] = ()
    a_init: str = "xavier"
    b_init: str = "zero"
    dtype: torch.dtype | None = None  # None: the base weight's
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora: LoRAConfig | None, params_dtype: torch.dtype, seed: int = 0) -> LoRASpec | None:
        """The spec of a ``LoRAConfig`` (None when rank is 0: LoRA off)."""
        if lora is None or not lora.rank:
            return None
        dtypes = {None: None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                  "bfloat16": torch.bfloat16}
        alpha = 16.0 if lora.alpha is None else float(lora.alpha)
        return cls(rank=int(lora.rank), alpha=alpha, dropout=float(lora.dropout),
                   target_modules=tuple(lora.target_modules), exclude_modules=tuple(lora.exclude_modules or ()),
                   a_init=lora.lora_A_init_method, b_init=lora.lora_B_init_method,
                   dtype=dtypes[lora.dtype] or params_dtype, seed=seed)


def _init(method: str, shape: tuple[int, int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A full-size factor drawn from its own generator (the same on every rank and layout)."""
    out = torch.empty(shape, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    fan_out, fan_in = shape
    if method == "zero":
        out.zero_()
    elif method == "xavier":
        out.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=generator)
    elif method == "kaiming":  # PEFT's default for A: kaiming_uniform(a=sqrt(5)), bound 1/sqrt(fan_in)
        bound = 1.0 / math.sqrt(fan_in)
        out.uniform_(-bound, bound, generator=generator)
    elif method == "normal":  # PEFT's "gaussian": std 1 / r (r: the factor's short side)
        out.normal_(0.0, 1.0 / min(shape), generator=generator)
    else:
        raise ValueError(f"unknown LoRA init method {method!r}; known: {', '.join(INIT_METHODS)}")
    return out.to(dtype)


def _seed(spec: LoRASpec, layer: int, target: str, part: str, factor: str, expert: int | None = None) -> int:
    where = f"{layer}.{target}.{part}.{factor}" if expert is None else f"{layer}.expert{expert}.{target}.{part}.{factor}"
    return (spec.seed * 1_000_003 + zlib.crc32(where.encode())) % (2**63)


class _SumGradOver(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group`` (an expert adapter's replicated factor,
    of whose gradient each ETP rank computes a part)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class LoRAAdapter(torch.nn.Module):
    """The adapter of one base linear; ``forward(x)`` is what it adds to the linear's output.

    ``hf_modules``: the HF module of each part (PEFT's names, inside ``model.layers.<layer>.``); ``expert``: the
    global index of the routed expert whose linear it adapts (split over ETP, expert-parallel), else None."""

    def __init__(self, spec: LoRASpec, target: str, layer: int, config, full_in: int, full_outs: Sequence[int],
                 device: torch.device, hf_modules: Sequence[str] | None = None, expert: int | None = None) -> None:
        super().__init__()
        self.target, self.layer, self.expert = target, layer, expert
        self.column = target in COLUMN_PARALLEL
        self.duplicated = target in DUPLICATED  # both factors whole on every TP rank
        self.parts = PARTS[target]
        self.hf_modules = tuple(hf_modules or HF_PARTS[target])
        self.rank, self.scale, self.dropout = spec.rank, spec.scale, spec.dropout
        # inside the experts the dispatcher does the sequence-parallel and ETP communication
        self.sequence_parallel = bool(config.sequence_parallel) and expert is None
        self.enabled = True
        tp, tp_rank = self.split_size(), self.split_rank()
        dtype = spec.dtype
        for part, full_out in zip(self.parts, full_outs):
            a = _init(spec.a_init, (spec.rank, full_in), _seed(spec, layer, target, part, "A", expert), dtype)
            b = _init(spec.b_init, (full_out, spec.rank), _seed(spec, layer, target, part, "B", expert), dtype)
            if self.column:  # B split like the output rows
                b = b.chunk(tp, dim=0)[tp_rank]
            elif not self.duplicated:  # A split like the input columns
                a = a.chunk(tp, dim=1)[tp_rank]
            a_param = torch.nn.Parameter(a.contiguous().to(device))
            b_param = torch.nn.Parameter(b.contiguous().to(device))
            if self.duplicated:  # each TP rank sees its slice of the sequence under SP: both summed over TP
                a_param.sequence_parallel = b_param.sequence_parallel = self.sequence_parallel
            else:
                split, whole = (b_param, a_param) if self.column else (a_param, b_param)
                set_tensor_model_parallel_attributes(split, is_parallel=True, dim=0 if self.column else 1, stride=1)
                # the factor each TP rank sees a part of the gradient of under SP: summed over TP by
                # finalize_model_grads
                whole.sequence_parallel = self.sequence_parallel
            if expert is not None:  # DDP: reduced over expert-DP, sharded there by the distributed optimizer
                a_param.allreduce = b_param.allreduce = False
            self.register_parameter(self._name("A", part), a_param)
            self.register_parameter(self._name("B", part), b_param)
        self.layout = None  # set by attach: how the parts' outputs interleave into the fused output

    def split_size(self) -> int:
        """Ranks the split factor is cut over: ETP for an expert's adapter, TP otherwise."""
        if self.expert is not None:
            return parallel_state.get_expert_tensor_parallel_world_size()
        return parallel_state.get_tensor_model_parallel_world_size()

    def split_rank(self) -> int:
        if self.expert is not None:
            return parallel_state.get_expert_tensor_parallel_rank()
        return parallel_state.get_tensor_model_parallel_rank()

    def split_group(self):
        if self.expert is not None:
            return parallel_state.get_expert_tensor_parallel_group()
        return parallel_state.get_tensor_model_parallel_group()

    def _replicated(self, factor: torch.Tensor) -> torch.Tensor:
        """An expert adapter's replicated factor, its gradient summed over ETP in the backward."""
        if self.expert is None or self.split_size() == 1:
            return factor
        return _SumGradOver.apply(factor, self.split_group())

    @staticmethod
    def _name(factor: str, part: str) -> str:
        return f"{factor}_{part}" if part else factor

    def factors(self, part: str) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        return getattr(self, self._name("A", part)), getattr(self, self._name("B", part))

    def _combine(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The parts' outputs ([..., out_p] each) in the fused linear's output order (its weight's rows)."""
        if self.target == "linear_qkv":  # per query group: [q heads of the group | k | v]
            groups = self.layout
            return torch.cat([p.reshape(*p.shape[:-1], groups, -1) for p in pieces], dim=-1).flatten(-2)
        return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            return self._expert_forward(x)
        if self.duplicated:  # like its base: this rank's tokens (its slice under SP), no communication
            a, b = self.factors("")
            x = F.dropout(x, self.dropout, self.training) if self.dropout else x
            return F.linear(F.linear(x, a), b) * self.scale
        if self.column:
            factors = [self.factors(part) for part in self.parts]
            # one pass over x for every part's A (x is the large operand at small r)
            a = torch.cat([a for a, _ in factors]) if len(factors) > 1 else factors[0][0]
            if self.sequence_parallel and not self.dropout:
                # Megatron's column-parallel matmul, as the base linear's: it gathers the sequence again in the
                # backward and saves only this rank's slice (the tensor the base linear saves), not a
                # whole-sequence copy (h x 2 B per token and adapted linear); its input grad is reduce-scattered
                hidden = linear_with_grad_accumulation_and_async_allreduce(
                    x, a, None, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=True,
                    tp_group=parallel_state.get_tensor_model_parallel_group())
            else:
                if self.sequence_parallel:
                    x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
                x = F.dropout(x, self.dropout, self.training) if self.dropout else x
                hidden = F.linear(x, a)
            if not self.sequence_parallel:  # each rank's B sees part of dL/dhidden: sum it over TP
                hidden = copy_to_tensor_model_parallel_region(hidden)
            pieces = [F.linear(h, b) for h, (_, b) in zip(hidden.split(self.rank, dim=-1), factors)]
            return self._combine(pieces) * self.scale
        a, b = self.factors("")
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        hidden = F.linear(x, a)  # a partial sum over this rank's input columns
        hidden = (reduce_scatter_to_sequence_parallel_region(hidden) if self.sequence_parallel
                  else reduce_from_tensor_model_parallel_region(hidden))
        return F.linear(hidden, b) * self.scale

    def _expert_forward(self, x: torch.Tensor) -> torch.Tensor:
        """No communication: x holds this expert's tokens on every ETP rank (fc1) or this rank's columns of
        them (fc2); the dispatcher sums fc2's partial outputs and fc1's partial input gradients over ETP."""
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        if self.column:
            pieces = []
            for part in self.parts:
                a, b = self.factors(part)
                pieces.append(F.linear(F.linear(x, self._replicated(a)), b))
            return self._combine(pieces) * self.scale
        a, b = self.factors("")
        return F.linear(F.linear(x, a), self._replicated(b)) * self.scale

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (this rank's shard of the base linear) + scale x B A, in the same layout."""
        deltas = []
        for part in self.parts:
            a, b = self.factors(part)
            deltas.append((b.float() @ a.float()).t())  # [in, out_p]: the combine works on the last dim
        delta = self._combine(deltas).t()
        return (weight.float() + self.scale * delta).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron dist-checkpoint entries: the TP-split factor with its axis, the other replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axis = {} if self.duplicated else \
            {self._name("B" if self.column else "A", part): 0 if self.column else 1 for part in self.parts}
        if self.expert is None:
            return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets)
        # an expert's: split over ETP; SequentialMLP adds the expert axis and the expert-DP replica ids
        return make_sharded_tensors_for_checkpoint(
            state, prefix, axis, sharded_offsets, tp_group=self.split_group(),
            dp_cp_group=parallel_state.get_expert_data_parallel_group())


def _target_sizes(target: str, config, ffn: int | None = None) -> tuple[int, list[int]]:
    """(full input size, full output size of each part) of a target linear (an MLP's of width ``ffn``: an
    expert's or the shared expert's; default the dense MLP's)."""
    if getattr(config, "multi_latent_attention", False) and target not in ("linear_fc1", "linear_fc2"):
        return _mla_target_sizes(target, config)
    h, d = config.hidden_size, config.kv_channels
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    ffn = ffn or config.ffn_hidden_size
    return {
        "linear_qkv": (h, [heads * d, groups * d, groups * d]),
        "linear_proj": (heads * d, [h]),
        "linear_fc1": (h, [ffn, ffn]),
        "linear_fc2": (ffn, [h]),
    }[target]


def _mla_target_sizes(target: str, config) -> tuple[int, list[int]]:
    """(input size, [output size]) of a multi-latent attention linear (Megatron's MLATransformerConfig names)."""
    h, heads = config.hidden_size, config.num_attention_heads
    q_rows = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    return {
        "linear_q_proj": (h, [q_rows]),
        "linear_q_down_proj": (h, [config.q_lora_rank or 0]),
        "linear_q_up_proj": (config.q_lora_rank or 0, [q_rows]),
        "linear_kv_down_proj": (h, [config.kv_lora_rank + config.qk_pos_emb_head_dim]),
        "linear_kv_up_proj": (config.kv_lora_rank, [heads * (config.qk_head_dim + config.v_head_dim)]),
        "linear_proj": (heads * config.v_head_dim, [h]),
    }[target]


def _hook(adapter: LoRAAdapter):
    def add_adapter(module, args, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter(args[0]).to(out.dtype), bias

    return add_adapter


def _input_requires_grad(module, args, output: torch.Tensor) -> torch.Tensor:
    """The frozen embedding's output made to require grad: Megatron's full recompute runs each layer chunk in a
    reentrant autograd Function, whose backward (the only place the adapters inside get their gradients) runs
    only if an input requires grad; with the base frozen none would, and the adapters would train on zeros."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _attach(parent: torch.nn.Module, target: str, adapter: LoRAAdapter) -> LoRAAdapter:
    parent.add_module(f"{target}_lora", adapter)
    getattr(parent, target).register_forward_hook(_hook(adapter))
    return adapter


def _moe_mlps(mlp: torch.nn.Module, hf) -> Iterator[tuple[torch.nn.Module, int | None, int]]:
    """(MLP module, global expert index or None for the shared expert, its width) of an MoE layer's experts."""
    if is_grouped(mlp.experts):
        raise ValueError("LoRA on MoE experts needs one MLP per expert (SequentialMLP); the grouped experts "
                         "(moe_grouped_gemm=true) have no per-expert linear to adapt")
    experts = local_experts(hf.moe, parallel_state.get_expert_model_parallel_world_size(),
                            parallel_state.get_expert_model_parallel_rank())
    for expert_mlp, expert in zip(mlp.experts.local_experts, experts, strict=True):
        yield expert_mlp, expert, hf.moe.ffn_hidden_size
    if mlp.shared_experts is not None:
        yield mlp.shared_experts, None, hf.moe.shared_expert_size


def attach_lora(model: torch.nn.Module, spec: LoRASpec, hf) -> list[LoRAAdapter]:
    """Add adapters to the targeted linears of ``model`` (one GPTModel chunk, before DDP; ``hf`` its
    HFModelConfig); returns them. On an MoE layer a targeted linear_fc1 / linear_fc2 is adapted in every local
    expert and in the shared expert."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    adapters = []
    config = model.config
    groups_local = (config.num_query_groups or config.num_attention_heads) \
        // parallel_state.get_tensor_model_parallel_world_size()
    if model.pre_process:  # later stages receive their input with requires_grad set (Megatron's p2p)
        model.embedding.register_forward_hook(_input_requires_grad)
    for layer in model.decoder.layers:
        index = layer.layer_number - 1  # the global layer number, as the planner counts
        chosen = lora_targets(spec, index, hf.mla)
        device = layer.self_attention.linear_proj.weight.device
        attention = ("linear_qkv", "linear_proj") if hf.mla is None else mla_linears(hf.mla)
        for target in attention:
            if target in chosen:
                adapter = LoRAAdapter(spec, target, index, config, *_target_sizes(target, config), device)
                adapter.layout = groups_local
                adapters.append(_attach(layer.self_attention, target, adapter))
        mlp_targets = [t for t in ("linear_fc1", "linear_fc2") if t in chosen]
        if not mlp_targets:
            continue
        if not isinstance(layer.mlp, MoELayer):
            for target in mlp_targets:
                adapter = LoRAAdapter(spec, target, index, config, *_target_sizes(target, config), device)
                adapters.append(_attach(layer.mlp, target, adapter))
            continue
        for mlp, expert, ffn in _moe_mlps(layer.mlp, hf):
            for target in mlp_targets:
                adapter = LoRAAdapter(spec, target, index, config, *_target_sizes(target, config, ffn), device,
                                      hf_modules=expert_hf_modules(hf.moe, index, target, expert), expert=expert)
                adapters.append(_attach(mlp, target, adapter))
    return adapters


def adapters_of(chunks: Sequence[torch.nn.Module]) -> list[LoRAAdapter]:
    return [module for chunk in chunks for module in chunk.modules() if isinstance(module, LoRAAdapter)]


def adapter_of(parent: torch.nn.Module, target: str) -> LoRAAdapter | None:
    """The adapter of ``parent.<target>`` (attention or MLP module), if it has one."""
    return getattr(parent, f"{target}_lora", None)


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Inside, the model computes with its base weights only (the reference policy of a LoRA actor)."""
    adapters = adapters_of(chunks)
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True
