"""The colocated workers a trainer drives: actor + reference + rollout in one process per rank (the
hybrid engine), and the critic, which can share those processes.

The ranks form rollout engine replicas (``megatron_rl.rollout.mesh``): one engine per rollout-TP group of
consecutive GPUs, built and driven by the group's leader; generation goes to the leaders
(ROLLOUT_COMPUTE_PROTO). After every update the actor's weights are exported under HF names (TP gathered,
PP broadcast) and every rank feeds its replica (``megatron_rl.weights.replica``). The engine gives its memory
back when a training phase starts and gets it back, with the current weights, at the next sync. The same
classes run under Ray (``RayWorkerGroup``) and torchrun (``LocalWorkerGroup``); both give them the validated
config as its dataclass tree (``PPOTrainerConfig``, ``megatron_rl.config.typed_config``).
"""
from __future__ import annotations

import math
import warnings
from datetime import timedelta
from typing import Any

import torch

from megatron_rl.agent import AgentLoop
from megatron_rl.agent.program import AgentProgramRollout
from megatron_rl.agent.rollout import multi_turn_rollout
from megatron_rl.algos.distillation import DistillationLossConfig
from megatron_rl.config import PPOTrainerConfig
from megatron_rl.config.distillation_schema import served_teacher
from megatron_rl.config.schema import MegatronParallelConfig
from megatron_rl.controller import Dispatch, Execute, Worker, register
from megatron_rl.controller.deadlines import collective_timeout_s
from megatron_rl.distributed.device import rank_place
from megatron_rl.distributed.model_parallel import init_model_parallel
from megatron_rl.distributed.process_group import DEFAULT_TIMEOUT, init_distributed
from megatron_rl.models.moe_routing import recording_routing
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.engines import build_rollout_engine, engine_of
from megatron_rl.rollout.mesh import build_rollout_mesh, server_mesh
from megatron_rl.workers.routing_replay import reference_parallel

# Megatron-Core warns on import, in every process, that Apex / Transformer Engine are absent and it uses
# its torch fallbacks: expected on CPU machines (docs/models.md), and noise that buries the training log.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)


def trainer_config(config: PPOTrainerConfig, role: str) -> PPOTrainerConfig:
    """A worker's config: the whole trainer config as ``PPOTrainerConfig`` (``typed_config(cfg)``), the same
    object under Ray (pickled) and torchrun; anything else is refused, naming the worker."""
    if not isinstance(config, PPOTrainerConfig):
        raise TypeError(f"{role} takes the trainer config as a PPOTrainerConfig (megatron_rl.config.typed_config(cfg)), "
                        f"got {type(config).__name__}")
    return config


def distillation_loss(config: PPOTrainerConfig) -> DistillationLossConfig | None:
    """``distillation.distillation_loss`` when on-policy distillation is on (docs/distillation.md), else None."""
    section = config.distillation
    return DistillationLossConfig.from_config(section.distillation_loss) if section.enabled else None


def _teacher_path(config: PPOTrainerConfig) -> str:
    """The one teacher's checkpoint (validated: plan/distillation.py)."""
    return next(t.model_path for t in config.distillation.teacher_models.values() if t.model_path)


def agree_with_the_rollout_engine(config: PPOTrainerConfig) -> None:
    """What every rank sets before any communicator exists when the engine is colocated
    (``EngineSpec.prepare_process``): a colocated ``sglang.Engine`` sets NCCL variables in its leader's process
    only, so every rank sets the same ones first and later communicators are created alike (docs/rollout.md)."""
    rollout = config.actor_rollout_ref.rollout
    prepare = engine_of(rollout).prepare_process
    if rollout.mode == "colocated" and prepare is not None:
        prepare()


def setup_parallel_state(megatron_cfg: MegatronParallelConfig, collective_timeout_s: float | None = None) -> None:
    """Initialise torch.distributed (from the launcher's environment) and Megatron's parallel state once
    per process; colocated roles share it, so a second call must ask for the same layout.
    ``collective_timeout_s``: how long a collective of these groups may wait (controller/deadlines.py
    ``collective_timeout_s`` of the run's config; None: 10 minutes)."""
    from megatron.core import parallel_state

    timeout = DEFAULT_TIMEOUT if collective_timeout_s is None else timedelta(seconds=collective_timeout_s)
    init_distributed(timeout=timeout)
    wanted = (megatron_cfg.tensor_model_parallel_size, megatron_cfg.pipeline_model_parallel_size,
              megatron_cfg.context_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size())
        if have != wanted:
            raise ValueError(f"colocated roles need one model-parallel layout: (TP, PP, CP) {wanted} asked, "
                             f"{have} already set up in this process")
        return
    init_model_parallel(tp=wanted[0], pp=wanted[1], vpp=megatron_cfg.virtual_pipeline_model_parallel_size,
                        cp=wanted[2], seed=megatron_cfg.seed, timeout_minutes=math.ceil(timeout.total_seconds() / 60),
                        ep=megatron_cfg.expert_model_parallel_size,
                        etp=megatron_cfg.expert_tensor_parallel_size)


