"""Where a command's CPU seconds go, by kind of process and by test file. The suite is CPU-bound (both
cores ~92% busy), so its time is the CPU its processes spend. Most of that is in processes the tests start
(Ray workers, vLLM engine cores, forked ranks, run drivers), which JUnit's per-test wall seconds do not show.

    python scripts/profile_suite_cpu.py --out cpu.json -- make test     # sample while the command runs
    python scripts/profile_suite_cpu.py --report cpu.json [--top 25]    # the tables again, from the samples

Every 0.5 s it reads /proc/<pid>/stat of each process started after the command (user + system seconds,
parent) and its command line. A process's CPU counts for the test its pytest-xdist worker was running when the
process started: the worker's title ("[pytest-xdist running] NODEID"), found through the chain of parents (a
Ray worker's parent is the raylet, whose parent is the test process that started Ray). A process whose parent
left first is "unattributed". A process that lives under half a second may be missed. Run it on an otherwise
quiet machine: any process started meanwhile counts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
PERIOD_S = 0.5
XDIST_TITLE = re.compile(r"^\[pytest-xdist running\] (\S+)")
# (kind, pattern on the command line): the first match wins. A multiprocessing child is named by its
# parent's kind.
KINDS = [
    ("test process (pytest-xdist worker)", re.compile(r"^\[pytest-xdist|-m pytest|/pytest ")),
    ("vLLM API server", re.compile(r"vllm\.entrypoints")),
    ("vLLM engine core", re.compile(r"^VLLM::")),
    ("Ray system (raylet, GCS, dashboard, monitors, agents)", re.compile(
        r"raylet|gcs_server|dashboard|log_monitor|monitor\.py|ray::(DashboardAgent|RuntimeEnvAgent)")),
    ("Ray worker (actors, idle workers)", re.compile(r"^ray::|default_worker\.py")),
    ("forked rank (run_multiprocess forkserver)", re.compile(r"multiprocessing\.forkserver")),
    ("spawned child (multiprocessing spawn)", re.compile(r"multiprocessing\.spawn")),
    ("run driver (python -m megatron_rl..., torchrun)",
     re.compile(r"-m megatron_rl|torch\.distributed\.run|torchrun")),
    ("SGLang stand-in", re.compile(r"sglang")),
    ("pip", re.compile(r"\bpip\b")),
    ("compilers (gcc, nvcc, ninja)",
     re.compile(r"\b(gcc|g\+\+|cc1plus|cc1|nvcc|cicc|cudafe\+\+|ptxas|ninja|ld)\b")),
]
# A process that spends at least this much has imported torch and Megatron-Core, transformers or vLLM, which
# is about what those imports cost on the 2-core machine (benchmarks/README.md, "Start-up").
IMPORTING_CPU_S = 5.0


@dataclass
class Proc:
    cmdline: str
    ppid: int
    cpu_s: float
    started: float  # seconds since boot
    titles: list[tuple[float, str]] = field(default_factory=list)  # a pytest-xdist worker's (time, test)


def _boot_seconds() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def _stat(pid: str) -> tuple[int, float, float] | None:
    """(parent pid, CPU seconds, start in seconds since boot) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, int(fields[19]) / TICKS


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def sample(procs: dict[str, Proc], since: float, me: int) -> None:
    """One pass over /proc: new processes started at or after ``since`` (seconds since boot), CPU of all."""
    now = _boot_seconds()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is None or stat[2] < since or int(pid) == me:
            continue
        ppid, cpu_s, started = stat
        key = f"{pid}@{started:.2f}"
        proc = procs.get(key)
        if proc is None:
            proc = procs[key] = Proc("", ppid, cpu_s, started)
        proc.cpu_s = cpu_s
        # read again each time: exec and setproctitle come after the fork, and a pytest-xdist worker takes its
        # title only once it has collected the tests, seconds after it started
        proc.cmdline = _cmdline(pid) or proc.cmdline
        title = XDIST_TITLE.match(proc.cmdline)
        if title and (not proc.titles or proc.titles[-1][1] != title[1]):
            proc.titles.append((now, title[1]))


