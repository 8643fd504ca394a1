"""Built-in tools (calculator, sandboxed python), Hermes parsing, verl's tool config."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import uuid

import pytest

from megatron_rl.agent import (
    CalculatorTool,
    PythonTool,
    ToolCall,
    ToolCallError,
    load_tool_config,
    parse_tool_calls,
    safe_arithmetic,
)


def test_parse_hermes_tool_calls():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> and '
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call> '
            '<tool_call>not json</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "x", "arguments": 3}</tool_call>')
    calls, rest = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "1+2"})
    assert calls[1] == ToolCall("python", {"code": "print(1)"})
    assert all(isinstance(c, ToolCallError) for c in calls[2:]) and len(calls) == 5
    assert "not valid JSON" in calls[2].message and "JSON object" in calls[3].message
    assert rest.startswith("think") and "<tool_call>" not in rest
    assert parse_tool_calls("#### 42") == ([], "#### 42")
    calls, _ = parse_tool_calls('<tool_call>{"name": "a"')
    assert isinstance(calls[0], ToolCallError) and "never closed" in calls[0].message


def test_calculator_is_exact_and_refuses_code():
    calc = CalculatorTool()
    assert calc.execute({"expression": "123456 * 654321"}) == str(123456 * 654321)
    assert calc.execute({"expression": "(2 + 3) ** 2 - 7 // 2"}) == "22"
    assert calc.execute({"expression": "10 / 4"}) == "2.5"
    for bad in ("__import__('os').system('true')", "open('/etc/passwd')", "(1).__class__", "x + 1", "[1]*9"):
        assert calc.execute({"expression": bad}).startswith("Error"), bad
    start = time.monotonic()
    assert "exponent" in calc.execute({"expression": "9 ** 9 ** 9"})
    assert calc.execute({"expression": "2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999"}).startswith("Error")
    assert time.monotonic() - start < 1.0
    assert calc.execute({"expression": "1/0"}) == "Error: division by zero."
    assert calc.execute({}).startswith("Error")
    assert calc.schema["function"]["name"] == "calculator"
    assert safe_arithmetic("-3 + 4") == 1


def test_python_tool_runs_code_and_truncates_output():
    py = PythonTool({"timeout_s": 5, "max_output_chars": 100})
    assert py.execute({"code": "print(6 * 7)"}).strip() == "42"
    long = py.execute({"code": "print('x' * 10000)"})
    assert len(long) <= 100 and "truncated" in long
    err = py.execute({"code": "raise ValueError('no')"})
    assert "ValueError: no" in err and "exit status 1" in err
    assert py.execute({"code": 3}).startswith("Error")


def test_python_tool_time_and_memory_limits():
    py = PythonTool({"timeout_s": 1, "memory_mb": 256})
    py.sandbox  # the once-per-process sandbox probe, outside the timed call
    start = time.monotonic()
    out = py.execute({"code": "while True: pass"})
    # the spin never ends by itself; the bound leaves room for a loaded CI machine (3.2 s seen at load 6-9)
    assert time.monotonic() - start < 1 + 15 and ("longer than" in out or "signal" in out)
    out = PythonTool({"timeout_s": 10, "memory_mb": 256}).execute(
        {"code": "x = bytearray(1024 * 1024 * 1024); print('alloc' + 'ated')"})
    assert "MemoryError" in out and "allocated" not in out.replace("'alloc' + 'ated'", "")


def test_python_tool_environment_and_network():
    py = PythonTool({"timeout_s": 5})
    # no inherited secrets / proxies; runs in an empty temporary directory
    names = set(eval(py.execute({"code": "import os; print(sorted(os.environ))"}).strip()))
    assert names - {"LC_CTYPE"} == {"PATH", "PYTHONIOENCODING", "HOME", "TMPDIR", "OMP_NUM_THREADS",
                                    "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    # besides the call's program, an empty root shows the first component of an interpreter prefix below /tmp (a
    # CI clone's venv), bound read-only inside the private /tmp
    from megatron_rl.agent.sandbox import interpreter_paths

    in_tmp = {p.split("/")[2] for p in interpreter_paths() if p.startswith("/tmp/")} if py.sandbox.empty_root else set()
    listed = eval(py.execute({"code": "import os; print(os.listdir('.'))"}).strip())
    assert sorted(listed) == sorted({"main.py", *in_tmp})
    if not py.network_isolated:
        pytest.skip("no unprivileged network namespace here (unshare -rn): network isolation not enforced")
    out = py.execute({"code": "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1); print('conn' + 'ected')"})
    assert "connected" not in out.replace("'conn' + 'ected'", "") and ("OSError" in out or "Errno" in out)


def test_verl_tool_config(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: megatron_rl.agent.tools.CalculatorTool\n"
        "    config: {}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: calc\n"
        "        description: arithmetic\n"
        "        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}\n"
        "  - class_name: python\n"
        "    config: {timeout_s: 2}\n"
    )
    tools = load_tool_config(path)
    assert sorted(tools) == ["calc", "python"]
    assert tools["calc"].execute({"expression": "2*3"}) == "6"
    assert tools["python"].timeout_s == 2.0
    assert tools["calc"].schema["function"]["parameters"]["required"] == ["expression"]


# ---------------------------------------------------------------------------------------------- containment
def _marked_processes(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line holds ``marker`` or whose name (``comm``, set
    with prctl) is ``marker`` (the whole machine's /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                head, tail = f.read().rsplit(b")", 1)
        except OSError:
            continue
        named = head.split(b"(", 1)[1] == marker.encode()
        if (marker.encode() in cmdline or named) and tail.split()[0] not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def _kill_marked(marker: str) -> None:
    for pid in _marked_processes(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# A daemon: double fork + setsid, the grandchild keeps stdout open and sleeps, named by a marker in its argv.
_DAEMON = """
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)  # {marker}"])
    os._exit(0)
