"""Deadlines of the driver's calls into the workers, by call kind (docs/launching.md, 'Deadlines').

One ``ray_init.timeout_s`` for every call made a 70B ``init_model`` (loading 140 GB of weights on 64
ranks, building the engines) share the bound of a 10 s log-prob pass. Each kind of call has its key:

    ray_init.init_timeout_s      init_model, load_checkpoint (weights and optimizer state from disk)
    ray_init.generate_timeout_s  generate_sequences (a whole rollout batch)
    ray_init.update_timeout_s    update_actor, update_critic (every mini-batch of a step)
    ray_init.save_timeout_s      save_checkpoint, save_hf (the final HF export)
    ray_init.timeout_s           everything else (log-probs, values, weight sync, small calls)

The workers' collectives wait as long as the longest of these (``ray_init.collective_timeout_s`` to say otherwise:
:func:`collective_timeout_s`, which every worker computes from the run's config as the driver does its deadlines).

A fixed 600 s failed long-CoT rollouts and a 70B step (issue 32). So the calls whose work grows with the run
are bounded by what the run asks for, derived from the response length, the batch and the model's size
(:func:`derived_deadlines`): generate and update when their key is null (the default), and the log-prob,
value, reward-model and weight-sync calls at least as long as their derived bound (``ray_init.timeout_s``
when that is larger). The bounds are generous floors of speed (a decode step of a whole batch in 0.25 s per
7 B active parameters, 10 TFLOP/s per GPU for forward and backward, 1 GB/s for a weight sync), so a deadline
catches a hang, not a slow step. A call past its deadline fails naming the key to raise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.config.access import is_unset, plain
from megatron_rl.models.hf_config import HFModelConfig, apply_override_config, parse_hf_config

if TYPE_CHECKING:  # the schema imports Hydra, which the deadlines do not need at run time
    from megatron_rl.config.schema import PPOTrainerConfig

CALL_KINDS: dict[str, tuple[str, ...]] = {
    "init_timeout_s": ("init_model", "load_checkpoint"),
    "generate_timeout_s": ("generate_sequences",),
    "update_timeout_s": ("update_actor", "update_critic"),
    "save_timeout_s": ("save_checkpoint", "save_hf"),
}
#: calls bounded by ``ray_init.timeout_s`` but never below their derived bound
SCALED_BY_TIMEOUT_S: dict[str, tuple[str, ...]] = {
    "forward": ("compute_log_prob", "compute_ref_log_prob", "compute_values", "compute_rm_score"),
    "sync": ("sync_weights", "verify_weights"),
}

BASE_S = 600.0  # start-up, scheduling, the first call's compilation: the old flat deadline, kept as a floor
DECODE_S_PER_TOKEN = 0.25  # one decode step of the whole batch, per 7 B active parameters (at least 0.25 s)
FLOPS_PER_GPU = 10e12  # forward/backward throughput floor per GPU (~1% of an H100's bf16 peak)
SYNC_BYTES_PER_S = 1e9  # bf16 weights into the engines
#: when the config says nothing usable: no deadline in practice (a week), as verl waits by default
NO_DEADLINE_S = 7 * 24 * 3600.0


def call_deadlines(cfg: PPOTrainerConfig) -> dict[str, tuple[float, str]]:
    """method -> (seconds, config key) for ``RayWorkerGroup(method_timeouts=...)``, from the whole run config:
    its ``ray_init`` keys, and the work (response length, batch, model size) the unset ones are derived from."""
    ray_init = cfg.ray_init
    work = derived_deadlines(cfg)
    out: dict[str, tuple[float, str]] = {}
    for field, methods in CALL_KINDS.items():
        value = getattr(ray_init, field, None)
        if value is None and field in ("generate_timeout_s", "update_timeout_s"):
            kind = field.removesuffix("_timeout_s")
            seconds, why = work.get(kind, (NO_DEADLINE_S, "no run config to derive it from: one week"))
            key = f"ray_init.{field} (null: {why})"
        else:
            key = f"ray_init.{field}" if value is not None else "ray_init.timeout_s"
            seconds = float(value if value is not None else ray_init.timeout_s)
        if seconds <= 0:
            raise ValueError(f"{key} must be > 0, got {seconds}")
        out.update({method: (seconds, key) for method in methods})
    timeout_s = float(ray_init.timeout_s)
    for kind, methods in SCALED_BY_TIMEOUT_S.items():
        if kind in work and work[kind][0] > timeout_s:
            seconds, key = work[kind][0], f"ray_init.timeout_s (at least {work[kind][1]})"
        else:
            seconds, key = timeout_s, "ray_init.timeout_s"
        out.update({method: (seconds, key) for method in methods})
    return out


def collective_timeout_s(cfg: PPOTrainerConfig) -> float:
    """How long the workers' process groups let a collective wait (NCCL's watchdog, gloo's timeout):
    ``ray_init.collective_timeout_s``, else the longest deadline of any call, so that a rank waiting in a collective
    for another still inside a long call (a 70B load under ``init_timeout_s``, a save under ``save_timeout_s``) is
    not killed before the call's own deadline; at least BASE_S (Megatron's and verl's 10 minutes)."""
    if cfg.ray_init.collective_timeout_s is not None:
        return float(cfg.ray_init.collective_timeout_s)
    return max([BASE_S, *(seconds for seconds, _ in call_deadlines(cfg).values())])


