"""What every training loop shares around its steps: the run's parts and state (``Run``), the data's batches,
what happens before the first step, after each step (count it, time it, validate and save when due, log) and
after the last (say why it ended, export the model), and the checkpoint of a step (save, resume).

A loop passes what differs as values: its ``generate`` (for validation), its tracking sink, and to
``save_checkpoint`` the writer of its own state (the rollouts an async loop generated ahead).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from omegaconf import DictConfig, OmegaConf

from megatron_rl.algos import get_kl_controller
from megatron_rl.config.schema import OptimConfig, PPOTrainerConfig
from megatron_rl.plan.validate import DerivedSizes
from megatron_rl.protocol import DataProto
from megatron_rl.reward.overlap import OverlappedScoring
from megatron_rl.trainer.checkpointing import HF_FINAL_DIR, TRAINER_STATE_FILE, TrainerCheckpointer
from megatron_rl.trainer.run_identity import write_identity
from megatron_rl.trainer.metrics import StageTimer, compute_throughput_metrics
from megatron_rl.trainer.signals import StopRequest
from megatron_rl.trainer.steps import Generate, RewardFailures
from megatron_rl.trainer.validation import validate

logger = logging.getLogger(__name__)


class ActorRolloutRef(Protocol):
    """What the loops need from the colocated actor + reference + rollout workers."""

    def generate_sequences(self, data: DataProto) -> DataProto: ...
    def compute_log_prob(self, data: DataProto) -> DataProto: ...
    def compute_ref_log_prob(self, data: DataProto) -> DataProto: ...
    def update_actor(self, data: DataProto) -> DataProto: ...
    def sync_weights(self, version: int) -> dict[str, float]: ...
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...
    def save_hf(self, path: str) -> None: ...


class Critic(Protocol):
    def compute_values(self, data: DataProto) -> DataProto: ...
    def update_critic(self, data: DataProto) -> DataProto: ...
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...


# Scores a batch: returns token_level_scores (+ per-sample extras such as `acc`), with the step's
# reward metrics in meta_info["reward_metrics"] (megatron_rl.reward.RewardManager).
RewardFn = Callable[[DataProto], DataProto]


@dataclass
class TrainerState:
    """Everything of the driver that a resumed run needs to continue as if never stopped."""

    global_steps: int = 0
    dataloader: dict[str, Any] = field(default_factory=dict)
    kl_ctrl: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_saved(cls, saved: Any, source: Path) -> TrainerState:
        """The state a checkpoint's trainer_state.json (``source``) holds; a renamed, missing or extra key is refused
        naming the file and the key (a missing one would silently restart from its default)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(saved, dict):
            raise ValueError(f"{source}: holds {type(saved).__name__}, expected a JSON object with keys {names}")
        problems = [f"no key {name!r}" for name in names if name not in saved]
        problems += [f"an unknown key {name!r}" for name in sorted(set(saved) - set(names))]
        if problems:
            raise ValueError(f"{source}: {', '.join(problems)} (a trainer state holds exactly {names}): renamed or "
                             f"damaged; resume from another checkpoint")
        return cls(**saved)


@dataclass
class Run:
    """The parts every step of a run uses, and the run's state (what a checkpoint keeps)."""

    cfg: PPOTrainerConfig
    sizes: DerivedSizes
    actor_rollout: ActorRolloutRef
    critic: Critic | None
    reward_fn: RewardFn
    train_loader: Any
    val_batches: Callable[[], Iterator[DataProto]] | None
    stop: StopRequest
    checkpointer: TrainerCheckpointer
    total_steps: int
    n: int  # responses per prompt
    use_critic: bool
    use_reference: bool
    kl_ctrl: Any  # the KL-in-reward controller, else None
    overlap: OverlappedScoring | None  # reward.overlap: scoring overlapped with generation
    reward_failures: RewardFailures
    state: TrainerState = field(default_factory=TrainerState)


