"""Two nodes simulated on one machine, so node boundaries are real: each "node" has its own 2 stand-in GPUs
(the stand-in's GPU registry is per SGLANG_STAND_IN_NODE) and its own launcher — two torchrun processes
meeting in one rendezvous, or a Ray head and a worker raylet, each with its own resources. Rollout TP 2 must
give one engine per node, on that node's GPUs 0 and 1, led by the node's first rank; an engine spanning two
nodes or a GPU id taken from the global rank would be refused by the stand-in."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from sglang_runs import check_run, sglang_overrides

from megatron_rl.config import load_config
from megatron_rl.distributed import free_port
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TWO_NODES = ("trainer.nnodes=2", "trainer.n_gpus_per_node=2", "trainer.total_training_steps=2")


def test_torchrun_on_two_nodes_builds_one_engine_per_node(sglang_stand_in, assets, tmp_path):
    env = {**os.environ, "NNODES": "2", "NPROC_PER_NODE": "2", "GPUS_PER_NODE": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1",
           "SGLANG_STAND_IN_GPUS_PER_NODE": "2"}
    overrides = [o for o in sglang_overrides(assets, tmp_path / "run") if not o.startswith("ray_init.")]
    launchers = [
        subprocess.Popen(["bash", "launch/torchrun.sh", *overrides, *TWO_NODES], cwd=REPO,
                         env={**env, "SGLANG_STAND_IN_NODE": f"node{i}"}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = [proc.communicate(timeout=900)[0] for proc in launchers]
    for i, out in enumerate(outputs):
        (tmp_path / f"launcher{i}.log").write_text(out)
    for proc, out in zip(launchers, outputs):
        assert proc.returncode == 0, f"{out[-3000:]}\n(whole outputs: {tmp_path}/launcher*.log)"
    host = socket.gethostname()
    mesh = re.search(r"rollout engines: (.*)", "".join(outputs)).group(1)
    # rendezvous node ranks: ranks 0-1 on torchrun node 0, 2-3 on node 1; each engine on its node's GPUs 0, 1
    assert mesh == f"engine 0: ranks [0, 1] on {host}/0 GPUs [0, 1]; engine 1: ranks [2, 3] on {host}/1 GPUs [0, 1]"
    check_run(tmp_path / "run" / "metrics.jsonl", 2)


@pytest.fixture
def two_raylets(sglang_stand_in):
    """A Ray head and a worker raylet on this machine, 2 CPUs and 2 GPUs each; the stand-in's node of every
    worker process is its raylet's (workers inherit the raylet's environment)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    nodes = [
        cluster.add_node(num_cpus=2, num_gpus=2,
                         env_vars={"SGLANG_STAND_IN_NODE": name, "SGLANG_STAND_IN_GPUS_PER_NODE": "2"})
        for name in ("head-node", "worker-node")
    ]
    cluster.wait_for_nodes()
    yield cluster.address, [n.node_id for n in nodes]
    cluster.shutdown()


def test_ray_on_two_raylets_builds_one_engine_per_node(two_raylets, assets, tmp_path):
    address, node_ids = two_raylets
    overrides = [o for o in sglang_overrides(assets, tmp_path) if not o.startswith("ray_init.num_")]
    result = run(load_config(overrides=[*overrides, *TWO_NODES, f"ray_init.address={address}", "ray_init.num_cpus=null"]))
    check_run(result.metrics_path, 2)
    engines = result.rollout_engines.split("; ")
    assert len(engines) == 2
    on_nodes = {re.search(r"on (\S+) GPUs \[0, 1\]", e).group(1) for e in engines}
    assert on_nodes == set(node_ids)  # one engine per raylet, each on that node's GPUs 0 and 1
