"""A run never loses work (issue 15): no silent overwrite, intact-checkpoint fallback, inputs checked before
the first step, outputs that agree after a resume. Fast: fake workers, no Ray, no Megatron."""
from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate
from megatron_rl.protocol import DataProto
from megatron_rl.trainer.checkpointing import TrainerCheckpointer

MANIFEST_FILE = "manifest.json"  # written last into every checkpoint
from megatron_rl.trainer.tracking import JsonlSink, Tracking, read_metrics

from test_trainer_loop import FakeActorRollout, FakeLoader, length_reward, make_trainer


# ---------------------------------------------------------------------------- 1. no silent overwrite
def _finished_run(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 11)))
    (root / "hf_final").mkdir()
    (root / "hf_final" / "config.json").write_text("{}")


def test_rerun_into_results_without_a_checkpoint_is_refused(tmp_path):
    from megatron_rl.trainer.preflight import check_output_dir

    _finished_run(tmp_path)
    cfg = load_config(overrides=[f"trainer.default_local_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        check_output_dir(cfg)
    message = str(err.value)
    assert str(tmp_path) in message and "metrics.jsonl (10 records)" in message and "hf_final" in message
    assert "trainer.overwrite=true" in message
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 10  # untouched
    check_output_dir(load_config(overrides=[f"trainer.default_local_dir={tmp_path}", "trainer.overwrite=true"]))
    check_output_dir(load_config(overrides=[f"trainer.default_local_dir={tmp_path / 'new'}"]))


def test_rerun_with_an_intact_checkpoint_resumes_instead(tmp_path):
    from megatron_rl.trainer.preflight import check_output_dir

    _finished_run(tmp_path)
    ckpt = TrainerCheckpointer(tmp_path, keep_last=2)
    with ckpt.saving(10) as tmp:
        ckpt.write_trainer_state(tmp, {"global_steps": 10})
    check_output_dir(load_config(overrides=[f"trainer.default_local_dir={tmp_path}"]))  # auto-resume: fine
    with pytest.raises(ConfigError, match="resume_mode=disable"):
        check_output_dir(load_config(overrides=[f"trainer.default_local_dir={tmp_path}", "trainer.resume_mode=disable"]))


# ---------------------------------------------------------------------------- 2. safe default, atomic export
def test_default_config_checkpoints_periodically_and_at_the_end(tmp_path):
    cfg = load_config()
    assert cfg.trainer.save_freq > 0, "the default must not be 'never checkpoint'"
    trainer, actor = make_trainer(tmp_path, "trainer.save_freq=2", "trainer.total_training_steps=5",
                                  "trainer.max_ckpt_to_keep=2", "trainer.save_hf_at_end=false")
    trainer.fit()
    # steps 2 and 4 by the frequency, 5 because it is the last; at most max_ckpt_to_keep kept
    assert trainer.run.checkpointer.completed_steps() == [4, 5]


class FailingExportActor(FakeActorRollout):
    def save_hf(self, path):
        os.makedirs(path, exist_ok=True)
        Path(path, "model-00001.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device", path)


def test_final_hf_export_is_atomic(tmp_path):
    old = tmp_path / "hf_final"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{\"old\": true}")
    trainer, _ = make_trainer(tmp_path, "trainer.total_training_steps=1", actor=FailingExportActor())
    with pytest.raises(OSError, match="hf_final"):
        trainer.fit()
    assert sorted(p.name for p in old.iterdir()) == ["config.json"]  # the old export is whole, not mixed

    trainer, actor = make_trainer(tmp_path / "b", "trainer.total_training_steps=1")
    trainer.fit()
    assert "save_hf" in actor.calls and (tmp_path / "b" / "hf_final").is_dir()
    assert not list((tmp_path / "b").glob("hf_final.tmp*"))


# ---------------------------------------------------------------------------- 3. intact-checkpoint fallback
def _save(ckpt: TrainerCheckpointer, step: int) -> Path:
    with ckpt.saving(step) as tmp:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "shard_0.pt").write_bytes(b"x" * 10)
        ckpt.write_trainer_state(tmp, {"global_steps": step})
    return ckpt.step_dir(step)


def test_auto_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog):
    ckpt = TrainerCheckpointer(tmp_path, keep_last=5)
    for step in (1, 2, 3, 4):
        _save(ckpt, step)
    assert (ckpt.step_dir(4) / MANIFEST_FILE).is_file()
    (ckpt.step_dir(4) / "trainer_state.json").unlink()  # a torn save
    (ckpt.step_dir(3) / "actor" / "shard_0.pt").write_bytes(b"x")  # a truncated shard
    (ckpt.step_dir(2) / MANIFEST_FILE).unlink()  # no manifest: never finished
    legacy = tmp_path / "global_step_5"
    legacy.mkdir()  # a directory with nothing in it
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_path("auto", None) == ckpt.step_dir(1)
    text = caplog.text
    assert "global_step_5" in text and "global_step_4" in text and "trainer_state.json" in text
    assert "global_step_3" in text and "shard_0.pt" in text and "global_step_2" in text
    assert "manifest" in text
    with pytest.raises(FileNotFoundError, match="incomplete"):
        ckpt.resume_path("resume_path", str(ckpt.step_dir(4)))


