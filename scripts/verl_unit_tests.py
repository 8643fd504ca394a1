#!/usr/bin/env python3
"""Run verl's own CPU unit tests against megatron_rl.compat.verl (docs/algorithms.md, "Coming from verl").

verl's test files are exported from a verl source tree, every ``verl.`` module reference is rewritten
to ``megatron_rl.compat.verl.`` (``from verl import`` likewise) and nothing else is changed, then
pytest runs them. The pass/fail counts are printed; the exit status is 0 only when every test
passed and at least one ran.

    python scripts/verl_unit_tests.py SOURCE [-- PYTEST_ARGS...]

SOURCE is one of
  * a directory holding verl's ``tests/``: a git checkout, verl's sdist unpacked, or verl's wheel
    unpacked (the 0.9.1 wheel ships these test files; ``make test`` installs it in .cache/verl-oracle);
  * verl's sdist .tar.gz (``pip download --no-binary :all: --no-deps verl==0.9.0``);
  * a git directory (bare or not) plus ``--ref`` (default v0.9.0).
Without SOURCE: $MEGATRON_RL_VERL_TESTS, else the first directory of $MEGATRON_RL_VERL_PATH (the verl
oracle's path, tests/algos/conftest.py) that holds the test files.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# verl's CPU tests of what megatron-rl mirrors (protocol, core_algos and its helpers); in v0.9.0's
# source and in the 0.9.1 wheel (0.9.1's protocol test has one test more)
TEST_FILES: tuple[str, ...] = (
    "tests/test_protocol_on_cpu.py",
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
    "tests/trainer/ppo/test_value_loss_normalization_on_cpu.py",
    "tests/trainer/ppo/test_reinforce_pp_multiturn_on_cpu.py",
    "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
    "tests/trainer/ppo/test_rollout_corr_integration.py",
)

COMPAT_PACKAGE = "megatron_rl.compat.verl"
# "verl." as a module path (not "foo_verl." or "x.verl."), and "from verl import" / "import verl"
_DOTTED = re.compile(r"(?<![\w.])verl\.")
_FROM_ROOT = re.compile(r"^(\s*)from verl import ", re.MULTILINE)
_IMPORT_ROOT = re.compile(r"^(\s*)import verl\s*$", re.MULTILINE)


class SourceError(RuntimeError):
    """The verl source tree given is missing, or lacks one of TEST_FILES."""


@dataclass(frozen=True)
class Counts:
    passed: int
    failed: int
    errors: int
    skipped: int
    passed_per_file: dict[str, int] = field(default_factory=dict)  # TEST_FILES entry -> tests passed

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.errors + self.skipped

    @property
    def ok(self) -> bool:
        """Everything passed, and every test file contributed at least one passing test."""
        nothing_else = self.failed == 0 and self.errors == 0 and self.skipped == 0
        return self.passed > 0 and nothing_else and all(self.passed_per_file.get(rel, 0) > 0 for rel in TEST_FILES)


def rewrite_imports(text: str) -> str:
    """verl's module paths -> the compat namespace; nothing else in the file changes."""
    text = _DOTTED.sub(COMPAT_PACKAGE + ".", text)
    text = _FROM_ROOT.sub(lambda m: f"{m.group(1)}from {COMPAT_PACKAGE} import ", text)
    return _IMPORT_ROOT.sub(lambda m: f"{m.group(1)}import {COMPAT_PACKAGE}", text)


def _read_from_tree(root: Path, rel: str) -> str:
    path = root / rel
    if not path.is_file():
        raise SourceError(f"{path}: verl test file not found (is {root} verl's source tree, version 0.9.0?)")
    return path.read_text()


