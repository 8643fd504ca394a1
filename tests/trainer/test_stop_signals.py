"""ctrl-C is SIGTERM (stop after the step, checkpoint, exit 75); a second one exits at once leaving no half-written
step; a checkpoint's writer processes ignore both (issue 56). The run is a real process (fake workers, no Ray):
signals go to it, not to pytest."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from megatron_rl.config import load_config
from megatron_rl.trainer.checkpointing import TrainerCheckpointer, checkpoint_problem
from megatron_rl.trainer.signals import EXIT_FORCED, EXIT_STOPPED_RESUMABLE

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# A run whose every step saves, each save taking `hold_s` after it has written its files.
RUN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from test_trainer_loop import FakeActorRollout, make_trainer
    from megatron_rl.trainer.signals import EXIT_STOPPED_RESUMABLE, StopRequest

    out, cue, hold_s = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])

    class SlowSave(FakeActorRollout):
        def save_checkpoint(self, path):
            super().save_checkpoint(path)
            Path(path, "shard.bin").write_bytes(bytes(1000))
            cue.touch()  # the test's cue: a save is under way
            end = time.monotonic() + hold_s
            while time.monotonic() < end:
                time.sleep(0.05)

    stop = StopRequest().install()
    trainer, _ = make_trainer(out, "trainer.save_freq=1", "trainer.total_training_steps=4",
                              "trainer.save_hf_at_end=false", actor=SlowSave(), stop=stop)
    trainer.fit()
    sys.exit(EXIT_STOPPED_RESUMABLE if trainer.stopped else 0)
""")


def _start(tmp_path: Path, hold_s: float) -> tuple[subprocess.Popen, Path, Path]:
    script, out, cue = tmp_path / "run.py", tmp_path / "run", tmp_path / "saving"
    script.write_text(RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(cue), str(hold_s)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not cue.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the run never started saving"
        time.sleep(0.05)
    return proc, out, cue


def test_ctrl_c_during_a_save_finishes_it_and_exits_resumable(tmp_path):
    proc, out, _ = _start(tmp_path, hold_s=2.0)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED_RESUMABLE, output
    assert "received SIGINT" in output
    # The save under way finished; the signal, landing after step 1's end was read, is heeded at step 2's end
    # (signals.StopRequest.heed), whose checkpoint is the stop's.
    steps = sorted(p.name for p in out.glob("global_step_*"))
    assert steps == ["global_step_1", "global_step_2"], output  # no .tmp left
    assert [checkpoint_problem(out / name) for name in steps] == [None, None]
    # the re-run resumes from it, nothing refused
    from megatron_rl.trainer.preflight import check_output_dir

    check_output_dir(load_config(overrides=[f"trainer.default_local_dir={out}"]))
    assert TrainerCheckpointer(out, 1).resume_path("auto", None) == out / "global_step_2"


def test_a_second_ctrl_c_exits_at_once_without_a_half_written_step(tmp_path):
    proc, out, _ = _start(tmp_path, hold_s=600.0)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # the first is handled (a request to stop after the step) before the second lands
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)  # the save would hold 600 s
    assert proc.returncode == EXIT_FORCED, output
    assert "received SIGINT, a second stop signal: exiting now" in output
    assert list(out.glob("global_step_*")) == [], output  # the interrupted save removed its directory
    assert TrainerCheckpointer(out, 1).resume_path("auto", None) is None  # a re-run starts from step 0


# A real Megatron save (torch_dist, its per-file writers forked) of one rank on gloo, each writer slowed down so
# that ctrl-C reaches the whole process group while they write ("slow"), or dying before it reports ("die").
SAVE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron_rl.distributed.cpu_compat import install_cpu_compat
    from megatron_rl.distributed.sharded_save import save_sharded
    from megatron_rl.trainer.signals import StopRequest

    out, cue, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[4]
    write = FileSystemWriterAsync.write_preloaded_data

    def slow_write(*args, **kwargs):  # runs in the forked writer
        cue.touch()
        if mode == "die":
            os._exit(3)  # what a writer killed by the OOM killer looks like to the rank: no report
        time.sleep(3)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(slow_write)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
    dist.init_process_group("gloo", rank=0, world_size=1)
    install_cpu_compat()
    stop = StopRequest().install()
    out.mkdir()
    save_sharded({"w": ShardedTensor.from_rank_offsets("w", torch.arange(1000.0), replica_id=0)}, str(out))
    print("saved; stop requested by", stop.reason, flush=True)
""")


def _save(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    from megatron_rl.distributed import free_port

    script, out, cue = tmp_path / "save.py", tmp_path / "ckpt", tmp_path / "writing"
    script.write_text(SAVE)
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(cue), str(free_port()), mode], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: ctrl-C's reach, the writers included
    return proc, out, cue


def test_ctrl_c_to_the_process_group_during_a_real_sharded_save_lets_it_finish(tmp_path):
    proc, out, cue = _save(tmp_path, "slow")
    deadline = time.monotonic() + 120
    while not cue.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "saved; stop requested by SIGINT" in output
    assert list(out.glob("*.distcp")) and (out / "metadata.json").is_file()


def test_a_checkpoint_writer_that_dies_fails_the_save_naming_it(tmp_path):
    """Megatron waits for its writers without a time limit; one that dies unreported hung the save for ever."""
    proc, _, _ = _save(tmp_path, "die")
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 1, output[-3000:]
    assert "WriterDied" in output and "(exit code 3) ended without reporting" in output, output[-3000:]


_WRITER_HANDLERS = textwrap.dedent("""
    import multiprocessing, signal
    from megatron_rl.distributed.sharded_save import children_ignore_stop_signals

    def report(conn):
        conn.send((int(signal.getsignal(signal.SIGINT) is signal.SIG_IGN),
                   int(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)))

    ctx = multiprocessing.get_context("fork")  # as Megatron's writers are started
    parent, child = ctx.Pipe()
    with children_ignore_stop_signals():
        writer = ctx.Process(target=report, args=(child,))
        writer.start()
    print("inside", parent.recv())
    writer.join(30)
    print("parent ignores", int(signal.getsignal(signal.SIGINT) is signal.SIG_IGN))
    later = ctx.Process(target=report, args=(child,))  # outside the block: inherited as usual
    later.start()
    print("outside", parent.recv())
    later.join(30)
""")


def test_checkpoint_writer_processes_ignore_ctrl_c_and_sigterm():
    """Megatron's per-file writers are forked `multiprocessing` children that the rank waits on without a time
    limit (filesystem_async.py, write_preloaded_data_multiproc: count_queue.join()); one ended by ctrl-C never
    reports, and the save would hang. Run in a process of its own: a fork from a pytest-xdist worker that earlier
    tests left with threads (Ray's gRPC clients) can deadlock in the child (it hung the CI run for 1200 s)."""
    done = subprocess.run([sys.executable, "-c", _WRITER_HANDLERS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["inside (1, 1)", "parent ignores 0", "outside (0, 0)"], done.stdout
