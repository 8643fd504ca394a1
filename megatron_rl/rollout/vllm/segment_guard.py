"""Which /dev/shm segments a vLLM worker maps or writes: only the run's own (docs/rollout.md, "vLLM servers").

The worker's ``/collective_rpc`` methods take a segment's path (``mrl_load_weights``) or name
(``mrl_read_weights``) from the caller. The route needs the run's secret (servers/route_auth.py); this is the
second wall, for a caller that has it by mistake or a bug that passes something else: a path is accepted only
when it names, without a link or a ``..``, a regular file called as the run calls its segments
(``shm.new_segment_name``), owned by this process's user, mode 0600 (``shm.ShmSegment`` creates it so), and at
least as large as the layout maps (mapping past its end would kill the engine with SIGBUS at the first read).
A name is accepted only bare: ``os.path.join`` drops the directory before an absolute one.

Imported inside vLLM's workers: the standard library only.
"""

from __future__ import annotations

import os
import stat

__all__ = ["SEGMENT_PREFIX", "checked_segment_name", "checked_segment_path"]

SEGMENT_PREFIX = "mrl_vllm_"  # shm.new_segment_name's
SEGMENT_MODE = 0o600


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str) or os.sep in name or "\0" in name or name in ("", ".", ".."):
        return "a bare file name is required, without a directory"
    if not name.startswith(SEGMENT_PREFIX):
        return f"not a weight segment name (they begin with {SEGMENT_PREFIX!r})"
    return None


def checked_segment_name(name: str) -> str:
    """``name`` if it is a bare segment name of the run (no directory, no ``..``); PermissionError otherwise."""
    if (problem := _name_problem(name)) is not None:
        raise PermissionError(f"refused segment name {name!r}: {problem}")
    return name


def checked_segment_path(path: str, size: int) -> str:
    """``path`` if it is one of the run's segments holding at least ``size`` bytes (see the module docstring);
    PermissionError naming the segment and the reason otherwise."""
    if not isinstance(path, str) or not os.path.isabs(path) or os.path.normpath(path) != path:
        raise PermissionError(f"refused segment {path!r}: an absolute path without '..' or '.' parts is required")
    if (problem := _name_problem(os.path.basename(path))) is not None:
        raise PermissionError(f"refused segment {path!r}: {problem}")
    try:
        info = os.lstat(path)  # the name itself, never what a link points to
    except OSError as exc:
        raise PermissionError(f"refused segment {path!r}: {exc.strerror}") from exc
    problems = []
    if not stat.S_ISREG(info.st_mode):
        problems.append("not a regular file (a link or a device)")
    if info.st_uid != os.getuid():
        problems.append(f"owned by uid {info.st_uid}, not this worker's ({os.getuid()})")
    if stat.S_IMODE(info.st_mode) != SEGMENT_MODE:
        problems.append(f"mode {oct(stat.S_IMODE(info.st_mode))}, not {oct(SEGMENT_MODE)}")
    if stat.S_ISREG(info.st_mode) and info.st_size < int(size):
        problems.append(f"it holds {info.st_size} bytes, the layout says {int(size)}")
    if problems:
        raise PermissionError(f"refused segment {path!r}: {'; '.join(problems)} (the run's segments are regular "
                              f"files {SEGMENT_PREFIX}*, mode 0600, of the worker's own user)")
    return path