def derived_deadlines(cfg: PPOTrainerConfig | None) -> dict[str, tuple[float, str]]:
    """kind (generate, forward, update, sync) -> (seconds, how it was derived) from the run's work; empty
    when ``cfg`` is None or lacks what is needed."""
    if cfg is None:
        return {}
    try:
        hf = _hf_config(cfg)
        params, source = float(_params(hf, active=True)), hf.source
        weights = float(_params(hf, active=False))  # a weight sync moves every expert, not the top-k
        rollout, data, trainer = cfg.actor_rollout_ref.rollout, cfg.data, cfg.trainer
        response = int(rollout.response_length or data.max_response_length)
        tokens = int(data.max_prompt_length) + response  # per sequence
        multi_turn = rollout.multi_turn
        turns = int(multi_turn.max_assistant_turns or 1) if multi_turn.enable else 1
        sequences = int(data.train_batch_size) * int(rollout.n)
        gpus = max(1, int(trainer.nnodes) * int(trainer.n_gpus_per_node))
        epochs = max(int(cfg.actor_rollout_ref.actor.ppo_epochs), int(cfg.critic.ppo_epochs or 1))
    except Exception:  # noqa: BLE001 - no model or batch facts (a missing path, a test config): no derivation
        return {}
    billions = params / 1e9
    per_token = DECODE_S_PER_TOKEN * max(1.0, billions / 7)
    forward = 2 * params * sequences * tokens / (gpus * FLOPS_PER_GPU)
    size = f"{billions:.1f} B active params ({source})"
    return {
        "generate": (_round(BASE_S + turns * response * per_token),
                     f"{BASE_S:g} s + {turns} turn(s) x {response} response tokens x {per_token:.2f} s for {size}"),
        "forward": (_round(BASE_S + forward),
                    f"{BASE_S:g} s + a forward over {sequences} x {tokens} tokens of {size} on {gpus} GPU(s) "
                    f"at {FLOPS_PER_GPU / 1e12:g} TFLOP/s each"),
        "update": (_round(BASE_S + 3 * epochs * forward),
                   f"{BASE_S:g} s + {epochs} epoch(s) of forward and backward over {sequences} x {tokens} tokens "
                   f"of {size} on {gpus} GPU(s) at {FLOPS_PER_GPU / 1e12:g} TFLOP/s each"),
        "sync": (_round(BASE_S + 2 * weights / SYNC_BYTES_PER_S),
                 f"{BASE_S:g} s + {2 * weights / 1e9:.0f} GB of bf16 weights at {SYNC_BYTES_PER_S / 1e9:g} GB/s"),
    }


def model_params(cfg: PPOTrainerConfig) -> tuple[float, str]:
    """(parameters one token passes through, where the architecture came from): the actor's config.json,
    else ``plan.architecture`` (as the planner reads them). Of an MoE model: every layer's attention; a dense
    layer's MLP (``mlp_only_layers`` / ``decoder_sparse_step``); an MoE layer's router, shared expert (with its
    gate) and top-k routed experts."""
    hf = _hf_config(cfg)
    return float(_params(hf, active=True)), hf.source


def _hf_config(cfg: PPOTrainerConfig) -> HFModelConfig:
    model = cfg.actor_rollout_ref.model
    path = None if is_unset(model, "path") else Path(str(model.path or "")).expanduser() / "config.json"
    if path is not None and path.is_file():
        raw, source = json.loads(path.read_text()), "config.json"
    else:
        raw, source = plain(cfg.plan.architecture), "plan.architecture"
        if not raw:
            raise ValueError("no architecture")
    return parse_hf_config(apply_override_config(raw, plain(model.override_config) or {}), source=source)


def layer_params(hf: HFModelConfig, layer: int, active: bool) -> int:
    """Weight matrices of ``layer``: attention plus its dense MLP, or its router, shared expert (and the
    shared expert's sigmoid gate) and routed experts (the top-k with ``active``, else all)."""
    h = hf.hidden_size
    attention = h * (hf.q_size + 2 * hf.kv_size) + hf.q_size * h
    moe = hf.moe
    if moe is None or not moe.is_moe_layer(layer):
        return attention + 3 * h * hf.intermediate_size
    routed = (moe.topk if active else moe.num_experts) * 3 * h * moe.ffn_hidden_size
    shared = 3 * h * moe.shared_expert_size + (h if moe.shared_expert_gate else 0) if moe.shared_expert_size else 0
    return attention + moe.num_experts * h + shared + routed


def _params(hf: HFModelConfig, active: bool) -> int:
    vocab = (1 if hf.tie_word_embeddings else 2) * hf.vocab_size * hf.hidden_size
    return sum(layer_params(hf, i, active) for i in range(hf.num_layers)) + vocab


def _round(seconds: float) -> float:
    return float(math.ceil(seconds / 60) * 60)  # whole minutes: a deadline, not a prediction
