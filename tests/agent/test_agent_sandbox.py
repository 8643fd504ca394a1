"""The python tool's filesystem: an empty root holding only the interpreter (issue 56: a tool call printed the
training data's prompts with their answers). The run's files are planted world-readable, so only the sandbox's
view of the filesystem, not file permissions, can keep them from the tool."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from megatron_rl.agent import sandbox, tools
from megatron_rl.agent.tools import PythonTool

REPO = Path(__file__).resolve().parents[2]
ANSWER = "the-answer-is-80779853376"

# What the tool's program tries: each path is read (or listed); every attempt must end in FileNotFoundError.
_PROBE = """
import os
for path in {paths!r}:
    try:
        with open(path, "rb") as f:
            print("READ", path, f.read(200))
    except IsADirectoryError:
        print("LISTED", path, os.listdir(path))
    except OSError as exc:
        print("REFUSED", path, type(exc).__name__)
"""


@pytest.fixture
def run_dir():
    """A run's directories (data, model, checkpoints, output) with world-readable files holding the answer."""
    # /var/tmp, not /tmp: the tool's private /tmp already covers the host's /tmp
    root = Path(tempfile.mkdtemp(prefix="mrl-run-", dir="/var/tmp"))
    root.chmod(0o755)
    for rel in ("data/train.parquet", "model/config.json", "checkpoints/global_step_1/trainer_state.json",
                "output/rollouts.jsonl"):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'{{"prompt": "What is 123456 * 654321?", "answer": "{ANSWER}"}}\n')
        for part in (path, *path.relative_to(root).parents):
            (root / part).chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root)


def _targets(run_dir: Path) -> list[str]:
    return [str(run_dir / "data/train.parquet"), str(run_dir / "model/config.json"),
            str(run_dir / "checkpoints/global_step_1/trainer_state.json"), str(run_dir / "output"), str(run_dir),
            "/etc/passwd", "/etc/hostname", str(REPO / "pyproject.toml"), str(REPO / "tests"), "/home", "/dev/shm",
            "/root/.bashrc"]


def _assert_nothing_seen(out: str, targets: list[str]) -> None:
    assert ANSWER not in out, out
    lines = [line for line in out.splitlines() if line.startswith(("READ", "LISTED", "REFUSED"))]
    assert len(lines) == len(targets), out
    for line, path in zip(lines, targets):
        assert line == f"REFUSED {path} FileNotFoundError", out


def test_python_tool_sees_none_of_the_runs_files_nor_the_hosts(run_dir):
    py = PythonTool({"timeout_s": 10})
    targets = _targets(run_dir)
    _assert_nothing_seen(py.execute({"code": _PROBE.format(paths=targets)}), targets)
    # what is there: the interpreter's directories (read-only), a private /tmp as cwd, /proc of its own, /dev.
    # Here the venv lives in the repository: of the repository, the tool sees the venv alone
    venv = {Path(p).relative_to(REPO).parts[0] for p in sandbox.interpreter_paths() if Path(p).is_relative_to(REPO)}
    listing = f"import os\nprint(sorted(os.listdir({str(REPO)!r})) if os.path.exists({str(REPO)!r}) else [])"
    assert py.execute({"code": listing}).strip() == str(sorted(venv))
    out = py.execute({"code": "import os, json, sys\nprint(sorted(os.listdir('/tmp')), sorted(os.listdir('/dev')))\n"
                              "try:\n    open(sys.executable + '.planted', 'w')\nexcept OSError as exc:\n"
                              "    print(type(exc).__name__, exc.errno)\n"
                              "print(json.dumps({'sum': sum(i * i for i in range(10**5))}))"})
    # /tmp: the call's program, and the first component of an interpreter prefix below /tmp (a CI clone's venv),
    # bound read-only inside the private /tmp
    in_tmp = {Path(p).relative_to("/tmp").parts[0] for p in sandbox.interpreter_paths() if p.startswith("/tmp/")}
    tmp_listing = str(sorted({"main.py", *in_tmp}))
    assert out.splitlines()[0] == f"{tmp_listing} ['full', 'null', 'random', 'urandom', 'zero']", out
    assert out.splitlines()[1] == "OSError 30", out  # EROFS: the interpreter's directories are read-only
    assert out.splitlines()[2] == '{"sum": 333328333350000}', out


def test_python_tool_as_another_user_sees_none_of_the_runs_files(run_dir):
    """The trainer run by a user that is not root (``runuser -u nobody``): the tool then makes a user namespace
    of its own for its mounts. The system interpreter runs it (this machine's venv lives below /root, which nobody
    cannot enter); the agent package's __init__ (torch) is skipped: tools.py and sandbox.py need only the
    standard library."""
    runuser, system_python = shutil.which("runuser"), "/usr/bin/python3"
    if os.geteuid() != 0 or not runuser or not os.access(system_python, os.X_OK):
        pytest.skip("needs root, runuser and /usr/bin/python3 to run the trainer side as nobody")
    targets = _targets(run_dir)
    script = textwrap.dedent(f"""
        import os, sys, types
        for name, path in (("megatron_rl", {str(REPO / "megatron_rl")!r}),
                           ("megatron_rl.agent", {str(REPO / "megatron_rl" / "agent")!r})):
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__path__ = [path]
        import megatron_rl.agent.tools as mod
        print("UID", os.getuid(), mod.sandbox_report())
        print(mod.PythonTool({{"timeout_s": 10}}).execute({{"code": {_PROBE.format(paths=targets)!r}}}))
    """)
    proc = subprocess.run([runuser, "-u", "nobody", "--", system_python, "-I", "-c", script], cwd="/",
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.startswith("UID 65534 namespaces"), out
    _assert_nothing_seen(out, targets)


def test_python_tool_without_an_empty_root_is_refused_naming_the_key(monkeypatch, tmp_path):
    """No ``unshare`` on PATH: no namespaces, so no empty root. The tool refuses to start, naming the config key
    of the weaker mode, and runs in that mode only when the key asks for it."""
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox._probe.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"python tool.*empty root.*filesystem: host"):
            PythonTool({"timeout_s": 10})
        with pytest.raises(ValueError, match=r"filesystem='hots'.*empty_root, host"):
            PythonTool({"filesystem": "hots"})
        weaker = PythonTool({"timeout_s": 10, "filesystem": "host"})
        assert weaker.execute({"code": "print(6 * 7)"}).strip() == "42"
        assert not weaker.sandbox.empty_root and weaker.sandbox.mode == "session"
    finally:
        monkeypatch.undo()
        sandbox._probe.cache_clear()
    assert PythonTool({"timeout_s": 10}).sandbox.empty_root