class ActorRolloutRefWorker(Worker):
    """One rank of the hybrid engine. ``config`` is the whole trainer config (``PPOTrainerConfig``)."""

    def __init__(self, config: PPOTrainerConfig) -> None:
        super().__init__()
        self.config = trainer_config(config, type(self).__name__)
        agree_with_the_rollout_engine(self.config)  # before any communicator: torchrun's group is lazy
        self.actor = self.ref = self.rollout = self.teacher = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self, probe_prompts: DataProto | None = None, token_ids: dict[str, Any] | None = None) -> str:
        """Build actor (+ reference) and this rank's part of its rollout replica, then sync version 0.
        ``probe_prompts``: the fixed verification batch; ``token_ids``: eos/pad ids (both from the driver).
        Returns the rollout mesh, described (which ranks form which engine, on which node and GPUs)."""
        # megatron-core: the Ray driver imports this module for its worker classes only
        from megatron_rl.workers import ActorRole, MegatronEngine, ReferenceRole
        from megatron_rl.workers.teacher import TeacherRole  # megatron-core, as above

        cfg = self.config
        arr = cfg.actor_rollout_ref
        model_dir = arr.model.path
        setup_parallel_state(arr.actor.megatron, collective_timeout_s(cfg))
        engine = MegatronEngine(model_dir, arr.actor.megatron, arr.actor.optim, name="actor_rollout_ref.actor",
                                override_config=arr.model.override_config, lora=arr.model.lora, mtp=arr.model.mtp,
                                freeze_vision_tower=bool(getattr(arr.actor, "freeze_vision_tower", False)))
        distillation = distillation_loss(cfg)
        self.actor = ActorRole(engine, arr.actor, rollout_n=arr.rollout.n,
                               log_prob_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu,
                               log_prob_use_dynamic_bsz=arr.rollout.log_prob_use_dynamic_bsz,
                               log_prob_max_token_len=arr.rollout.log_prob_max_token_len_per_gpu,
                               distillation=distillation)
        if distillation is not None and served_teacher(cfg.distillation) is None:
            # the teacher: a frozen engine of its checkpoint at the reference's layout (an engine-served one is built
            # with the rollout, on its leaders)
            self.teacher = TeacherRole(
                MegatronEngine(_teacher_path(cfg), reference_parallel(arr.actor.megatron, arr.ref.megatron), None,
                               name="distillation.teacher_models"), distillation, arr.ref)
        if cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss:
            if engine.lora is not None:  # the reference policy is the actor with its adapters off: no second model
                self.ref = ReferenceRole(engine, arr.ref, adapters_off=True)
            else:
                ref_engine = MegatronEngine(model_dir, reference_parallel(arr.actor.megatron, arr.ref.megatron), None,
                                            name="actor_rollout_ref.ref",
                                            override_config=arr.model.override_config)
                self.ref = ReferenceRole(ref_engine, arr.ref)
        # Offloaded state (megatron.param_offload / optimizer_offload) leaves before the engine sizes itself
        # on the memory then free (docs/workers.md, 'Offload').
        self._offload_for_generation()
        self._token_ids = dict(token_ids or {})
        self.rollout = self._build_rollout(probe_prompts, dict(token_ids or {}))
        if distillation is not None and served_teacher(cfg.distillation) is not None and self.rollout.is_leader:
            self.teacher = self._engine_teacher(distillation)
        replica = self.rollout.replica
        self.set_mesh(**engine.mesh_kwargs(), rollout_replica=replica.index,
                      rollout_replicas=self.rollout.mesh.num_engines, is_rollout_leader=self.rollout.is_leader)
        # The engines start from random weights: the first sync (version 0, verified) makes them serve the actor's.
        self.sync_weights(0)
        return self.rollout.mesh.describe()

    def _build_rollout(self, probe_prompts: DataProto | None, token_ids: dict[str, Any]):
        import torch.distributed as dist

        from megatron_rl.rollout.hf_engine import resolve_dtype  # transformers: the HF engine's model classes
        from megatron_rl.weights.replica import RolloutReplica  # megatron-core: the weight export

        cfg = self.config
        rollout = cfg.actor_rollout_ref.rollout
        world = dist.get_world_size()
        if rollout.mode == "server":
            mesh = server_mesh(world)
        else:
            places: list[Any] = [None] * world
            dist.all_gather_object(places, rank_place(self.rank, self.local_rank))
            mesh = build_rollout_mesh(places, rollout.tensor_model_parallel_size)

        on_gpu = torch.cuda.is_available()

        def build_engine(replica):
            return build_rollout_engine(rollout, cfg.actor_rollout_ref.model.path,
                                        response_length=cfg.data.max_response_length,
                                        override_config=cfg.actor_rollout_ref.model.override_config,
                                        **token_ids, **engine_of(rollout).placement(replica, cfg, on_gpu))

        return RolloutReplica(rollout, mesh, self.rank, build_engine,
                              member_dtype=resolve_dtype(str(rollout.dtype), torch.device("cuda" if on_gpu else "cpu")),
                              probe_prompts=probe_prompts, trainer_log_prob_fn=self._trainer_log_probs,
                              record_trainer_routing=self._record_routing if self.actor.engine.hf_config.moe else None,
                              trainer_dtype=self.actor.engine.params_dtype,
                              drafts_with_mtp=bool(cfg.actor_rollout_ref.model.mtp.enable_rollout))

    # ------------------------------------------------------------------ rollout
    @register(Dispatch.ROLLOUT_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample this replica's share on its engine (runs on the replica's leader only). Consecutive
        generations (validation, ReMax's greedy baseline, DAPO's refills) all run on the weights of the last
        sync: the engine releases its memory only when a training phase starts. With
        ``rollout.multi_turn.enable`` every sample runs through the agent loop, one engine call per turn."""
        if self.config.actor_rollout_ref.rollout.multi_turn.enable:
            return self._agent_loop().generate_sequences(prompts)
        return self.rollout.generate(prompts)

    def _agent_loop(self) -> AgentLoop | AgentProgramRollout:
        """The multi-turn rollout over this replica's engine: the agent loop, or with ``multi_turn.agent_program`` the
        user's program through the agent proxy (built once; docs/rollout.md, "Agent loop" and "Agent programs")."""
        if getattr(self, "_agent", None) is None:
            from megatron_rl.data.tokenizer import load_tokenizer  # transformers: the tokenizer classes

            tokenizer = load_tokenizer(self._tokenizer_dir(), self.config.data.trust_remote_code)
            eos = (getattr(self, "_token_ids", None) or {}).get("eos_token_id", tokenizer.eos_token_id)
            self._agent = multi_turn_rollout(self.rollout.generate, tokenizer, self.config, eos)
        return self._agent

    @register(Dispatch.RANK_ZERO)
    def sync_weights(self, version: int, defer_verify: bool = False) -> dict[str, float]:
        """Push the actor's current weights into every engine (every rank takes part in the export and feeds
        its replica); the driver gets rank 0's metrics. ``version`` is the training step the weights come
        from; every sample generated with them carries it. ``defer_verify``: a due verification runs at
        ``verify_weights`` (fully async: after the paused servers continue)."""
        metrics = self.rollout.sync(self.actor.export_buckets, version=version, defer_verify=defer_verify)
        self._offload_for_generation()  # generation comes next, on every rank of the engines' GPUs
        return metrics

    @register(Dispatch.RANK_ZERO)
    def verify_weights(self) -> dict[str, float]:
        """The verification a ``defer_verify`` sync left ({} when none was due); rank 0's metrics."""
        metrics = self.rollout.verify_pending()
        self._offload_for_generation()
        return metrics

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def replace_rollout_servers(self, server_urls: list[str]) -> list[str]:
        """Server mode: dead rollout servers were replaced at these URLs (servers/restarts.py); rank 0,
        their only sender, joins them to a fresh update group at the next sync. Returns the URLs of servers
        stuck in a broken broadcast (to be replaced too)."""
        return self.rollout.replace_servers(list(server_urls))

    def _offload_for_generation(self) -> None:
        self.actor.engine.offload.enter("generate")
        if self.ref is not None and self.ref.engine is not self.actor.engine:
            self.ref.engine.offload.enter("generate")

    # ------------------------------------------------------------------ actor / reference
    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        self.rollout.release()
        return self.actor.compute_log_prob(data)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob called but no reference model was built: neither "
                               "algorithm.use_kl_in_reward nor actor_rollout_ref.actor.use_kl_loss is set")
        self.rollout.release()
        return self.ref.compute_ref_log_prob(data)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        if self.teacher is None:
            raise RuntimeError("compute_teacher_log_prob called but no teacher was built: distillation.enabled "
                               "is false")
        self.rollout.release()
        return self.teacher.compute_teacher_log_prob(data)

    @register(Dispatch.ROLLOUT_COMPUTE_PROTO)
    def compute_teacher_log_prob_on_engine(self, data: DataProto) -> DataProto:
        """The engine-served teacher's scores of this replica's share (its leader only)."""
        if self.teacher is None:
            raise RuntimeError("compute_teacher_log_prob_on_engine called but no engine-served teacher was built: "
                               "distillation.teacher_models.<name>.inference.name is not set")
        self.rollout.release()
        return self.teacher.compute_teacher_log_prob(data)

    def _engine_teacher(self, distillation: DistillationLossConfig) -> Any:
        from megatron_rl.rollout.hf_engine import resolve_dtype  # transformers: the HF engine's model classes
        from megatron_rl.workers.teacher import EngineTeacher  # as above

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        arr = self.config.actor_rollout_ref
        return EngineTeacher(_teacher_path(self.config), distillation, device,
                             resolve_dtype(str(arr.rollout.dtype), device), arr.ref.log_prob_micro_batch_size_per_gpu)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        self.rollout.release()
        return self.actor.update_actor(data)

    @register(Dispatch.ONE_TO_ALL)
    def release_rollout(self) -> None:
        """The step's training phase starts (trainer/steps.py ``log_probs``, before whichever role computes
        first): the colocated engine gives its memory back. The compute calls above release too, but the critic
        (another worker in these processes) can come first: bypass mode without a reference."""
        self.rollout.release()

    def shutdown(self) -> None:
        """Stop the rollout engine this rank started (vLLM's engine core and workers are processes of their own).
        An in-process run calls it at its end (trainer/runner.py); a Ray worker's engine goes with its process."""
        if self.rollout is not None:
            self.rollout.shutdown()
            self.rollout = None

    # ------------------------------------------------------------------ checkpoints
    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.actor.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.actor.load_checkpoint(path)

    @register(Dispatch.RANK_ZERO)
    def save_hf(self, path: str) -> None:
        """Collective export; global rank 0 writes the directory."""
        from megatron_rl.weights import save_hf_checkpoint  # megatron-core: the weight export

        # megatron.param_offload: the weights are on the host between syncs; read on the host they crash (SIGSEGV on
        # CPU), so they come back for the export and leave again as after a sync
        self.actor.engine.offload.enter("compute")
        save_hf_checkpoint(self.actor.engine.model, path, tokenizer_dir=self._tokenizer_dir())
        self._offload_for_generation()

    # ------------------------------------------------------------------ helpers
    def _tokenizer_dir(self) -> str:
        return self.config.data.tokenizer or self.config.actor_rollout_ref.model.path

    def _trainer_log_probs(self, data: DataProto) -> torch.Tensor:
        data.meta_info.setdefault("temperature", 1.0)
        return self.actor.compute_log_prob(data).batch["old_log_probs"]

    def _record_routing(self) -> Any:
        """MoE: record the actor's routing in the forwards inside (the probe's log-prob pass)."""
        return recording_routing(self.actor.engine)


