"""scripts/profile_suite_cpu.py: a process's CPU goes to the test its pytest-xdist worker ran when it started,
and a multiprocessing child is named by its parent's kind."""
from __future__ import annotations

import sys
import textwrap

from megatron_rl_testing.scripts import load_script

profile_suite_cpu = load_script("profile_suite_cpu")

# A stand-in test process: titled as pytest-xdist titles its workers (only after collecting, seconds after it
# started), it starts one busy child per "test".
WORKER = textwrap.dedent("""
    import subprocess, sys, time
    import setproctitle
    time.sleep(4.0)
    BUSY = "import time\\nend = time.process_time() + 4.0\\nwhile time.process_time() < end: pass"
    for test in ("tests/a.py::test_one", "tests/b.py::test_two"):
        setproctitle.setproctitle("[pytest-xdist running] " + test)
        time.sleep(3.0)  # the sampler (every 0.5 s) reads the title before the child starts, even under load
        subprocess.run([sys.executable, "-c", BUSY], check=True)
""")


def test_child_cpu_goes_to_the_test_that_started_it(tmp_path):
    out = tmp_path / "cpu.json"
    assert profile_suite_cpu.profile([sys.executable, "-c", WORKER], out) == 0
    procs = profile_suite_cpu.load(out)
    by_pid = {int(key.split("@")[0]): key for key in procs}
    charged = {}
    for key, proc in procs.items():
        if not proc.titles and proc.cmdline.startswith(sys.executable + " -c import time"):
            charged[profile_suite_cpu.test_of(key, procs, by_pid)] = proc.cpu_s
    assert set(charged) == {"tests/a.py::test_one", "tests/b.py::test_two"}, charged
    assert all(cpu > 2.0 for cpu in charged.values()), charged  # of 4 CPU-s: the samples missed little
    table = profile_suite_cpu.report(procs, top=5)
    assert "| tests/a.py |" in table and "| tests/b.py |" in table, table


def test_a_spawned_child_is_named_by_its_parent():
    Proc = profile_suite_cpu.Proc
    procs = {
        "10@1.00": Proc("ray::IDLE", 1, 5.0, 1.0),
        "11@2.00": Proc("python -c from multiprocessing.spawn import spawn_main; spawn_main()", 10, 9.0, 2.0),
        "12@3.00": Proc("python -m vllm.entrypoints.openai.api_server --model /tmp/pytest-of-root/m", 1, 9.0,
                        3.0),
    }
    by_pid = {int(key.split("@")[0]): key for key in procs}
    assert profile_suite_cpu.kind_of("11@2.00", procs, by_pid) == \
        "spawned child (multiprocessing spawn) of a Ray worker"
    assert profile_suite_cpu.kind_of("12@3.00", procs, by_pid) == "vLLM API server"
    assert profile_suite_cpu.test_of("11@2.00", procs, by_pid) == "unattributed"


def test_a_file_it_did_not_write_is_refused_by_name(tmp_path, capsys):
    bad = tmp_path / "junit.xml"
    bad.write_text("<testsuites/>")
    try:
        profile_suite_cpu.main(["--report", str(bad)])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("a file that is not samples was read")
    assert f"--report {bad}: not samples this script wrote" in capsys.readouterr().err
