"""Server mode under torchrun: the trainer (rank 0 of the weight-update group) runs with torchrun's
``TORCHELASTIC_USE_AGENT_STORE=True``, which turns ``c10d.rendezvous("tcp://...")`` into a client of a store
nobody hosts; the SGLang server joins from a plain process the way SGLang 0.5.23's
``init_custom_process_group`` does (issue 32, item 4)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from megatron_rl.distributed.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# SGLang's side, verbatim in its calls (srt/utils: init_custom_process_group): not under torchrun.
SERVER = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import torch
    from torch.distributed import distributed_c10d as c10d

    port = int(sys.argv[1])
    timeout = timedelta(seconds=20)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore("weights", store)
    group, _ = c10d._new_process_group_helper(2, 1, [], c10d.Backend("gloo"), store,
                                              group_name="weights", timeout=timeout)
    c10d._world.pg_group_ranks[group] = {0: 0, 1: 1}
    received = torch.zeros(4)
    torch.distributed.broadcast(received, src=0, group=group)
    print("SERVER GOT", received.tolist(), flush=True)
    # a server stays up; this one leaves at once, without tearing gloo down under its peer: at interpreter
    # exit the group's threads can abort it ("terminate called without an active exception", CI, loaded)
    import os
    os._exit(0)
    """
)

# The trainer's side, run by torchrun (1 process): our init_weight_update_group as rank 0.
TRAINER = textwrap.dedent(
    """
    import os, subprocess, sys
    from datetime import timedelta
    import torch
    from megatron_rl.rollout.update_group import init_weight_update_group

    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True", os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    port, server_script = int(sys.argv[1]), sys.argv[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC"))}
    server = subprocess.Popen([sys.executable, server_script, str(port)], env=env)
    try:
        group = init_weight_update_group("127.0.0.1", port, rank=0, world_size=2, group_name="weights",
                                         backend="gloo", timeout=timedelta(seconds=15))
        torch.distributed.broadcast(torch.tensor([1.0, 2.0, 3.0, 4.0]), src=0, group=group)
        sys.exit(server.wait(timeout=30))
    finally:
        if server.poll() is None:
            server.kill()
    """
)


def test_trainer_hosts_the_update_group_store_under_torchrun(tmp_path):
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "trainer.py").write_text(TRAINER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--nnodes=1",
         f"--master_port={free_port()}", str(tmp_path / "trainer.py"), str(free_port()),
         str(tmp_path / "server.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "SERVER GOT [1.0, 2.0, 3.0, 4.0]" in log, log[-4000:]
