"""The launch scripts' command lines, read from DRY_RUN=1 (plan checked, nothing started).

Inside a "job" the SLURM variables are set by hand: the scripts only read them before starting anything.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def run_script(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    full_env = {**base, "PYTHON": sys.executable, "MEGATRON_RL_DIR": str(REPO), "DRY_RUN": "1", **env}
    return subprocess.run(["bash", str(REPO / "launch" / script), *args], env=full_env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def dry_run_lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return [line.split("DRY_RUN: ", 1)[1] for line in result.stdout.splitlines() if "DRY_RUN: " in line]


def driver_argv(result: subprocess.CompletedProcess) -> list[str]:
    (driver,) = [line for line in dry_run_lines(result) if line.startswith("driver: ")]
    return shlex.split(driver.removeprefix("driver: "))


def slurm_job(job_id: str, nodes: int, submit_dir: Path, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NAME": "grpo_70b.sh",
            "SLURM_SUBMIT_DIR": str(submit_dir), "SLURMD_NODENAME": "node001",
            "SLURM_JOB_NODELIST": f"node[001-{nodes:03d}]", **extra}


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_grpo_70b_sbatch_script_maps_the_environment_to_overrides(tmp_path):
    env = slurm_job("42", 8, tmp_path, SLURM_GPUS_PER_NODE="h100:8", HEAD_IP="10.0.0.1",
                    MODEL_PATH="/models/llama3-70b", DATA_DIR="/data/gsm8k", EXTRA_OVERRIDES="trainer.save_freq=5")
    result = run_script("grpo_70b.sh", "trainer.test_freq=7", **env)
    assert "Ray head on node001 at 10.0.0.1:6379, Ray workers on the 7 other node(s)" in dry_run_lines(result)
    # Arguments first, then the environment's overrides, EXTRA_OVERRIDES, and what the launcher owns.
    assert driver_argv(result) == [
        sys.executable, "-m", "megatron_rl.train", "+experiment=grpo_70b", "trainer.test_freq=7",
        "trainer.resume_mode=auto", f"trainer.default_local_dir={tmp_path}/outputs/grpo_70b-42",
        "actor_rollout_ref.model.path=/models/llama3-70b",
        "data.train_files=[/data/gsm8k/train.parquet]", "data.val_files=[/data/gsm8k/val.parquet]",
        "trainer.save_freq=5", "trainer.nnodes=8", "trainer.n_gpus_per_node=8", "ray_init.address=10.0.0.1:6379",
        "ray_init.num_cpus=null",
    ]
    assert "peak: generate" in result.stdout  # the plan was printed before the dry-run stop


def test_sbatch_script_rejects_a_plan_before_starting_ray(tmp_path):
    # Micro-batches of 8 responses: 62.8 GiB of activations per GPU, and the 70B update does not fit.
    result = run_script("grpo_70b.sh", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                        **slurm_job("43", 8, tmp_path, SLURM_GPUS_PER_NODE="8", HEAD_IP="10.0.0.1"))
    assert result.returncode == 1
    assert "does not fit" in result.stderr and "the plan was rejected (above); nothing was started" in result.stderr


def test_node_count_must_match_the_allocation(tmp_path):
    result = run_script("grpo_70b.sh", NNODES="16", **slurm_job("44", 8, tmp_path, SLURM_GPUS_PER_NODE="8"))
    assert result.returncode == 1
    assert "NNODES=16 but the job has 8 nodes; choose the node count with sbatch --nodes=16" in result.stderr


def test_ray_launcher_refuses_to_run_outside_slurm():
    result = run_script("ray_on_slurm.sh", "+experiment=grpo_70b")
    assert result.returncode == 1 and "not inside a SLURM job" in result.stderr


def test_torchrun_on_one_cpu_node(tiny_model):
    result = run_script("torchrun.sh", f"actor_rollout_ref.model.path={tiny_model}", GPUS_PER_NODE="0",
                        NPROC_PER_NODE="2")
    assert driver_argv(result) == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", SIGNALS,
        "--shutdown-timeout=240", "--standalone", "-m", "megatron_rl.train",
        f"actor_rollout_ref.model.path={tiny_model}", "trainer.resume_mode=auto", "trainer.nnodes=1",
        "trainer.launcher=torchrun", "trainer.n_gpus_per_node=2",
    ]


def test_torchrun_in_a_slurm_job_starts_one_agent_per_node(tiny_model, tmp_path):
    env = slurm_job("45", 2, tmp_path, SLURM_GPUS_PER_NODE="8", MASTER_ADDR="10.0.0.2")
    argv = driver_argv(run_script("torchrun.sh", f"actor_rollout_ref.model.path={tiny_model}", **env))
    assert argv[:5] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--gpus-per-node=8"]
    assert argv[5:12] == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8",
                          SIGNALS, "--shutdown-timeout=240"]
    assert argv[12:15] == ["--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.2:29500", "--rdzv-id=45"]
    assert argv[-3:] == ["trainer.nnodes=2", "trainer.launcher=torchrun", "trainer.n_gpus_per_node=8"]


def test_torchrun_on_cpu_needs_the_process_count():
    result = run_script("torchrun.sh", "+experiment=grpo_7b", GPUS_PER_NODE="0")
    assert result.returncode == 1 and "set NPROC_PER_NODE" in result.stderr


# ---------------------------------------------------------------------------- issue 15, item 13
def test_torchrun_from_a_fresh_shell_finds_the_project_interpreter(tiny_model, tmp_path):
    """PATH's python may lack megatron_rl: the launcher takes the checkout's .venv, or says what it needs."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python").write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n")
    (fake_bin / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(PATH=f"{fake_bin}:{env['PATH']}", MEGATRON_RL_DIR=str(REPO), DRY_RUN="1", GPUS_PER_NODE="0",
               NPROC_PER_NODE="2")
    result = subprocess.run(["bash", str(REPO / "launch" / "torchrun.sh"), f"actor_rollout_ref.model.path={tiny_model}"],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    venv_python = REPO / ".venv" / "bin" / "python"
    if venv_python.exists():
        assert driver_argv(result)[0] == str(venv_python)
    bad = run_script("torchrun.sh", f"actor_rollout_ref.model.path={tiny_model}", GPUS_PER_NODE="0",
                     NPROC_PER_NODE="2", PYTHON=str(fake_bin / "python"))
    assert bad.returncode == 1
    assert f"PYTHON={fake_bin / 'python'} cannot import megatron_rl" in bad.stderr
    assert "No module named torch" in bad.stderr and "plan was rejected" not in bad.stderr


def test_the_users_resume_mode_is_not_overridden(tiny_model):
    argv = driver_argv(run_script("torchrun.sh", f"actor_rollout_ref.model.path={tiny_model}",
                                  "trainer.resume_mode=disable", GPUS_PER_NODE="0", NPROC_PER_NODE="2"))
    assert "trainer.resume_mode=disable" in argv and "trainer.resume_mode=auto" not in argv


def test_data_dir_takes_the_task_writers_val_file(tiny_model, tmp_path):
    from megatron_rl.data.tasks import write_task

    write_task("copy", tmp_path, n_train=8, n_val=4, seed=0)
    argv = driver_argv(run_script("torchrun.sh", f"actor_rollout_ref.model.path={tiny_model}", GPUS_PER_NODE="0",
                                  NPROC_PER_NODE="2", DATA_DIR=str(tmp_path)))
    assert f"data.val_files=[{tmp_path}/val.parquet]" in argv and f"data.train_files=[{tmp_path}/train.parquet]" in argv


# ---------------------------------------------------------------------------- issue 32, item 18
def stand_ins(tmp_path: Path) -> Path:
    """scontrol, getent, ip and hostname as a multi-NIC SLURM node shows them: `hostname -I` lists the docker
    bridge first; SLURM knows the first node as node001 with NodeAddr node001-ib, which resolves to
    10.1.0.1; the interface ib0 holds 10.2.0.1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": """case "$1 $2" in
  "show hostnames") [ -n "$3" ] && printf 'node001\\nnode002\\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=$3-ib NodeHostName=$3 State=ALLOCATED" ;;
  *) exit 1 ;;
