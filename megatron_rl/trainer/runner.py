"""Assemble a run from a validated config: data, reward, worker groups (Ray or torchrun), the trainer.

Both launchers build the same `RLTrainer`; only the worker groups differ. Under Ray the driver process
hosts the trainer and one Ray actor per rank hosts the workers; under torchrun every rank runs the
trainer over in-process workers (`LocalWorkerGroup`) and rank 0 logs. A one-rank Ray job with nothing else
to place runs as a one-process torchrun job would, in the driver (controller/in_driver.py): no Ray at all.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

from megatron_rl.config import PPOTrainerConfig, typed_config
from megatron_rl.controller.deferred_compile import deferred_compile
from megatron_rl.controller.in_driver import enter_driver_rank, ray_needed_for
from megatron_rl.controller.local_group import LocalWorkerGroup
from megatron_rl.distributed import init_distributed
from megatron_rl.plan.validate import DerivedSizes
from megatron_rl.data import RLDataset, load_tokenizer, make_dataloader
from megatron_rl.protocol import DataProto
from megatron_rl.trainer.reward_setup import build_reward_fn
from megatron_rl.trainer.checkpointing import TrainerCheckpointer
from megatron_rl.controller.deadlines import call_deadlines, collective_timeout_s
from megatron_rl.trainer.disaggregated import build_trainer, start_rollout_servers
from megatron_rl.trainer.loop import config_dict, fill_optimizer_steps, hf_final_dir
from megatron_rl.trainer.signals import StopRequest, keep_handlers_through_ray
from megatron_rl.trainer.tracking import Tracking, plot_curves
from megatron_rl.workers.reward_model import RewardModelWorker, colocated_with_actor, reward_model_group

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    output_dir: Path
    metrics_path: Path
    tensorboard_dir: Path
    plot_path: Path | None
    hf_dir: Path | None
    last_metrics: dict[str, float]
    stopped: str | None = None  # the signal that stopped the run before its last step (resumable)
    last_step: int = 0
    rollout_engines: str = ""  # which ranks form which rollout engine, on which node and GPUs


def _val_batches(cfg: PPOTrainerConfig, tokenizer) -> Callable[[], Iterator[DataProto]] | None:
    if not cfg.data.val_files:
        return None
    dataset = RLDataset.from_config(list(cfg.data.val_files), tokenizer, cfg.data)
    batch_size = cfg.data.val_batch_size or len(dataset)

    def batches() -> Iterator[DataProto]:
        yield from make_dataloader(dataset, batch_size, shuffle=False, seed=cfg.data.seed, drop_last=False)

    return batches


def _probe_prompts(cfg: PPOTrainerConfig, dataset: RLDataset) -> DataProto:
    """The fixed batch every weight sync is verified on: the first training prompts, in file order."""
    size = min(cfg.actor_rollout_ref.rollout.weight_sync.probe_batch_size, len(dataset))
    return next(iter(make_dataloader(dataset, size, shuffle=False, seed=0))).pop_for_generation()


def _token_ids(tokenizer) -> dict[str, Any]:
    return {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}


def _ray_groups(cfg: PPOTrainerConfig, sizes: DerivedSizes) -> tuple[Any, Any, Any, Callable[[], None]]:
    # Ray, and Megatron-Core (compiled at first use): imported only by a run on Ray
    from megatron_rl.controller import (
        RayResourcePool,
        RayWorkerGroup,
        create_colocated_worker_cls,
        init_ray_from_config,
    )
    from megatron_rl.workers.hybrid import ActorRolloutRefWorker, CriticWorker

    init_ray_from_config(cfg.ray_init)  # does nothing when Ray is already up (rollout servers, judge)
    # One bundle per rank, holding a GPU whenever the cluster has GPUs (ray_init.num_gpus declares them on
    # an embedded Ray, which is how the CPU tests give each rank its own GPU id).
    pool = RayResourcePool([cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes,
                           use_gpu=True if _device(cfg) == "cuda" else None, name="global_pool")
    # Actor, reference, rollout (and the critic and the reward model when used and colocated) share one process
    # per rank: the hybrid engine.
    workers = {"actor_rollout": ActorRolloutRefWorker}
    if sizes.uses_critic:
        workers["critic"] = CriticWorker
    if colocated_with_actor(cfg):
        workers["reward_model"] = RewardModelWorker
    if len(workers) > 1:
        cls = create_colocated_worker_cls(workers)
        group = RayWorkerGroup(pool, cls, init_args={role: {"config": cfg} for role in workers},
                               name_prefix="hybrid", timeout_s=cfg.ray_init.timeout_s,
                               method_timeouts=call_deadlines(cfg))
        roles = group.spawn()
        actor_rollout, critic, reward_model = (roles.get(r) for r in ("actor_rollout", "critic", "reward_model"))
    else:
        group = RayWorkerGroup(pool, ActorRolloutRefWorker, init_args={"config": cfg},
                               name_prefix="actor_rollout", timeout_s=cfg.ray_init.timeout_s,
                               method_timeouts=call_deadlines(cfg))
        actor_rollout, critic, reward_model = group, None, None

    def close() -> None:
        group.kill()
        pool.release()

    return actor_rollout, critic, reward_model, close


def _ray_is_up() -> bool:
    ray = sys.modules.get("ray")  # not imported: not up (and a run without Ray does not import it)
    return ray is not None and ray.is_initialized()


def _driver_groups(cfg: PPOTrainerConfig, sizes: DerivedSizes) -> tuple[Any, Any, Any, Callable[[], None]]:
    """The one rank's workers in this process, on a world-size-1 process group (then the torchrun path)."""
    leave = enter_driver_rank()
    try:
        actor_rollout, critic, reward_model, stop_engines = _torchrun_groups(cfg, sizes)
    except BaseException:
        leave()
        raise

    def close() -> None:
        try:
            stop_engines()
        finally:
            leave()

    return actor_rollout, critic, reward_model, close


