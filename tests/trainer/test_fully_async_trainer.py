"""Fully async loop (trainer/fully_async.py) on in-process fakes: responses span a weight sync with exact
per-token versions, the staleness bound is enforced (drop: whole batches, counted; mask: only the too-old
tokens), the on-policy limit (max_staleness=0) gives the synchronous trainer's numbers, and a resumed run
trains every produced batch once with the same versions as an uninterrupted one. The fake servers refuse a
weight sync while a generation is in flight and not paused (real SGLang would make the sync wait), so a loop
that forgot the pause fails. The real stack runs in tests/e2e/test_async_train.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_async_trainer import _cfg, assert_same_steps, synchronous_run
from test_trainer_loop import Collect, FakeActorRollout, FakeLoader, length_reward

from megatron_rl.plan.validate import validate
from megatron_rl.config import ConfigError
from megatron_rl.trainer.fully_async import FullyAsyncTrainer
from megatron_rl.trainer.signals import StopRequest

FULLY = ["actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_servers=1",
         "async_training.mode=fully_async", "actor_rollout_ref.rollout.weight_sync.verify_freq=0",
         "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"]
WAIT_S = 20


def _objects(rows):
    out = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        out[i] = row
    return out


class FakeAsyncServers(FakeActorRollout):
    """Rollout servers (generation, pause/continue) and the workers that sync them. A batch is decoded one
    position at a time; each position takes the version the servers hold then and waits while paused.
    ``split``: the batches (by index) that wait after their first position until the next sync, so their
    2-token responses span a weight update. ``lead``: step k's update waits until every batch from ``first``
    to k + lead decoded its first position, which fixes the version every batch starts on (batches generate
    concurrently, so a later one can start before an earlier one). ``after``: {batch: the batch it waits for
    before its first position}, to start batches out of order. ``partial``: a sync needs the servers paused
    when a generation is in flight; without, it needs none in flight."""

    def __init__(self, split=(), lead: int = 0, partial: bool = True, first: int = 1,
                 after: dict[int, int] | None = None) -> None:
        super().__init__()
        self.version, self.paused, self.in_flight = 0, False, 0
        self.split, self.lead, self.partial, self.first, self.after = split, lead, partial, first, after or {}
        self.state = threading.Condition()
        self.started: set[int] = set()
        self.resuming: dict[int, int] = {}  # split batches between their positions: the first's version
        self.trained: list[dict] = []
        self.verified: list[int] = []  # versions whose deferred verification ran (after the continue)
        self.deferred_verify = False

    def pause_generation(self):
        with self.state:
            # a split batch takes its second position on the version synced after its first, however late its
            # thread runs: the next sync waits for it
            assert self.state.wait_for(lambda: all(v >= self.version for v in self.resuming.values()), WAIT_S)
            self.paused = True

    def continue_generation(self):
        with self.state:
            self.paused = False
            self.state.notify_all()

    def generate_sequences(self, gen):
        out = super().generate_sequences(gen)
        index, lengths = gen.meta_info["global_steps"], out.batch["response_mask"].sum(-1).tolist()
        positions: list[int] = []
        with self.state:
            self.in_flight += 1
            if index in self.after:
                assert self.state.wait_for(lambda: self.after[index] in self.started, WAIT_S)
        try:
            # one lock hold: only a split batch (or a paused server) lets a sync fall between two positions,
            # so the versions a batch samples do not depend on when its thread runs
            with self.state:
                for t in range(max(lengths)):
                    if t == 1 and index in self.split:
                        first = self.resuming[index] = positions[0]
                        assert self.state.wait_for(lambda: self.version > first and not self.paused, WAIT_S)
                        del self.resuming[index]
                    else:
                        assert self.state.wait_for(lambda: not self.paused, WAIT_S)
                    positions.append(self.version)
                    self.state.notify_all()
                    if t == 0:
                        self.started.add(index)
        finally:
            with self.state:
                self.in_flight -= 1
        versions = [np.asarray(positions[:n], dtype=np.int64) for n in lengths]
        lp = torch.zeros(out.batch["responses"].shape)
        for row, v in enumerate(versions):
            lp[row, :len(v)] = -0.1 * (torch.as_tensor(v, dtype=torch.float32) + 1)
        out.batch["rollout_log_probs"] = lp
        out.non_tensor_batch["token_weight_versions"] = _objects(versions)
        out.non_tensor_batch["weight_version"] = np.asarray([v.min() for v in versions], dtype=np.int64)
        return out

    def update_actor(self, data):
        step = data.meta_info["global_steps"]
        if self.lead:
            with self.state:
                due = set(range(self.first, step + self.lead + 1))
                assert self.state.wait_for(lambda: due <= self.started, WAIT_S), \
                    f"batches {sorted(due - self.started)} never started during step {step}"
        mask = data.batch["response_mask"].bool()
        self.trained.append({
            "uids": sorted(set(data.non_tensor_batch["uid"])),
            "tokens": [v[mask[row, :len(v)].numpy()].tolist() for row, v in
                       enumerate(data.non_tensor_batch["token_weight_versions"])],
            "is_sum": float(data.batch["rollout_is_weights"].sum()) if "rollout_is_weights" in data.batch else None})
        return super().update_actor(data)

    def sync_weights(self, version, defer_verify=False):
        with self.state:
            if self.in_flight and (not self.partial or not self.paused):
                raise AssertionError(f"weights v{version} swapped under a running generation (paused={self.paused})")
            self.version = version
            self.deferred_verify = defer_verify
            self.state.notify_all()
        return super().sync_weights(version)

    def verify_weights(self):
        """The deferred verification: its probe is a /generate, which paused servers hold (a deadlock)."""
        with self.state:
            if self.paused:
                raise AssertionError(f"verification probe of v{self.version} sent to paused servers")
            if not self.deferred_verify:
                raise AssertionError("verify_weights without a deferred sync before it")
            self.deferred_verify = False
            self.verified.append(self.version)
        return {"rollout/logprob_diff_max": 0.0}


def fully_async(tmp_path, *overrides, servers=None, stop=None):
    cfg = _cfg(tmp_path, *FULLY, *overrides)
    servers = servers or FakeAsyncServers()
    trainer = FullyAsyncTrainer(cfg, validate(cfg), servers, None, length_reward, FakeLoader(16, 2), None,
                                stop=stop, rollout_client=servers)
    trainer.tracking = Collect()
    return trainer, servers


def _records(trainer, key):
    return [trainer.tracking.records[s][key] for s in (1, 2, 3, 4)]


def test_responses_span_the_sync_with_exact_token_versions(tmp_path):
    trainer, servers = fully_async(tmp_path, "async_training.buffer_batches=1", "async_training.max_staleness=2",
                                   servers=FakeAsyncServers(split=range(2, 99), lead=1))
    trainer.fit()
    # batch k >= 2 starts on v[k-2] while step k-1 trains and resumes on v[k-1] after that step's sync
    for k, trained in enumerate(servers.trained, start=1):
        assert all(v == ([0, 0] if k == 1 else [k - 2, k - 1])[:len(v)] for v in trained["tokens"]), (k, trained)
        assert any(len(v) == 2 for v in trained["tokens"])
    assert _records(trainer, "async/staleness_max") == [0.0, 1.0, 1.0, 1.0]
    assert _records(trainer, "async/partial_samples") == [0.0, 1.0, 1.0, 1.0]  # the 2-token response
    assert [t["uids"] for t in servers.trained] == [[f"{s}-0", f"{s}-1"] for s in (1, 2, 3, 4)]
    assert servers.synced == [1, 2, 3, 4]
    assert servers.verified == [1, 2, 3, 4]  # each sync's check ran once the servers generated again
    assert all("rollout/logprob_diff_max" in trainer.tracking.records[s] for s in (1, 2, 3, 4))
    assert "rollout_corr/rollout_is_mean" in trainer.tracking.records[2]


def test_without_partial_rollout_the_sync_waits_for_the_batch_in_flight(tmp_path):
    trainer, servers = fully_async(tmp_path, "async_training.partial_rollout=false",
                                   servers=FakeAsyncServers(partial=False))
    trainer.fit()
    assert all(len(set(v)) == 1 for t in servers.trained for v in t["tokens"])
    assert servers.verified == []  # nothing paused: a due check runs inside the sync
    assert max(_records(trainer, "async/staleness_max")) <= 1


@pytest.mark.parametrize("after", [{}, {3: 4}], ids=["in_order", "batch_4_starts_before_3"])
def test_drop_leaves_out_whole_batches_above_the_bound(tmp_path, after):
    trainer, servers = fully_async(tmp_path, "async_training.buffer_batches=3", "async_training.max_staleness=1",
                                   servers=FakeAsyncServers(lead=3, after=after))
    trainer.fit()
    # batches 1-4 start on v0 (batch 4 before step 1's sync); 3 and 4 are 2 versions old at step 3
    assert [t["uids"][0].split("-")[0] for t in servers.trained] == ["1", "2", "5", "6"]
    assert _records(trainer, "async/dropped_samples") == [0.0, 0.0, 8.0, 0.0]
    assert trainer.tracking.records[4]["async/dropped_samples_total"] == 8.0
    assert max(_records(trainer, "async/staleness_max")) == 1.0


def test_mask_drops_only_the_tokens_above_the_bound(tmp_path):
    trainer, servers = fully_async(tmp_path, "async_training.buffer_batches=3", "async_training.max_staleness=1",
                                   "async_training.stale_samples=mask", servers=FakeAsyncServers(split={3}, lead=2))
    trainer.fit()
    # batch 3 starts on v0 and resumes on v1 after step 1's sync; at step 3 (policy v2) its first tokens are
    # 2 versions old
    step3 = servers.trained[2]["tokens"]
    assert sorted(map(tuple, step3)) == [(), (), (), (1,)]  # 1-token responses fully masked, 2-token keep [1]
    assert trainer.tracking.records[3]["async/masked_tokens"] == 4.0
    assert trainer.tracking.records[3]["async/dropped_samples"] == 0.0


def test_on_policy_limit_equals_the_synchronous_trainer(tmp_path):
    sync_servers = FakeAsyncServers()
    sync = synchronous_run(tmp_path / "sync", sync_servers)
    limit, servers = fully_async(tmp_path / "async", "async_training.max_staleness=0")
    limit.fit()
    assert servers.trained == sync_servers.trained
    assert_same_steps(sync, limit)
    assert all(limit.tracking.records[step]["async/staleness_max"] == 0.0 for step in (1, 2, 3, 4))


def test_resume_trains_every_produced_batch_once(tmp_path):
    extra = ["async_training.buffer_batches=2", "async_training.max_staleness=2"]
    straight, servers = fully_async(tmp_path / "straight", *extra, servers=FakeAsyncServers(lead=2))
    straight.fit()

    class StopAfterStep2(FakeAsyncServers):
        def update_actor(self, data):
            if len(self.trained) == 1:
                stop.request("SIGTERM")
            return super().update_actor(data)

    stop = StopRequest()
    first, first_servers = fully_async(tmp_path / "cut", *extra, servers=StopAfterStep2(lead=2), stop=stop)
    first.fit()
    saved = tmp_path / "cut" / "global_step_2"
    assert first.state.global_steps == 2 and sorted(p.name for p in saved.glob("rollout_buffer*")) == [
        "rollout_buffer.json", "rollout_buffer_0.pkl", "rollout_buffer_1.pkl"]
    # batches 3 and 4 come from the checkpoint: these servers generate from batch 5
    second, second_servers = fully_async(tmp_path / "cut", *extra, servers=FakeAsyncServers(lead=2, first=5))
    assert second.resume() == 2
    second.fit()
    assert first_servers.trained + second_servers.trained == servers.trained  # same batches, versions, weights
    for step in (3, 4):
        assert second.tracking.records[step]["async/staleness_max"] == straight.tracking.records[step]["async/staleness_max"]


@pytest.mark.parametrize("extra, message", [
    (["async_training.buffer_batches=0"], "buffer_batches must be >= 1"),
    (["algorithm.rollout_correction.rollout_is=null"], "policy_loss=decoupled_ppo"),
    (["async_training.max_staleness=-1"], "max_staleness must be >= 0"),
    (["actor_rollout_ref.actor.policy_loss=decoupled_ppo"], "unset algorithm.rollout_correction.rollout_is"),
])
def test_refusals_name_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(tmp_path, *FULLY, *extra))
