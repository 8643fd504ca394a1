"""The ``python`` tool's sandbox: how a tool call's program is contained on this machine (docs/rollout.md,
"Agent loop", Tools).

``sandbox_for(isolate_network, filesystem)`` probes once per process which containment works here, strongest
first, and returns it; ``Sandbox.run(code, limits)`` runs one program in it. ``filesystem="empty_root"`` (the
python tool's default) is only ever given by mount and PID namespaces: where they are not allowed it is refused,
never weakened without the user's say-so (``filesystem="host"``). Standard library only (it runs under any
interpreter, the tests load it without the package).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["FILESYSTEMS", "Sandbox", "SandboxLimits", "SandboxReport", "SandboxRun", "interpreter_paths", "sandbox_for",
           "sandbox_report"]

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
files = json.load(open(c["files"], encoding="utf-8")) if c["files"] else {}  # read before the host is sealed off
tmp_opts = "size=%dm,mode=0700%s" % (c["tmpfs_mb"], ",uid=%d,gid=%d" % (c["uid"], c["uid"]) if c["drop"] else "")
work = c["work"]
if c["namespaces"]:
    class MountAttr(ctypes.Structure):
        _fields_ = [("set", ctypes.c_uint64), ("clr", ctypes.c_uint64), ("prop", ctypes.c_uint64), ("ns", ctypes.c_uint64)]
    def mount_setattr(path, flags, set_, clr):
        a = MountAttr(set_, clr, 0, 0)
        return libc.syscall(442, -100, path.encode(), flags, ctypes.byref(a), ctypes.sizeof(a))
    if libc.mount(None, b"/", None, 0x40000 | 0x4000, None):  # MS_PRIVATE | MS_REC
        fail("private mounts", ctypes.get_errno())
    if c["root"] is not None:
        # an empty root: a tmpfs over the call's host directory, holding only the paths in c["root"] (bound from
        # the host, symlinked components recreated as symlinks), this PID namespace's /proc and a /tmp; then
        # pivot_root into it and detach the host's root, so no path leads back to the host's files
        new, bound = work, []
        if libc.mount(b"tmpfs", new.encode(), b"tmpfs", 2, b"mode=0755,size=1m"):  # MS_NOSUID
            fail("empty root", ctypes.get_errno())
        # the private /tmp first: an interpreter prefix below /tmp (a venv in a CI clone) is bound inside it
        os.makedirs(new + "/tmp", 0o755)
        if libc.mount(b"tmpfs", (new + "/tmp").encode(), b"tmpfs", 2 | 4, tmp_opts.encode()):  # NOSUID | NODEV
            fail("private /tmp", ctypes.get_errno())
        def place(path):
            parts = path.strip("/").split("/")
            for i in range(1, len(parts) + 1):
                cur = "/" + "/".join(parts[:i])
                if os.path.islink(cur):
                    if not os.path.lexists(new + cur):
                        os.symlink(os.readlink(cur), new + cur)
                    return place(os.path.join(os.path.realpath(cur), *parts[i:]))
            if any(path == b or path.startswith(b + "/") for b in bound):
                return
            if os.path.isdir(path):
                os.makedirs(new + path, 0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(new + path), 0o755, exist_ok=True)
                open(new + path, "ab").close()
            if libc.mount(path.encode(), (new + path).encode(), None, 0x1000 | 0x4000, None):  # MS_BIND | MS_REC
                fail("mounting " + path, ctypes.get_errno())
            bound.append(path)
        for path in c["root"]:
            place(path)
        os.makedirs(new + "/proc", 0o555)
        if libc.mount(b"/proc", (new + "/proc").encode(), None, 0x1000 | 0x4000, None):
            fail("mounting /proc", ctypes.get_errno())
        os.chdir(new)
        if libc.syscall(c["pivot_root"], b".", b"."):
            fail("pivot_root", ctypes.get_errno())
        if libc.umount2(b".", 2):  # MNT_DETACH: the host's root, now stacked on the new one
            fail("detaching the host's root", ctypes.get_errno())
        os.chdir("/")
    elif c["drop"]:
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
    if c["root"] is not None:
        if mount_setattr("/tmp", 0, 0, 1):  # the private /tmp writable again; the prefixes bound in it stay read-only
            fail("writable /tmp", ctypes.get_errno())
    elif libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 2 | 4, tmp_opts.encode()):  # MS_NOSUID | MS_NODEV
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
for name, data in files.items():  # the request's files (sandbox_service: SandboxFusion's "files"), beside main.py
    if os.path.dirname(name):
        os.makedirs(os.path.dirname(name), exist_ok=True)
    with open(name, "wb") as f:
        f.write(bytes.fromhex(data))
sys.argv = ["main.py"]
del ctypes, json, r, c, fail, libc, work, files
exec(compile(src, "main.py", "exec"), {"__name__": "__main__"})
"""
# pivot_root has no libc wrapper; its number differs by architecture (the newer mount calls above do not)
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
FILESYSTEMS = ("empty_root", "host")


