"""RLTrainer's loop, checkpoints, signals and metric sinks, driven by in-process fake workers (fast: no
Ray, no Megatron). The real stack runs in tests/e2e."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.plan.validate import validate
from megatron_rl.protocol import DataProto
from megatron_rl.trainer.checkpointing import LATEST_FILE, TrainerCheckpointer
from megatron_rl.trainer.rl_trainer import RLTrainer
from megatron_rl.trainer.signals import StopRequest
from megatron_rl.trainer.tracking import JsonlSink, read_metrics

P, R = 3, 4  # prompt and response widths


class FakeLoader:
    """Prompts 0..N-1 in order, with the resumable-loader interface the trainer uses."""

    def __init__(self, num_prompts: int, batch_size: int) -> None:
        self.num_prompts, self.batch_size = num_prompts, batch_size
        self.epoch, self.batches_done = 0, 0

    def __len__(self) -> int:
        return self.num_prompts // self.batch_size

    def __iter__(self):
        while self.batches_done < len(self):
            start = self.batches_done * self.batch_size
            self.batches_done += 1
            ids = torch.arange(start, start + self.batch_size).repeat_interleave(P).view(-1, P)
            yield DataProto.from_single_dict({
                "input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(P).expand_as(ids),
                "data_source": ["fake"] * self.batch_size,
                "reward_model": [{"ground_truth": str(i)} for i in range(start, start + self.batch_size)],
            })
        self.epoch, self.batches_done = self.epoch + 1, 0

    def state_dict(self):
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state):
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]


class FakeActorRollout:
    """Responses whose length encodes the prompt id and the copy (tests use n=2): prompt p, copy k has
    1 + (p % 2) * k valid tokens, so only odd prompts' groups differ in score. Records every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.saved: list[str] = []
        self.synced: list[int] = []

    def generate_sequences(self, gen: DataProto) -> DataProto:
        self.calls.append("generate_sequences")
        prompt_ids = gen.batch["input_ids"][:, 0]
        copy = torch.arange(len(gen)) % 2
        lengths = 1 + (prompt_ids % 2) * copy
        if gen.meta_info.get("do_sample") is False:
            lengths = torch.full_like(lengths, R)
        mask = (torch.arange(R) < lengths[:, None]).long()
        responses = torch.full((len(gen), R), 7) * mask
        return DataProto.from_dict({
            "prompts": gen.batch["input_ids"], "responses": responses, "response_mask": mask,
            "input_ids": torch.cat([gen.batch["input_ids"], responses], 1),
            "attention_mask": torch.cat([gen.batch["attention_mask"], mask], 1),
            "position_ids": torch.arange(P + R).expand(len(gen), -1),
        })

    def compute_log_prob(self, data):
        self.calls.append("compute_log_prob")
        assert data.meta_info["temperature"] == 1.0
        return DataProto.from_dict({"old_log_probs": torch.zeros(len(data), R)})

    def compute_ref_log_prob(self, data):
        self.calls.append("compute_ref_log_prob")
        return DataProto.from_dict({"ref_log_prob": torch.zeros(len(data), R)})

    def update_actor(self, data):
        self.calls.append("update_actor")
        data.require("advantages", "returns", "old_log_probs", where="fake update_actor")
        return DataProto(meta_info={"metrics": {"actor/pg_loss": float(data.batch["advantages"].abs().sum())}})

    def sync_weights(self, version):
        self.calls.append("sync_weights")
        self.synced.append(version)
        return {"weight_sync/version": float(version)}

    def save_checkpoint(self, path):
        os.makedirs(path)
        self.saved.append(path)

    def load_checkpoint(self, path):
        assert os.path.isdir(path)

    def save_hf(self, path):
        self.calls.append("save_hf")


def length_reward(batch: DataProto) -> DataProto:
    mask = batch.batch["response_mask"]
    scores = torch.zeros(mask.shape)
    lengths = mask.sum(-1)
    rows = torch.arange(len(batch))[lengths > 0]
    scores[rows, lengths[lengths > 0] - 1] = lengths[lengths > 0].float() / R
    return DataProto.from_dict({"token_level_scores": scores}, meta_info={"reward_metrics": {"reward/errors": 0.0}})


class Collect:
    def __init__(self):
        self.records = {}

    def log(self, metrics, step):
        self.records.setdefault(step, {}).update(metrics)


