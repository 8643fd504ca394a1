"""Tools an environment lets the model call, described in OpenAI function-call JSON schema form (verl's
tool config), with two built-ins: ``calculator`` (safe arithmetic) and ``python`` (a sandboxed executor).

A tool's ``execute(arguments)`` returns the text the model sees. It must not raise for bad input: errors
are returned as text. The agent loop additionally bounds every tool call in time
(``multi_turn.tool_timeout_s``), so a hanging tool costs its sample a timeout observation, never the batch.

Tool config file (``multi_turn.tool_config_path``, verl's format)::

    tools:
      - class_name: megatron_rl.agent.tools.CalculatorTool   # or a built-in name: calculator, python
        config: {}
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import operator
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = [
    "CalculatorTool",
    "PythonTool",
    "SandboxReport",
    "Tool",
    "TOOL_REGISTRY",
    "build_tools",
    "load_tool_config",
    "register_tool",
    "safe_arithmetic",
    "sandbox_report",
    "truncate",
]


class Tool:
    """Base class. ``name`` and ``schema`` (OpenAI ``{"type": "function", "function": {...}}``)."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        self.config = dict(config or {})
        if tool_schema is not None:
            function = dict(tool_schema).get("function", tool_schema)
            self.name = function.get("name", self.name)
            self.description = function.get("description", self.description)
            self.parameters = function.get("parameters", self.parameters)
        if not self.name:
            raise ValueError(f"{type(self).__name__} has no name (set it or give a tool_schema)")

    @property
    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def execute(self, arguments: dict[str, Any], **kwargs: Any) -> str:  # pragma: no cover - abstract
        raise NotImplementedError


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """Cut ``text`` to ``limit`` characters (verl's tool_response_truncate_side: left | right | middle)."""
    if limit <= 0 or len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    if side == "left":
        return marker + text[len(text) - keep:]
    if side == "right":
        return text[:keep] + marker
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head):]


# ---------------------------------------------------------------------------------------------- calculator
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000
_MAX_DIGITS = 4000
_MAX_EXPRESSION = 1000


def safe_arithmetic(expression: str) -> int | float:
    """Evaluate + - * / // % ** and parentheses on numbers; nothing else is accepted (no names, calls,
    attributes), exponents are capped and results bounded, so no input can run code or hang."""
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION} characters")
    tree = ast.parse(expression.strip(), mode="eval")

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 3.33:
                raise ValueError("result too large")
            return value
        raise ValueError(f"unsupported element {type(node).__name__} (only numbers and + - * / // % ** ( ))")

    return ev(tree)


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns the exact result."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 123456 * 654321"}},
        "required": ["expression"],
    }

    def execute(self, arguments: dict[str, Any], **kwargs: Any) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return 'Error: calculator needs {"expression": "<arithmetic expression>"}.'
        try:
            value = safe_arithmetic(expression)
        except ZeroDivisionError:
            return "Error: division by zero."
        except (SyntaxError, ValueError, TypeError, OverflowError) as exc:
            return f"Error: cannot evaluate {expression!r}: {exc}"
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        return str(value)


