"""The processes a test started, found through /proc: a test looks only at its own (several test processes may
share the host, pytest-xdist), never at every process of a name."""
from __future__ import annotations

import os


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every live descendant of ``pid`` with its command line (arguments joined by spaces)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found.append((child, f.read().replace(b"\0", b" ").decode(errors="replace").strip()))
        except OSError:
            continue
        todo += children.get(child, [])
    return found
