"""The colocated workers a trainer drives: actor + reference + rollout in one process per rank (the
hybrid engine), and the critic, which can share those processes.

Each rank holds a full rollout-engine replica (rollout data parallelism over all ranks) next to its
Megatron shard of the actor; after every update the actor's weights are exported under HF names
(TP gathered, PP broadcast) and streamed into the local engine. The same classes run under Ray
(``RayWorkerGroup``) and torchrun (``LocalWorkerGroup``).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from megatron_rl.controller import Dispatch, Worker, register
from megatron_rl.protocol import DataProto

# Megatron-Core warns on import, in every process, that Apex / Transformer Engine are absent and it uses
# its torch fallbacks: expected on CPU machines (docs/models.md), and noise that buries the training log.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)


def _as_config(config: dict[str, Any] | DictConfig) -> DictConfig:
    return config if isinstance(config, DictConfig) else OmegaConf.create(config)


def setup_parallel_state(megatron_cfg: Any) -> None:
    """Initialise torch.distributed (from the launcher's environment) and Megatron's parallel state once
    per process; colocated roles share it, so a second call must ask for the same layout."""
    from megatron.core import parallel_state

    from megatron_rl.distributed import init_distributed, init_model_parallel

    init_distributed()
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
                        cp=wanted[2], seed=megatron_cfg.seed)


class ActorRolloutRefWorker(Worker):
    """One rank of the hybrid engine. ``config`` is the whole trainer config (a plain dict under Ray)."""

    def __init__(self, config: dict[str, Any] | DictConfig) -> None:
        super().__init__()
        self.config = _as_config(config)
        self.actor = self.ref = self.rollout = self.syncer = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from megatron_rl.rollout import WeightSyncer, build_rollout_engine
        from megatron_rl.workers import ActorRole, MegatronEngine, ReferenceRole

        cfg = self.config
        arr = cfg.actor_rollout_ref
        model_dir = arr.model.path
        setup_parallel_state(arr.actor.megatron)
        engine = MegatronEngine(model_dir, arr.actor.megatron, arr.actor.optim, name="actor_rollout_ref.actor",
                                override_config=arr.model.override_config)
        self.actor = ActorRole(engine, arr.actor, rollout_n=arr.rollout.n,
                               log_prob_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu)
        if cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss:
            ref_engine = MegatronEngine(model_dir, arr.ref.megatron, None, name="actor_rollout_ref.ref",
                                        override_config=arr.model.override_config)
            self.ref = ReferenceRole(ref_engine, arr.ref)
        self.set_mesh(**engine.mesh_kwargs())

        engine_kwargs = (dict(arr.rollout.sglang, base_gpu_id=self.local_rank) if arr.rollout.name == "sglang"
                         else {})
        self.rollout = build_rollout_engine(arr.rollout, model_dir, response_length=cfg.data.max_response_length,
                                            override_config=arr.model.override_config, **self._token_ids(),
                                            **engine_kwargs)
        self.syncer = WeightSyncer(arr.rollout.weight_sync, self.rollout, probe_prompts=self._probe_prompts(),
                                   trainer_log_prob_fn=self._trainer_log_probs)
        # The engine starts from random weights: the first sync (version 0, verified) makes it serve the actor's.
        self.sync_weights(0)

    # ------------------------------------------------------------------ rollout
    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample this rank's share; then, with rollout.free_cache_engine, the engine sleeps so the
        training phases get its memory back (the next sync wakes it)."""
        self.rollout.wake_up()
        try:
            return self.rollout.generate_sequences(prompts)
        finally:
            if self.config.actor_rollout_ref.rollout.free_cache_engine:
                self.rollout.sleep()

    @register(Dispatch.RANK_ZERO)
    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the actor's current weights into this rank's engine (every rank takes part in the export);
        the driver gets rank 0's metrics. The engine stays awake: generation comes next. ``version`` is
        the training step the weights come from; every sample generated with them carries it."""
        self.rollout.wake_up()
        return self.syncer.sync(self.actor.named_hf_weights(), version=version)

    # ------------------------------------------------------------------ actor / reference
    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        return self.actor.compute_log_prob(data)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob called but no reference model was built: neither "
                               "algorithm.use_kl_in_reward nor actor_rollout_ref.actor.use_kl_loss is set")
        return self.ref.compute_ref_log_prob(data)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        return self.actor.update_actor(data)

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
        from megatron_rl.models import save_hf_checkpoint

        save_hf_checkpoint(self.actor.engine.model, path, tokenizer_dir=self._tokenizer_dir())

    # ------------------------------------------------------------------ helpers
    def _tokenizer_dir(self) -> str:
        return self.config.data.tokenizer or self.config.actor_rollout_ref.model.path

    def _token_ids(self) -> dict[str, Any]:
        from megatron_rl.data import load_tokenizer

        tokenizer = load_tokenizer(self._tokenizer_dir())
        return {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}

    def _probe_prompts(self) -> DataProto:
        """A fixed batch for sync verification: the first training prompts."""
        from megatron_rl.data import RLDataset, load_tokenizer, make_dataloader

        cfg = self.config
        dataset = RLDataset.from_config(list(cfg.data.train_files), load_tokenizer(self._tokenizer_dir()), cfg.data)
        size = min(cfg.actor_rollout_ref.rollout.weight_sync.probe_batch_size, len(dataset))
        probe = next(iter(make_dataloader(dataset, size, shuffle=False, seed=0)))
        return probe.pop_for_generation()

    def _trainer_log_probs(self, data: DataProto) -> torch.Tensor:
        data.meta_info.setdefault("temperature", 1.0)
        return self.actor.compute_log_prob(data).batch["old_log_probs"]


class CriticWorker(Worker):
    """One rank of the critic (value model); colocated with the hybrid engine under the same layout."""

    def __init__(self, config: dict[str, Any] | DictConfig) -> None:
        super().__init__()
        self.config = _as_config(config)
        self.critic = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from megatron_rl.workers import CriticRole, MegatronEngine

        cfg = self.config
        critic_cfg, actor_cfg = cfg.critic, cfg.actor_rollout_ref.actor
        setup_parallel_state(critic_cfg.megatron)
        engine = MegatronEngine(critic_cfg.model.path, critic_cfg.megatron, critic_cfg.optim, value_head=True,
                                value_head_init=critic_cfg.value_head_init, name="critic",
                                override_config=critic_cfg.model.override_config)
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