def test_leftover_tmp_save_directories_are_cleaned_up(tmp_path):
    ckpt = TrainerCheckpointer(tmp_path, keep_last=2)
    _save(ckpt, 1)
    (tmp_path / "global_step_2.tmp" / "actor").mkdir(parents=True)
    (tmp_path / "hf_final.tmp").mkdir()
    (tmp_path / "unrelated.tmp").mkdir()
    removed = ckpt.clean_leftovers()
    assert sorted(p.name for p in removed) == ["global_step_2.tmp", "hf_final.tmp"]
    assert (tmp_path / "unrelated.tmp").is_dir() and ckpt.step_dir(1).is_dir()


def test_trainer_resume_uses_the_fallback(tmp_path):
    first, _ = make_trainer(tmp_path, "trainer.save_freq=1", "trainer.total_training_steps=2",
                            "trainer.save_hf_at_end=false", "trainer.max_ckpt_to_keep=3")
    first.fit()
    (tmp_path / "global_step_2" / MANIFEST_FILE).unlink()
    (tmp_path / "global_step_3.tmp").mkdir()
    resumed, _ = make_trainer(tmp_path, "trainer.save_freq=1", "trainer.save_hf_at_end=false")
    assert resumed.resume() == 1
    assert not (tmp_path / "global_step_3.tmp").exists()


# ---------------------------------------------------------------------------- 4. torn metrics.jsonl
def test_torn_final_metrics_line_is_dropped_on_resume(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "x": 1}) + "\n" + json.dumps({"step": 2, "x": 2}) + "\n" + '{"step": 3, "x')
    with caplog.at_level(logging.WARNING):
        sink = JsonlSink(path, initial_step=2)
    sink.log({"x": 3.0}, 3)
    sink.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert str(path) in caplog.text and "torn" in caplog.text


def test_damaged_metrics_line_in_the_middle_names_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + "garbage\n" + json.dumps({"step": 3}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}.*line 2"):
        JsonlSink(path, initial_step=3)
    JsonlSink(path, initial_step=0).close()  # a fresh start does not need the old records
    assert read_metrics(path) == []


# ---------------------------------------------------------------------------- 11. tensorboard agrees on resume
def test_tensorboard_events_past_the_resumed_step_are_purged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = Tracking(["tensorboard"], tmp_path, "p", "e", total_steps=5)
    for step in (1, 2, 3):
        first.log({"x": float(step)}, step)
    first.close()
    resumed = Tracking(["tensorboard"], tmp_path, "p", "e", total_steps=5, initial_step=2)
    resumed.log({"x": 30.0}, 3)
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


# ---------------------------------------------------------------------------- 10. reward failing every sample
def failing_reward(batch: DataProto) -> DataProto:
    out = length_reward(batch)
    out.meta_info["reward_metrics"] = {"reward/errors": float(len(batch))}
    return out


def test_reward_failing_every_sample_for_k_steps_stops_the_run(tmp_path):
    trainer, _ = make_trainer(tmp_path, "trainer.total_training_steps=5", "reward.max_failed_steps=2",
                              "trainer.save_hf_at_end=false")
    trainer.run.reward_fn = failing_reward
    with pytest.raises(RuntimeError, match=r"every sample.*2 steps in a row.*reward.max_failed_steps"):
        trainer.fit()
    assert trainer.state.global_steps == 1
    trainer, _ = make_trainer(tmp_path / "b", "trainer.total_training_steps=3", "reward.max_failed_steps=0",
                              "trainer.save_hf_at_end=false")
    trainer.run.reward_fn = failing_reward
    trainer.fit()  # 0 turns the check off
    assert trainer.state.global_steps == 3