def _torchrun_groups(cfg: PPOTrainerConfig, sizes: DerivedSizes) -> tuple[Any, Any, Any, Callable[[], None]]:
    with deferred_compile():  # Megatron-Core's models and fused kernels: compiled at first use, not at import
        from megatron_rl.workers.hybrid import ActorRolloutRefWorker, CriticWorker

    # the process groups wait as long as the longest call may take (controller/deadlines.py)
    launch = init_distributed(timeout=timedelta(seconds=collective_timeout_s(cfg)))
    if launch.world_size != sizes.world_size:
        raise ValueError(f"torchrun started {launch.world_size} processes but trainer.nnodes * "
                         f"trainer.n_gpus_per_node = {sizes.world_size}")
    worker = ActorRolloutRefWorker(config=cfg)
    actor_rollout = LocalWorkerGroup(worker, "actor_rollout")
    critic = LocalWorkerGroup(CriticWorker(config=cfg), "critic") if sizes.uses_critic else None
    # the run's end stops the engines this process started: a run in a test, a notebook or the demo's process
    # would otherwise leave vLLM's engine core and workers running after it returns
    return actor_rollout, critic, None, worker.shutdown  # the reward model joins these processes itself


def _checkpointer(cfg: PPOTrainerConfig, is_torchrun: bool) -> TrainerCheckpointer:
    root, keep = Path(cfg.trainer.default_local_dir), cfg.trainer.max_ckpt_to_keep
    hash_shards = bool(cfg.trainer.checkpoint_hash_shards)
    if not is_torchrun:
        return TrainerCheckpointer(root, keep, hash_shards=hash_shards)
    import torch.distributed as dist

    return TrainerCheckpointer(root, keep, is_writer=dist.get_rank() == 0, barrier=dist.barrier,
                               hash_shards=hash_shards)


def _device(cfg: PPOTrainerConfig) -> str:
    import torch

    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _stop_ray_unless(was_up: bool) -> None:
    if _ray_is_up() and not was_up:
        from megatron_rl.controller import shutdown_ray  # Ray: imported only when it is up

        shutdown_ray()


