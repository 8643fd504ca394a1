"""The planner's memory terms (plan/memory.py) against outside references, with their measured error.

For Qwen3-8B, Qwen2.5-32B and Qwen3-30B-A3B at TP 1, TP 2 + SP, TP 4 + SP, PP 2 and PP 2 x VPP 2 (DP 4,
distributed optimizer) it recomputes, independently of memory.py:
- Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), Table 2, per
  layer and token: literally (q = k = v = h, a GeLU MLP of 4h) and adapted to the model (GQA, SwiGLU, for MoE
  the MLP row per routed pair); flash attention drops the 5as/h term, no dropout the masks (2 x 1 B per h).
- Megatron-LM megatron/training/theoretical_memory_usage.py: compute_activation_memory (its SP path),
  compute_activation_memory_without_sp and compute_weight_and_optimizer_memory, restated here (not copied).
- The first stage's in-flight micro-batches from Megatron's warm-up count (megatron/core/pipeline_parallel/
  schedules.py, get_pp_rank_microbatches) and from theoretical_memory_usage's interleaving penalty.
Each relative difference is asserted within a bound set from the figures (the measured extremes, rounded out);
the table prints with ``-s``. A CPU run then checks that autograd's saved tensors at TP 2 + SP over TP 1 scale
as planned for a tiny Qwen2 model, and how far the fp32 CPU run is from the GPU formula at each size.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from megatron_rl.distributed import run_multiprocess

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("compat", "workers"):  # the config.json facts; the worker jobs (spawned ranks inherit sys.path)
    if os.path.join(TESTS, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(TESTS, _sub))

from cp_jobs import ACTIVATION_SHAPE, activation_job  # noqa: E402
from test_verl_current_scripts import QWEN2_5_32B, QWEN3_8B, QWEN3_30B_A3B  # noqa: E402

from megatron_rl.plan import memory  # noqa: E402
from megatron_rl.plan.memory import Layout  # noqa: E402

MODELS = {"Qwen3-8B": QWEN3_8B, "Qwen2.5-32B": QWEN2_5_32B, "Qwen3-30B-A3B": QWEN3_30B_A3B}
DP, MICRO_BATCHES = 4, 8
LAYOUTS = {"TP1": Layout(tp=1, pp=1, cp=1, dp=DP),
           "TP2+SP": Layout(tp=2, pp=1, cp=1, dp=DP, sequence_parallel=True),
           "TP4+SP": Layout(tp=4, pp=1, cp=1, dp=DP, sequence_parallel=True),
           "PP2": Layout(tp=1, pp=2, cp=1, dp=DP),
           "PP2xVPP2": Layout(tp=1, pp=2, cp=1, dp=DP, vpp=2)}

# (term, reference) -> (low, high) bound on (ours - reference) / reference, from the printed table (the
# measured extremes rounded out); MOE_BOUNDS replaces the activation rows' for Qwen3-30B-A3B. Expected gaps:
# - korthikanti literal is 32h B: q = k = v = h and a GeLU MLP of 4h keeping fc1's and GeLU's outputs (16h B).
#   Ours: 8h + 4q + 4kv + 6 ffn (GQA: kv = h/4, h/5; SwiGLU keeps gate, up and their product) + 2 (q + kv) for
#   Qwen3's q/k-norm inputs: Qwen3-8B 33.5h (+4.7 %), Qwen2.5-32B (ffn 5.4h, no q/k norm) 45.2h (+41.3 %).
# - korthikanti adapted (the same tensor list with the model's q, kv, ffn and SwiGLU): Qwen2.5-32B exact;
#   Qwen3-8B +8.1 %, Qwen3's q/k-norm inputs, which Table 2 (no such norms) lacks. For the MoE model the MLP
#   row is taken per routed (token, expert) pair: the dispatched input (2h, gathered over TP when ETP = TP,
#   so unsplit) and the expert's SwiGLU (6 ffn_e / TP); ours adds each pair's expert output (2h, kept for the
#   routing weight's gradient), the fp32 router logits and scores (8E B) and the q/k-norm inputs: +41.2 % at
#   TP 1, +69.7 % at TP 4 + SP (the dispatched pairs do not split over TP; the rest does).
# - megatron, SP path (18h + 4 ffn) / TP: 2 dropout masks (2h), K/V at h, q at h, GeLU's 4 ffn: Qwen3-8B
#   +11.7 %, Qwen2.5-32B +14.1 %. Without SP, (10 + 24 / TP) h = 34h at TP 1 ignores ffn (assumes 4h): -1.5 %,
#   +32.9 %. Neither of its functions models MoE (its ffn_hidden_size, 6144 here, as a dense MLP, all tokens):
#   Qwen3-30B-A3B +112 % .. +460 % (the literal Table 2: +125 % .. +425 %).
# - in-flight: exact (the planner's PP + (PP - 1) / VPP is Megatron's warm-up count and its penalty).
# - logits: ours is bf16 logits + their fp32 copy, 6 V / TP B a token; Megatron counts 4 V / TP (SP path,
#   fp32) or 2 V / TP (without SP, bf16): +50 % / +200 % by design (RL's log-softmax keeps the fp32 copy).
# - weights+optimizer: Megatron counts the norms, not the q/k/v biases nor the MoE router; ours the reverse.
BOUNDS = {("act/token/layer", "korthikanti-literal"): (0.04, 0.42),
          ("act/token/layer", "korthikanti-adapted"): (0.0, 0.09),
          ("act/token/layer", "megatron"): (-0.02, 0.33),
          ("act/token/layer", "adapted+omissions"): (0.0, 0.0),  # every difference named: equal
          ("in-flight", "megatron-schedule"): (0.0, 0.0), ("in-flight", "megatron-penalty"): (0.0, 0.0),
          ("logits", "megatron"): (0.5, 2.0),
          ("state bytes", "megatron"): (-0.00005, 0.0005)}
MOE_BOUNDS = {("act/token/layer", "korthikanti-literal"): (1.24, 4.26),
              ("act/token/layer", "korthikanti-adapted"): (0.41, 0.70),
              ("act/token/layer", "megatron"): (1.11, 4.61),
              ("act/token/layer", "adapted+omissions"): (0.0, 0.0)}


def _bound(term: str, ref: str, model: str) -> tuple[float, float]:
    return MOE_BOUNDS.get((term, ref), BOUNDS[term, ref]) if model == "Qwen3-30B-A3B" else BOUNDS[term, ref]


def _hf(facts: dict, tmp_path, name: str):
    from megatron_rl.models.hf_config import load_hf_config

    (tmp_path / name).mkdir(exist_ok=True)
    (tmp_path / name / "config.json").write_text(json.dumps(facts))
    return load_hf_config(tmp_path / name)


# ---------------------------------------------------------------------------------------- the references
def korthikanti_per_token_layer(h: int, tp: int, sp: bool, q: int | None = None, kv: int | None = None,
                                ffn: int | None = None, swiglu: bool = False,
                                experts: tuple[int, int] | None = None) -> float:
    """Table 2 of Korthikanti et al., per token and layer, in bytes (16-bit activations), flash attention (no
    5as/h: no scores, softmax or its dropout) and no dropout (no 1-byte masks). Literal: q = kv = h, ffn = 4h.
    LayerNorms: 2 inputs of h (4h B). Attention: its input (the LN output, 2h B), Q and K (4h), V (2h), the
    projection's input (2h). MLP: fc1's input (2h B), GeLU's input and fc2's input (2 x 2 x ffn). Without SP
    the LN inputs and the attention's and MLP's inputs are replicated over TP; the rest splits. ``experts``
    (top-k, ffn_e): the MLP row per routed pair, its input the dispatched copy (unsplit: gathered over TP)."""
    q, kv, ffn = q or h, kv or h, ffn or 4 * h
    replicated = 2 * h + 2 * h + 2 * h + 2 * h  # LN1 in, LN1 out (QKV in), LN2 in, LN2 out (fc1 / router in)
    split = 2 * q + 2 * kv + 2 * kv + 2 * q  # Q, K, V, the projection's input
    gated = 3 if swiglu else 2
    if experts is None:
        split += gated * 2 * ffn
    per_token = (replicated + split) / tp if sp else replicated + split / tp
    if experts is not None:
        topk, ffn_e = experts
        per_token += topk * (2 * h + gated * 2 * ffn_e / tp)
    return per_token


def left_out_by_table_2(hf, tp: int, sp: bool) -> float:
    """The tensors Table 2 has no row for, per token and layer: Qwen3's q/k-norm inputs (2 (q + kv) B, split over
    TP) and, in an MoE layer, each routed pair's expert output (2h B, kept for the routing weight's gradient; ETP =
    TP here, so unsplit) and the router's fp32 logits and scores (2 x 4E B, split over TP under SP)."""
    extra = 2 * (hf.q_size + hf.kv_size) / tp if hf.qk_norm else 0.0
    if hf.moe is not None:
        extra += hf.moe.topk * 2 * hf.hidden_size + 8 * hf.moe.num_experts / (tp if sp else 1)
    return extra