# ---------------------------------------------------------------------------- 12. exit codes and SIGTERM
def test_a_stopped_run_exits_with_the_resumable_code(tmp_path):
    from megatron_rl.trainer.signals import EXIT_STOPPED_RESUMABLE, StopRequest

    stop = StopRequest().install()
    try:
        trainer, _ = make_trainer(tmp_path, "trainer.total_training_steps=5", stop=stop)
        os.kill(os.getpid(), signal.SIGTERM)
        trainer.fit()
    finally:
        stop.restore()  # SIGINT too: ctrl-C stops pytest again
    assert EXIT_STOPPED_RESUMABLE not in (0, 1, 2) and trainer.stopped == "SIGTERM"


def test_sigterm_before_the_first_step_stops_cleanly(tmp_path, monkeypatch, capsys):
    from megatron_rl.trainer import runner
    from megatron_rl.trainer.signals import EXIT_STOPPED_RESUMABLE
    from megatron_rl.train import exit_code

    class SignalledActor(FakeActorRollout):
        rank = 0

        def init_model(self, *args):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the workers are still starting
            return ["fake engine mesh"]

    actor = SignalledActor()
    monkeypatch.setattr(runner, "load_tokenizer", lambda path, trust_remote_code=False: None)
    monkeypatch.setattr(runner.RLDataset, "from_config", classmethod(lambda cls, *a, **k: list(range(8))))
    monkeypatch.setattr(runner, "build_reward_fn", lambda cfg, tok: type("R", (), {"close": lambda self: None})())
    monkeypatch.setattr(runner, "_probe_prompts", lambda *a: None, raising=False)
    monkeypatch.setattr(runner, "_token_ids", lambda *a: None, raising=False)
    monkeypatch.setattr(runner, "_ray_groups", lambda cfg, sizes: (actor, None, None, lambda: None))
    monkeypatch.setattr(runner, "_driver_groups", lambda cfg, sizes: (actor, None, None, lambda: None))  # one rank
    cfg = load_config(overrides=[f"trainer.default_local_dir={tmp_path}", "trainer.nnodes=1",
                                 "trainer.n_gpus_per_node=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                                 "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                 "actor_rollout_ref.model.path=none", "data.tokenizer=none"])
    try:
        result = runner.run_training(cfg, validate(cfg))
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert result.stopped == "SIGTERM" and result.hf_dir is None
    assert exit_code(result) == EXIT_STOPPED_RESUMABLE
    assert "generate_sequences" not in actor.calls


# ---------------------------------------------------------------------------- 14. I/O errors name the path
class FullDiskActor(FakeActorRollout):
    def save_checkpoint(self, path):
        raise OSError(28, "No space left on device")


def test_a_full_disk_during_a_checkpoint_names_the_path(tmp_path):
    trainer, _ = make_trainer(tmp_path, "trainer.save_freq=1", "trainer.total_training_steps=1",
                              actor=FullDiskActor())
    with pytest.raises(OSError, match=r"global_step_1.*No space left on device"):
        trainer.fit()
    assert not (tmp_path / "global_step_1").exists()


def test_a_full_disk_while_logging_names_metrics_jsonl(tmp_path, monkeypatch):
    sink = JsonlSink(tmp_path / "metrics.jsonl", initial_step=0)

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    sink.file = Full()
    with pytest.raises(OSError, match=r"metrics.jsonl.*No space left"):
        sink.log({"x": 1.0}, 1)


def test_ray_start_up_does_not_take_over_sigterm():
    """ray.init installs sys.exit as the SIGTERM handler (a native abort mid start-up); the trainer keeps its own."""
    import ray._private.utils as ray_utils

    from megatron_rl.trainer.signals import StopRequest, keep_handlers_through_ray

    original = ray_utils.set_sigterm_handler
    stop = StopRequest().install()
    try:
        keep_handlers_through_ray()
        ray_utils.set_sigterm_handler(lambda signum, frame: None)  # what ray.init calls
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        ray_utils.set_sigterm_handler = original
        stop.restore()  # SIGINT too: ctrl-C stops pytest again