def run_training(cfg: PPOTrainerConfig, sizes: DerivedSizes) -> RunResult:
    """Build everything, train, and return where the outputs are. Config must already be validated."""
    cfg = typed_config(cfg)  # from here on the run, and every worker (pickled by Ray), reads the typed tree
    output_dir = Path(cfg.trainer.default_local_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    in_driver = cfg.trainer.launcher == "ray" and ray_needed_for(cfg, sizes.world_size) is None
    # in the driver the workers are in-process, exactly as under torchrun: only their start differs
    is_torchrun = cfg.trainer.launcher == "torchrun" or in_driver
    if in_driver:
        logger.info("one rank, no servers: the workers run in this process (no Ray; docs/launching.md)")

    tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path, cfg.data.trust_remote_code)
    train_dataset = RLDataset.from_config(list(cfg.data.train_files), tokenizer, cfg.data)
    train_loader = make_dataloader(train_dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                   seed=cfg.data.seed, drop_last=True,
                                   num_workers=cfg.data.dataloader_num_workers)
    reward_fn = build_reward_fn(cfg, tokenizer)  # rule scorers, and the reward model when reward_model.enable
    fill_optimizer_steps(cfg, len(train_loader))  # before the workers build their lr schedules

    # Installed before the workers start: a SIGTERM while they start up stops the run cleanly, too.
    stop = StopRequest().install()
    # A Ray this run finds running (the user's session, a cluster's) outlives the run; one it starts does not.
    ray_was_up = _ray_is_up()
    if not is_torchrun:  # under torchrun nothing imports Ray (a second of start-up)
        keep_handlers_through_ray()
    servers = start_rollout_servers(cfg)  # rollout servers on their own processes (server mode, name=hf)
    try:
        groups = _driver_groups if in_driver else _torchrun_groups if is_torchrun else _ray_groups
        actor_rollout, critic, reward_model, close = groups(cfg, sizes)
    except BaseException:
        if servers is not None:
            servers.close()
        _stop_ray_unless(ray_was_up)
        raise
    stop.install()  # Ray's start-up replaces the handlers with its own
    is_logger = not is_torchrun or actor_rollout.rank == 0
    tracking = None
    try:
        meshes = actor_rollout.init_model(_probe_prompts(cfg, train_dataset), _token_ids(tokenizer))
        if is_logger:
            print(f"rollout engines: {meshes[0]}", flush=True)
        if critic is not None:
            critic.init_model()
        rm_group, close_rm = reward_model_group(cfg, colocated=reward_model)  # every placement of the RM
        if rm_group is not None:
            reward_fn.attach(rm_group, close_rm)
        if stop.requested:
            logger.warning("received %s before the first step; stopping (nothing trained, nothing to save)",
                           stop.reason)
            return RunResult(output_dir, output_dir / "metrics.jsonl", output_dir / "tensorboard", None, None, {},
                             stopped=stop.reason, last_step=0)
        trainer = build_trainer(cfg, sizes, actor_rollout, critic, reward_fn, train_loader, _val_batches(cfg, tokenizer),
                                stop=stop, checkpointer=_checkpointer(cfg, is_torchrun), servers=servers,
                                token_ids=_token_ids(tokenizer))
        start_step = trainer.resume()
        if is_logger:
            tracking = Tracking(cfg.trainer.logger, output_dir, cfg.trainer.project_name, cfg.trainer.experiment_name,
                                total_steps=trainer.run.total_steps, initial_step=start_step, config=config_dict(cfg))
            trainer.tracking = tracking
        last = trainer.fit()
    finally:
        if tracking is not None:
            tracking.close()
        reward_fn.close()
        close()
        if servers is not None:
            servers.close()
        _stop_ray_unless(ray_was_up)
        stop.restore()  # ctrl-C after the run (or in the caller of run_training) is KeyboardInterrupt again

    plot = None
    if is_logger and tracking.metrics_path.exists():
        plot = plot_curves(tracking.metrics_path, output_dir / "curves.png")
    hf_dir = hf_final_dir(cfg) if cfg.trainer.save_hf_at_end and trainer.stopped is None else None
    return RunResult(output_dir, output_dir / "metrics.jsonl", output_dir / "tensorboard", plot, hf_dir, last,
                     stopped=trainer.stopped, last_step=trainer.state.global_steps, rollout_engines=meshes[0])
