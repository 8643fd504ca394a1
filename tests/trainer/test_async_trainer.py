"""One-step off-policy loop (trainer/off_policy.py) on in-process fakes: the generation of step k+1 really runs
during the update of step k, every sample's weight version is exact, staleness is 1 (0 at the first step), the
on-policy limit (max_staleness=0) gives the synchronous trainer's numbers, and a resumed run trains every
prompt exactly once with the same versions as an uninterrupted one. The real stack (HF-engine servers, Ray,
Megatron) runs in tests/e2e/test_async_train.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_trainer_loop import Collect, FakeActorRollout, FakeLoader, length_reward

from megatron_rl.config import load_config, ConfigError
from megatron_rl.plan.validate import validate
from megatron_rl.trainer.off_policy import OneStepOffPolicyTrainer
from megatron_rl.trainer.rl_trainer import RLTrainer
from megatron_rl.trainer.signals import StopRequest

ASYNC = ["actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_servers=1", "async_training.mode=one_step_off",
         "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"]


class FakeServers(FakeActorRollout):
    """Rollout servers + the actor workers that sync them: responses as FakeActorRollout's, each sample tagged
    with the version the servers hold, behaviour log-probs that depend on that version. With ``overlap``, a
    generation started during a step waits until that step's update has begun: without real overlap the
    loop would deadlock (and the wait fails after 20 s)."""

    def __init__(self, overlap: bool = False) -> None:
        super().__init__()
        self.version = 0
        self.overlap = overlap
        self.updating = threading.Event()
        self.trained: list[dict] = []

    def generate_sequences(self, gen):
        if self.overlap and gen.meta_info["global_steps"] > 1 and not self.updating.wait(20):
            raise AssertionError(f"the generation of step {gen.meta_info['global_steps']} did not overlap an update")
        self.updating.clear()
        out = super().generate_sequences(gen)
        out.batch["rollout_log_probs"] = torch.full(out.batch["responses"].shape, -0.1 * (self.version + 1))
        out.non_tensor_batch["weight_version"] = np.full(len(out), self.version, dtype=np.int64)
        return out

    def update_actor(self, data):
        self.updating.set()
        self.trained.append({"uids": sorted(set(data.non_tensor_batch["uid"])),
                             "versions": sorted(set(data.non_tensor_batch["weight_version"].tolist())),
                             "is_mean": float(data.batch["rollout_is_weights"].sum())})
        return super().update_actor(data)

    def sync_weights(self, version):
        self.version = version
        return super().sync_weights(version)


def _cfg(tmp_path, *overrides):
    return load_config(overrides=[
        f"trainer.default_local_dir={tmp_path}", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.total_training_steps=4",
        "trainer.save_hf_at_end=false", "trainer.save_freq=-1", *overrides])


def async_trainer(tmp_path, *overrides, servers=None, stop=None):
    cfg = _cfg(tmp_path, *ASYNC, *overrides)
    servers = servers or FakeServers()
    trainer = OneStepOffPolicyTrainer(cfg, validate(cfg), servers, None, length_reward, FakeLoader(16, 2), None,
                                      stop=stop, rollout_client=servers)
    trainer.tracking = Collect()
    return trainer, servers


def test_next_rollout_overlaps_the_update_and_versions_are_exact(tmp_path):
    trainer, servers = async_trainer(tmp_path, servers=FakeServers(overlap=True))
    trainer.fit()
    assert [t["versions"] for t in servers.trained] == [[0], [0], [1], [2]]  # step k >= 2 trains v[k-2]
    records = trainer.tracking.records
    assert [records[s]["async/staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert [records[s]["async/staleness_mean"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert servers.synced == [1, 2, 3, 4]
    assert [t["uids"] for t in servers.trained] == [[f"{s}-0", f"{s}-1"] for s in (1, 2, 3, 4)]
    assert "rollout_corr/rollout_is_mean" in records[2]  # behaviour log-probs reach the update


def synchronous_run(tmp_path, servers) -> RLTrainer:
    """RLTrainer on ``servers`` with the async tests' config (token IS on): the on-policy limit's reference."""
    cfg = _cfg(tmp_path, "algorithm.rollout_correction.rollout_is=token")
    sync = RLTrainer(cfg, validate(cfg), servers, None, length_reward, FakeLoader(16, 2), None)
    sync.tracking = Collect()
    sync.fit()
    return sync


def assert_same_steps(sync: RLTrainer, other, steps=(1, 2, 3, 4)) -> None:
    """Every metric of every step equal, timings and the async trainer's own metrics aside."""
    for step in steps:
        a, b = sync.tracking.records[step], other.tracking.records[step]
        same = {k for k in a if not k.startswith(("timing_s/", "perf/", "async/"))}
        assert {k: a[k] for k in same} == {k: b[k] for k in same}


