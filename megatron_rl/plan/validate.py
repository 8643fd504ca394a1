"""Reject impossible settings before any worker starts, and say the numbers.

``validate(cfg)`` returns the derived sizes (``DerivedSizes``) that the trainer and the planner use, so
the arithmetic of batch sizes lives in one place. A composed DictConfig meets the checks that read it by its keys'
strings first and is then converted once (config/loader.py ``checked_typed_config``); every rule after that reads
the typed tree (``PPOTrainerConfig``).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from megatron_rl.agent.tools import PythonTool, build_tools, load_tool_config
from megatron_rl.algos import get_estimator_traits, get_kl_controller, list_adv_estimators, list_policy_losses
from megatron_rl.algos.policy_loss_config import PolicyLossConfig
from megatron_rl.algos.rollout_corr import RolloutCorrection
from megatron_rl.algos.value_loss import check_cliprange_value
from megatron_rl.config import checks
from megatron_rl.config.access import megatron_section, plain
from megatron_rl.config.errors import ConfigError, require as _require
from megatron_rl.config.loader import checked_typed_config
from megatron_rl.config.lora import check_lora, lora_enabled
from megatron_rl.config.mtp import check_mtp_settings
from megatron_rl.config.router_replay import check_router_replay
from megatron_rl.plan.distillation import check_distillation
from megatron_rl.config.schema import PPOTrainerConfig, RewardJudgeConfig, RolloutConfig, RolloutCorrectionConfig
from megatron_rl.config.worker_rules import check_resume_setting, check_share_prompts_packing
from megatron_rl.models.router_replay import replay_mode
from megatron_rl.plan.context_parallel import (  # noqa: F401  (the preflight and tests import these from here)
    check_context_parallel,
    check_context_parallel_model,
    context_parallel_roles,
    cp_comm_type,
)
from megatron_rl.reward.model.combine import CombinePlan
from megatron_rl.reward.model.judge import GenerativeJudge, VerdictParser
from megatron_rl.reward.overlong import OverlongPenalty
from megatron_rl.rollout.engines import ENGINES, engine_of
from megatron_rl.workers.lr_schedule import check_optim_config


@contextmanager
def _check_errors_refused() -> Iterator[None]:
    """config/checks.py's CheckError, raised as the ConfigError every refusal here is."""
    try:
        yield
    except checks.CheckError as err:
        raise ConfigError(str(err)) from None


def _check_rollout_correction(section: RolloutCorrectionConfig) -> None:
    try:
        corr = RolloutCorrection.from_config(section)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if corr.bypass_mode and corr.loss_type != "ppo_clip":
        raise ConfigError(f"algorithm.rollout_correction.loss_type={str(corr.loss_type)!r} with bypass_mode=true is not "
                          "run by the trainer (only ppo_clip); compute_policy_loss_bypass_mode has it for custom loops")
    if corr.bypass_mode and (corr.rollout_is is not None or corr.rollout_rs is not None):
        # verl computes them inside its bypass loss from the policy being trained; the trainer's bypass sets
        # old := rollout log-probs before the update, where they would be no-ops (weights 1, nothing rejected)
        raise ConfigError("algorithm.rollout_correction.bypass_mode=true with rollout_is/rollout_rs set "
                          f"(rollout_is={corr.rollout_is and str(corr.rollout_is)!r}, rollout_rs={corr.rollout_rs!r}): the trainer's bypass "
                          "does not compute them against the policy being trained, so they would do nothing; "
                          "unset them, or set bypass_mode=false to correct against recomputed old log-probs")


@dataclass(frozen=True)
class RoleSizes:
    """Batch arithmetic for one trained role (actor or critic), per data-parallel rank."""

    model_parallel_size: int  # TP * PP * CP
    data_parallel_size: int
    mini_batch_responses: int  # global, per optimizer step
    mini_batches_per_epoch: int
    mini_batch_responses_per_dp_rank: int
    micro_batch_size: int
    grad_accumulation_steps: int  # micro-batches per optimizer step per DP rank (fixed-size batching)


@dataclass(frozen=True)
class DerivedSizes:
    world_size: int
    prompts_per_step: int
    responses_per_step: int
    actor: RoleSizes
    critic: RoleSizes | None
    uses_critic: bool

    def summary(self) -> str:
        lines = [
            f"world size {self.world_size}; {self.prompts_per_step} prompts x n -> {self.responses_per_step} responses per step",
        ]
        for name, role in (("actor", self.actor), ("critic", self.critic)):
            if role is None:
                continue
            lines.append(
                f"{name}: TP*PP*CP={role.model_parallel_size}, DP={role.data_parallel_size}, "
                f"{role.mini_batches_per_epoch} mini-batches of {role.mini_batch_responses} responses "
                f"({role.mini_batch_responses_per_dp_rank} per DP rank) -> {role.grad_accumulation_steps} "
                f"micro-batches of {role.micro_batch_size} per optimizer step"
            )
        return "\n".join(lines)