# ---------------------------------------------------------------------------------------------- python
_NOBODY = 65534
# The child's first statements (run by ``python -I -c``; no preexec_fn, which is unsafe in the agent loop's
# multi-threaded tool pool): read the program, seal the filesystem, drop privileges, set the limits, run it.
_BOOT = r"""
import ctypes, json, os, sys, resource as r
c = json.loads(sys.argv[1])
def fail(what, err=None):
    sys.stdout.write("[sandbox set-up failed: %s%s]\n" % (what, ": " + os.strerror(err) if err else ""))
    sys.stdout.flush()
    os._exit(125)
libc = ctypes.CDLL(None, use_errno=True)
src = open(c["src"], encoding="utf-8").read()
work = c["work"]
if c["namespaces"]:
    class MountAttr(ctypes.Structure):
        _fields_ = [("set", ctypes.c_uint64), ("clr", ctypes.c_uint64), ("prop", ctypes.c_uint64), ("ns", ctypes.c_uint64)]
    def mount_setattr(path, flags, set_, clr):
        a = MountAttr(set_, clr, 0, 0)
        return libc.syscall(442, -100, path.encode(), flags, ctypes.byref(a), ctypes.sizeof(a))
    if libc.mount(None, b"/", None, 0x40000 | 0x4000, None):  # MS_PRIVATE | MS_REC
        fail("private mounts", ctypes.get_errno())
    if c["drop"]:
        # nobody must still read the interpreter: a directory on sys.path below one nobody may not enter
        # (/root/.pyenv/...) is cloned, that directory is covered by an empty tmpfs (its other contents hidden)
        # and the clone put back at its own path
        def hidden_above(path):
            parts = path.split("/")
            for i in range(2, len(parts) + 1):
                top = "/".join(parts[:i])
                if not os.stat(top).st_mode & 1:
                    return top
        keep = {}
        for p in sorted({os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)}):
            top = hidden_above(p)
            if top and not any(p.startswith(k + "/") for k in keep):
                fd = libc.syscall(428, -100, p.encode(), 1 | 0x8000 | 0o2000000)  # open_tree CLONE|RECURSIVE
                if fd < 0:
                    fail("cloning " + p, ctypes.get_errno())
                keep[p] = (top, fd)
        for top in sorted({top for top, _ in keep.values()}):
            if libc.mount(b"tmpfs", top.encode(), b"tmpfs", 2 | 4, b"mode=0755,size=1m"):
                fail("covering " + top, ctypes.get_errno())
        for p, (top, fd) in keep.items():
            os.makedirs(p, exist_ok=True)
            if libc.syscall(429, fd, b"", -100, p.encode(), 4):  # move_mount F_EMPTY_PATH
                fail("restoring " + p, ctypes.get_errno())
            os.close(fd)
    if mount_setattr("/", 0x8000, 1, 0):  # AT_RECURSIVE, MOUNT_ATTR_RDONLY: every mount read-only
        fail("read-only filesystem", ctypes.get_errno())
    opts = "size=%dm,mode=0700%s" % (c["tmpfs_mb"], ",uid=%d,gid=%d" % (c["uid"], c["uid"]) if c["drop"] else "")
    if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 2 | 4, opts.encode()):  # MS_NOSUID | MS_NODEV
        fail("private /tmp", ctypes.get_errno())
    work = "/tmp"
if c["drop"]:
    os.setgroups([])
    os.setgid(c["uid"])
    os.setuid(c["uid"])
    if os.getuid() != c["uid"] or os.geteuid() != c["uid"]:
        fail("dropping to uid %d" % c["uid"])
if libc.unshare(0x10000000):  # CLONE_NEWUSER: a process count of its own; no capability over the mounts
    if c["namespaces"] and not c["drop"]:
        fail("nested user namespace", ctypes.get_errno())
for res, value in ((r.RLIMIT_CPU, c["cpu"]), (r.RLIMIT_AS, c["mem"]), (r.RLIMIT_FSIZE, c["fsize"]),
                   (r.RLIMIT_NOFILE, 64), (r.RLIMIT_CORE, 0), (r.RLIMIT_NPROC, c["nproc"])):
    r.setrlimit(res, (value, value))
os.chdir(work)
os.environ["HOME"] = os.environ["TMPDIR"] = work
if c["namespaces"]:
    with open("main.py", "w", encoding="utf-8") as f:
        f.write(src)
sys.argv = ["main.py"]
del ctypes, json, r, c, fail, libc, work
exec(compile(src, "main.py", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class SandboxReport:
    """How the ``python`` tool is contained on this machine (``PythonTool.sandbox``).

    ``pid_namespace``: every call runs in a PID namespace of its own (it sees no other process, and all its
    processes die with it); ``private_filesystem``: everything is read-only but a private ``/tmp`` (its cwd);
    ``unprivileged``: it runs as ``nobody`` (trainer is root) or in a user namespace of its own, without
    capabilities; ``network_isolated``: a new, empty network namespace."""

    mode: str
    pid_namespace: bool
    private_filesystem: bool
    unprivileged: bool
    network_isolated: bool

    def __str__(self) -> str:
        flags = [name for name in ("pid_namespace", "private_filesystem", "unprivileged", "network_isolated")
                 if getattr(self, name)]
        return f"{self.mode} ({', '.join(flags) or 'process group only'})"


@dataclass(frozen=True)
class _Plan:
    prefix: tuple[str, ...]
    namespaces: bool
    drop: bool
    report: SandboxReport


def _plans(isolate_network: bool) -> list[_Plan]:
    """Candidates, strongest first: namespaces (as root: drop to nobody; otherwise in a user namespace), then
    a session of its own (killed as a group) with nobody's uid where the trainer is root."""
    exe = shutil.which("unshare")
    root = os.geteuid() == 0
    net = ("--net",) if isolate_network else ()
    plans = []
    if exe:
        user = () if root else ("--user", "--map-root-user")
        prefix = (exe, *user, "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts", *net)
        plans.append(_Plan(prefix, True, root, SandboxReport("namespaces", True, True, True, bool(net))))
        if net and not root:
            plans.append(_Plan((exe, "-rn"), False, False, SandboxReport("session", False, False, False, True)))
    if root:
        plans.append(_Plan((), False, True, SandboxReport("session", False, False, True, False)))
    plans.append(_Plan((), False, False, SandboxReport("session", False, False, False, False)))
    return plans


