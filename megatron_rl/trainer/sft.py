"""The SFT loop (issue 55; docs/sft.md): ``python -m megatron_rl.sft`` trains the model on conversations.

It is the RL loop's family by composition: the same config tree (``actor_rollout_ref.model`` / ``.actor``'s
layout, optimizer and micro-batching; ``data``; ``trainer``), the same ``Run`` and the helpers of trainer/loop.py
around each step (count, time, save when due, log, the final HF export, resume), the same checkpointer, loggers
and launchers; only the step differs: one optimizer step on a batch of conversations (workers/sft.py), and the
validation is the loss on ``data.val_files``.

    for batch in conversations:                      # data/sft.py: loss mask on the assistant's tokens
        metrics = workers.train_batch(batch)         # NLL of the masked tokens, one optimizer step
        every test_freq steps: val/loss on the validation conversations
        every save_freq steps: checkpoint (model, optimizer, data position)
    hf_final/                                        # what ``python -m megatron_rl.train`` takes as model.path
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

from megatron_rl.config import ConfigError, PPOTrainerConfig, typed_config
from megatron_rl.controller.deadlines import collective_timeout_s
from megatron_rl.controller.deferred_compile import deferred_compile
from megatron_rl.controller.in_driver import enter_driver_rank
from megatron_rl.controller.local_group import LocalWorkerGroup
from megatron_rl.data import load_tokenizer, make_dataloader
from megatron_rl.data.rows import MalformedRowError
from megatron_rl.data.sft import SFTDataset, sft_batch
from megatron_rl.distributed import init_distributed
from megatron_rl.plan.validate import DerivedSizes
from megatron_rl.protocol import DataProto, reduce_metrics
from megatron_rl.trainer import loop
from megatron_rl.trainer.checkpointing import TrainerCheckpointer
from megatron_rl.trainer.metrics import StageTimer
from megatron_rl.trainer.runner import RunResult
from megatron_rl.trainer.signals import StopRequest
from megatron_rl.trainer.tracking import Tracking, plot_curves

logger = logging.getLogger(__name__)

VAL_LOSS = "val/loss"


class SFTTrainer:
    """``workers``: the SFT worker group (workers/sft.py ``SFTWorker``); ``val_batches``: the validation
    conversations' batches, or None."""

    def __init__(self, cfg: PPOTrainerConfig, sizes: DerivedSizes, workers: Any, train_loader: Any,
                 val_batches: Callable[[], Iterator[DataProto]] | None, tracking: Any = None,
                 stop: StopRequest | None = None, checkpointer: TrainerCheckpointer | None = None) -> None:
        # no reward, no generation: the Run's RL parts stay unused (val_batches None: no generating validation)
        self.run = loop.build_run(cfg, sizes, workers, None, None, train_loader, None, stop, checkpointer)
        self.workers, self.val_batches, self.tracking = workers, val_batches, tracking
        self.stopped: str | None = None

    @property
    def state(self) -> loop.TrainerState:
        return self.run.state

    def resume(self) -> int:
        """Restore the newest checkpoint per trainer.resume_mode; the step training continues from."""
        loop.resume(self.run)
        return self.run.state.global_steps

    def fit(self) -> dict[str, float]:
        run, last, trainer = self.run, {}, self.run.cfg.trainer
        if trainer.val_before_train and self.val_batches is not None and run.state.global_steps == 0:
            loop.log(self.tracking, self.validation_loss(), step=0)
        batches = loop.loader_batches(run)
        while run.state.global_steps < run.total_steps and (batch := next(batches, None)) is not None:
            step, timer = run.state.global_steps + 1, StageTimer()
            with timer("step"):
                with timer("update_actor"):
                    metrics = reduce_metrics(self.workers.train_batch(batch).meta_info["metrics"])
                # verl's SFT rule: validate every test_freq steps and after the last (test_freq -1 too)
                if self.val_batches is not None and (loop.due(trainer.test_freq, step) or step >= run.total_steps):
                    with timer("testing"):
                        metrics |= self.validation_loss()
            last = loop.end_step(run, self.tracking, step, batch, metrics, timer, None, self.save_checkpoint)
            if run.stop.heeded:
                break
        self.stopped = loop.finish(run)
        return last

    def validation_loss(self) -> dict[str, float]:
        """``val/loss``: the NLL per assistant token over every validation conversation."""
        nll, tokens = 0.0, 0.0
        for batch in self.val_batches():
            log_probs = self.workers.token_log_probs(batch).batch["log_probs"]
            mask = batch.batch["response_mask"].to(log_probs.dtype)
            nll -= float((log_probs * mask).sum())
            tokens += float(mask.sum())
        return {VAL_LOSS: nll / max(tokens, 1.0)}

    def save_checkpoint(self) -> Path:
        return loop.save_checkpoint(self.run)


def sft_dataset(cfg: PPOTrainerConfig, tokenizer: Any, files_key: str) -> SFTDataset:
    """The conversations of ``data.<files_key>``; a bad row is a ConfigError naming its file and row."""
    data = cfg.data
    try:
        return SFTDataset(list(getattr(data, files_key)), tokenizer, max_length=data.max_length,
                          truncation=str(data.truncation), messages_key=data.messages_key,
                          prompt_key=data.prompt_key, response_key=data.response_key, tools_key=data.tools_key)
    except (MalformedRowError, OSError, ValueError) as err:
        raise ConfigError(f"data.{files_key}: {err}") from None


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an eos token to pad SFT rows with")
    return int(pad)