def interpreter_paths() -> tuple[str, ...]:
    """The host paths an ``empty_root`` sandbox shows (read-only): the interpreter's prefixes (the venv and the
    Python it was made from: standard library, installed packages, the executable), the shared libraries'
    directories and the dynamic linker's cache, and the harmless devices. Nothing else: sys.path entries outside
    the prefixes (the working directory, PYTHONPATH, editable installs) stay outside."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                os.path.dirname(os.path.realpath(sys.executable))}
    libraries = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64", "/etc/ld.so.cache")
    devices = ("/dev/full", "/dev/null", "/dev/random", "/dev/urandom", "/dev/zero")
    # a prefix of / would be the whole host again: its standard library lies in /lib or /usr/lib anyway
    shown = {p for p in {*prefixes, *libraries} if os.path.exists(p) and os.path.realpath(p) != "/"}
    return tuple(sorted(shown)) + devices


@dataclass(frozen=True)
class SandboxReport:
    """How the ``python`` tool is contained on this machine (``PythonTool.sandbox``).

    ``pid_namespace``: every call runs in a PID namespace of its own (it sees no other process, and all its
    processes die with it); ``private_filesystem``: everything is read-only but a private ``/tmp`` (its cwd);
    ``unprivileged``: it runs as ``nobody`` (trainer is root) or in a user namespace of its own, without
    capabilities; ``network_isolated``: a new, empty network namespace; ``empty_root``: its filesystem holds
    only ``interpreter_paths()``, not the host's (mode ``unavailable``: no sandbox can give it one here)."""

    mode: str
    pid_namespace: bool
    private_filesystem: bool
    unprivileged: bool
    network_isolated: bool
    empty_root: bool = False

    def __str__(self) -> str:
        flags = [name for name in ("pid_namespace", "private_filesystem", "empty_root", "unprivileged",
                                   "network_isolated") if getattr(self, name)]
        return f"{self.mode} ({', '.join(flags) or 'process group only'})"