def _check_async(cfg: PPOTrainerConfig) -> None:
    """async_training.mode=one_step_off|fully_async: what trainer/off_policy.py and trainer/fully_async.py run."""
    run = cfg.async_training
    if run.mode == "sync":
        return
    rollout, algo = cfg.actor_rollout_ref.rollout, cfg.algorithm
    where = f"async_training.mode={run.mode}"
    _require(rollout.mode == "server", f"{where} generates on rollout servers: set actor_rollout_ref.rollout.mode=server")
    _require(cfg.trainer.launcher == "ray", f"{where} needs trainer.launcher=ray (one driver talks to the servers)")
    if run.mode == "one_step_off":
        _require(run.max_staleness in (0, 1), f"{where}: async_training.max_staleness must be 0 (on-policy, = sync) "
                 f"or 1, got {run.max_staleness}")
    else:
        _require(run.max_staleness >= 0, f"{where}: async_training.max_staleness must be >= 0, got {run.max_staleness}")
        _require(run.buffer_batches >= 1, f"{where}: async_training.buffer_batches must be >= 1, got {run.buffer_batches}")
    _require(not algo.filter_groups.enable, f"{where} does not run algorithm.filter_groups (dynamic sampling refills)")
    _require(not get_estimator_traits(algo.adv_estimator).needs_greedy_baseline,
             f"{where} does not run algorithm.adv_estimator={algo.adv_estimator} (its greedy baseline is on-policy)")
    corr = algo.rollout_correction
    decoupled = cfg.actor_rollout_ref.actor.policy_loss == "decoupled_ppo"
    _require(run.max_staleness == 0 or corr.rollout_is is not None or corr.bypass_mode or decoupled,
             f"{where} trains on samples older than the policy: set algorithm.rollout_correction.rollout_is "
             "(token|sequence: importance weights to the behaviour policy, the PPO ratio to the current one), "
             "algorithm.rollout_correction.bypass_mode=true or actor_rollout_ref.actor.policy_loss=decoupled_ppo")


# Engines whose rollout servers the run starts itself (rollout.mode=server, rollout.num_servers, no server_urls)
STARTED_SERVER_ENGINES = tuple(name for name, spec in ENGINES.items() if spec.run_starts_servers)


def starts_servers(rollout: RolloutConfig) -> bool:
    """rollout.mode=server with servers the run starts itself (not rollout.server_urls started elsewhere)."""
    return (rollout.mode == "server" and engine_of(rollout).run_starts_servers and rollout.num_servers >= 1
            and not rollout.server_urls)


def _check_server_restarts(cfg: PPOTrainerConfig) -> None:
    """rollout.server_restarts > 0: only servers the run started itself (rollout.num_servers) can be restarted."""
    rollout = cfg.actor_rollout_ref.rollout
    key = f"actor_rollout_ref.rollout.server_restarts={rollout.server_restarts}"
    _require(rollout.server_restarts >= 0, f"{key} must be >= 0 (0: a dead rollout server fails the run)")
    if rollout.server_restarts == 0:
        return
    _require(starts_servers(rollout),
             f"{key} replaces rollout servers the run starts itself: it needs rollout.mode=server, rollout.name="
             f"{'|'.join(STARTED_SERVER_ENGINES)} and rollout.num_servers >= 1 without rollout.server_urls (servers "
             "started elsewhere are not ours to restart)")
    _require(cfg.trainer.launcher == "ray", f"{key} needs trainer.launcher=ray (one driver watches the servers)")
    _require(cfg.async_training.mode == "sync" or rollout.num_servers >= 2,
             f"{key} with async_training.mode={cfg.async_training.mode} needs rollout.num_servers >= 2: a dead "
             "server's rows in flight are finished by a survivor (only the servers hold the weights they were "
             f"sampled with), got num_servers={rollout.num_servers}")