esac""",
        "getent": """[ "$1 $2" = "ahostsv4 node001-ib" ] || exit 2
printf '10.1.0.1       STREAM node001-ib\\n10.1.0.1       DGRAM\\n'""",
        "ip": """[ "$*" = "-4 -o addr show dev ib0" ] || exit 1
echo '3: ib0    inet 10.2.0.1/16 brd 10.2.255.255 scope global ib0\\       valid_lft forever preferred_lft forever'""",
        "hostname": """case "$1" in -I) echo '172.17.0.1 10.1.0.1 10.2.0.1' ;; *) echo node001 ;; esac""",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_the_head_address_is_slurms_or_the_named_interfaces_not_hostname_I(tiny_model, tmp_path):
    path = f"{stand_ins(tmp_path)}:{os.environ['PATH']}"
    job = slurm_job("46", 2, tmp_path, SLURM_GPUS_PER_NODE="8", PATH=path, NCCL_SOCKET_IFNAME="ib0",
                    GLOO_SOCKET_IFNAME="ib0")
    model = f"actor_rollout_ref.model.path={tiny_model}"
    # torchrun: the rendezvous (so the ranks' MASTER_ADDR) is SLURM's address of node001, not 172.17.0.1
    argv = driver_argv(run_script("torchrun.sh", model, **job))
    assert "--rdzv-endpoint=10.1.0.1:29500" in argv
    # every agent (so every rank it starts) gets the socket interfaces, whatever srun's --export is
    python = argv.index(sys.executable)
    assert argv[python - 3:python] == ["env", "NCCL_SOCKET_IFNAME=ib0", "GLOO_SOCKET_IFNAME=ib0"]
    assert argv[:2] == ["srun", "--nodes=2"]
    # MRL_HEAD_IFACE names the interface
    argv = driver_argv(run_script("torchrun.sh", model, MRL_HEAD_IFACE="ib0", **job))
    assert "--rdzv-endpoint=10.2.0.1:29500" in argv
    bad = run_script("torchrun.sh", model, MRL_HEAD_IFACE="eth9", **job)
    assert bad.returncode == 1 and "MRL_HEAD_IFACE=eth9: no IPv4 address on that interface" in bad.stderr

    # Ray on SLURM: head address, the driver's ray_init.address and every node's `ray start`
    result = run_script("grpo_70b.sh", **{**job, **slurm_job("46", 8, tmp_path, SLURM_GPUS_PER_NODE="8")})
    lines = dry_run_lines(result)
    assert "Ray head on node001 at 10.1.0.1:6379, Ray workers on the 7 other node(s)" in lines, result.stdout
    (ray_start,) = [line for line in lines if line.startswith("ray start: ")]
    assert shlex.split(ray_start.removeprefix("ray start: "))[:4] == ["env", "NCCL_SOCKET_IFNAME=ib0",
                                                                      "GLOO_SOCKET_IFNAME=ib0", "ray"]
    assert "ray_init.address=10.1.0.1:6379" in driver_argv(result)


def test_a_head_that_resolves_to_loopback_is_refused_on_several_nodes(tiny_model, tmp_path):
    bin_dir = stand_ins(tmp_path)
    (bin_dir / "getent").write_text("#!/bin/sh\necho '127.0.1.1       STREAM node001-ib'\n")
    env = slurm_job("47", 2, tmp_path, SLURM_GPUS_PER_NODE="8", PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = run_script("torchrun.sh", f"actor_rollout_ref.model.path={tiny_model}", **env)
    assert result.returncode == 1
    assert "the head node node001 resolves to the loopback address 127.0.1.1" in result.stderr
    assert "set MRL_HEAD_IFACE" in result.stderr