def megatron_per_token_layer(h: int, ffn: int, tp: int, sp: bool) -> float:
    """theoretical_memory_usage's per-layer activation bytes over s x b: compute_activation_memory (chosen by
    report_theoretical_memory with SP and selective recompute, which flash matches) is (18 + 4 ffn / h) h
    / TP; compute_activation_memory_without_sp is (10 + 24 / TP) h (its final x 1.05 overhead left out)."""
    return (18 * h + 4 * ffn) / tp if sp else (10 + 24 / tp) * h


def megatron_logits_per_token(h: int, padded_vocab: int, tp: int, sp: bool) -> float:
    """The output-layer terms of the same two functions, logits part only: 4 V / TP (SP path) or 2 V / TP."""
    return (4 if sp else 2) * padded_vocab / tp


def schedule_in_flight(pp: int, vpp: int | None, micro_batches: int) -> float:
    """Micro-batches (in whole-stage equivalents) rank 0 holds at the 1F1B peak: its warm-up forwards plus the
    one of the steady state (schedules.py get_pp_rank_microbatches: PP - 1 warm-up, or with VPP (PP - 1) x 2 +
    (VPP - 1) x PP chunk forwards), each chunk holding 1 / VPP of the stage's layers."""
    if pp == 1:
        return 1
    chunks = vpp or 1
    warmup = pp - 1 if vpp is None else (pp - 1) * 2 + (vpp - 1) * pp
    return min(warmup + 1, micro_batches * chunks) / chunks


