"""A real SLURM job: the unmodified launch/grpo_70b.sh on a one-node cluster started on this machine.

scripts/slurm_local.sh installs slurm-wlm + munge when missing (root + apt-get) and starts munged,
slurmctld and slurmd; the job runs the tiny CPU preset for a few steps through Ray on SLURM.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.distributed.ports import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SLURM_LOCAL = REPO / "scripts" / "slurm_local.sh"
JOB_TIMEOUT_S = 280


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return f"the local SLURM cluster runs munged and slurmd as root; uid is {os.geteuid()}"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "slurm-wlm is not installed and apt-get is not available to install it"
    return None


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory) -> str:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    already_running = subprocess.run([SLURM_LOCAL, "status"], capture_output=True).returncode == 0
    started = subprocess.run([SLURM_LOCAL, "start"], capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, f"scripts/slurm_local.sh start failed:\n{started.stdout}\n{started.stderr}"
    conf = started.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF=")
    yield conf
    if not already_running:  # stop only the daemons this test started
        subprocess.run([SLURM_LOCAL, "stop"], check=True, timeout=120)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports below the ephemeral range (bound by the job's Ray seconds later: a port the
    kernel chose could go meanwhile to any outgoing connection of the host)."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def wait_for_job(job_id: str, env: dict[str, str]) -> str:
    """Poll until the job has left the queue; return its final JobState."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "--noheader", "--jobs", job_id, "--format=%T"], env=env,
                                capture_output=True, text=True).stdout.strip()
        if not queued:
            break
        time.sleep(3)
    else:
        subprocess.run(["scancel", job_id], env=env)
        return "TIMEOUT (cancelled by the test)"
    shown = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return next(field.split("=", 1)[1] for field in shown.split() if field.startswith("JobState="))


def test_grpo_70b_script_runs_the_tiny_cpu_preset(slurm_conf, tmp_path):
    from megatron_rl.demo import prepare_assets  # the demo's task data and random tiny model

    train, val, model_dir = prepare_assets(tmp_path / "assets")
    out, log = tmp_path / "out", tmp_path / "job.out"
    ray_port, client_port, agent_port, agent_grpc_port, metrics_port = free_ports(5)
    env = {
        **os.environ,
        "SLURM_CONF": slurm_conf,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # python and ray of this venv
        "PYTHON": sys.executable,
        "EXPERIMENT": "grpo_tiny_cpu",
        "MODEL_PATH": str(model_dir),
        "EXTRA_OVERRIDES": f"data.train_files=[{train}] data.val_files=[{val}] trainer.total_training_steps=2 "
                           # two ranks, the preset's layout before issue 39
                           "trainer.n_gpus_per_node=2 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 "
                           "actor_rollout_ref.actor.megatron.share_prompts=false",
        "OUTPUT_DIR": str(out),
        # Ports of their own, so a Ray cluster someone else runs on this machine cannot collide.
        "RAY_PORT": str(ray_port),
        # 4 logical CPUs on a 2-core machine: the tiny preset's actors ask for them (ray_init.num_cpus: 4).
        "RAY_START_ARGS": f"--num-cpus=4 --include-dashboard=false --disable-usage-stats --ray-client-server-port={client_port} "
                          f"--dashboard-agent-listen-port={agent_port} --dashboard-agent-grpc-port={agent_grpc_port} "
                          f"--metrics-export-port={metrics_port}",
    }
    # Command-line options override the script's #SBATCH lines: one node, no GPUs, a short time limit.
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--time=10", f"--output={log}",
         f"--chdir={REPO}", "launch/grpo_70b.sh"],
        cwd=REPO, env=env, capture_output=True, text=True, check=True)
    job_id = submitted.stdout.strip().split(";")[0]

    state = wait_for_job(job_id, env)
    job_log = log.read_text() if log.exists() else "(no job output)"
    assert state == "COMPLETED", f"job {job_id} ended {state}; its output:\n{job_log[-6000:]}"
    metrics_files = sorted(out.rglob("metrics.jsonl"))
    assert metrics_files, f"no metrics.jsonl under {out}; job output:\n{job_log[-6000:]}"
    records = [json.loads(line) for line in metrics_files[0].read_text().splitlines() if line.strip()]
    assert any("actor/pg_loss" in record for record in records), f"no actor/pg_loss in {metrics_files[0]}: {records}"
