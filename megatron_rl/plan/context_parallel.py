"""Context parallelism (issue 35): the Megatron roles a run builds, their ``cp_comm_type``, and what each role's
CP > 1 needs from the config and from the model, refused before launch naming the key."""
from __future__ import annotations

from megatron_rl.config.access import megatron_section, plain
from megatron_rl.config.errors import require as _require
from megatron_rl.config.lora import lora_enabled
from megatron_rl.config.schema import MegatronParallelConfig, PPOTrainerConfig
from megatron_rl.models.hf_config import HFModelConfig

# megatron.override_transformer_config.cp_comm_type values built for CP > 1 (null: p2p, Megatron's default)
CP_COMM_TYPES = ("p2p", "a2a", "all_gather")


def context_parallel_roles(cfg: PPOTrainerConfig, uses_critic: bool) -> list[str]:
    """The Megatron roles a run builds, by config prefix: the actor, the reference (KL), the critic, the
    reward model's trunk (not the judge, which is a rollout-style engine)."""
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    roles = ["actor_rollout_ref.actor"]
    # with the actor's LoRA the reference is the actor with its adapters off: no model of its own
    if (algo.use_kl_in_reward or actor.use_kl_loss) and not lora_enabled(cfg.actor_rollout_ref.model.lora):
        roles.append("actor_rollout_ref.ref")
    if uses_critic:
        roles.append("critic")
    if cfg.reward_model.enable and not cfg.reward_model.judge.enable:
        roles.append("reward_model")
    return roles


def cp_comm_type(mcfg: MegatronParallelConfig) -> str | list[str] | None:
    """``megatron.override_transformer_config.cp_comm_type`` as given (None: Megatron's default, p2p)."""
    overrides = mcfg.override_transformer_config or {}
    value = overrides.get("cp_comm_type") if hasattr(overrides, "get") else None
    return plain(value)


def check_context_parallel(cfg: PPOTrainerConfig, uses_critic: bool) -> None:
    """Context parallelism (issue 35): what each role's CP > 1 needs, refused here naming the key (the
    model build or the first forward would refuse it after Ray and the workers started). The rollout
    engines are not affected by the trainer's CP. The model's own limits (MoE, head counts for a2a, a
    sliding window with p2p) need its config.json: ``check_context_parallel_model``."""
    for role in context_parallel_roles(cfg, uses_critic):
        mcfg = megatron_section(cfg, role)
        cp = mcfg.context_parallel_size
        if cp == 1:
            continue
        key = f"{role}.megatron.context_parallel_size={cp}"
        _require(bool(mcfg.packed_sequences),
                 f"{key} needs {role}.megatron.packed_sequences=true: context parallelism splits packed (THD) "
                 f"sequences into 2 x CP chunks per rank pair; padded [rows, longest] micro-batches "
                 f"({role}.megatron.packed_sequences=false) are not built for CP")
        _require(not mcfg.share_prompts,
                 f"{key} with {role}.megatron.share_prompts=true is not built: a shared-prompt sequence "
                 f"[prompt | response 1 | ... | response n] runs under one tree mask over the whole sequence, "
                 f"which the CP split into chunks does not carry; set share_prompts=false or CP to 1")
        comm = cp_comm_type(mcfg)
        where = f"{role}.megatron.override_transformer_config.cp_comm_type={comm!r}"
        _require(comm is None or isinstance(comm, str),
                 f"{where} with {key}: one type for every layer is built (p2p, a2a), not a list per layer")
        _require(comm is None or comm in CP_COMM_TYPES,
                 f"{where} with {key} is not built: choose p2p (ring, the default: K/V chunks passed round the "
                 f"CP ranks) or a2a (all-to-all over heads, for models with many heads)"
                 + ("; a2a+p2p (hierarchical CP) needs hierarchical_context_parallel_sizes and Transformer "
                    "Engine 2.11 does not run it on packed (THD) sequences" if comm == "a2a+p2p" else ""))
        _require(comm != "all_gather" or str(cfg.trainer.device) == "cpu",
                 f"{where} with {key}: Transformer Engine 2.11's all-gather CP attention refuses packed (THD) "
                 "sequences (AttnFuncWithCPAndKVAllGather: 'thd format is not supported'), and CP runs on packed "
                 "sequences only; use p2p or a2a (with trainer.device=cpu SDPAttention all-gathers K/V whatever cp_comm_type "
                 "says, and all_gather is accepted)")


def check_context_parallel_model(model: HFModelConfig, role: str, cp: int, tp: int = 1, comm: str | None = None,
                                 te_attention: bool = True) -> None:
    """What a role's CP > 1 needs from the model itself (``model``: the HFModelConfig the planner and the
    preflight read from config.json or plan.architecture; ``comm``: its cp_comm_type); raises ConfigError
    naming the key. ``te_attention``: the run is on CUDA, where Transformer Engine's CP attention runs and
    brings its own limits (windows, a2a's heads); on CPU SDPAttention's all-gather takes any of them."""
    if cp == 1:
        return
    key = f"{role}.megatron.context_parallel_size={cp}"
    # Megatron-Core 0.16.1's MLA builds its YaRN rotary table in pinned memory under CP (a CUDA-only allocator) and
    # its CP attention is Transformer Engine's; the CPU path (SDPAttention's all-gather) does not cover MLA
    _require(model.mla is None,
             f"{key} with multi-latent attention ({model.source}: {model.architecture}) is not built here: "
             "Megatron-Core 0.16.1's MLA runs context parallelism only inside Transformer Engine's attention, untested "
             "here; set context_parallel_size=1")
    # An MoE model splits its tokens over CP like a dense one: each router sees its rank's chunks, Megatron reduces
    # the expert counts over TP x CP, and the engine masks the split's pad tokens out of the router losses (issue
    # 51; tests/workers/test_context_parallel_moe.py). Routing replay with CP is refused by config/router_replay.py.
    if not te_attention:
        return
    window = getattr(model, "sliding_window", None)
    comm_key = f"{role}.megatron.override_transformer_config.cp_comm_type"
    _require(not window or comm == "a2a",
             f"{key} with a sliding-window model ({model.source}: sliding_window={window}) needs {comm_key}=a2a "
             f"(got {comm!r}): Transformer Engine's p2p (ring) CP attention refuses sliding windows")
    if comm == "a2a":
        heads, groups = model.num_attention_heads, model.num_key_value_heads
        per_rank = (heads // tp, max(1, groups // tp))
        _require(per_rank[0] % cp == 0 and per_rank[1] % cp == 0,
                 f"{comm_key}=a2a with {key} splits each TP rank's heads over the CP ranks, but at TP={tp} a rank "
                 f"has {per_rank[0]} query and {per_rank[1]} KV heads ({model.source}: num_attention_heads={heads}, "
                 f"num_key_value_heads={groups}), not both divisible by CP={cp}: use cp_comm_type=p2p or a "
                 "smaller CP / TP")