def megatron_penalty_in_flight(pp: int, vpp: int | None, micro_batches: int) -> float:
    """compute_activation_memory's factor over one micro-batch of L / PP layers: PP (times min(1, m / PP)), or
    PP x (1 + (PP - 1) / (PP x VPP)) interleaved (its printed count is the ceiling of that)."""
    if vpp is not None:
        return pp * (1 + (pp - 1) / (pp * vpp))
    return min(micro_batches, pp) if pp > 1 else 1


def megatron_weight_optimizer_bytes(hf, layout: Layout, padded_vocab: int) -> float:
    """compute_weight_and_optimizer_memory: the most loaded shard holds (block / PP + embedding) / TP
    parameters (+ the untied output layer at PP 1) at 6 + 12 / DP bytes each with the distributed optimizer.
    The block counts RMSNorms (h each: 2 a layer + the final), q/k/v/o (2h^2 (1 + groups / heads) q / h) and
    the (gated: x 3/2) MLPs 2h ffn, all experts for MoE."""
    h, q, L = hf.hidden_size, hf.q_size, hf.num_layers
    attention = 2 * h * h * (1 + hf.num_key_value_heads / hf.num_attention_heads) * q / h
    ffn = hf.moe.num_experts * hf.moe.ffn_hidden_size if hf.moe is not None else hf.intermediate_size
    block = L * (2 * h * (ffn * 3 / 2 + 1) + attention) + h
    embedding = h * padded_vocab
    shard = (block / layout.pp + embedding) / layout.tp
    if not hf.tie_word_embeddings and layout.pp == 1:
        shard += embedding / layout.tp
    return shard * (6 + 12 / (layout.dp * layout.cp))


# ---------------------------------------------------------------------------------------- the comparison
def _rel(ours: float, ref: float) -> float:
    return (ours - ref) / ref


def comparison_rows(tmp_path) -> list[tuple[str, str, str, str, float, float]]:
    from megatron_rl.models.sizes import padded_vocab_size

    rows = []
    for name, facts in MODELS.items():
        hf = _hf(facts, tmp_path, name)
        h, ffn = hf.hidden_size, hf.intermediate_size
        for label, layout in LAYOUTS.items():
            tp, sp = layout.tp, layout.sequence_parallel
            act = memory.activation_bytes_per_token_layer(hf, layout)
            experts = (hf.moe.topk, hf.moe.ffn_hidden_size) if hf.moe is not None else None
            adapted = korthikanti_per_token_layer(h, tp, sp, hf.q_size, hf.kv_size, ffn, True, experts)
            refs = {"korthikanti-literal": korthikanti_per_token_layer(h, tp, sp),
                    "korthikanti-adapted": adapted, "megatron": megatron_per_token_layer(h, ffn, tp, sp),
                    "adapted+omissions": adapted + left_out_by_table_2(hf, tp, sp)}
            rows += [(name, label, "act/token/layer", ref, act, value) for ref, value in refs.items()]
            flight = memory.micro_batches_in_flight(layout, MICRO_BATCHES, "first")
            rows.append((name, label, "in-flight", "megatron-schedule", flight,
                         schedule_in_flight(layout.pp, layout.vpp, MICRO_BATCHES)))
            rows.append((name, label, "in-flight", "megatron-penalty", flight,
                         megatron_penalty_in_flight(layout.pp, layout.vpp, MICRO_BATCHES)))
            vocab = padded_vocab_size(hf.vocab_size, tp)
            if layout.pp == 1:  # Megatron counts the output layer at PP 1 only (its busiest stage: the first)
                rows.append((name, label, "logits", "megatron", memory.logits_bytes(hf, layout, 1),
                             megatron_logits_per_token(h, vocab, tp, sp)))
            state = memory.state_bytes_per_param("bf16", True, layout.dp * layout.cp)
            per_param = state.params + state.grads + state.optimizer
            ours = memory.stage_params(hf, layout, "first") * per_param
            rows.append((name, label, "state bytes", "megatron", ours,
                         megatron_weight_optimizer_bytes(hf, layout, vocab)))
    return rows