def _check_server_pool(cfg: PPOTrainerConfig) -> None:
    """Under Ray the servers the run starts get their own pool (servers/ray_pool.py): it must fit in an
    embedded Ray next to the trainer's ranks (one CPU each), or the trainer's pool would wait ray_init.timeout_s."""
    rollout = cfg.actor_rollout_ref.rollout
    if not starts_servers(rollout) or cfg.trainer.launcher != "ray":
        return
    cpus = rollout.server_threads if rollout.server_cpus is None else rollout.server_cpus
    _require(cpus > 0, f"actor_rollout_ref.rollout.server_cpus must be > 0 (CPUs each server's bundle reserves on "
             f"the servers' Ray pool; null: server_threads), got {cpus}")
    per_node = rollout.servers_per_node
    _require(not engine_of(rollout).servers_on_trainer_host or per_node is None,
             f"actor_rollout_ref.rollout.servers_per_node={per_node} with rollout.name={rollout.name}: its rollout "
             "servers take their weights through /dev/shm of trainer rank 0's host, so they cannot spread over "
             "nodes; unset it (all servers on one node)")
    _require(per_node is None or per_node >= 1, "actor_rollout_ref.rollout.servers_per_node must be >= 1 or null "
             f"(all servers on one node), got {per_node}")
    nodes = 1 if per_node is None else -(-rollout.num_servers // per_node)
    _require(nodes == 1 or cfg.ray_init.address is not None,
             f"actor_rollout_ref.rollout.num_servers={rollout.num_servers} at servers_per_node={per_node} spread over "
             f"{nodes} Ray nodes, but without ray_init.address the run starts a one-node Ray: set ray_init.address "
             "to the cluster's head or raise rollout.servers_per_node")
    total = cfg.ray_init.num_cpus
    if total is None or cfg.ray_init.address is not None:
        return  # Ray's own count: the pools check what the nodes hold when they reserve
    trainer = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    reward_cpus, reward_what = _reward_pool_cpus(cfg)
    need = rollout.num_servers * cpus + trainer + reward_cpus
    _require(need <= total, f"actor_rollout_ref.rollout.num_servers={rollout.num_servers} servers of "
             f"server_cpus={cpus:g} CPUs and the trainer's {trainer} ranks (trainer.n_gpus_per_node x nnodes, one "
             f"CPU each){reward_what} need {need:g} CPUs, but ray_init.num_cpus={total}: raise ray_init.num_cpus or "
             "lower rollout.num_servers / rollout.server_cpus")


def _reward_pool_cpus(cfg: PPOTrainerConfig) -> tuple[int, str]:
    """The CPUs the reward model's own Ray pool takes (reward_model.enable_resource_pool), and how to say so."""
    rm = cfg.reward_model
    if not (rm.enable and rm.enable_resource_pool):
        return 0, ""
    if rm.judge.enable:
        return 1, " and the judge's actor (1 CPU)"
    ranks = (rm.n_gpus_per_node or cfg.trainer.n_gpus_per_node) * (rm.nnodes or cfg.trainer.nnodes)
    return ranks, f" and the reward model's {ranks} ranks (reward_model_pool, one CPU each)"


def _positive(values: dict[str, Any]) -> None:
    """Each value (by the key that sets it) a positive integer."""
    for key, value in values.items():
        _require(isinstance(value, int) and value > 0, f"{key} must be a positive integer, got {value!r}")


def _role_sizes(cfg: PPOTrainerConfig, prefix: str, mini_batch_prompts: int, micro: int, world: int,
                responses_per_step: int, n: int, dynamic_bsz: bool) -> RoleSizes:
    mcfg = megatron_section(cfg, prefix)
    tp, pp, cp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size, mcfg.context_parallel_size
    for key, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("context_parallel_size", cp)):
        _require(value >= 1, f"{prefix}.megatron.{key} must be >= 1, got {value}")
    mp = tp * pp * cp
    _require(world % mp == 0,
             f"{prefix}.megatron: TP*PP*CP = {tp}*{pp}*{cp} = {mp} does not divide the world size "
             f"{world} (trainer.nnodes * trainer.n_gpus_per_node)")
    dp = world // mp
    vpp = mcfg.virtual_pipeline_model_parallel_size
    _require(vpp is None or (vpp >= 1 and pp > 1),
             f"{prefix}.megatron.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 (got {pp})")

    mini_responses = mini_batch_prompts * n
    _require(responses_per_step % mini_responses == 0,
             f"{prefix}.ppo_mini_batch_size={mini_batch_prompts} prompts x rollout.n={n} = {mini_responses} responses "
             f"does not divide the {responses_per_step} responses per step "
             f"(data.train_batch_size * actor_rollout_ref.rollout.n)")
    _require(mini_responses % dp == 0,
             f"{prefix}: a mini-batch of {mini_responses} responses does not split over data-parallel size {dp}")
    per_rank = mini_responses // dp
    _require(micro <= per_rank,
             f"{prefix}.ppo_micro_batch_size_per_gpu={micro} is larger than the {per_rank} responses each DP rank gets "
             f"per mini-batch: that would be 0 micro-batches (and NaN from dividing by zero)")
    _require(dynamic_bsz or per_rank % micro == 0,
             f"{prefix}.ppo_micro_batch_size_per_gpu={micro} does not divide the {per_rank} responses per DP rank per mini-batch")
    return RoleSizes(mp, dp, mini_responses, responses_per_step // mini_responses, per_rank, micro,
                     -(-per_rank // micro))


def _known_algorithm_names() -> dict[str, list[str]]:
    # Read from algos/ at call time: users can register their own estimators and losses before validating.
    # (loss_agg_mode and the KL types are closed choices: enums of the schema, checked by check_choices.)
    return {"estimators": list_adv_estimators(), "policy_losses": list_policy_losses()}


def _check_judge(judge: RewardJudgeConfig) -> None:
    _require(bool(judge.model.path), "reward_model.judge.enable=true needs reward_model.judge.model.path (a causal LM)")
    _require(judge.response_length >= 1, f"reward_model.judge.response_length must be >= 1, got {judge.response_length}")
    try:
        GenerativeJudge(lambda prompts: prompts, judge.template, VerdictParser(judge.verdict_pattern),
                        judge.timeout_s, judge.retries)
    except ValueError as err:
        raise ConfigError(f"reward_model.judge: {err}") from None


def _check_reward_model(cfg: PPOTrainerConfig) -> None:
    """reward_model.*: the checkpoint, the combine plan, and a layout its ranks can hold."""
    rm = cfg.reward_model
    if rm.judge.enable:
        _check_judge(rm.judge)
        _require(not (rm.enable_resource_pool and cfg.trainer.launcher == "torchrun"),
                 "reward_model.enable_resource_pool=true serves the judge in a Ray actor of its own: it needs "
                 "trainer.launcher=ray (false: the judge runs in the driver)")
        return
    _require(bool(rm.model.path), "reward_model.enable=true needs reward_model.model.path (an HF "
             "<Family>ForSequenceClassification directory with one label) or reward_model.judge.enable=true")
    _require(rm.max_length is None or rm.max_length >= 1,
             f"reward_model.max_length must be >= 1 or null, got {rm.max_length}")
    _positive({"reward_model.micro_batch_size_per_gpu": rm.micro_batch_size_per_gpu,
               "reward_model.forward_max_token_len_per_gpu": rm.forward_max_token_len_per_gpu})
    try:
        CombinePlan(rm.combine)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    layout = {k: getattr(rm.megatron, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                   "context_parallel_size")}
    if cfg.trainer.launcher == "torchrun" or not rm.enable_resource_pool:  # it shares the actor's processes
        actor = {k: getattr(cfg.actor_rollout_ref.actor.megatron, k) for k in layout}
        where = ("under trainer.launcher=torchrun" if cfg.trainer.launcher == "torchrun"
                 else "with reward_model.enable_resource_pool=false")
        _require(layout == actor, f"{where} the reward model shares the actor's processes: "
                 f"reward_model.megatron {layout} must equal actor_rollout_ref.actor.megatron {actor}")
    ranks = ((rm.n_gpus_per_node or cfg.trainer.n_gpus_per_node) * (rm.nnodes or cfg.trainer.nnodes))
    model_parallel = layout["tensor_model_parallel_size"] * layout["pipeline_model_parallel_size"] * \
        layout["context_parallel_size"]
    _require(ranks % model_parallel == 0, f"the reward model's {ranks} ranks (reward_model.n_gpus_per_node x "
             f"nnodes, 0 = the trainer's) are not a multiple of its TP x PP x CP = {model_parallel}")


def _check_reward_overlap(cfg: PPOTrainerConfig) -> None:
    """reward.overlap: scoring in a thread beside generation, so it must not use the generating processes."""
    overlap, rm = cfg.reward.overlap, cfg.reward_model
    if not overlap.enable:
        return
    _require(isinstance(overlap.num_chunks, int) and overlap.num_chunks >= 2,
             f"reward.overlap.num_chunks must be an integer >= 2 (1 chunk scores after the whole rollout, as "
             f"reward.overlap.enable=false does), got {overlap.num_chunks!r}")
    _require(cfg.async_training.mode == "sync", f"reward.overlap runs in the synchronous loop; "
             f"async_training.mode={cfg.async_training.mode} scores in its own loop: set reward.overlap.enable=false")
    shared = cfg.trainer.launcher == "torchrun" or not rm.enable_resource_pool
    _require(not (rm.enable and not rm.judge.enable and shared),
             "reward.overlap needs the reward model on its own pool (reward_model.enable_resource_pool=true, "
             "trainer.launcher=ray): in the actor's processes its scoring cannot run while they generate, and its "
             "collectives would interleave with generation's")


def _check_engine(cfg: PPOTrainerConfig) -> None:
    """The engine of rollout.name: its device, engine arguments only for it, servers that cannot see the model's
    override_config, then its own keys (EngineSpec.check_config)."""
    rollout = cfg.actor_rollout_ref.rollout
    spec = engine_of(rollout)
    _require(not spec.needs_cuda or cfg.trainer.device != "cpu",
             f"actor_rollout_ref.rollout.name={spec.name} needs CUDA, but trainer.device=cpu; use rollout.name="
             f"{' or '.join(n for n, other in ENGINES.items() if not other.needs_cuda)} on CPU")
    section = vars(rollout.engine_kwargs) if rollout.engine_kwargs is not None else {}
    for engine, given in section.items():
        key = f"actor_rollout_ref.rollout.engine_kwargs.{engine}"
        kwargs = plain(given)
        _require(kwargs is None or isinstance(kwargs, dict),
                 f"{key} must be a mapping of engine arguments, got {kwargs!r}")
        _require(not kwargs or engine == spec.name,
                 f"{key}={kwargs} are arguments of the {engine} engine, but actor_rollout_ref.rollout.name="
                 f"{spec.name}: they would do nothing; drop them or set rollout.name={engine}")
    override = cfg.actor_rollout_ref.model.override_config
    _require(rollout.mode != "server" or not override,
             f"actor_rollout_ref.model.override_config={plain(override) if override else None} is "
             f"applied to the Megatron model and to colocated engines, but {spec.name} rollout servers never see it "
             "(they load model.path): bake the fields into config.json, start servers of your own with the engine's "
             "override flag (SGLang --json-model-override-args, vLLM --hf-overrides), or use rollout.mode=colocated")
    _require(not rollout.enable_rollout_routing_replay or spec.reports_routed_experts,
             "actor_rollout_ref.rollout.enable_rollout_routing_replay=true: actor_rollout_ref.rollout.name="
             f"{spec.name} cannot report routed experts (engines that can: "
             f"{', '.join(n for n, other in ENGINES.items() if other.reports_routed_experts)})")
    _require(not cfg.actor_rollout_ref.model.mtp.enable_rollout or (spec.drafts_with_mtp and rollout.mode == "colocated"),
             f"actor_rollout_ref.model.mtp.enable_rollout=true: speculative decoding with the MTP layers is built for "
             f"colocated engines that draft with them ({', '.join(n for n, o in ENGINES.items() if o.drafts_with_mtp)}"
             f"; here {spec.name}, mode={rollout.mode}): the others' drafters do not receive the MTP weights at each "
             "sync. Set it false (the rollout decodes without drafting; model.mtp.enable / enable_train still load, "
             "train and export the MTP layers)")
    spec.check_config(cfg)


def _check_tools(cfg: PPOTrainerConfig) -> None:
    """The multi-turn tools, built as the agent loop builds them (a verl tool YAML, else the names): an unknown
    tool, a bad tool config, or a python tool whose sandbox this machine cannot give (its empty root) is refused
    here rather than in the workers; the python tool as root only where its sandbox drops privileges, or where the
    user said they accept it."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return
    path = multi_turn.tool_config_path
    names = plain(multi_turn.tools) if multi_turn.tools else []
    key = (f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}" if path
           else f"actor_rollout_ref.rollout.multi_turn.tools={names}")
    try:
        tools = load_tool_config(path) if path else build_tools(names)
    except (ValueError, KeyError, TypeError, ImportError, AttributeError, OSError) as err:
        raise ConfigError(f"{key}: {err}") from None
    python = next((tool for tool in tools.values() if isinstance(tool, PythonTool)), None)
    if python is None or os.geteuid() != 0 or multi_turn.python_tool_unsandboxed_ok:
        return
    report = python.sandbox
    _require(report.unprivileged,
             f"the python tool would run as root: this machine allows no sandbox that drops privileges (it has: "
             f"{report}), so model-written code could read any file, write outside its directory and signal the "
             "trainer. Run the trainer as another user, allow namespaces (unshare --pid --mount) or setuid to "
             "nobody, or set actor_rollout_ref.rollout.multi_turn.python_tool_unsandboxed_ok=true to accept it")


def _check_counts(cfg: PPOTrainerConfig) -> None:
    """The counts every run divides by, positive."""
    data, actor, rollout = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    _positive({"data.train_batch_size": data.train_batch_size, "data.max_prompt_length": data.max_prompt_length,
               "data.max_response_length": data.max_response_length, "actor_rollout_ref.rollout.n": rollout.n,
               "actor_rollout_ref.actor.ppo_mini_batch_size": actor.ppo_mini_batch_size,
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": actor.ppo_micro_batch_size_per_gpu,
               "actor_rollout_ref.actor.ppo_epochs": actor.ppo_epochs, "trainer.nnodes": cfg.trainer.nnodes,
               "trainer.n_gpus_per_node": cfg.trainer.n_gpus_per_node,
               "trainer.total_epochs": cfg.trainer.total_epochs})
    if rollout.log_prob_max_token_len_per_gpu is not None:  # null: the actor's ppo_max_token_len_per_gpu
        _positive({"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": rollout.log_prob_max_token_len_per_gpu})


def _check_algorithm_names(cfg: PPOTrainerConfig) -> None:
    """The estimator and the policy loss registered (ours or a user's), with the parameters their losses need."""
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    known = _known_algorithm_names()
    estimators, policy_losses = known["estimators"], known["policy_losses"]
    _require(algo.adv_estimator in estimators,
             f"algorithm.adv_estimator={algo.adv_estimator!r} is unknown; known: {estimators}")
    _require(actor.policy_loss in policy_losses,
             f"actor_rollout_ref.actor.policy_loss={actor.policy_loss!r} is unknown; known: {policy_losses}")
    _require(actor.policy_loss != "dro" or (actor.dro_beta is not None and actor.dro_beta > 0),
             f"actor_rollout_ref.actor.policy_loss=dro needs actor_rollout_ref.actor.dro_beta > 0 (its squared "
             f"log-ratio penalty; verl's policy_loss.dro_beta), got {actor.dro_beta}")
    for key, value in (("clip_cov_ratio", actor.clip_cov_ratio), ("kl_cov_ratio", actor.kl_cov_ratio)):
        _require(value is None or 0 < value <= 1,
                 f"actor_rollout_ref.actor.{key}={value} must be in (0, 1]: the share of tokens it selects")
    _require(actor.policy_loss != "decoupled_ppo" or algo.rollout_correction.rollout_is is None,
             "actor_rollout_ref.actor.policy_loss=decoupled_ppo weights behaviour->proximal itself: unset "
             "algorithm.rollout_correction.rollout_is (the weights would count twice)")


def _check_rollout_servers(cfg: PPOTrainerConfig) -> None:
    """rollout.mode=server: servers to talk to, given or started by the run."""
    rollout = cfg.actor_rollout_ref.rollout
    _require(rollout.mode != "server" or bool(rollout.server_urls) or starts_servers(rollout),
             "actor_rollout_ref.rollout.mode=server needs actor_rollout_ref.rollout.server_urls (servers started "
             f"elsewhere: SGLang or vLLM), or rollout.name={'|'.join(STARTED_SERVER_ENGINES)} with "
             f"rollout.num_servers >= 1 (servers the run starts), got rollout.name={rollout.name}, "
             f"num_servers={rollout.num_servers}")
    wait_s = rollout.sglang.broken_group_wait_s
    _require(wait_s > 0, f"actor_rollout_ref.rollout.sglang.broken_group_wait_s={wait_s} must be > 0 seconds (how "
                         "long a server may take to answer a weight broadcast that failed)")


def _check_reward(cfg: PPOTrainerConfig) -> None:
    """reward.*: the manager's needs and its own checks of reward.reward_kwargs."""
    reward, rollout = cfg.reward, cfg.actor_rollout_ref.rollout
    _require(reward.reward_manager != "batch" or bool(reward.custom_reward_function.path),
             "reward.reward_manager=batch needs reward.custom_reward_function.path (a function scoring whole lists)")
    _require(reward.num_workers >= 0, f"reward.num_workers must be >= 0, got {reward.num_workers}")
    _require(reward.timeout_s > 0, f"reward.timeout_s must be > 0, got {reward.timeout_s}")
    _require(reward.reward_manager != "prime" or reward.num_workers >= 1,
             "reward.reward_manager=prime scores each sample in a worker process with a time limit (verl's "
             "PrimeRewardManager), but reward.num_workers=0 scores in the trainer without one: set reward.num_workers "
             ">= 1, or use reward.reward_manager=naive")
    try:
        OverlongPenalty.from_config(reward, rollout.response_length if rollout.response_length is not None
                                    else cfg.data.max_response_length)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.reward_model.enable:
        _check_reward_model(cfg)


def _check_sampling_and_advantages(cfg: PPOTrainerConfig) -> None:
    """The sampling knobs, the advantage's discount, rollout correction, groups, and the KL counted once."""
    algo, actor, rollout = cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    _require(0.0 <= algo.gamma <= 1.0 and 0.0 <= algo.lam <= 1.0,
             f"algorithm.gamma={algo.gamma} and algorithm.lam={algo.lam} must lie in [0, 1]")
    _require(rollout.temperature >= 0, f"actor_rollout_ref.rollout.temperature must be >= 0, got {rollout.temperature}")
    _require(0 < rollout.top_p <= 1, f"actor_rollout_ref.rollout.top_p must be in (0, 1], got {rollout.top_p}")
    _check_rollout_correction(algo.rollout_correction)
    # distillation without the task reward trains on the teacher's scores alone: the advantage is not used
    distilled_only = cfg.distillation.enabled and not cfg.distillation.distillation_loss.use_task_rewards
    if get_estimator_traits(algo.adv_estimator).needs_groups and rollout.n == 1 and not distilled_only:
        raise ConfigError(f"algorithm.adv_estimator={algo.adv_estimator!r} compares responses within a group and "
                          f"needs actor_rollout_ref.rollout.n > 1, got 1")
    _require(not (algo.use_kl_in_reward and actor.use_kl_loss),
             "algorithm.use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss are both true: the KL would be "
             "counted twice; choose one")


def _check_ray_init(cfg: PPOTrainerConfig) -> None:
    _require(not (cfg.ray_init.address and cfg.ray_init.num_cpus),
             f"ray_init.address={cfg.ray_init.address!r} joins an existing cluster whose size is fixed; "
             f"ray_init.num_cpus={cfg.ray_init.num_cpus} applies only to an embedded Ray: unset one")
    for key in ("timeout_s", "init_timeout_s", "generate_timeout_s", "update_timeout_s", "save_timeout_s",
                "collective_timeout_s"):  # (the calls' deadlines refused them only when the workers started)
        seconds = getattr(cfg.ray_init, key)
        _require(seconds is None or seconds > 0, f"ray_init.{key}={seconds} must be > 0 seconds (or null where "
                 "its default is null)")


# The settings' rules, in the order a config meets them: the first refusal is the one it reports.
SETTINGS_RULES: tuple[Callable[[PPOTrainerConfig], None], ...] = (
    _check_counts, _check_algorithm_names, _check_rollout_servers, _check_server_restarts,
    _check_server_pool, check_distillation, _check_async, _check_tools, _check_engine, _check_reward,
    _check_reward_overlap, _check_sampling_and_advantages, _check_ray_init, check_mtp_settings,
)


def _world_size(cfg: PPOTrainerConfig) -> int:
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def _responses_per_step(cfg: PPOTrainerConfig) -> int:
    return cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n


def _actor_sizes(cfg: PPOTrainerConfig) -> RoleSizes:
    actor = cfg.actor_rollout_ref.actor
    return _role_sizes(cfg, "actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                       _world_size(cfg), _responses_per_step(cfg), cfg.actor_rollout_ref.rollout.n,
                       actor.use_dynamic_bsz)


def _check_rollout_layout(cfg: PPOTrainerConfig) -> None:
    """The rollout engines' TP over the world: one engine per rollout-TP group of consecutive GPUs of one node
    (rollout/mesh.py)."""
    rollout, world = cfg.actor_rollout_ref.rollout, _world_size(cfg)
    rtp = rollout.tensor_model_parallel_size
    _require(rtp >= 1 and world % rtp == 0,
             f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp} does not divide the world size {world}")
    _require(rollout.mode == "server" or cfg.trainer.n_gpus_per_node % rtp == 0,
             f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp} does not divide "
             f"trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node}: a colocated engine cannot span two nodes")
    _require(engine_of(rollout).tensor_parallel or rtp == 1,
             f"actor_rollout_ref.rollout.name={rollout.name} runs one model per process: it needs "
             f"actor_rollout_ref.rollout.tensor_model_parallel_size=1, got {rtp} (use rollout.name="
             f"{' or '.join(n for n, spec in ENGINES.items() if spec.tensor_parallel)} for TP)")


def _critic_in_use(cfg: PPOTrainerConfig) -> bool:
    """critic.enable, else what the estimator needs; an estimator that needs values refuses critic.enable=false."""
    algo = cfg.algorithm
    needs_critic = get_estimator_traits(algo.adv_estimator).needs_critic
    in_use = uses_critic(cfg)
    _require(in_use or not needs_critic,
             f"algorithm.adv_estimator={algo.adv_estimator!r} needs values, but critic.enable=false")
    return in_use


def _check_colocated_layouts(cfg: PPOTrainerConfig, uses_critic: bool) -> None:
    """The reference and the critic are colocated with the actor and share Megatron's (process-global) parallel
    state, so their layout must be the actor's. With the actor's LoRA no reference model is built (the actor with
    its adapters off is the reference), so ref.megatron's layout is not used (config/lora.py)."""
    check_lora(cfg, uses_critic)
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    colocated = [("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron)] if (
        (algo.use_kl_in_reward or actor.use_kl_loss) and not lora_enabled(cfg.actor_rollout_ref.model.lora)) else []
    if uses_critic:
        colocated.append(("critic", cfg.critic.megatron))
    for prefix, megatron in colocated:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "virtual_pipeline_model_parallel_size", "context_parallel_size"):
            _require(getattr(megatron, key) == getattr(actor.megatron, key),
                     f"{prefix}.megatron.{key}={getattr(megatron, key)} differs from actor_rollout_ref.actor.megatron."
                     f"{key}={getattr(actor.megatron, key)}; the colocated {prefix.split('.')[-1]} shares the actor's "
                     "model-parallel layout")


def _critic_sizes(cfg: PPOTrainerConfig) -> RoleSizes:
    critic = cfg.critic
    _positive({"critic.ppo_micro_batch_size_per_gpu": critic.ppo_micro_batch_size_per_gpu})
    mini = critic.ppo_mini_batch_size or cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    return _role_sizes(cfg, "critic", mini, critic.ppo_micro_batch_size_per_gpu, _world_size(cfg),
                       _responses_per_step(cfg), cfg.actor_rollout_ref.rollout.n, critic.use_dynamic_bsz)


def _check_run_settings(cfg: PPOTrainerConfig, uses_critic: bool) -> None:
    with _check_errors_refused():
        checks.check_run_settings(cfg, uses_critic)


def validate(cfg: DictConfig | PPOTrainerConfig) -> DerivedSizes:
    """Check the whole config; raise ConfigError naming the key and numbers, else return derived sizes.

    A DictConfig is converted here (``checked_typed_config``: its key-string checks, then the typed tree; verl's
    flat LoRA keys are folded into its ``model.lora`` in place); the rules read the typed tree."""
    cfg = checked_typed_config(cfg)
    for rule in SETTINGS_RULES:
        rule(cfg)
    actor_sizes = _actor_sizes(cfg)
    _check_rollout_layout(cfg)
    uses_critic = _critic_in_use(cfg)
    _check_colocated_layouts(cfg, uses_critic)
    critic_sizes = _critic_sizes(cfg) if uses_critic else None
    _check_run_settings(cfg, uses_critic)
    check_refused_at_run_time(cfg, uses_critic)
    return DerivedSizes(_world_size(cfg), cfg.data.train_batch_size, _responses_per_step(cfg), actor_sizes,
                        critic_sizes, uses_critic)


SFT_TRUNCATIONS = ("error", "left", "right")


def validate_sft(cfg: DictConfig | PPOTrainerConfig) -> DerivedSizes:
    """An SFT run's config (trainer/sft.py; docs/sft.md): the model, data and layout keys it reads, each refusal a
    ConfigError naming the key; its sizes (one optimizer step per ``data.train_batch_size`` conversations)."""
    cfg = checked_typed_config(cfg)
    data, trainer, world = cfg.data, cfg.trainer, _world_size(cfg)
    _require(cfg.actor_rollout_ref.model.path not in ("", "???"), "SFT needs actor_rollout_ref.model.path")
    _require(bool(data.train_files), "SFT needs data.train_files (parquet or jsonl conversations)")
    _require(str(data.truncation) in SFT_TRUNCATIONS,
             f"data.truncation={data.truncation}: SFT rows are cut {'/'.join(SFT_TRUNCATIONS)} (docs/sft.md)")
    _require(data.max_length >= 2, f"data.max_length={data.max_length}: an SFT row needs at least 2 tokens")
    _require(trainer.launcher == "torchrun" or world == 1,
             f"trainer.launcher={trainer.launcher} with {world} ranks: SFT runs under torchrun (trainer.launcher="
             "torchrun), or in one process")
    actor = cfg.actor_rollout_ref.actor
    megatron = actor.megatron
    dp = world // max(megatron.tensor_model_parallel_size * megatron.pipeline_model_parallel_size
                      * megatron.context_parallel_size, 1)
    _require(dp >= 1 and data.train_batch_size % dp == 0,
             f"data.train_batch_size={data.train_batch_size} conversations do not split over data-parallel size {dp}")
    sizes = _role_sizes(cfg, "actor_rollout_ref.actor", data.train_batch_size, actor.ppo_micro_batch_size_per_gpu,
                        world, data.train_batch_size, 1, actor.use_dynamic_bsz)
    return DerivedSizes(world, data.train_batch_size, data.train_batch_size, sizes, None, False)


def uses_critic(cfg: PPOTrainerConfig) -> bool:
    """Whether the run trains a critic: critic.enable, or (null) whether the estimator needs values."""
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return get_estimator_traits(cfg.algorithm.adv_estimator).needs_critic


def _check_packing(cfg: PPOTrainerConfig, uses_critic: bool) -> None:
    """share_prompts needs padded micro-batches (its tree mask is a dense mask the packed kernels do not take): the
    engine's rule (workers/engine.py check_share_prompts calls config/worker_rules.py check_share_prompts_packing),
    called here before launch. A preset that shares prompts meets verl's default packed_sequences=true through the
    compat entry."""
    roles = ["actor_rollout_ref.actor", "actor_rollout_ref.ref"] + (["critic"] if uses_critic else [])
    roles += ["reward_model"] if cfg.reward_model.enable else []
    for role in roles:
        megatron = megatron_section(cfg, role)
        try:
            check_share_prompts_packing(megatron.share_prompts, megatron.packed_sequences, f"{role}.megatron")
        except ValueError as err:
            raise ConfigError(str(err)) from None


def check_refused_at_run_time(cfg: PPOTrainerConfig, uses_critic: bool) -> None:
    """Settings the workers, the model build or the first step would refuse after Ray and the model are up
    (issue 33 items 7 and 10), refused here instead, naming the key."""
    check_context_parallel(cfg, uses_critic)
    _check_packing(cfg, uses_critic)
    check_router_replay(cfg)  # MoE routing replay's keys (config/router_replay.py)
    rollout, estimator = cfg.actor_rollout_ref.rollout, cfg.algorithm.adv_estimator
    _require(rollout.temperature > 0,
             f"actor_rollout_ref.rollout.temperature={rollout.temperature} makes the training rollout greedy, but "
             f"algorithm.adv_estimator={estimator} learns from sampled responses and the trainer's log-probs are "
             "those of the temperature-scaled policy (logits / temperature): set it > 0 (1.0: the policy itself). "
             "Greedy decoding is for validation (actor_rollout_ref.rollout.val_kwargs) and ReMax's baseline, which "
             "the trainer generates greedily by itself")
    traits = get_estimator_traits(estimator)
    _require(rollout.do_sample or not (traits.needs_groups or traits.needs_greedy_baseline),
             f"actor_rollout_ref.rollout.do_sample=false makes every response of a prompt the same, but "
             f"algorithm.adv_estimator={estimator} compares sampled responses (with each other or with the greedy "
             "baseline): the advantages would all be 0. Set do_sample=true")
    _require(rollout.response_length is None or rollout.response_length >= 1,
             f"actor_rollout_ref.rollout.response_length={rollout.response_length} must be >= 1 token, or null "
             "(data.max_response_length)")
    verify_freq = rollout.weight_sync.verify_freq
    _require(verify_freq >= 0, f"actor_rollout_ref.rollout.weight_sync.verify_freq={verify_freq} must be >= 0 "
             "(verify after every N-th weight sync; 0 disables)")
    # found by tests/unit/test_refusal_guard.py: refused only by weights/ when the first sync ran
    bucket_mb = rollout.weight_sync.bucket_size_mb
    _require(bucket_mb > 0, f"actor_rollout_ref.rollout.weight_sync.bucket_size_mb={bucket_mb} must be > 0 (MiB per "
             "weight-sync bucket)")
    max_diff = rollout.weight_sync.verify_max_logprob_diff
    _require(max_diff is None or max_diff > 0, "actor_rollout_ref.rollout.weight_sync.verify_max_logprob_diff="
             f"{max_diff} must be > 0, or null (a threshold by the trainer's and engine's dtypes)")

    # issue 56 item 6: the workers' own rules on config values, called here too (one rule, two callers; the refusal
    # guard, tests/unit/test_refusal_guard.py, counts a worker refusal inside a function called here as refused)
    def refused(rule: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            rule(*args, **kwargs)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    refused(check_resume_setting, cfg.trainer.resume_mode, cfg.trainer.resume_from_path)  # the loop's resume
    optims = {"actor_rollout_ref.actor": cfg.actor_rollout_ref.actor.optim}
    optims.update({"critic": cfg.critic.optim} if uses_critic else {})
    for role, optim in optims.items():  # the engine's LR schedule (workers/lr_schedule.py), e.g. cosine's length
        refused(check_optim_config, optim, f"{role}.optim", cfg.trainer.total_training_steps, before_start=True)
    actor_cfg = cfg.actor_rollout_ref.actor
    refused(PolicyLossConfig.from_actor_config, actor_cfg)  # the actor's loss config (workers/actor.py), clip_ratio_c
    if cfg.algorithm.use_kl_in_reward:  # the loop's KL controller (trainer/loop.py), e.g. adaptive's target_kl > 0
        refused(get_kl_controller, cfg.algorithm.kl_ctrl)
    # override_transformer_config: the Megatron-Core TransformerConfig fields the model builder takes (a misspelt
    # key was refused by the dry run's plan but only by the workers' model build in a real start on CPU). Reading
    # the fields imports Megatron-Core, so only where a built role sets overrides.
    built = ["actor_rollout_ref.actor"]
    built += (["actor_rollout_ref.ref"] if (cfg.algorithm.use_kl_in_reward or actor_cfg.use_kl_loss)
              and not lora_enabled(cfg.actor_rollout_ref.model.lora) else [])
    built += ["critic"] if uses_critic else []
    built += ["reward_model"] if cfg.reward_model.enable and not cfg.reward_model.judge.enable else []
    for role in built:
        overrides = plain(megatron_section(cfg, role).override_transformer_config)
        if overrides:
            # late, with the Megatron-Core import it serves: only a config that sets overrides pays for them
            from megatron_rl.controller.deferred_compile import deferred_compile

            with deferred_compile():  # Megatron-Core, as train.py imports the planner
                from megatron_rl.models.builder import check_transformer_overrides
            refused(check_transformer_overrides, overrides, f"{role}.megatron.override_transformer_config")
    # found by the refusal guard once it read algos/ and models/ too: the critic's value loss (its first update) and
    # each built role's routing-replay mode (its model build; config/router_replay.py reads the actor's only)
    if uses_critic:
        refused(check_cliprange_value, cfg.critic.cliprange_value)
    for role in built:
        refused(replay_mode, megatron_section(cfg, role), f"{role}.megatron")
