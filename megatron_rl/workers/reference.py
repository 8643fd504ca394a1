"""ReferenceRole: log-probs of the responses under the reference policy (the actor's initial weights).

Give it a frozen ``MegatronEngine`` built from the actor's HF checkpoint (no optim config: no
gradients, no optimizer memory). When no KL term is used nobody asks for reference log-probs, so no
reference model needs to exist; an engine shared with the actor is accepted but then answers with
the actor's *current* weights. A LoRA actor's engine is the reference itself with ``adapters_off``:
its base weights never train, so with the adapters switched off it is the initial policy.
"""

from __future__ import annotations

import contextlib

from megatron_rl.config.schema import RefConfig
from megatron_rl.models.lora import adapters_disabled
from megatron_rl.protocol import DataProto
from megatron_rl.workers.batch_checks import check_batch, read_temperature
from megatron_rl.workers.engine import MegatronEngine
from megatron_rl.workers.forward import compute_log_probs
from megatron_rl.workers.micro_batches import MicroBatchSpec


class ReferenceRole:
    """Args:
    engine: usually a frozen ``MegatronEngine`` (``optim=None``) of the actor's initial checkpoint.
    config: ``RefConfig`` (``actor_rollout_ref.ref``): log-prob micro-batching.
    """

    prefix = "actor_rollout_ref.ref"

    def __init__(self, engine: MegatronEngine, config: RefConfig, *, adapters_off: bool = False) -> None:
        if engine.value_head:
            raise ValueError("ReferenceRole needs a causal-LM engine, got a value-head (critic) engine")
        if adapters_off and engine.lora is None:
            raise ValueError("ReferenceRole(adapters_off=True) needs an engine with LoRA adapters")
        self.engine = engine
        self.adapters_off = adapters_off
        self.spec = MicroBatchSpec(
            config.log_prob_micro_batch_size_per_gpu,
            config.log_prob_use_dynamic_bsz,
            config.log_prob_max_token_len_per_gpu,
        )

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """{"ref_log_prob": [B, R] fp32} for the response tokens (0 on response padding)."""
        check_batch(data, (), "compute_ref_log_prob")
        temperature = read_temperature(data, "compute_ref_log_prob")
        self.engine.offload.enter("compute")
        adapters = adapters_disabled(self.engine.model) if self.adapters_off else contextlib.nullcontext()
        with adapters:
            out = compute_log_probs(
                self.engine, data, self.spec, temperature, False, f"{self.prefix}.log_prob_max_token_len_per_gpu"
            )
        return DataProto.from_dict({"ref_log_prob": out["log_probs"]})