class CriticWorker(Worker):
    """One rank of the critic (value model); colocated with the hybrid engine under the same layout."""

    def __init__(self, config: PPOTrainerConfig) -> None:
        super().__init__()
        self.config = trainer_config(config, type(self).__name__)
        agree_with_the_rollout_engine(self.config)  # before any communicator: torchrun's group is lazy
        self.critic = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from megatron_rl.workers import CriticRole, MegatronEngine  # megatron-core, as in ActorRolloutRefWorker

        cfg = self.config
        critic_cfg, actor_cfg = cfg.critic, cfg.actor_rollout_ref.actor
        setup_parallel_state(critic_cfg.megatron, collective_timeout_s(cfg))
        engine = MegatronEngine(critic_cfg.model.path, critic_cfg.megatron, critic_cfg.optim, value_head=True,
                                value_head_init=critic_cfg.value_head_init, name="critic",
                                override_config=critic_cfg.model.override_config, lora=critic_cfg.model.lora)
        self.critic = CriticRole(engine, critic_cfg, rollout_n=cfg.actor_rollout_ref.rollout.n,
                                 ppo_mini_batch_size=critic_cfg.ppo_mini_batch_size or actor_cfg.ppo_mini_batch_size,
                                 ppo_epochs=critic_cfg.ppo_epochs or actor_cfg.ppo_epochs)
        self.set_mesh(**engine.mesh_kwargs())

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        return self.critic.compute_values(data)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        return self.critic.update_critic(data)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.critic.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.critic.load_checkpoint(path)
