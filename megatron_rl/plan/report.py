"""What a plan holds and how it prints: memory rows per phase, the rollout engine's share, the verdict."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import ConfigError
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.sizes import padded_vocab_size
from megatron_rl.plan import memory
from megatron_rl.plan.accuracy import ACTIVATIONS
from megatron_rl.plan.memory import Layout, Stage
from megatron_rl.plan.validate import DerivedSizes
from megatron_rl.rollout.memory import EngineMemory

GIB = 2**30
FIT_OPTIONS = ("more nodes (the distributed optimizer shards Adam over DP), a larger TP or PP, a smaller "
               "ppo_micro_batch_size_per_gpu (ppo_max_token_len_per_gpu with dynamic batch sizes), "
               "megatron.override_transformer_config.recompute_granularity=full (with recompute_method and "
               "recompute_num_layers), megatron.param_offload / optimizer_offload (state off the GPU while "
               "generating), or a lower actor_rollout_ref.rollout.gpu_memory_utilization")



def _attention(model: HFModelConfig) -> str:
    """The report's attention: GQA's heads / KV heads, or MLA's latent widths (its KV cache is the latent)."""
    mla = model.mla
    if mla is None:
        return f"{model.num_attention_heads} heads / {model.num_key_value_heads} KV heads"
    q = f"q latent {mla.q_lora_rank}" if mla.q_lora_rank is not None else "no q latent"
    return (f"{model.num_attention_heads} heads of multi-latent attention ({q}, kv latent {mla.kv_lora_rank} + rope "
            f"{mla.qk_rope_head_dim})")


def _mtp_layers(model: HFModelConfig) -> str:
    return f" + {model.mtp.num_layers} MTP" if model.mtp is not None else ""

class PlanError(ConfigError):
    """The plan cannot run: the layout does not factor for this model, or it does not fit in memory."""


@dataclass(frozen=True)
class MemoryRow:
    """Bytes per GPU of one item in each phase of a step (phase name -> bytes)."""

    label: str
    per_phase: dict[str, float]
    error: float = 0.0  # the estimate's relative error (plan/accuracy.py): 0 for counts, ACTIVATIONS for activations


@dataclass(frozen=True)
class RolloutShare:
    engines: int
    tp: int
    memory: EngineMemory  # per GPU, the engine's own reading of gpu_memory_utilization (rollout/memory.py)
    kv_tokens: int  # KV cache capacity of one engine, in tokens

    @property
    def reserved(self) -> float:
        """Bytes per GPU the knob grants the engine: weights + KV cache (+ what else the engine counts in it)."""
        return self.memory.budget

    @property
    def weights(self) -> float:
        return self.memory.start.weights

    @property
    def free_at_start(self) -> float:
        """Bytes per GPU free when the engine starts (after actor + reference)."""
        return self.memory.start.free

    @property
    def fraction(self) -> float:
        return self.memory.start.fraction

    @property
    def kv_cache(self) -> float:
        return self.memory.kv_cache