@dataclass(frozen=True)
class PostTraining:
    """What differs between the post-training runs that share ``run_post_training`` (SFT here, DPO in trainer/dpo.py):
    the worker group's name, its worker class (a callable: the class imports Megatron-Core, which only a starting
    run pays for), the dataset of ``data.<files_key>``, the collate of its items, the loop, the plotted metrics."""

    role: str
    worker: Callable[[], type]
    dataset: Callable[[PPOTrainerConfig, Any, str], Any]
    collate: Callable[..., DataProto]  # (items, pad_token_id=...) -> one batch
    trainer: type[SFTTrainer]
    plot_keys: tuple[str, ...]


def _sft_worker() -> type:
    with deferred_compile():  # Megatron-Core's models and fused kernels: compiled at first use
        from megatron_rl.workers.sft import SFTWorker
    return SFTWorker


SFT = PostTraining("sft", _sft_worker, sft_dataset, sft_batch, SFTTrainer, ("train/loss", VAL_LOSS))


def _workers(cfg: PPOTrainerConfig, sizes: DerivedSizes,
             kind: PostTraining) -> tuple[LocalWorkerGroup, Callable[[], None]]:
    """This rank's worker (torchrun; a one-rank run in this process is rank 0 of 1)."""
    worker = kind.worker()
    leave = enter_driver_rank() if cfg.trainer.launcher != "torchrun" else (lambda: None)
    try:
        launch = init_distributed(timeout=timedelta(seconds=collective_timeout_s(cfg)))
        if launch.world_size != sizes.world_size:
            raise ValueError(f"torchrun started {launch.world_size} processes but trainer.nnodes * "
                             f"trainer.n_gpus_per_node = {sizes.world_size}")
        return LocalWorkerGroup(worker(config=cfg), kind.role), leave
    except BaseException:
        leave()
        raise


def _checkpointer(cfg: PPOTrainerConfig) -> TrainerCheckpointer:
    import torch.distributed as dist  # initialised by _workers

    return TrainerCheckpointer(Path(cfg.trainer.default_local_dir), cfg.trainer.max_ckpt_to_keep,
                               is_writer=dist.get_rank() == 0, barrier=dist.barrier,
                               hash_shards=bool(cfg.trainer.checkpoint_hash_shards))


def _loaders(cfg: PPOTrainerConfig, kind: PostTraining) -> tuple[Any, Callable[[], Iterator[DataProto]] | None]:
    """The training loader and the validation batches (None without data.val_files); every row is checked here,
    before a worker starts."""
    tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path, cfg.data.trust_remote_code)
    collate = functools.partial(kind.collate, pad_token_id=_pad_id(tokenizer))
    train = kind.dataset(cfg, tokenizer, "train_files")
    val = kind.dataset(cfg, tokenizer, "val_files") if cfg.data.val_files else None
    train_loader = make_dataloader(train, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                                   drop_last=True, num_workers=cfg.data.dataloader_num_workers, collate_fn=collate)
    if val is None:
        return train_loader, None

    def val_batches() -> Iterator[DataProto]:
        yield from make_dataloader(val, cfg.data.val_batch_size or len(val), shuffle=False, seed=cfg.data.seed,
                                   drop_last=False, collate_fn=collate)

    return train_loader, val_batches


def run_post_training(cfg: PPOTrainerConfig, sizes: DerivedSizes, kind: PostTraining = SFT) -> RunResult:
    """Build the data and the workers, train, export; the config must be validated (``validate_sft`` or the
    run's own)."""
    cfg = typed_config(cfg)
    output_dir = Path(cfg.trainer.default_local_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    train_loader, val_batches = _loaders(cfg, kind)
    loop.fill_optimizer_steps(cfg, len(train_loader))
    stop = StopRequest().install()
    workers, leave = _workers(cfg, sizes, kind)
    tracking = None
    try:
        workers.init_model()
        trainer = kind.trainer(cfg, sizes, workers, train_loader, val_batches, stop=stop,
                               checkpointer=_checkpointer(cfg))
        start_step = trainer.resume()
        if workers.rank == 0:
            tracking = Tracking(cfg.trainer.logger, output_dir, cfg.trainer.project_name, cfg.trainer.experiment_name,
                                total_steps=trainer.run.total_steps, initial_step=start_step,
                                config=loop.config_dict(cfg))
            trainer.tracking = tracking
        last = trainer.fit()
    finally:
        if tracking is not None:
            tracking.close()
        leave()
        stop.restore()
    plot = None
    if tracking is not None and tracking.metrics_path.exists():
        plot = plot_curves(tracking.metrics_path, output_dir / "curves.png", keys=kind.plot_keys)
    hf_dir = loop.hf_final_dir(cfg) if cfg.trainer.save_hf_at_end and trainer.stopped is None else None
    return RunResult(output_dir, output_dir / "metrics.jsonl", output_dir / "tensorboard", plot, hf_dir, last,
                     stopped=trainer.stopped, last_step=trainer.state.global_steps)