def build_run(cfg: PPOTrainerConfig, sizes: DerivedSizes, actor_rollout: ActorRolloutRef, critic: Critic | None,
              reward_fn: RewardFn, train_loader, val_batches: Callable[[], Iterator[DataProto]] | None,
              stop: StopRequest | None = None, checkpointer: TrainerCheckpointer | None = None) -> Run:
    algo, overlap = cfg.algorithm, cfg.reward.overlap
    return Run(cfg=cfg, sizes=sizes, actor_rollout=actor_rollout, critic=critic, reward_fn=reward_fn,
               train_loader=train_loader, val_batches=val_batches, stop=stop or StopRequest(),
               checkpointer=checkpointer or TrainerCheckpointer(
                   Path(cfg.trainer.default_local_dir), cfg.trainer.max_ckpt_to_keep,
                   hash_shards=bool(cfg.trainer.checkpoint_hash_shards)),
               total_steps=total_steps(cfg, len(train_loader), sizes.uses_critic),
               n=cfg.actor_rollout_ref.rollout.n, use_critic=sizes.uses_critic,
               use_reference=algo.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss,
               kl_ctrl=get_kl_controller(algo.kl_ctrl) if algo.use_kl_in_reward else None,
               overlap=OverlappedScoring(reward_fn, overlap.num_chunks) if overlap.enable else None,
               reward_failures=RewardFailures(cfg.reward.max_failed_steps))


# ---------------------------------------------------------------------- the run's length
def planned_steps(cfg: PPOTrainerConfig, batches_per_epoch: int) -> int:
    """The run's step count: ``trainer.total_training_steps``, else epochs x batches per epoch (verl's rule)."""
    if cfg.trainer.total_training_steps is not None:
        return int(cfg.trainer.total_training_steps)
    total = batches_per_epoch * cfg.trainer.total_epochs
    if total == 0:
        raise ValueError(f"the training data gives 0 steps: {batches_per_epoch} batches of "
                         f"data.train_batch_size={cfg.data.train_batch_size} prompts per epoch x "
                         f"trainer.total_epochs={cfg.trainer.total_epochs}; use more prompts or a "
                         f"smaller data.train_batch_size")
    return total


def optimizers(cfg: PPOTrainerConfig) -> dict[str, OptimConfig]:
    """The optimizer sections by the key they are set under."""
    return {"actor_rollout_ref.actor": cfg.actor_rollout_ref.actor.optim, "critic": cfg.critic.optim}


def fill_optimizer_steps(cfg: PPOTrainerConfig, batches_per_epoch: int) -> None:
    """An optimizer's ``total_training_steps: -1`` becomes the run's step count (as verl fills it), before the
    workers are built: the cosine schedule decays over it."""
    total = planned_steps(cfg, batches_per_epoch)
    for optim in optimizers(cfg).values():
        if optim.total_training_steps == -1:
            optim.total_training_steps = total


def total_steps(cfg: PPOTrainerConfig, batches_per_epoch: int, use_critic: bool) -> int:
    total = planned_steps(cfg, batches_per_epoch)
    for role, optim in optimizers(cfg).items():
        warmup = optim.lr_warmup_steps
        if warmup > total and (role != "critic" or use_critic):
            raise ValueError(f"{role}.optim.lr_warmup_steps={warmup} is longer than the {total} training steps")
    return total


def loader_batches(run: Run) -> Iterator[DataProto]:
    """Batches across epochs; the loader's own state says which epoch and position come next."""
    while run.train_loader.epoch < run.cfg.trainer.total_epochs:
        yield from run.train_loader


# ---------------------------------------------------------------------- around the steps
def start(run: Run, tracking: Any, generate: Generate) -> None:
    """Before the first step: say so when the run already finished; validate first when asked."""
    if run.state.global_steps >= run.total_steps > 0:
        logger.warning("the run in %s already finished its %d steps; nothing to train",
                       run.cfg.trainer.default_local_dir, run.total_steps)
    if run.cfg.trainer.val_before_train and run.val_batches is not None and run.state.global_steps == 0:
        log(tracking, validate(run, generate, tracking), step=0)


def end_step(run: Run, tracking: Any, step: int, batch: DataProto, metrics: dict[str, float], timer: StageTimer,
             generate: Generate, save: Callable[[], Path]) -> dict[str, float]:
    """After step ``step`` trained ``batch``: count it, add its timings and throughput, validate and ``save``
    when due (the last step too, and a stopping run's), log. The step's metrics."""
    trainer = run.cfg.trainer
    run.state.global_steps = step
    metrics |= timer.metrics()
    metrics |= compute_throughput_metrics(batch, timer.seconds["step"], run.sizes.world_size)
    if due(trainer.test_freq, step) and run.val_batches is not None:
        metrics |= validate(run, generate, tracking)  # tracking: where trainer.log_val_generations go
    # The last step is saved too (when saving at all): a failed final export then costs no training.
    final = step >= run.total_steps and trainer.save_freq > 0
    stopping = run.stop.heed()
    if due(trainer.save_freq, step) or final or stopping:
        save()
    log(tracking, metrics, step)
    if stopping:
        logger.warning("stopping after step %d on %s; checkpoint saved, the run is resumable", step, run.stop.reason)
    return metrics


