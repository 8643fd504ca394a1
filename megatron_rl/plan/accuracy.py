"""How far each row of the plan can be off, and the evidence for it (issue 51): a plan over the GPU by less than
its rows' error is warned about and starts; only one over by more is refused.

- Weights, grads and Adam state are counts of the model's parameters, exact but for the norm weights and biases
  they leave out (< 0.01% of a 7B+ model): error 0.
- The rollout engine's share is what the engine itself reserves on its own reading of the knob (rollout/memory.py):
  error 0. ``plan.reserved_gib`` (CUDA context, NCCL, fragmentation) is the user's allowance, not an estimate.
- Activations are the estimate: a count, tensor by tensor, of what Megatron-Core's layers save for backward
  (memory.activation_bytes_per_token_layer, the 1F1B in-flight count, the logits). How it scales is measured on CPU
  with autograd's saved tensors: TP 2 + sequence parallelism over TP 1 within 3.7%
  (tests/plan/test_estimate_references.py), CP 2 over CP 1 within 5.3% (tests/workers/test_context_parallel_memory.py).
  Megatron-Core's theoretical-memory report and Korthikanti et al.'s per-layer formula (flash attention, sequence
  parallelism) are held against it term by term in the same test: they match once the tensors they leave out are
  added (SwiGLU's third tensor, grouped KV heads, Qwen3's q/k-norm inputs, an MoE layer's routed pairs), and the
  in-flight counts match exactly. No GPU run has measured the absolute level yet, so ``ACTIVATIONS.error`` is twice
  the largest scaling error measured.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowError:
    """The relative error of a row's estimate and where it was measured."""

    error: float  # fraction of the row's bytes
    evidence: str


EXACT = RowError(0.0, "a count of parameters or the engine's own reservation")
ACTIVATIONS = RowError(
    0.10,
    "activations are counted tensor by tensor and scale with TP, sequence parallelism and CP as autograd measures on "
    "CPU within 5.3%; with no GPU measurement yet the plan allows twice that, 10% (plan/accuracy.py, "
    "tests/plan/test_estimate_references.py)",
)