def test_data_that_gives_no_batch_is_an_error_not_a_silent_success(tmp_path, caplog):
    trainer, _ = make_trainer(tmp_path, "trainer.total_training_steps=3", loader=FakeLoader(1, 2))
    with pytest.raises(RuntimeError, match=r"gave no batch.*total_training_steps=3"):
        trainer.fit()
    trainer, _ = make_trainer(tmp_path / "b", "trainer.total_training_steps=5", "trainer.save_hf_at_end=false",
                              loader=FakeLoader(4, 2))
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    assert trainer.state.global_steps == 2 and "the data ran out after 2 of" in caplog.text


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_only_rank_0_prints_the_summary(tmp_path, monkeypatch, capsys, rank, printed):
    from megatron_rl import train
    from megatron_rl.trainer.runner import RunResult

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr("megatron_rl.trainer.preflight.preflight", lambda cfg: None)
    monkeypatch.setattr("megatron_rl.trainer.runner.run_training",
                        lambda cfg, sizes: RunResult(tmp_path, tmp_path / "metrics.jsonl", tmp_path / "tb", None,
                                                     tmp_path / "hf_final", {}, stopped=None, last_step=3))
    cfg = load_config(overrides=[f"trainer.default_local_dir={tmp_path}", "trainer.nnodes=1",
                                 "trainer.n_gpus_per_node=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                                 "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    train.run(cfg)
    out = capsys.readouterr().out
    assert ("world size 1" in out and "final HF checkpoint" in out) == printed and (out == "") != printed


def test_a_checkpoint_from_before_manifests_can_be_resumed_by_path(tmp_path, caplog):
    ckpt = TrainerCheckpointer(tmp_path, keep_last=2)
    old = _save(ckpt, 3)
    (old / MANIFEST_FILE).unlink()  # what the previous version wrote
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_path("auto", None) is None
    assert f"trainer.resume_from_path={old}" in caplog.text  # the skip says how to take it anyway
    assert ckpt.resume_path("resume_path", str(old)) == old
    (old / "trainer_state.json").unlink()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        ckpt.resume_path("resume_path", str(old))


FULL_DISK_SCRIPT = r"""
import json, resource, signal, sys
from pathlib import Path
from megatron_rl.trainer.checkpointing import TrainerCheckpointer
from megatron_rl.trainer.tracking import JsonlSink

root = Path(sys.argv[1])
ckpt = TrainerCheckpointer(root, keep_last=2)
with ckpt.saving(1) as tmp:
    ckpt.write_trainer_state(tmp, {"global_steps": 1})
sink = JsonlSink(root / "metrics.jsonl", initial_step=0)
sink.log({"x": 1.0}, 1)
# From here on no file may grow past 4 KiB: a full disk, as the writing process sees it (EFBIG, like ENOSPC).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
errors = []
try:
    with ckpt.saving(2) as tmp:
        ckpt.write_trainer_state(tmp, {"global_steps": 2, "pad": "x" * 10000})
except OSError as err:
    errors.append(str(err))
try:
    for step in range(2, 200):
        sink.log({"pad": float(step), **{f"k{i}": 1.0 for i in range(20)}}, step)
except OSError as err:
    errors.append(str(err))
print(json.dumps(errors))
"""


def test_a_size_limited_disk_names_the_paths_and_keeps_the_last_checkpoint(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt_error, metrics_error = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "global_step_2" in ckpt_error and "File too large" in ckpt_error
    assert "metrics.jsonl" in metrics_error and "File too large" in metrics_error
    ckpt = TrainerCheckpointer(tmp_path, keep_last=2)
    assert ckpt.resume_path("auto", None) == tmp_path / "global_step_1"  # the last whole checkpoint survives
    ckpt.clean_leftovers()
    assert not (tmp_path / "global_step_2.tmp").exists()
    records = read_metrics(tmp_path / "metrics.jsonl", tolerate_torn_tail=True)  # a torn last line at most
    assert records[0]["step"] == 1


# ---------------------------------------------------------------------------- issue 33 item 5: one run per directory
HOLD_LOCK = ("import sys, time\nfrom megatron_rl.trainer.run_lock import acquire\nacquire(sys.argv[1])\n"
             "print('held', flush=True)\ntime.sleep(600)\n")


def _in_flight_run(root: Path) -> dict[str, bytes]:
    """What a run in progress has in its directory: an intact checkpoint, the next one being saved, metrics and
    TensorBoard events; returned as {relative path: bytes} to compare after the second start."""
    ckpt = TrainerCheckpointer(root, keep_last=2)
    _save(ckpt, 1)
    (root / "global_step_2.tmp" / "actor").mkdir(parents=True)
    (root / "global_step_2.tmp" / "actor" / "shard_0.pt").write_bytes(b"being written")
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in (1, 2)))
    (root / "tensorboard").mkdir()
    (root / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"e" * 200)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".run.lock"}