def finish(run: Run) -> str | None:
    """After the last step: the signal that stopped the run early (resumable), else None once the data's end is
    reported and the final HF export written."""
    if run.stop.heeded:
        return run.stop.reason
    if run.state.global_steps < run.total_steps:
        epochs = run.cfg.trainer.total_epochs
        if run.state.global_steps == 0:
            raise RuntimeError(f"the training data gave no batch: trainer.total_training_steps="
                               f"{run.total_steps} but {len(run.train_loader)} batches per epoch x "
                               f"trainer.total_epochs={epochs}; nothing was trained")
        logger.warning("the data ran out after %d of trainer.total_training_steps=%d steps "
                       "(%d batches per epoch x trainer.total_epochs=%d); raise total_epochs to train them all",
                       run.state.global_steps, run.total_steps, len(run.train_loader), epochs)
    if run.cfg.trainer.save_hf_at_end:
        export_hf(run)
    return None


def due(freq: int, step: int) -> bool:
    return freq > 0 and step % freq == 0


def log(tracking: Any, metrics: dict[str, float], step: int) -> None:
    if tracking is not None:  # None on ranks that do not log
        tracking.log(metrics, step)


def config_dict(cfg: PPOTrainerConfig | DictConfig) -> dict[str, Any]:
    """The config as the trackers record it."""
    tree = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(tree, resolve=True, enum_to_str=True)  # type: ignore[return-value]


# ---------------------------------------------------------------------- checkpoints and the final export
def hf_final_dir(cfg: PPOTrainerConfig) -> Path:
    return Path(cfg.trainer.default_local_dir) / HF_FINAL_DIR


def export_hf(run: Run) -> Path:
    """The final HF checkpoint, written to `hf_final.tmp` and renamed: `hf_final` is never half-written."""
    with run.checkpointer.publishing(hf_final_dir(run.cfg)) as tmp:
        run.actor_rollout.save_hf(str(tmp))
    return hf_final_dir(run.cfg)


def save_checkpoint(run: Run, loop_state: Callable[[Path], None] | None = None) -> Path:
    """The step's checkpoint: the workers', the trainer's state and what ``loop_state`` writes into the
    directory (an async loop's rollouts generated ahead)."""
    state = run.state
    state.dataloader = run.train_loader.state_dict()
    state.kl_ctrl = run.kl_ctrl.state_dict() if run.kl_ctrl is not None else {}
    with run.checkpointer.saving(state.global_steps) as tmp_dir:
        try:
            run.actor_rollout.save_checkpoint(str(tmp_dir / "actor"))
            if run.critic is not None:
                run.critic.save_checkpoint(str(tmp_dir / "critic"))
            run.checkpointer.write_trainer_state(tmp_dir, state.__dict__)
            if run.checkpointer.is_writer:  # the model and tokenizer it was trained with (run_identity.py)
                write_identity(tmp_dir, run.cfg)
            if loop_state is not None:
                loop_state(tmp_dir)
        except OSError:
            raise  # the checkpointer names the directory
        except Exception as err:  # a remote worker's error (Ray wraps the OSError)
            raise RuntimeError(f"saving the step-{state.global_steps} checkpoint into {tmp_dir} "
                               f"failed: {err}") from err
    return run.checkpointer.step_dir(state.global_steps)


def resume(run: Run) -> Path | None:
    """Restore the newest checkpoint per trainer.resume_mode into the workers and ``run.state``; its directory
    (the loop reads its own state from it, then syncs the engines to the restored weights), else None."""
    run.checkpointer.clean_leftovers()
    path = run.checkpointer.resume_path(run.cfg.trainer.resume_mode, run.cfg.trainer.resume_from_path)
    if path is None:
        return None
    logger.info("resuming from %s", path)
    state = TrainerState.from_saved(run.checkpointer.read_trainer_state(path), path / TRAINER_STATE_FILE)
    run.actor_rollout.load_checkpoint(str(path / "actor"))
    if run.critic is not None:
        run.critic.load_checkpoint(str(path / "critic"))
    run.state = state
    run.train_loader.load_state_dict(run.state.dataloader)
    if run.kl_ctrl is not None and run.state.kl_ctrl:
        run.kl_ctrl.load_state_dict(run.state.kl_ctrl)
    return path