def make_trainer(tmp_path, *overrides, loader=None, actor=None, stop=None):
    cfg = load_config(overrides=[
        f"trainer.default_local_dir={tmp_path}", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.total_training_steps=3", *overrides,
    ])
    actor = actor or FakeActorRollout()
    loader = loader if loader is not None else FakeLoader(16, 2)  # an empty loader is falsy
    trainer = RLTrainer(cfg, validate(cfg), actor, None, length_reward, loader, None, stop=stop)
    trainer.tracking = Collect()
    return trainer, actor


def test_one_step_follows_the_lifeline(tmp_path):
    trainer, actor = make_trainer(tmp_path, "trainer.total_training_steps=1", "trainer.save_hf_at_end=false")
    trainer.fit()
    assert actor.calls == ["generate_sequences", "compute_log_prob", "update_actor", "sync_weights"]
    record = trainer.tracking.records[1]
    for key in ("critic/score/mean", "critic/advantages/mean", "response_length/mean", "timing_s/step", "timing_s/gen",
                "perf/throughput", "actor/pg_loss", "weight_sync/version", "reward/errors"):
        assert key in record, key
    assert actor.synced == [1]


def test_kl_in_reward_asks_the_reference_and_writes_penalised_rewards(tmp_path):
    trainer, actor = make_trainer(tmp_path, "algorithm.use_kl_in_reward=true", "trainer.total_training_steps=1")
    trainer.fit()
    assert "compute_ref_log_prob" in actor.calls
    assert "actor/reward_kl_penalty_coeff" in trainer.tracking.records[1]


def test_remax_uses_a_greedy_rollout_as_baseline(tmp_path):
    trainer, actor = make_trainer(tmp_path, "algorithm.adv_estimator=remax", "trainer.total_training_steps=1")
    trainer.fit()
    assert actor.calls.count("generate_sequences") == 2  # samples + one greedy response per prompt
    # greedy responses are full length (score 1.0), so every advantage is score - 1 <= 0
    assert trainer.last_batch.batch["advantages"].max() <= 0


def test_dynamic_sampling_drops_uninformative_groups_and_refills(tmp_path):
    trainer, actor = make_trainer(tmp_path, "algorithm.filter_groups.enable=true", "trainer.total_training_steps=1")
    trainer.fit()
    record = trainer.tracking.records[1]
    assert "dynamic_sampling/num_dropped_groups" in record
    assert record["dynamic_sampling/num_dropped_groups"] == 2  # prompts 0 and 2
    assert record["dynamic_sampling/num_gen_batches"] == 2
    uids = trainer.last_batch.non_tensor_batch["uid"]
    assert len(trainer.last_batch) == 4 and len(set(uids)) == 2  # two whole groups of n=2
    scores = trainer.last_batch.batch["token_level_scores"].sum(-1).view(2, 2)
    assert bool((scores[:, 0] != scores[:, 1]).all()), "every kept group has score variance"


def test_checkpoint_resume_continues_data_and_step(tmp_path):
    trainer, actor = make_trainer(tmp_path, "trainer.save_freq=2", "trainer.save_hf_at_end=false")
    trainer.fit()
    straight = dict(trainer.tracking.records)

    first, _ = make_trainer(tmp_path / "b", "trainer.save_freq=2", "trainer.total_training_steps=2",
                            "trainer.save_hf_at_end=false")
    first.fit()
    resumed, resumed_actor = make_trainer(tmp_path / "b", "trainer.save_freq=2", "trainer.save_hf_at_end=false")
    assert resumed.resume() == 2
    assert resumed_actor.synced == [2]  # the engine is re-synced to the restored weights
    resumed.fit()
    assert sorted(resumed.tracking.records) == [3]
    assert resumed.tracking.records[3]["critic/score/mean"] == straight[3]["critic/score/mean"]
    assert (tmp_path / "b" / LATEST_FILE).read_text() == "3"  # the last step is saved too


def test_stop_signal_saves_and_ends_after_the_step(tmp_path):
    stop = StopRequest().install()
    try:
        trainer, actor = make_trainer(tmp_path, "trainer.total_training_steps=5", stop=stop)
        os.kill(os.getpid(), signal.SIGUSR1)
        trainer.fit()
    finally:
        stop.restore()  # SIGINT too: ctrl-C stops pytest again
    assert sorted(trainer.tracking.records) == [1]
    assert (tmp_path / "global_step_1" / "trainer_state.json").is_file()
    assert "save_hf" not in actor.calls  # a preempted run is not finished