@dataclass(frozen=True)
class Plan:
    sizes: DerivedSizes
    model: HFModelConfig
    gpu_memory: float  # bytes
    actor_layout: Layout
    actor_stage: Stage
    phases: tuple[str, ...]
    rows: tuple[MemoryRow, ...]
    rollout: RolloutShare
    sequence_length: int  # prompt + response tokens
    notes: tuple[str, ...] = ()  # lines printed after the batch arithmetic (context parallelism's split)

    def total(self, phase: str) -> float:
        return sum(row.per_phase.get(phase, 0.0) for row in self.rows)

    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    def margin(self, phase: str) -> float:
        """Bytes the phase's estimate can be off by: each row's bytes times its measured error (plan/accuracy.py)."""
        return sum(row.per_phase.get(phase, 0.0) * row.error for row in self.rows)

    @property
    def fits(self) -> bool:
        return self.total(self.peak_phase()) <= self.gpu_memory

    @property
    def over_beyond_error(self) -> bool:
        """Some phase needs more than the GPU even at the low end of its estimate: the plan is refused. A plan over
        the GPU by less than its error is warned about and starts (``edge_warning``)."""
        return any(self.total(p) - self.margin(p) > self.gpu_memory for p in self.phases)

    def _verdict(self) -> str:
        peak = self.peak_phase()
        over, margin = self.total(peak) - self.gpu_memory, self.margin(peak)
        if over <= 0:
            return "fits"
        if self.over_beyond_error:
            return f"DOES NOT FIT, over by {in_gib(over)} GiB, more than the estimate's error ({in_gib(margin)} GiB)"
        return f"OVER by {in_gib(over)} GiB, within the estimate's error ({in_gib(margin)} GiB): warned, not refused"

    def edge_warning(self) -> str | None:
        """The loud warning of a plan over the GPU by less than its estimate's error (it starts), None otherwise."""
        if self.fits or self.over_beyond_error:
            return None
        peak = self.peak_phase()
        return (f"WARNING: the plan's {peak} phase needs {in_gib(self.total(peak))} GiB of the {in_gib(self.gpu_memory)} "
                f"GiB per GPU (plan.gpu_memory_gib): over by {in_gib(self.total(peak) - self.gpu_memory)} GiB, less "
                f"than the estimate's error of {in_gib(self.margin(peak))} GiB, so it starts, and may run out of memory "
                f"in that phase. The error: {ACTIVATIONS.evidence}. To be safe: {FIT_OPTIONS}")

    def refusal(self) -> str:
        """Why a plan over the GPU by more than its error cannot run, with the table and the options."""
        return (f"the plan does not fit in {self.gpu_memory / GIB:g} GiB per GPU (plan.gpu_memory_gib), even at the "
                f"low end of its estimate ({ACTIVATIONS.evidence}):\n{self.format()}\noptions: {FIT_OPTIONS}")

    def format(self) -> str:
        model, layout, rollout = self.model, self.actor_layout, self.rollout
        params = memory.total_params(model)
        moe = model.moe
        active = (f" ({short_count(memory.active_params(model))} active: top-{moe.topk} of {moe.num_experts} experts "
                  f"of ffn {moe.ffn_hidden_size}; experts over EP {layout.ep} x ETP {layout.etp or layout.tp})"
                  if moe is not None else "")
        lines = [
            f"model ({model.source}): {model.architecture}, {short_count(params)} params{active}; hidden "
            f"{model.hidden_size}, {model.num_layers} layers{_mtp_layers(model)}, {_attention(model)}, ffn "
            f"{model.intermediate_size}, vocab {model.vocab_size} (padded to "
            f"{padded_vocab_size(model.vocab_size, layout.tp)} at TP={layout.tp})",
            f"GPUs: {self.sizes.world_size} = actor TP {layout.tp} x PP {layout.pp} x CP {layout.cp} x DP {layout.dp}",
            self.sizes.summary(),
            *self.notes,
            _rollout_line(rollout, self.sequence_length),
            f"memory per GPU in GiB, actor at its {self.actor_stage} pipeline stage:",
        ]
        width = max(len(row.label) for row in self.rows)
        lines.append("  " + " " * width + "".join(f"{phase:>15}" for phase in self.phases))
        for row in self.rows:
            lines.append(f"  {row.label:<{width}}"
                         + "".join(f"{in_gib(row.per_phase.get(p, 0.0)):>15}" for p in self.phases))
        lines.append(f"  {'total':<{width}}" + "".join(f"{in_gib(self.total(p)):>15}" for p in self.phases))
        peak = self.peak_phase()
        lines.append(f"peak: {peak}, {in_gib(self.total(peak))} of {in_gib(self.gpu_memory)} GiB per GPU: "
                     f"{self._verdict()}")
        return "\n".join(lines)


def _rollout_line(rollout: RolloutShare, sequence_length: int) -> str:
    mem = rollout.memory
    other = rollout.reserved - rollout.weights - rollout.kv_cache
    other_text = f" + activations and CUDA graphs {in_gib(other)}" if other > 0 else ""
    asleep = f"; asleep it keeps {in_gib(mem.asleep)} GiB" if mem.asleep else ""
    return (f"rollout: {rollout.engines} {mem.engine} engines of TP {rollout.tp} ({mem.meaning}); each GPU reserves "
            f"{rollout.fraction:g} x {in_gib(mem.base)} GiB {mem.base_label} = {in_gib(rollout.reserved)} GiB: weights "
            f"{in_gib(rollout.weights)}{other_text} + KV cache {in_gib(rollout.kv_cache)} GiB = {rollout.kv_tokens:,} "
            f"tokens ({rollout.kv_tokens // sequence_length:,} sequences of {sequence_length} tokens) per engine{asleep}")


def in_gib(nbytes: float) -> str:
    """Bytes as GiB with one decimal, the unit of every figure the plan prints."""
    return f"{nbytes / GIB:.1f}"


def short_count(n: int) -> str:
    """A parameter count as 1.23 B / 4.56 M / 7.89 k."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)