print("parent done", flush=True)
"""


def test_python_tool_daemon_cannot_outlive_the_call():
    marker = f"mrl-daemon-{uuid.uuid4().hex}"
    # 10 s: room for unshare + python -I on a loaded machine; a call cut off at the limit has no "parent done"
    py = PythonTool({"timeout_s": 10})
    py.sandbox  # the once-per-process sandbox probe, outside the timed calls
    try:
        start = time.monotonic()
        out = py.execute({"code": _DAEMON.format(marker=marker)})
        elapsed = time.monotonic() - start
        # the grandchild sleeps 600 s: a call that waited for the pipe to close would take that long
        assert elapsed < 10 + 15, f"the call took {elapsed:.1f}s (limit 10s): a grandchild held the pipe"
        assert "parent done" in out, out
        if not py.sandbox.pid_namespace:
            pytest.skip(f"no PID namespace here ({py.sandbox}): a daemon that left the session is not reaped")
        assert _marked_processes(marker) == [], "a daemonised grandchild survived the call"
        # the same when the program itself outlives the limit
        start = time.monotonic()
        out = PythonTool({"timeout_s": 2}).execute(
            {"code": _DAEMON.format(marker=marker) + "import time; time.sleep(600)"})
        assert time.monotonic() - start < 2 + 15 and "longer than" in out
        assert _marked_processes(marker) == []
    finally:
        _kill_marked(marker)


def test_python_tool_bounds_processes():
    marker = f"mrlf{uuid.uuid4().hex[:11]}"  # a process name holds 15 characters
    # 10 s: room for unshare + python -I on a loaded machine; a call cut off at the limit has no "forks"
    py = PythonTool({"timeout_s": 10, "max_processes": 8})
    py.sandbox  # the once-per-process sandbox probe, outside the timed calls
    # bounded by the test itself (200 forks at most), so it cannot run away on a tool without the limit;
    # the children sleep 600 s: a call that waited for them (or for the pipe they hold) would take that long.
    # The program reaches the tool as a file, not on a command line, so each child names itself by the marker
    # (prctl PR_SET_NAME) for a survivor to be found in /proc
    name = f"import ctypes\nname = lambda: ctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)\n"
    code = (f"import os, time\n{name}n = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
            "            name(); time.sleep(600); os._exit(0)\n        n += 1\nexcept OSError as exc:\n"
            "    print('forks', n, type(exc).__name__)\nelse:\n    print('forks', n, 'unbounded')\n")
    try:
        start = time.monotonic()
        out = py.execute({"code": code})
        assert time.monotonic() - start < 10 + 15
        assert "unbounded" not in out and "forks" in out, out
        assert int(out.split()[1]) < 8, out
        if py.sandbox.pid_namespace:
            assert _marked_processes(marker) == []
        # a real fork bomb: bounded, killed at the limit, nothing left
        start = time.monotonic()
        out = PythonTool({"timeout_s": 2, "max_processes": 8}).execute(
            {"code": f"import os\n{name}while True:\n    try:\n        if os.fork() == 0:\n"
                     "            name()\n    except OSError:\n        pass\n"})
        assert time.monotonic() - start < 2 + 15 and "longer than" in out, out
        if py.sandbox.pid_namespace:
            assert _marked_processes(marker) == []
    finally:
        _kill_marked(marker)


def test_python_tool_is_unprivileged(tmp_path):
    py = PythonTool({"timeout_s": 5})
    out = py.execute({"code": "print(open('/etc/shadow').read()[:4])"})
    assert "Error" in out and ("Permission" in out or "No such file" in out), out
    outside = tmp_path / "planted.txt"
    tmp_path.chmod(0o777)  # even a world-writable directory of the trainer's is out of reach
    out = py.execute({"code": f"open({str(outside)!r}, 'w').write('x')"})
    assert not outside.exists() and "Error" in out, out
    out = py.execute({"code": "open('here.txt', 'w').write('fine'); import os, tempfile\n"
                              "print(open('here.txt').read(), os.environ['HOME'] == os.getcwd() == tempfile.gettempdir())"})
    assert out.strip() == "fine True", out
    # no view of the trainer: it cannot be signalled (not even probed with signal 0), nor the tool's parent
    code = (f"import os\ntry:\n    os.kill({os.getpid()}, 0)\n    print('reached the trainer')\n"
            "except OSError as exc:\n    print('trainer:', type(exc).__name__)\n"
            "ppid = os.getppid()\nif ppid:\n    try:\n        os.kill(ppid, 0)\n        print('reached the parent')\n"
            "    except OSError as exc:\n        print('parent:', type(exc).__name__)\n")
    out = py.execute({"code": code})
    assert "reached" not in out and "trainer: " in out, out
    assert py.execute({"code": "print(sum(range(10)))"}).strip() == "45"