def test_a_second_run_in_the_same_directory_is_refused_naming_the_first(tmp_path):
    """Two real processes: the first holds the directory (as a run does from its start to its end); a real
    `python -m megatron_rl.train` into the same directory exits 2 naming the first's pid and host, and touches
    nothing there (not even Hydra's .hydra/ and train.log). Before issue 33 the second start went ahead: it removed
    global_step_2.tmp "left by an interrupted save", cut metrics.jsonl back and deleted the events."""
    import socket
    import subprocess
    import sys

    root = tmp_path / "run"
    before = _in_flight_run(root)
    first = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        second = subprocess.run([sys.executable, "-m", "megatron_rl.train", f"trainer.default_local_dir={root}",
                                 "trainer.logger=[jsonl,tensorboard]"], capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"trainer.default_local_dir={root} is in use by another run: pid {first.pid} on host " \
               f"{socket.gethostname()} since " in second.stderr
        assert "choose another trainer.default_local_dir" in second.stderr
        after = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                 if p.is_file() and p.name != ".run.lock"}
        assert after == before  # no .hydra/, no train.log, the in-flight save and the metrics untouched

        # the same refusal for the Python entry point (train.run), before preflight reads the directory
        from megatron_rl.train import run
        from megatron_rl.trainer.run_lock import RunDirLocked

        cfg = load_config(overrides=[f"trainer.default_local_dir={root}"])
        with pytest.raises(RunDirLocked, match=f"pid {first.pid}"):
            run(cfg)
    finally:
        first.kill()
        first.wait()
    # The first run was killed: the kernel released its flock, its record is left. The next start takes over.
    third = subprocess.run([sys.executable, "-c", HOLD_LOCK.replace("time.sleep(600)", "pass"), str(root)],
                           capture_output=True, text=True, timeout=120)
    assert third.returncode == 0 and third.stdout.strip() == "held", third.stderr
    assert f"taking over the run lock {root / '.run.lock'} of pid {first.pid} on host {socket.gethostname()}" \
        in third.stderr and "that process is gone" in third.stderr
    # it ended cleanly: nothing left to take over
    fourth = subprocess.run([sys.executable, "-c", HOLD_LOCK.replace("time.sleep(600)", "pass"), str(root)],
                            capture_output=True, text=True, timeout=120)
    assert fourth.returncode == 0 and "taking over" not in fourth.stderr, fourth.stderr


def test_the_run_lock_is_reentrant_in_one_process_and_released_at_the_end(tmp_path):
    from megatron_rl.trainer import run_lock

    with run_lock.holding(tmp_path):
        with run_lock.holding(tmp_path):  # main() before Hydra, then run()
            pass
        assert str(tmp_path.resolve()) in run_lock._held
    assert str(tmp_path.resolve()) not in run_lock._held
    assert (tmp_path / ".run.lock").read_text() == ""


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    from megatron_rl.demo import prepare_assets

    return prepare_assets(tmp_path_factory.mktemp("assets"))


def test_dry_run_writes_nothing_into_the_output_directory(tmp_path, tiny_assets):
    """Before issue 33 `--dry-run` left Hydra's .hydra/ and train.log in trainer.default_local_dir (and created it)."""
    import subprocess
    import sys

    train, val, model = tiny_assets
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--dry-run", "+experiment=grpo_tiny_cpu",
                           f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                           f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={out}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "peak:" in proc.stdout
    assert not out.exists()


# ---------------------------------------------------------------------------- issue 33 item 6: resume with what it was
class LoaderWithOrder(FakeLoader):
    """FakeLoader with the real loader's order settings in its state (data/loader.py)."""

    def state_dict(self):
        return {**super().state_dict(), "batch_size": self.batch_size, "shuffle": True, "seed": 1}