def test_on_policy_limit_equals_the_synchronous_trainer(tmp_path):
    sync_actor = FakeServers()
    sync = synchronous_run(tmp_path / "sync", sync_actor)
    limit, servers = async_trainer(tmp_path / "async", "async_training.max_staleness=0")
    limit.fit()
    assert servers.trained == sync_actor.trained
    assert_same_steps(sync, limit)
    assert all(limit.tracking.records[step]["async/staleness_max"] == 0.0 for step in (1, 2, 3, 4))


def test_resume_trains_the_saved_rollouts_once(tmp_path):
    straight, servers = async_trainer(tmp_path / "straight")
    straight.fit()

    class StopAfterStep2(FakeServers):
        def update_actor(self, data):
            if len(self.trained) == 1:
                stop.request("SIGTERM")
            return super().update_actor(data)

    stop = StopRequest()
    first, first_servers = async_trainer(tmp_path / "cut", servers=StopAfterStep2(), stop=stop)
    first.fit()
    assert first.state.global_steps == 2 and (tmp_path / "cut" / "global_step_2" / "rollout_ahead.pkl").is_file()
    second, second_servers = async_trainer(tmp_path / "cut")
    assert second.resume() == 2
    second.fit()
    assert first_servers.trained + second_servers.trained == servers.trained  # same prompts, versions, weights
    assert second.tracking.records[3]["async/staleness_max"] == 1.0


@pytest.mark.parametrize("extra, message", [
    (["actor_rollout_ref.rollout.mode=colocated"], "set actor_rollout_ref.rollout.mode=server"),
    (["algorithm.rollout_correction.rollout_is=null"], "algorithm.rollout_correction.rollout_is"),
    (["async_training.max_staleness=2"], "max_staleness must be 0"),
    (["algorithm.filter_groups.enable=true"], "filter_groups"),
])
def test_refusals_name_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(tmp_path, *ASYNC, *extra))


def _cut_after_step_2(tmp_path):
    """A one-step-off run stopped after step 2: its checkpoint holds the rollouts generated ahead."""
    class StopAfterStep2(FakeServers):
        def update_actor(self, data):
            if len(self.trained) == 1:
                stop.request("SIGTERM")
            return super().update_actor(data)

    stop = StopRequest()
    first, _ = async_trainer(tmp_path, servers=StopAfterStep2(), stop=stop)
    first.fit()
    return tmp_path / "global_step_2"


def test_resume_runs_no_code_planted_in_the_run_directory(tmp_path):
    """Issue 33, item 1. Someone who can write the run directory replaces the rollouts saved ahead with a pickle
    payload (in the format load_from_disk read before: torch.save of the three parts) and rewrites the manifest to
    match. Before: resuming ran the payload (the marker was written) and training went on. Now: the file is read
    with torch.load(weights_only=True) and refused, naming it, and nothing runs."""
    import json
    import pickle

    from megatron_rl.protocol import DataProto

    step_dir = _cut_after_step_2(tmp_path / "run")
    ahead = step_dir / "rollout_ahead.pkl"
    saved, marker = DataProto.load_from_disk(ahead), tmp_path / "marker"

    class RunsCode:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    torch.save({"batch": dict(saved.batch.items()), "batch_size": list(saved.batch.batch_size),
                "non_tensor_batch": saved.non_tensor_batch,
                "meta_info": {**saved.meta_info, "x": RunsCode()}}, ahead, pickle_module=pickle)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"]["rollout_ahead.pkl"] = ahead.stat().st_size
    manifest.pop("sha256", None)  # an attacker who can write the directory rewrites the manifest as well
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    second, _ = async_trainer(tmp_path / "run")
    with pytest.raises(ValueError, match="rollout_ahead.pkl"):
        second.resume()
    assert not marker.exists(), "resuming ran the code planted in the run directory"


def test_a_changed_checkpoint_file_fails_its_content_hash_naming_it(tmp_path):
    """The manifest records each file's sha256 besides its size: a file changed after the save (same size) is
    named, auto-resume skips the checkpoint and trainer.resume_from_path refuses it."""
    from megatron_rl.trainer.checkpointing import checkpoint_problem

    step_dir = _cut_after_step_2(tmp_path / "run")
    assert checkpoint_problem(step_dir) is None
    ahead = step_dir / "rollout_ahead.pkl"
    raw = bytearray(ahead.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    ahead.write_bytes(bytes(raw))
    problem = checkpoint_problem(step_dir)
    assert problem is not None and "rollout_ahead.pkl" in problem and "sha256" in problem
    explicit, _ = async_trainer(tmp_path / "run", "trainer.resume_mode=resume_path",
                                f"trainer.resume_from_path={step_dir}")
    with pytest.raises(FileNotFoundError, match="rollout_ahead.pkl"):
        explicit.resume()
