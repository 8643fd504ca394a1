"""Before launch: the routing-replay keys (verl's) agree with each other and with what the run can build.

``actor_rollout_ref.actor.megatron.router_replay.mode`` (disabled | R2 | R3) and
``actor_rollout_ref.rollout.enable_rollout_routing_replay``; the model's side (an MoE model) is checked where the
engines are built (models/router_replay.py, rollout/routed_experts.py). docs/models.md, "Routing replay".
"""

from __future__ import annotations

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema import PPOTrainerConfig

MODE = "actor_rollout_ref.actor.megatron.router_replay"
ROLLOUT = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
MODES = ("disabled", "R2", "R3")
SERVERS_WITH_ROUTING = ("hf", "sglang")  # rollout.name of the servers whose replies carry routing (R3)


def check_router_replay(cfg: PPOTrainerConfig) -> None:
    """Raise ConfigError naming the keys for a routing-replay setting the run cannot honour."""
    arr = cfg.actor_rollout_ref
    replay = arr.actor.megatron.router_replay
    mode = str(replay.mode)
    enabled = bool(arr.rollout.enable_rollout_routing_replay)
    if mode not in MODES:
        raise ConfigError(f"{MODE}.mode={mode!r} must be one of {', '.join(MODES)}")
    for key in ("record_file", "replay_file"):
        if getattr(replay, key):
            raise ConfigError(f"{MODE}.{key}={getattr(replay, key)!r}: routing to or from files is not built (the routing "
                              "travels with the batch); leave it null")
    if mode == "R3" and not enabled:
        raise ConfigError(f"{MODE}.mode=R3 replays the rollout engine's routing: set {ROLLOUT}=true")
    if enabled and mode != "R3":
        raise ConfigError(f"{ROLLOUT}=true reports the engine's routing for {MODE}.mode=R3, but mode={mode}: set "
                          "mode=R3 (or the key to false)")
    if mode == "disabled":
        return
    megatron = arr.actor.megatron
    for role in ("actor", "ref"):  # the reference replays the actor's mode (workers/routing_replay.py)
        fusion = f"actor_rollout_ref.{role}.megatron.override_transformer_config.moe_router_fusion"
        if (getattr(arr, role).megatron.override_transformer_config or {}).get("moe_router_fusion", False):
            raise ConfigError(f"{MODE}.mode={mode} with {fusion}=true: Megatron's fused router takes its top-k "
                              "before the replay hook, so the routing would not be replayed; set it false")
    if megatron.context_parallel_size > 1:
        raise ConfigError(f"{MODE}.mode={mode} with actor_rollout_ref.actor.megatron.context_parallel_size="
                          f"{megatron.context_parallel_size} is not built (a router sees part of each sequence)")
    if megatron.share_prompts:
        raise ConfigError(f"{MODE}.mode={mode} with actor_rollout_ref.actor.megatron.share_prompts=true is not built "
                          "(a shared prompt is routed once for its whole group)")
    if mode == "R2" and cfg.algorithm.rollout_correction.bypass_mode:
        raise ConfigError(f"{MODE}.mode=R2 records the routing in the old-log-prob pass, which "
                          "algorithm.rollout_correction.bypass_mode=true skips: use R3 or disabled")
    if mode == "R3":
        rollout = arr.rollout  # whether its engine reports routed experts: plan/validate.py (EngineSpec)
        if str(rollout.mode) == "server" and str(rollout.name) not in SERVERS_WITH_ROUTING:
            # the HF-engine and SGLang servers answer SGLang's return_routed_experts (servers/client.py); the vLLM
            # servers' OpenAI routes carry no routing, and vLLM 0.32 on CPU cannot capture it at all
            raise ConfigError(f"{ROLLOUT}=true with actor_rollout_ref.rollout.mode=server and "
                              f"actor_rollout_ref.rollout.name={rollout.name} is not built (the vLLM servers' "
                              "replies carry no routing; vLLM 0.32 on CPU cannot report routed experts): use "
                              f"rollout.name={' or '.join(SERVERS_WITH_ROUTING)} servers, or mode=colocated")
        if rollout.multi_turn.enable and rollout.multi_turn.agent_program:
            raise ConfigError(f"{ROLLOUT}=true with actor_rollout_ref.rollout.multi_turn.agent_program is not built "
                              "(the agent proxy does not keep the turns' routing; the agent loop does)")