def _model_copy(source: Path, target: Path, **config_changes) -> Path:
    import shutil

    shutil.copytree(source, target)
    if config_changes:
        config = json.loads((target / "config.json").read_text())
        config.update(config_changes)
        (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def test_resuming_with_another_model_or_loader_order_is_refused_before_start_up(tmp_path, tiny_assets):
    """A checkpoint records its model (config.json and tokenizer hashes, path); preflight (dry run and real start)
    refuses a resume with another one naming both paths and what differs, and a data loader whose saved position
    cannot be continued naming the key. Before issue 33 preflight passed all of these: the other model (same
    shapes) trained on silently, the batch size was refused by the loader only after Ray and the model were up."""
    from megatron_rl.trainer.preflight import preflight

    train, val, model = tiny_assets
    out = tmp_path / "run"
    data = [f"data.train_files=[{train}]", f"data.val_files=[{val}]", "trainer.save_freq=1",
            "trainer.save_hf_at_end=false"]
    trainer, _ = make_trainer(out, f"actor_rollout_ref.model.path={model}", *data, "trainer.total_training_steps=1",
                              loader=LoaderWithOrder(16, 2))
    trainer.fit()
    saved = json.loads((out / "global_step_1" / "run_identity.json").read_text())
    assert saved["model_path"] == str(model.resolve()) and saved["config_sha256"] and saved["tokenizer_sha256"]
    assert "run_identity.json" in json.loads((out / "global_step_1" / MANIFEST_FILE).read_text())["sha256"]

    def start(*overrides):
        preflight(load_config(overrides=[f"trainer.default_local_dir={out}", "trainer.nnodes=1",
                                         "trainer.n_gpus_per_node=1", "data.train_batch_size=2",
                                         "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.seed=1",
                                         "data.max_prompt_length=16", "data.max_response_length=6",  # 64 positions
                                         *data, *overrides]))

    start(f"actor_rollout_ref.model.path={model}")  # the same model: resumes
    start(f"actor_rollout_ref.model.path={_model_copy(model, tmp_path / 'moved')}")  # moved, same files: resumes

    other = _model_copy(model, tmp_path / "other", rope_theta=12345.0)  # same shapes, another model
    with pytest.raises(ConfigError) as err:
        start(f"actor_rollout_ref.model.path={other}")
    message = str(err.value)
    assert f"actor_rollout_ref.model.path={model.resolve()}" in message and str(other.resolve()) in message
    assert "config.json differs (rope_theta:" in message and "12345.0" in message
    assert "trainer.resume_mode=disable" in message and "another trainer.default_local_dir" in message

    retokenized = _model_copy(model, tmp_path / "retokenized")
    tokenizer_config = json.loads((retokenized / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = 77
    (retokenized / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ConfigError, match="the tokenizer differs"):
        start(f"actor_rollout_ref.model.path={retokenized}")

    with pytest.raises(ConfigError) as err:
        start(f"actor_rollout_ref.model.path={model}", "data.train_batch_size=4",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    message = str(err.value)
    assert "data.train_batch_size=4 (the checkpoint's data loader ran with 2)" in message
    assert "trainer.resume_mode=disable" in message
    start(f"actor_rollout_ref.model.path={other}", "trainer.resume_mode=disable", "trainer.overwrite=true")


# ---------------------------------------------------------------------------- issue 33 item 12: smaller ones
def test_an_empty_tensorboard_file_is_not_the_results_of_a_run(tmp_path):
    """A run that failed before its first step leaves an event file with TensorBoard's header only; before issue 33
    it counted as "results of a run" and the fixed command was refused."""
    from torch.utils.tensorboard import SummaryWriter

    from megatron_rl.trainer.preflight import check_output_dir

    writer = SummaryWriter(str(tmp_path / "tensorboard"))
    writer.flush()
    writer.close()
    cfg = load_config(overrides=[f"trainer.default_local_dir={tmp_path}"])
    check_output_dir(cfg)  # header only: nothing to overwrite
    logged = Tracking(["tensorboard"], tmp_path, "p", "e", total_steps=2)
    logged.log({"x": 1.0}, 1)
    logged.close()
    with pytest.raises(ConfigError, match="tensorboard/ events"):
        check_output_dir(cfg)
