"""Colocated SGLang engines that start at the same moment on one host get distinct ports.

CI once ran two tests at once whose replica-1 engines both found 23002 taken, both picked 24002 (free when
checked) and the later scheduler's bind failed: ``EADDRINUSE`` on ``nccl_port 24002``. SGLang binds its
``nccl_port`` only once its schedulers run, seconds after the pick, so the pick must be held until then.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

from megatron_rl_testing.free_ports import free_base

ENGINE_START = textwrap.dedent("""
    import pathlib, socket, sys, time
    from megatron_rl.rollout.sglang import engine_transport

    class Engine:  # binds nccl_port the way SGLang's schedulers do: once they run, after a slow start
        def __init__(self, **args):
            time.sleep(2.0)
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", args["nccl_port"]))
            self.sock.listen()

    engine_transport.import_sglang = lambda module, name: Engine if name == "Engine" else "0.5.23"
    folder, me, base = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    (folder / me).touch()
    while len(list(folder.iterdir())) < 2:  # both pick at the same moment
        time.sleep(0.01)
    transport = engine_transport.InProcessTransport({"tp_size": 1}, replica_index=1, port_base=base,
                                                    port_stride=1000)
    print(transport.nccl_port, flush=True)
    time.sleep(3.0)  # still serving while the other engine starts
""")


def test_two_engines_starting_at_once_take_distinct_ports(tmp_path):
    base = free_base(2, 3, 1002, 1003, 2002, 2003)  # replica 1 asks for base + 2 (nccl_port) and base + 3
    (tmp_path / "ready").mkdir()
    script = tmp_path / "engine_start.py"
    script.write_text(ENGINE_START)
    engines = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "ready"), name, str(base)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in ("a", "b")
    ]
    results = [engine.communicate(timeout=120) for engine in engines]
    for engine, (out, err) in zip(engines, results):
        assert engine.returncode == 0, err[-2000:]
    picked = sorted(int(out.strip()) for out, _ in results)
    assert picked == [base + 2, base + 1002]