def test_every_term_is_within_its_bound_of_the_references(tmp_path):
    rows = comparison_rows(tmp_path)
    print(f"\n{'model':14} {'layout':9} {'term':16} {'reference':20} {'ours':>14} {'reference':>14} "
          f"{'rel':>9}")
    extremes: dict[tuple[str, str, str], list[float]] = {}
    for model, layout, term, ref, ours, value in rows:
        rel = _rel(ours, value)
        extremes.setdefault((term, ref, model), []).append(rel)
        print(f"{model:14} {layout:9} {term:16} {ref:20} {ours:14.6g} {value:14.6g} {rel:+9.3%}")
    print(f"\n{'term':16} {'reference':20} {'model':14} {'min':>9} {'max':>9}   bound")
    for (term, ref, model), rels in extremes.items():
        low, high = _bound(term, ref, model)
        print(f"{term:16} {ref:20} {model:14} {min(rels):+9.3%} {max(rels):+9.3%}   [{low:+g}, {high:+g}]")
    assert {key[:2] for key in extremes} == set(BOUNDS)
    failures = [(model, layout, term, ref, _rel(ours, value))
                for model, layout, term, ref, ours, value in rows
                if not (_bound(term, ref, model)[0] - 1e-9 <= _rel(ours, value)
                        <= _bound(term, ref, model)[1] + 1e-9)]
    assert not failures, failures


# -------------------------------------------------------------------------------- CPU autograd at TP 2 + SP
@pytest.mark.distributed
def test_saved_activations_at_tp2_sp_scale_as_planned(tmp_path):
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = str(make_tiny_hf_checkpoint(tmp_path / "m", "qwen2", with_tokenizer=False, **ACTIVATION_SHAPE))
    tp1 = run_multiprocess(activation_job, 1, model, 1, 1, timeout_s=600)[0]
    tp2 = max(run_multiprocess(activation_job, 2, model, 1, 2, timeout_s=600), key=lambda rank: rank["bytes"])
    hf = load_hf_config(model)

    def planned(tp: int) -> float:
        layout = Layout(tp=tp, pp=1, cp=1, dp=1, sequence_parallel=tp > 1)
        return memory.micro_batch_activation_bytes(hf, layout, tp1["lengths"], dtype_bytes=4)

    measured, plan = tp2["bytes"] / tp1["bytes"], planned(2) / planned(1)
    print(f"\nTP1 -> TP2+SP saved bytes: measured {tp1['bytes']} -> {tp2['bytes']} ({measured:.3f}); "
          f"planned {planned(1):.0f} -> {planned(2):.0f} ({plan:.3f}); "
          f"ratio error {measured / plan - 1:+.1%}; "
          f"CPU/plan {tp1['bytes'] / planned(1):.2f} (TP1), {tp2['bytes'] / planned(2):.2f} (TP2+SP)")
    # measured 0.518 vs 0.500 (+3.7 %): some saved tensors do not split over TP (not broken down here; the
    # planner splits everything under SP). The CPU run keeps 1.55x / 1.61x the GPU formula at fp32, inside
    # the 1.0 - 2.0 the CP check found (tests/workers/test_context_parallel_memory.py)
    assert measured == pytest.approx(plan, rel=0.05), (measured, plan)
    for cpu, tp in ((tp1["bytes"], 1), (tp2["bytes"], 2)):
        assert 1.5 <= cpu / planned(tp) <= 1.7, (tp, cpu, planned(tp))
