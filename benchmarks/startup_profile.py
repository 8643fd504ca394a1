"""Where the launch-to-first-step time goes (issue 39): one training step of the tiny preset at the demo's size,
launched as a user launches it (`python -m megatron_rl.train ...`), timed from outside at markers in its output,
with Python's import-time table of the same run and, with --cprofile, the functions that took longest.

    python benchmarks/startup_profile.py [--runs 3] [--cprofile] [--repo DIR] [-- key=value ...]

Markers (first time each appears, seconds since launch; min / median over --runs):
  imported     the config printed (train.py's summary): Python, torch, Megatron-Core, transformers imported,
               Hydra composed, preflight done
  engines      "rollout engines:": workers built (Megatron model, HF engine, weights synced and verified)
  first step   the first metrics.jsonl line: the first training step done
  exit         the process exited (shutdown included)
--repo runs another checkout's code (e.g. a `git archive` of an older commit) with this interpreter.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKERS = {"imported": re.compile(r"^world size \d+;"),
           "engines": re.compile(r"^rollout engines:")}
# the top-level packages whose import time is reported (cumulative microseconds in -X importtime)
PACKAGES = ("torch", "megatron.core", "transformers", "ray", "tensordict", "hydra", "pyarrow.parquet", "matplotlib",
            "matplotlib.pyplot", "sympy", "torch._dynamo", "megatron_rl.plan.planner", "megatron_rl.rollout.hf_engine")


def _assets(root: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO))
    from megatron_rl.demo import prepare_assets

    train, _val, model = prepare_assets(root)
    return train, model


def _overrides(train: Path, model: Path, out: Path, extra: list[str]) -> list[str]:
    return ["+experiment=grpo_tiny_cpu", f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={out}", "trainer.total_training_steps=1", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.logger=[jsonl]", "trainer.save_hf_at_end=false", "trainer.overwrite=true",
            *extra]


def one_run(repo: Path, overrides: list[str], out: Path, flags: list[str]) -> tuple[dict[str, float], str]:
    """Seconds since launch at each marker, and the run's stderr (the import-time table when -X importtime)."""
    out.mkdir(parents=True, exist_ok=True)
    stdout, stderr, metrics = out / "stdout.log", out / "stderr.log", out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.perf_counter()
    with open(stdout, "w") as so, open(stderr, "w") as se:
        proc = subprocess.Popen([sys.executable, *flags, "-m", "megatron_rl.train", *overrides], cwd=repo, env=env,
                                stdout=so, stderr=se)
        marks: dict[str, float] = {}
        while proc.poll() is None:
            now = time.perf_counter() - start
            lines = stdout.read_text(errors="replace").splitlines()
            for name, pattern in MARKERS.items():
                if name not in marks and any(pattern.search(line) for line in lines):
                    marks[name] = now
            if "first step" not in marks and metrics.exists() and metrics.read_text().count("\n"):
                marks["first step"] = now
            time.sleep(0.02)
        marks["exit"] = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed ({proc.returncode}):\n{stderr.read_text()[-3000:]}")
    return marks, stderr.read_text(errors="replace")


def import_table(stderr: str) -> dict[str, float]:
    """Seconds of each package in PACKAGES (cumulative, its first import) from -X importtime's lines."""
    seconds: dict[str, float] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        _, _self, cumulative, name = (part.strip() for part in re.split(r"[:|]", line, maxsplit=3))
        if name in PACKAGES and name not in seconds and cumulative.isdigit():
            seconds[name] = int(cumulative) / 1e6
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose code runs (default: this one)")
    parser.add_argument("--cprofile", action="store_true", help="also one run under cProfile: top 25 cumulative")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (e.g. a layout)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="startup_profile_"))
    train, model = _assets(root / "assets")
    runs = []
    imports: list[dict[str, float]] = []
    for i in range(args.runs):  # every run with -X importtime: its cost is small next to the imports themselves
        marks, stderr = one_run(args.repo, _overrides(train, model, root / f"run{i}", args.overrides), root / f"run{i}",
                                ["-X", "importtime"])
        runs.append(marks)
        imports.append(import_table(stderr))
    print(f"repo {args.repo}, overrides {' '.join(args.overrides) or '(none)'}, {args.runs} runs, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'marker (s since launch)':<28}{'min':>8}{'median':>8}")
    for name in ("imported", "engines", "first step", "exit"):
        values = [r[name] for r in runs if name in r]
        if values:
            print(f"{name:<28}{min(values):>8.2f}{statistics.median(values):>8.2f}")
    print(f"{'import (cumulative s)':<28}{'min':>8}{'median':>8}")
    for name in PACKAGES:
        values = [t[name] for t in imports if name in t]
        if values:
            print(f"{name:<28}{min(values):>8.2f}{statistics.median(values):>8.2f}")
        else:
            print(f"{name:<28}{'not imported':>16}")
    if args.cprofile:
        import pstats

        prof = root / "run.prof"
        one_run(args.repo, _overrides(train, model, root / "prof", args.overrides), root / "prof",
                ["-m", "cProfile", "-o", str(prof)])
        pstats.Stats(str(prof)).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