def kind_of(key: str, procs: dict[str, Proc], by_pid: dict[int, str]) -> str:
    proc = procs[key]
    for kind, pattern in KINDS:
        if pattern.search(proc.cmdline):
            if kind.startswith("spawned child"):
                parent = by_pid.get(proc.ppid)
                if parent is not None and parent != key:
                    return f"{kind} of a {kind_of(parent, procs, by_pid).split(' (')[0]}"
            return kind
    return "other"


def test_of(key: str, procs: dict[str, Proc], by_pid: dict[int, str]) -> str:
    """The test a process ran for: the one its pytest-xdist ancestor was running when the process started."""
    started, seen = procs[key].started, set()
    while key is not None and key not in seen:
        seen.add(key)
        proc = procs[key]
        if proc.titles:
            current = [test for at, test in proc.titles if at <= started + PERIOD_S]
            return current[-1] if current else proc.titles[0][1]
        key = by_pid.get(proc.ppid)
    return "unattributed"


def report(procs: dict[str, Proc], top: int) -> str:
    by_pid = {int(key.split("@")[0]): key for key in procs}  # a reused pid maps to its latest process
    kinds: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    tests: Counter[str] = Counter()
    for key, proc in procs.items():
        kind = kind_of(key, procs, by_pid)
        kinds[kind] += proc.cpu_s
        counts[kind] += 1
        if not proc.titles:  # a test process's own CPU is spread over its tests: not charged to its first
            tests[test_of(key, procs, by_pid).split("::")[0]] += proc.cpu_s
    total = sum(kinds.values())
    importing = [p for p in procs.values() if p.cpu_s >= IMPORTING_CPU_S and not p.titles]
    imports_s = IMPORTING_CPU_S * len(importing)
    summary = (f"{total:.0f} CPU-s in {len(procs)} processes. {len(importing)} of them spent >= "
               f"{IMPORTING_CPU_S:g} CPU-s each (processes that import torch and Megatron-Core, transformers "
               f"or vLLM: about {IMPORTING_CPU_S:g} CPU-s of imports each, {imports_s:.0f} in all).")
    lines = [summary, "", "| kind of process | processes | CPU-s | share |", "|---|---|---|---|"]
    lines += [f"| {kind} | {counts[kind]} | {cpu:.0f} | {cpu / total:.0%} |"
              for kind, cpu in kinds.most_common()]
    lines += ["", f"The {top} test files whose processes (not counting the test process) spent the most:", "",
              "| test file | CPU-s |", "|---|---|"]
    lines += [f"| {test} | {cpu:.0f} |" for test, cpu in tests.most_common(top)]
    return "\n".join(lines)


def _save(procs: dict[str, Proc], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({key: asdict(proc) for key, proc in procs.items()}))
    tmp.replace(path)


def load(path: Path) -> dict[str, Proc]:
    return {key: Proc(**{**fields, "titles": [tuple(t) for t in fields["titles"]]})
            for key, fields in json.loads(path.read_text()).items()}


def profile(command: list[str], out: Path) -> int:
    """Run ``command``, sampling until it exits; the samples go to ``out`` (every 30 s and at the end)."""
    procs: dict[str, Proc] = {}
    since = _boot_seconds() - 1.0 / TICKS
    child = subprocess.Popen(command)
    saved = time.monotonic()
    while child.poll() is None:
        sample(procs, since, os.getpid())
        if time.monotonic() - saved > 30:
            _save(procs, out)
            saved = time.monotonic()
        time.sleep(PERIOD_S)
    sample(procs, since, os.getpid())
    _save(procs, out)
    return child.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the samples go (with a command)")
    parser.add_argument("--report", type=Path, help="print the tables of earlier samples")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.report:
        try:
            procs = load(args.report)
        except (OSError, ValueError, TypeError, AttributeError) as err:
            parser.error(f"--report {args.report}: not samples this script wrote ({err})")
        print(report(procs, args.top))
        return 0
    if not command or args.out is None:
        parser.error("give --out FILE -- COMMAND, or --report FILE")
    rc = profile(command, args.out)
    print(report(load(args.out), args.top), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