def _read_from_git(git_dir: Path, ref: str, rel: str) -> str:
    proc = subprocess.run(
        ["git", "--git-dir", str(git_dir), "show", f"{ref}:{rel}"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SourceError(f"{git_dir} at {ref}: cannot read {rel}: {proc.stderr.strip()}")
    return proc.stdout


def _read_from_tarball(tar_path: Path, rel: str) -> str:
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            if member.name.split("/", 1)[-1] == rel and member.isfile():
                handle = tar.extractfile(member)
                assert handle is not None
                return handle.read().decode()
    raise SourceError(f"{tar_path}: no {rel} inside (expected verl's sdist, which ships tests/)")


def _git_dir(path: Path) -> Path | None:
    if (path / "HEAD").is_file() and (path / "objects").is_dir():
        return path  # bare
    if (path / ".git").exists() and not (path / "tests").is_dir():
        return path / ".git"
    return None


def find_source() -> Path | None:
    """$MEGATRON_RL_VERL_TESTS, else the first $MEGATRON_RL_VERL_PATH directory holding TEST_FILES[0]."""
    explicit = os.environ.get("MEGATRON_RL_VERL_TESTS")
    if explicit:
        return Path(explicit)
    for entry in os.environ.get("MEGATRON_RL_VERL_PATH", "").split(os.pathsep):
        if entry and (Path(entry) / TEST_FILES[0]).is_file():
            return Path(entry)
    return None


def export_tests(source: Path, dest: Path, ref: str = "v0.9.0") -> list[Path]:
    """Writes TEST_FILES, rewritten, under ``dest`` (same relative paths); returns their paths."""
    if not source.exists():
        raise SourceError(f"{source}: verl source not found")
    git_dir = _git_dir(source) if source.is_dir() else None
    written = []
    for rel in TEST_FILES:
        if source.is_file():
            text = _read_from_tarball(source, rel)
        elif git_dir is not None:
            text = _read_from_git(git_dir, ref, rel)
        else:
            text = _read_from_tree(source, rel)
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(rewrite_imports(text))
        written.append(out)
    return written


def count_junit(xml_path: Path) -> Counts:
    """Counts from pytest's JUnit XML report (a collection error is one error)."""
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    per_file: dict[str, int] = {rel: 0 for rel in TEST_FILES}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(child.tag, outcome)
        totals[outcome] += 1
        if outcome == "passed":
            module = case.get("classname", "").replace(".", "/")
            for rel in TEST_FILES:  # classname: verl_tests.tests.trainer.ppo.test_x[.Class]
                if ("/" + module + "/").find("/" + rel[: -len(".py")] + "/") >= 0:
                    per_file[rel] += 1
    return Counts(**totals, passed_per_file=per_file)


def run_tests(source: Path, ref: str = "v0.9.0", pytest_args: tuple[str, ...] = ()) -> tuple[Counts, str]:
    """Exports, rewrites and runs verl's tests in a temporary directory; returns (counts, pytest output)."""
    with tempfile.TemporaryDirectory(prefix="verl_unit_tests_") as tmp:
        work = Path(tmp)
        files = export_tests(source, work / "verl_tests", ref)
        xml_path = work / "junit.xml"
        env = dict(os.environ)
        # the project first on the path; no installed `verl` can be picked up since nothing imports it
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", f"--junitxml={xml_path}",
            "--rootdir", str(work / "verl_tests"), *map(str, files), *pytest_args,
        ]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=False)
        output = proc.stdout + proc.stderr
        if not xml_path.is_file():
            raise RuntimeError(f"pytest wrote no report (exit {proc.returncode}):\n{output}")
        return count_junit(xml_path), output


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", type=Path, default=find_source())
    parser.add_argument("--ref", default="v0.9.0", help="git ref when SOURCE is a git directory")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's whole output")
    args = parser.parse_args(argv)
    if not args.source:
        parser.error("no verl source: pass SOURCE, or set MEGATRON_RL_VERL_TESTS or MEGATRON_RL_VERL_PATH")
    try:
        counts, output = run_tests(args.source, args.ref, tuple(extra))
    except SourceError as err:
        print(f"verl_unit_tests: {err}", file=sys.stderr)
        return 2
    if args.verbose or not counts.ok:
        print(output)
    print(
        f"verl unit tests on {COMPAT_PACKAGE}: {counts.passed} passed, {counts.failed} failed, "
        f"{counts.errors} errors, {counts.skipped} skipped (of {counts.total}; source {args.source})"
    )
    for rel, passed in counts.passed_per_file.items():
        print(f"  {rel}: {passed} passed")
    return 0 if counts.ok else 1


if __name__ == "__main__":
    sys.exit(main())
