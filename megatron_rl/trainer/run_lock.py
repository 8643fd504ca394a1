"""One run per output directory (issue 33): an exclusive ``flock`` on ``<trainer.default_local_dir>/.run.lock``,
taken before anything reads or writes the directory and held until the run ends.

Two runs in one directory would delete each other's work: the second start removes the first's in-flight
``global_step_<k>.tmp`` as "left by an interrupted save", cuts its ``metrics.jsonl`` back and deletes its
TensorBoard events. The second one is refused instead (a ``ConfigError``: exit code 2), naming the holder's pid,
host and start time. The lock file records the holder; the kernel drops the ``flock`` when the holder's process
ends however it ends, so a lock left by a killed run is taken over, with a message saying whose it was. A clean
end empties the record.

The lock is re-entrant within a process (``python -m megatron_rl.train`` takes it before Hydra writes its files,
``train.run`` again around preflight and training); under torchrun only global rank 0 takes it.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from megatron_rl.config import ConfigError

LOCK_FILE = ".run.lock"


class RunDirLocked(ConfigError):
    """Another live process holds the output directory's lock."""


@dataclass
class _Held:
    fd: int
    path: Path
    count: int


_held: dict[str, _Held] = {}


def _record(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 65536).decode("utf-8", "replace").strip()
        return json.loads(raw) if raw else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "a process that has not recorded itself yet (it is starting)"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    command = f", command: {holder['command']}" if holder.get("command") else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {when}{command}"


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(directory: str | Path) -> Path:
    """Take the run lock of ``directory`` (created if needed) for this process, or raise ``RunDirLocked`` naming
    its holder. Re-entrant: each call must be paired with ``release``. Returns the lock file's path."""
    directory = Path(directory).expanduser()
    key = str(directory.resolve())
    if key in _held:
        _held[key].count += 1
        return _held[key].path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(f"trainer.default_local_dir={directory}: cannot create its run lock "
                          f"{directory / LOCK_FILE}: {err.strerror or err}") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _record(fd)
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"trainer.default_local_dir={directory}: cannot lock {path}: "
                              f"{err.strerror or err}") from err
        raise RunDirLocked(
            f"trainer.default_local_dir={directory} is in use by another run: {_describe(holder)} (lock {path}). "
            f"Two runs in one directory delete each other's checkpoints, metrics and TensorBoard events, so this "
            f"one does not start. Wait for that run to end or stop it, or choose another trainer.default_local_dir"
        ) from None
    previous = _record(fd)
    here = socket.gethostname()
    if previous and previous.get("pid") != os.getpid():
        gone = ("that process is gone" if previous.get("host") == here and not _alive(previous.get("pid"))
                else "no process holds its lock any more")
        print(f"taking over the run lock {path} of {_describe(previous)}: {gone} (it ended without releasing it: "
              f"killed or crashed)", file=sys.stderr, flush=True)
    record = {"pid": os.getpid(), "host": here, "since": time.time(), "command": " ".join(sys.argv)[:500]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    os.fsync(fd)
    _held[key] = _Held(fd, path, 1)
    return path


def release(directory: str | Path) -> None:
    """Drop one hold of ``directory``'s lock; the last one empties the record and unlocks."""
    key = str(Path(directory).expanduser().resolve())
    held = _held.get(key)
    if held is None:
        return
    held.count -= 1
    if held.count > 0:
        return
    del _held[key]
    try:
        os.ftruncate(held.fd, 0)  # a clean end: the next run finds no holder to take over from
    except OSError:
        pass
    finally:
        fcntl.flock(held.fd, fcntl.LOCK_UN)
        os.close(held.fd)


def release_all() -> None:
    for key in list(_held):
        _held[key].count = 1
        release(key)


atexit.register(release_all)


@contextmanager
def holding(directory: str | Path) -> Iterator[Path]:
    """``with holding(dir):`` the run lock for the block (re-entrant)."""
    path = acquire(directory)
    try:
        yield path
    finally:
        release(directory)