@dataclass(frozen=True)
class SandboxLimits:
    """One call's bounds: wall clock (and CPU seconds from it), address space, processes, the private /tmp, and
    the bytes of output kept (head and tail each)."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 32
    tmp_mb: int = 64
    output_bytes: int = 1 << 16


@dataclass(frozen=True)
class SandboxRun:
    """One program's run: whether it ran past its wall-clock limit, its exit status (negative: the signal that
    killed it; -1 with the reason in ``stdout``: it could not start), what it printed, and its seconds."""

    timed_out: bool
    return_code: int
    stdout: str
    stderr: str
    seconds: float


@dataclass(frozen=True)
class Sandbox:
    """One containment: the command it runs under (``unshare ...`` or none), whether the boot makes its mounts,
    drops to nobody, and the paths of an empty root (None: the host's filesystem)."""

    prefix: tuple[str, ...]
    namespaces: bool
    drop: bool
    root: tuple[str, ...] | None
    report: SandboxReport

    def run(self, code: str, limits: SandboxLimits) -> tuple[bool, int, str]:
        """Run ``code``: (timed out, exit status, output: stdout and stderr interleaved)."""
        result = self.execute(code, limits, merge_stderr=True)
        return result.timed_out, result.return_code, result.stdout

    def execute(self, code: str, limits: SandboxLimits, *, stdin: str | None = None,
                files: dict[str, bytes] | None = None, merge_stderr: bool = False) -> SandboxRun:
        """Run ``code`` with ``stdin`` (text; none: /dev/null) and ``files`` (relative path -> bytes, written
        beside the program): what it printed, on one stream or on stdout and stderr apart."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONIOENCODING": "utf-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with tempfile.TemporaryDirectory(prefix="mrl-python-tool-") as host_dir:
            src = os.path.join(host_dir, "main.py")
            with open(src, "w", encoding="utf-8") as f:
                f.write(code)
            files_path = None
            if files:
                files_path = os.path.join(host_dir, "files.json")
                with open(files_path, "w", encoding="utf-8") as f:
                    json.dump({name: bytes(data).hex() for name, data in files.items()}, f)
            # stdin from a file, not a pipe: a program that reads none never blocks the writer
            stdin_path = os.path.join(host_dir, "stdin")
            with open(stdin_path, "w", encoding="utf-8") as f:
                f.write(stdin or "")
            if self.drop and not self.namespaces:  # nobody works in the host directory
                os.chown(host_dir, _NOBODY, _NOBODY)
                for path in (src, files_path):
                    if path:
                        os.chmod(path, 0o644)
            cpu = max(1, int(limits.timeout_s) + 1)
            boot_cfg = {"src": src, "files": files_path, "work": host_dir, "namespaces": self.namespaces,
                        "drop": self.drop, "root": self.root, "pivot_root": _PIVOT_ROOT.get(os.uname().machine),
                        "uid": _NOBODY, "cpu": cpu, "mem": limits.memory_mb << 20, "fsize": 16 << 20,
                        "nproc": max(1, limits.max_processes), "tmpfs_mb": max(1, limits.tmp_mb)}
            started = time.monotonic()
            try:
                with open(stdin_path if stdin is not None else os.devnull, "rb") as stdin_file:
                    proc = subprocess.Popen(
                        [*self.prefix, sys.executable, "-I", "-c", _BOOT, json.dumps(boot_cfg)], cwd=host_dir,
                        env=env, stdin=stdin_file, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, start_new_session=True,
                    )
            except OSError as exc:
                return SandboxRun(False, -1, f"Error: could not start the Python sandbox: {exc}", "", 0.0)
            streams = [proc.stdout] if merge_stderr else [proc.stdout, proc.stderr]
            try:
                timed_out, outs = _read(proc, streams, started + limits.timeout_s, limits.output_bytes)
            finally:
                _stop(proc)
                for stream in streams:
                    stream.close()
        texts = [out.decode("utf-8", errors="replace") for out in outs]
        return SandboxRun(timed_out, proc.returncode, texts[0], "" if merge_stderr else texts[1],
                          time.monotonic() - started)


def _candidates(isolate_network: bool, filesystem: str) -> list[Sandbox]:
    """Strongest first: namespaces (as root: drop to nobody; otherwise in a user namespace), then, for
    ``filesystem="host"`` only, a session of its own (killed as a group) with nobody's uid where the trainer
    is root. An empty root needs the namespaces: nothing weaker is tried for it."""
    exe = shutil.which("unshare")
    root = os.geteuid() == 0
    net = ("--net",) if isolate_network else ()
    empty = filesystem == "empty_root"
    arch_known = os.uname().machine in _PIVOT_ROOT
    candidates = []
    if exe and (arch_known or not empty):
        user = () if root else ("--user", "--map-root-user")
        prefix = (exe, *user, "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts", *net)
        report = SandboxReport("namespaces", True, True, True, bool(net), empty)
        candidates.append(Sandbox(prefix, True, root, interpreter_paths() if empty else None, report))
    if empty:
        return candidates
    if exe and net and not root:
        candidates.append(Sandbox((exe, "-rn"), False, False, None,
                                  SandboxReport("session", False, False, False, True)))
    if root:
        candidates.append(Sandbox((), False, True, None, SandboxReport("session", False, False, True, False)))
    candidates.append(Sandbox((), False, False, None, SandboxReport("session", False, False, False, False)))
    return candidates


@lru_cache(maxsize=4)
def _probe(isolate_network: bool, filesystem: str) -> tuple[Sandbox | None, str]:
    """The strongest candidate that runs ``print('ok')`` here (probed once per process), and why the strongest
    failed where it did (None: no candidate works; only ``empty_root`` has none to fall back on)."""
    candidates, why = _candidates(isolate_network, filesystem), ""
    for sandbox in candidates:
        timed_out, returncode, out = sandbox.run("import json, tempfile; print('ok')", SandboxLimits(timeout_s=10))
        if (timed_out, returncode, out) == (False, 0, "ok\n"):
            return sandbox, why
        why = why or (f"timed out: {out.strip()}" if timed_out else out.strip() or f"exit status {returncode}")
    if not candidates:
        why = ("no `unshare` on PATH" if not shutil.which("unshare")
               else f"pivot_root's number on {os.uname().machine} is not known here")
    return (None, why) if filesystem == "empty_root" else (candidates[-1], why)


def sandbox_for(isolate_network: bool, filesystem: str) -> Sandbox:
    """The strongest sandbox this machine allows; ValueError where ``empty_root`` cannot be had."""
    sandbox, why = _probe(isolate_network, filesystem)
    if sandbox is None:
        raise ValueError(
            f"the python tool cannot run in an empty root on this machine ({why}): that needs mount and PID "
            "namespaces (`unshare`, as root or with unprivileged user namespaces). Without one the tool reads "
            "every world-readable host file, the training data included. Run where namespaces are allowed, or "
            "accept that with the tool's config `filesystem: host` (a tool YAML in "
            "actor_rollout_ref.rollout.multi_turn.tool_config_path: `- class_name: python`, "
            "`config: {filesystem: host}`)")
    return sandbox


def sandbox_report(isolate_network: bool = True, filesystem: str = "empty_root") -> SandboxReport:
    """How a ``python`` tool call is contained on this machine (see ``SandboxReport``)."""
    sandbox, _ = _probe(isolate_network, filesystem)
    return sandbox.report if sandbox else SandboxReport("unavailable", False, False, False, False)


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


def _read(proc: subprocess.Popen, streams: list, deadline: float, cap: int) -> tuple[bool, list[bytes]]:
    """Each stream's output until EOF or ``deadline``; never blocks on a pipe that a leftover process holds open
    (stop reading 0.2 s after the program itself exited). Keeps ``cap`` bytes of the head and of the tail of
    each long output."""
    kept = {s.fileno(): (bytearray(), bytearray(), [False]) for s in streams}  # fd -> head, tail, dropped
    exited_at = None
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return True, [bytes(head) for head, _, _ in kept.values()]
            if exited_at is None and _exited(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in sel.select(min(0.05, deadline - now)):
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                head, tail, dropped = kept[key.fd]
                room = cap - len(head)
                head += chunk[:room]
                if len(chunk) > room:
                    tail += chunk[room:]
                    if len(tail) > cap:
                        del tail[:len(tail) - cap]
                        dropped[0] = True
    while not _exited(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not _exited(proc.pid):
        return True, [bytes(head) for head, _, _ in kept.values()]
    return False, [bytes(head + (b"\n...(output cut)...\n" if dropped[0] else b"") + tail)
                   for head, tail, dropped in kept.values()]