def test_a_stop_signal_while_a_step_is_logged_saves_that_step_or_trains_on(tmp_path):
    """The signal lands after the step's save was decided (here: while its metrics are written, when an
    operator watching them sends it). The run must not end on that step unsaved: the stop is seen at the
    next step's end, which is saved. Before, the loop ended on step 1 saying "resumable" with no checkpoint."""
    stop = StopRequest().install()
    try:
        trainer, actor = make_trainer(tmp_path, "trainer.total_training_steps=5", "trainer.save_freq=-1", stop=stop)
        logged = trainer.tracking.log

        def log_then_signal(metrics, step):
            logged(metrics, step)
            if step == 1:
                os.kill(os.getpid(), signal.SIGUSR1)

        trainer.tracking.log = log_then_signal
        trainer.fit()
    finally:
        stop.restore()  # SIGINT too: ctrl-C stops pytest again
    assert trainer.stopped == "SIGUSR1"
    assert sorted(trainer.tracking.records) == [1, 2]
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2"]
    assert "save_hf" not in actor.calls


def test_checkpointer_is_atomic_and_keeps_the_last_k(tmp_path):
    ckpt = TrainerCheckpointer(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        with ckpt.saving(step) as tmp:
            ckpt.write_trainer_state(tmp, {"global_steps": step})
    assert ckpt.completed_steps() == [2, 3]
    with pytest.raises(RuntimeError):
        with ckpt.saving(4) as tmp:
            raise RuntimeError("crash mid-save")
    assert ckpt.completed_steps() == [2, 3]  # the half-written step 4 is not a checkpoint
    assert ckpt.resume_path("auto", None) == tmp_path / "global_step_3"
    assert ckpt.resume_path("disable", None) is None
    with pytest.raises(ValueError, match="resume_from_path"):
        ckpt.resume_path("resume_path", None)
    with pytest.raises(ValueError, match="resume_mode='sometimes'"):
        ckpt.resume_path("sometimes", None)
    with pytest.raises(FileNotFoundError, match="no trainer_state.json"):
        ckpt.read_trainer_state(tmp_path)


def test_only_the_writer_rank_touches_the_checkpoint_layout(tmp_path):
    calls = []
    reader = TrainerCheckpointer(tmp_path, keep_last=1, is_writer=False, barrier=lambda: calls.append("barrier"))
    with reader.saving(1) as tmp:
        reader.write_trainer_state(tmp, {"global_steps": 1})
    assert not any(tmp_path.iterdir())  # the writer (another rank) makes and renames the directory
    assert calls == ["barrier"] * 3


def test_jsonl_sink_drops_records_past_the_restart_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)))
    sink = JsonlSink(path, initial_step=2)
    sink.log({"x": 30.0, "bad": float("nan")}, 3)
    sink.close()
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["x"] == 30.0 and records[-1]["bad"] == "nan"
    JsonlSink(path, initial_step=0).close()  # a fresh run starts with an empty file
    assert read_metrics(path) == []


def test_uids_are_deterministic_per_step():
    from megatron_rl.trainer.steps import new_uids

    assert list(new_uids(3, 2)) == ["3-0", "3-1"]
    assert np.array_equal(new_uids(3, 2), new_uids(3, 2))


class RolloutLogProbActor(FakeActorRollout):
    """Returns rollout log-probs that differ from the (zero) old log-probs."""

    def generate_sequences(self, gen):
        out = super().generate_sequences(gen)
        out.batch["rollout_log_probs"] = -0.5 * torch.arange(R, dtype=torch.float32).expand(len(gen), R).clone()
        return out

    def update_actor(self, data):
        self.seen = data
        return super().update_actor(data)


def test_rollout_correction_weights_reach_the_actor(tmp_path):
    actor = RolloutLogProbActor()
    trainer, _ = make_trainer(tmp_path, "trainer.total_training_steps=1", "trainer.save_hf_at_end=false",
                              "algorithm.rollout_correction.rollout_is=token",
                              "algorithm.rollout_correction.rollout_is_threshold=2.0", actor=actor)
    trainer.fit()
    weights = actor.seen.batch["rollout_is_weights"]
    mask = actor.seen.batch["response_mask"].float()
    expected = torch.exp(0.5 * torch.arange(R, dtype=torch.float32)).clamp(max=2.0) * mask
    torch.testing.assert_close(weights, expected)
    assert "rollout_corr/rollout_is_mean" in trainer.tracking.records[1]


def test_rollout_correction_bypass_mode_skips_the_old_log_prob_pass(tmp_path):
    actor = RolloutLogProbActor()
    trainer, _ = make_trainer(tmp_path, "trainer.total_training_steps=1", "trainer.save_hf_at_end=false",
                              "algorithm.rollout_correction.bypass_mode=true", actor=actor)
    trainer.fit()
    assert "compute_log_prob" not in actor.calls
    assert torch.equal(actor.seen.batch["old_log_probs"], actor.seen.batch["rollout_log_probs"])
