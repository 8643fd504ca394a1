"""TP sharding of Llama/Qwen2/Qwen3 weights the way SGLang's loaders lay them out.

- q/k/v -> ``qkv_proj`` (column parallel: this rank's q heads, then its kv heads; a kv head is
  replicated on ``tp // num_kv_heads`` ranks when tp > num_kv_heads), biases sharded with them;
- gate/up -> ``gate_up_proj`` (column parallel);
- o_proj, down_proj: row parallel (dim 1), their biases (if any) replicated;
- embed_tokens, lm_head: vocab parallel (dim 0), vocab padded to a multiple of 64 (padding rows zero);
- everything else (norms, q_norm/k_norm): replicated.

A *plan* maps one FULL HF tensor to (sglang name, destination slices in the shard, source slices in the
full tensor); loading and reassembly are both plain slice copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

VOCAB_PADDING = 64
Slices = tuple[slice, ...]


@dataclass(frozen=True)
class Plan:
    target: str  # SGLang parameter name in the shard
    dst: Slices
    src: Slices


class ShardLayout:
    def __init__(self, config, hf_shapes: dict[str, tuple[int, ...]], tp_size: int, tp_rank: int) -> None:
        self.tp, self.rank = int(tp_size), int(tp_rank)
        self.hf_shapes = {k: tuple(v) for k, v in hf_shapes.items()}
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.num_heads = int(config.num_attention_heads)
        self.num_kv = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.intermediate = int(config.intermediate_size)
        self.vocab = int(config.vocab_size)
        tp = self.tp
        if self.num_heads % tp:
            raise ValueError(f"num_attention_heads={self.num_heads} is not divisible by tp_size={tp}")
        if (self.num_kv >= tp and self.num_kv % tp) or (self.num_kv < tp and tp % self.num_kv):
            raise ValueError(f"num_key_value_heads={self.num_kv} and tp_size={tp} do not divide")
        if self.intermediate % tp:
            raise ValueError(f"intermediate_size={self.intermediate} is not divisible by tp_size={tp}")
        self.padded_vocab = math.ceil(self.vocab / VOCAB_PADDING) * VOCAB_PADDING
        if self.padded_vocab % tp:
            raise ValueError(f"padded vocab {self.padded_vocab} is not divisible by tp_size={tp}")
        self.q_per = self.num_heads // tp
        self.kv_per = max(1, self.num_kv // tp)
        self.shard_shapes = self._shard_shapes()

    # ------------------------------------------------------------------ layout
    def kv_start(self, rank: int) -> int:
        if self.num_kv >= self.tp:
            return rank * self.kv_per
        return rank // (self.tp // self.num_kv)

    def _classify(self, name: str) -> tuple[str, str, str | None]:
        """-> (kind, sglang name, stacked shard id)."""
        for proj in ("q_proj", "k_proj", "v_proj"):
            if f".self_attn.{proj}." in name:
                return "qkv", name.replace(f".{proj}.", ".qkv_proj."), proj[0]
        for proj, sid in (("gate_proj", "gate"), ("up_proj", "up")):
            if f".mlp.{proj}." in name:
                return "gate_up", name.replace(f".{proj}.", ".gate_up_proj."), sid
        if (".self_attn.o_proj." in name or ".mlp.down_proj." in name) and name.endswith(".weight"):
            return "row", name, None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return "vocab", name, None
        return "replicated", name, None

    def _shard_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        hd = self.head_dim
        for name, shape in self.hf_shapes.items():
            kind, target, _ = self._classify(name)
            if kind == "vocab" and name == "lm_head.weight" and self.tied:
                continue
            if kind == "qkv":
                shapes[target] = ((self.q_per + 2 * self.kv_per) * hd, *shape[1:])
            elif kind == "gate_up":
                shapes[target] = (2 * self.intermediate // self.tp, *shape[1:])
            elif kind == "row":
                shapes[target] = (shape[0], shape[1] // self.tp)
            elif kind == "vocab":
                shapes[target] = (self.padded_vocab // self.tp, *shape[1:])
            else:
                shapes[target] = shape
        return shapes

    def plan(self, name: str, shape: tuple[int, ...] | torch.Size, rank: int | None = None) -> Plan | None:
        """How FULL tensor ``name`` lands in rank's shard (None: nothing to load, e.g. a tied lm_head).
        Unknown names and shape mismatches raise ValueError naming the tensor."""
        rank = self.rank if rank is None else rank
        if name not in self.hf_shapes:
            raise ValueError(
                f"weight {name!r} is not a parameter of this model (names look like "
                f"{sorted(self.hf_shapes)[:3]})"
            )
        if tuple(shape) != self.hf_shapes[name]:
            raise ValueError(
                f"weight {name!r} has shape {tuple(shape)}, the model expects {self.hf_shapes[name]}"
            )
        kind, target, sid = self._classify(name)
        full = self.hf_shapes[name]
        everything = tuple(slice(None) for _ in full)
        hd = self.head_dim
        if kind == "qkv":
            if sid == "q":
                src = slice(rank * self.q_per * hd, (rank + 1) * self.q_per * hd)
                dst = slice(0, self.q_per * hd)
            else:
                start = self.kv_start(rank)
                src = slice(start * hd, (start + self.kv_per) * hd)
                offset = (self.q_per + (0 if sid == "k" else self.kv_per)) * hd
                dst = slice(offset, offset + self.kv_per * hd)
            return Plan(target, (dst, *everything[1:]), (src, *everything[1:]))
        if kind == "gate_up":
            per = self.intermediate // self.tp
            offset = 0 if sid == "gate" else per
            return Plan(
                target,
                (slice(offset, offset + per), *everything[1:]),
                (slice(rank * per, (rank + 1) * per), *everything[1:]),
            )
        if kind == "row":
            per = full[1] // self.tp
            return Plan(
                target, (slice(None), slice(0, per)), (slice(None), slice(rank * per, (rank + 1) * per))
            )
        if kind == "vocab":
            if name == "lm_head.weight" and self.tied:
                return None  # SGLang's load_weights skips it: lm_head shares embed_tokens
            per = self.padded_vocab // self.tp
            lo, hi = min(rank * per, self.vocab), min((rank + 1) * per, self.vocab)
            return Plan(target, (slice(0, hi - lo), *everything[1:]), (slice(lo, hi), *everything[1:]))
        return Plan(target, everything, everything)

    # ------------------------------------------------------------------ helpers
    def empty_shards(self) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(shape, dtype=torch.float32) for name, shape in self.shard_shapes.items()}

    def shard(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shards = self.empty_shards()
        for name, tensor in full.items():
            plan = self.plan(name, tensor.shape)
            if plan is not None:
                shards[plan.target][plan.dst].copy_(tensor[plan.src])
        return shards

    def reassemble(self, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The full HF state dict from every rank's shard (ranks in order)."""
        if len(shards) != self.tp:
            raise ValueError(f"need {self.tp} shards, got {len(shards)}")
        full: dict[str, torch.Tensor] = {}
        for name, shape in self.hf_shapes.items():
            if name == "lm_head.weight" and self.tied:
                continue
            out = torch.empty(shape, dtype=torch.float32)
            for rank, shard in enumerate(shards):
                plan = self.plan(name, shape, rank)
                out[plan.src] = shard[plan.target][plan.dst]
            full[name] = out
        if self.tied and "lm_head.weight" in self.hf_shapes:
            full["lm_head.weight"] = full["model.embed_tokens.weight"]
        return full