@lru_cache(maxsize=2)
def _sandbox_plan(isolate_network: bool) -> _Plan:
    """The strongest candidate that runs ``print('ok')`` on this machine (probed once per process)."""
    probe = PythonTool({"timeout_s": 10, "isolate_network": isolate_network})
    for plan in _plans(isolate_network):
        if probe.run_in(plan, "import json, tempfile; print('ok')") == (False, 0, "ok\n"):
            return plan
    return _plans(isolate_network)[-1]


def sandbox_report(isolate_network: bool = True) -> SandboxReport:
    """How a ``python`` tool call is contained on this machine (see ``SandboxReport``)."""
    return _sandbox_plan(isolate_network).report


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _exited(pid: int) -> bool:
    """Whether the child ``pid`` has exited, without reaping it (its pid, and so its group, stays ours)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _stop(proc: subprocess.Popen) -> None:
    """Kill everything the call started: the PID namespace's init first (the kernel then kills every process
    in the namespace and ``unshare`` returns once they are all gone), then the whole process group."""
    deadline = time.monotonic() + 5.0
    if not _exited(proc.pid):
        for child in _children(proc.pid):
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class PythonTool(Tool):
    """Runs code in a fresh ``python -I`` subprocess, contained as ``sandbox`` reports (``SandboxReport``).

    Where the kernel allows (``sandbox.mode == "namespaces"``): a PID namespace per call (it sees no other
    process; every process it starts, daemons included, dies with the call), a mount namespace with the whole
    filesystem read-only but a private size-bounded ``/tmp`` (its cwd, HOME and TMPDIR), a new empty network,
    IPC and UTS namespace, and no privileges: as ``nobody`` (65534, no supplementary groups) when the trainer
    is root, in a user namespace of its own otherwise. Elsewhere: a session of its own killed as a group, as
    ``nobody`` when the trainer is root. Always: wall-clock limit (``timeout_s``; output is read with a
    deadline, so a process holding the pipe cannot extend the call), CPU seconds, address space
    (``memory_mb``), file size, open files, processes (RLIMIT_NPROC, ``max_processes``; counted per call where
    a user namespace can be made), no core dumps; an environment with only PATH (no proxies or secrets);
    output truncated to ``max_output_chars``."""

    name = "python"
    description = "Run a Python 3 program and return what it prints (stdout and stderr)."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print() the result"}},
        "required": ["code"],
    }

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        super().__init__(config, tool_schema)
        self.timeout_s = float(self.config.get("timeout_s", 5.0))
        self.memory_mb = int(self.config.get("memory_mb", 512))
        self.max_output_chars = int(self.config.get("max_output_chars", 2000))
        self.isolate_network = bool(self.config.get("isolate_network", True))
        self.max_processes = int(self.config.get("max_processes", 32))
        self.tmp_mb = int(self.config.get("tmp_mb", 64))

    @property
    def sandbox(self) -> SandboxReport:
        return sandbox_report(self.isolate_network)

    @property
    def network_isolated(self) -> bool:
        return self.sandbox.network_isolated

    def run_in(self, plan: _Plan, code: str) -> tuple[bool, int, str]:
        """Run ``code`` under ``plan``: (timed out, exit status, output)."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONIOENCODING": "utf-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with tempfile.TemporaryDirectory(prefix="mrl-python-tool-") as host_dir:
            src = os.path.join(host_dir, "main.py")
            with open(src, "w", encoding="utf-8") as f:
                f.write(code)
            if plan.drop and not plan.namespaces:  # nobody works in the host directory
                os.chown(host_dir, _NOBODY, _NOBODY)
                os.chmod(src, 0o644)
            cpu = max(1, int(self.timeout_s) + 1)
            boot_cfg = {"src": src, "work": host_dir, "namespaces": plan.namespaces, "drop": plan.drop,
                        "uid": _NOBODY, "cpu": cpu, "mem": self.memory_mb << 20, "fsize": 16 << 20,
                        "nproc": max(1, self.max_processes), "tmpfs_mb": max(1, self.tmp_mb)}
            try:
                proc = subprocess.Popen(
                    [*plan.prefix, sys.executable, "-I", "-c", _BOOT, json.dumps(boot_cfg)], cwd=host_dir, env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                return False, -1, f"Error: could not start the Python sandbox: {exc}"
            try:
                timed_out, out = self._read(proc, time.monotonic() + self.timeout_s)
            finally:
                _stop(proc)
                proc.stdout.close()
        return timed_out, proc.returncode, out.decode("utf-8", errors="replace")

    def _read(self, proc: subprocess.Popen, deadline: float) -> tuple[bool, bytes]:
        """Output until EOF or ``deadline``; never blocks on a pipe that a leftover process holds open (stop
        reading 0.2 s after the program itself exited). Keeps the head and the tail of long output."""
        cap = max(4 * self.max_output_chars, 1 << 16)
        head, tail, dropped = bytearray(), bytearray(), False
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        exited_at = None
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                if now >= deadline:
                    return True, bytes(head)
                if exited_at is None and _exited(proc.pid):
                    exited_at = now
                if exited_at is not None and now - exited_at > 0.2:
                    break
                if not sel.select(min(0.05, deadline - now)):
                    continue
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    break
                room = cap - len(head)
                head += chunk[:room]
                if len(chunk) > room:
                    tail += chunk[room:]
                    if len(tail) > cap:
                        del tail[:len(tail) - cap]
                        dropped = True
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not _exited(proc.pid):
            return True, bytes(head)
        return False, bytes(head + (b"\n...(output cut)...\n" if dropped else b"") + tail)

    def execute(self, arguments: dict[str, Any], **kwargs: Any) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return 'Error: python needs {"code": "<program>"}.'
        timed_out, returncode, text = self.run_in(_sandbox_plan(self.isolate_network), code)
        if timed_out:
            return f"Error: the program ran longer than {self.timeout_s:g}s and was killed."
        if returncode == -1 and text.startswith("Error: could not start"):
            return text
        if returncode != 0:
            reason = (f"killed by signal {-returncode}" if returncode < 0
                      else f"killed by signal {returncode - 128}" if returncode > 128
                      else f"exit status {returncode}")
            text = f"{text}\n[{reason}]".strip()
        return truncate(text, self.max_output_chars, "middle") if text else "(no output)"


# ---------------------------------------------------------------------------------------------- registry
TOOL_REGISTRY: dict[str, type[Tool]] = {"calculator": CalculatorTool, "python": PythonTool}


def register_tool(name: str) -> Callable[[type[Tool]], type[Tool]]:
    def wrap(cls: type[Tool]) -> type[Tool]:
        TOOL_REGISTRY[name] = cls
        return cls

    return wrap


def _resolve_class(class_name: str) -> type[Tool]:
    if class_name in TOOL_REGISTRY:
        return TOOL_REGISTRY[class_name]
    module, _, attr = class_name.rpartition(".")
    if not module:
        raise ValueError(f"unknown tool {class_name!r}; built-in: {sorted(TOOL_REGISTRY)}, or give module.Class")
    return getattr(importlib.import_module(module), attr)


def build_tools(specs: Any) -> dict[str, Tool]:
    """Tools by name from a list of names (``["calculator"]``) or verl tool-config entries."""
    tools: dict[str, Tool] = {}
    for spec in specs or ():
        if isinstance(spec, str):
            tool = _resolve_class(spec)()
        else:
            spec = dict(spec)
            tool = _resolve_class(spec["class_name"])(spec.get("config") or {}, spec.get("tool_schema"))
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def load_tool_config(path: str | os.PathLike) -> dict[str, Tool]:
    """Read verl's tool config YAML (``tools: [{class_name, config, tool_schema}]``)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(cfg, dict) or "tools" not in cfg:
        raise ValueError(f"{path}: a tool config needs a top-level 'tools' list")
    return build_tools(cfg["tools"])
