"""Code-execution reward: the response's program run against the row's unit tests in our sandbox
(docs/data_and_rewards.md, "Code execution"). Scores verl's code data sources (``codecontests``, ``apps``,
``codeforces``, ``taco``: verl's default_compute_score sends them to sandbox_fusion or prime_code).

The program: the last fenced block of the response (a ```python block first), the whole response if it has
none. The tests (``reward_model.ground_truth``, a dict or its JSON, verl's ``test_cases`` format):

- ``{"inputs": [...], "outputs": [...]}``: stdin/stdout pairs; a case passes when the program exits 0 within
  its time and prints the expected output (compared line by line, trailing whitespace and blank lines aside);
- with ``"fn_name"``: call-based cases (APPS): ``inputs[i]`` is the argument list of a call of that function
  (or of ``Solution().<fn_name>``), or text with one JSON argument a line (verl's form), passing when it returns
  ``outputs[i]`` (or ``outputs[i][0]``, APPS' wrapping; text is read as JSON);
- ``"assert_case": [...]``: each case is the program followed by that code (``assert`` statements), passing
  when it exits 0 (with its ``inputs[i]`` as stdin where given).

Where it runs: this machine's sandbox (agent/sandbox.py, ``empty_root``, no network) by default, or a
SandboxFusion ``/run_code`` service when ``reward.sandbox_fusion.url`` is set (ours,
``python -m megatron_rl.agent.sandbox_service``, or SandboxFusion itself), at most
``reward.sandbox_fusion.max_concurrent`` cases of one sample at once. Score (``continuous``, verl's flag):
true (verl's choice for these sources): the fraction of the first ``max_tests`` cases passed; false: 1.0 when
every case passes, else 0.0 (stops at the first failure). A case the sandbox could not run (the service
unreachable, refusing, broken) fails the sample's scoring (the reward manager scores it 0 and counts it in
``reward/errors``) instead of passing for a wrong answer.
"""

from __future__ import annotations

import functools
import json
import os
import re
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from megatron_rl.reward.registry import register_scorer

__all__ = ["CODE_SOURCES", "TestCase", "compute_score", "extract_code", "run_case", "test_cases"]

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_CALL = """

import json as _mrl_json, sys as _mrl_sys
_mrl_args = _mrl_json.loads(_mrl_sys.stdin.read())
_mrl_fn = globals().get({name!r}) or getattr(globals()["Solution"](), {name!r})
print(_mrl_json.dumps(_mrl_fn(*_mrl_args)))
"""


class SandboxUnavailable(RuntimeError):
    """The sandbox could not run a case (not the program's fault): the sample's scoring fails, by name."""


@dataclass(frozen=True)
class TestCase:
    """One case: the program to run (the solution, plus a call or an assert), its stdin, what it must print
    (None: anything; exit 0 suffices) and whether the printed value is a call's JSON result."""

    __test__ = False  # not a pytest class

    code: str
    stdin: str | None
    expected: Any
    call: bool = False


def extract_code(response: str) -> str:
    """The last ```python block, else the last fenced block, else the whole response."""
    blocks = _FENCE.findall(response)
    python = [body for lang, body in blocks if lang.strip().lower() in ("python", "python3", "py")]
    if python or blocks:
        return (python or [body for _, body in blocks])[-1]
    return response


def test_cases(solution: str, ground_truth: Any) -> list[TestCase]:
    """verl's test_cases (module docstring) as runnable cases; ValueError for a malformed one."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(tests, dict):
        raise ValueError(f"code tests must be a dict (inputs/outputs, assert_case), got {type(tests).__name__}")
    asserts = tests.get("assert_case")
    inputs = tests.get("inputs")
    outputs = tests.get("outputs")
    if asserts is not None:
        if not isinstance(asserts, list):
            raise ValueError("assert_case must be a list of code strings")
        inputs = inputs if inputs is not None else [None] * len(asserts)
        outputs = outputs if outputs is not None else [None] * len(asserts)
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError("code tests need inputs and outputs: two lists of the same length")
    if asserts is not None and len(asserts) != len(inputs):
        raise ValueError(f"{len(asserts)} assert_case for {len(inputs)} inputs")
    name = tests.get("fn_name")
    cases = []
    for i, (given, expected) in enumerate(zip(inputs, outputs)):
        if asserts is not None:
            cases.append(TestCase(f"{solution}\n\n{asserts[i]}\n", _text(given), _text(expected)))
        elif name:
            cases.append(TestCase(solution + _CALL.format(name=str(name)), json.dumps(_arguments(given)),
                                  _json_or_text(expected), call=True))
        else:
            cases.append(TestCase(solution, _text(given), _text(expected)))
    return cases


def _arguments(given: Any) -> list[Any]:
    """A call's arguments: a list as they are, or text with one JSON value a line (verl's and APPS' string form)."""
    if isinstance(given, list):
        return given
    if isinstance(given, str):
        try:
            return [json.loads(line) for line in given.split("\n") if line.strip()]
        except ValueError:
            raise ValueError(f"fn_name inputs must be JSON values, one a line: {given[:80]!r}") from None
    return [given]


def _json_or_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def passed(case: TestCase, stdout: str) -> bool:
    """The printed output against the case's expectation (the program exited 0 in time)."""
    if case.expected is None:
        return True
    if case.call:
        try:
            got = json.loads(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return False
        want = case.expected
        return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])
    return _lines(stdout) == _lines(str(case.expected))


@dataclass(frozen=True)
class Runner:
    """Where cases run: ``url`` None -> this machine's sandbox; else a SandboxFusion /run_code service."""

    url: str | None
    memory_limit_mb: int
    timeout_s: float
    max_concurrent: int


@functools.lru_cache(maxsize=8)
def _service(url: str, memory_limit_mb: int, timeout_s: float, max_concurrent: int) -> Any:
    """One client per service and process: its slots (max_concurrent) bound every sample's cases together."""
    # agent's package imports torch: scoring workers that never call a service stay light
    from megatron_rl.agent.tool_service import SandboxFusionTool

    return SandboxFusionTool({"sandbox_fusion_url": url, "memory_limit_mb": memory_limit_mb,
                              "default_timeout": timeout_s, "rate_limit": max_concurrent, "retries": 2})


def run_case(runner: Runner, case: TestCase) -> bool:
    """Whether the case passes; SandboxUnavailable where the sandbox could not run it."""
    if runner.url is None:
        # agent's package imports torch: scoring workers import it only when a code source is scored
        from megatron_rl.agent.sandbox import SandboxLimits, sandbox_for

        try:
            sandbox = sandbox_for(True, "empty_root")
        except ValueError as err:
            raise SandboxUnavailable(f"{err} (or set reward.sandbox_fusion.url to a sandbox service)") from None
        run = sandbox.execute(case.code, SandboxLimits(timeout_s=runner.timeout_s, memory_mb=runner.memory_limit_mb),
                              stdin=case.stdin)
        if run.return_code == -1 and run.stdout.startswith("Error: could not start"):
            raise SandboxUnavailable(run.stdout)
        return not run.timed_out and run.return_code == 0 and passed(case, run.stdout)
    service = _service(runner.url, runner.memory_limit_mb, runner.timeout_s, runner.max_concurrent)
    answer = service.request({"code": case.code, "language": "python", "stdin": case.stdin,
                              "run_timeout": runner.timeout_s, "compile_timeout": runner.timeout_s,
                              "memory_limit_MB": runner.memory_limit_mb, "files": {}, "fetch_files": []})
    reason = getattr(answer, "reason", None)  # a ToolError: the request failed
    if reason is not None or not isinstance(answer, dict) or answer.get("status") == "SandboxError":
        message = answer if reason is not None else (answer.get("message") if isinstance(answer, dict) else answer)
        raise SandboxUnavailable(f"the sandbox service {runner.url} could not run a case: {message}")
    run = answer.get("run_result") or {}
    finished = run.get("status") == "Finished" and run.get("return_code") == 0
    return answer.get("status") == "Success" and finished and passed(case, run.get("stdout") or "")


def score_cases(runner: Runner, cases: list[TestCase], all_or_nothing: bool) -> list[bool]:
    """Each case's outcome, run ``max_concurrent`` at a time; all-or-nothing stops at the first failure (the
    cases not yet started are dropped and count as failed)."""
    local_cap = (os.cpu_count() or 1) if runner.url is None else len(cases)
    workers = max(1, min(runner.max_concurrent, len(cases), local_cap))
    results = [False] * len(cases)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="code-reward") as pool:
        pending = {pool.submit(run_case, runner, case): i for i, case in enumerate(cases)}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                results[pending.pop(future)] = future.result()  # SandboxUnavailable propagates
            if all_or_nothing and any(not results[i] for i in range(len(cases)) if i not in pending.values()):
                for future in pending:
                    future.cancel()
                break
    return results


@register_scorer(*CODE_SOURCES, sandbox=True)
def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, *,
                  sandbox_fusion_url: str | None = None, memory_limit_mb: int | None = 1024, max_concurrent: int = 64,
                  continuous: bool = True, run_timeout_s: float = 5.0, max_tests: int = 10,
                  concurrent_semaphore: Any = None) -> dict[str, Any]:
    """The sample's score (module docstring), ``acc`` (every case run passed), ``tests_passed``, ``tests_run``.
    verl's keyword arguments (``sandbox_fusion_url``, ``memory_limit_mb``, ``concurrent_semaphore``: unused, the
    client's slots bound the concurrency) are accepted as verl's default_compute_score passes them."""
    try:
        cases = test_cases(extract_code(solution_str), ground_truth)
    except ValueError as err:
        raise ValueError(f"{data_source}: the row's tests (reward_model.ground_truth) are malformed: {err}") from None
    if not cases:
        return {"score": 0.0, "acc": False, "tests_passed": 0, "tests_run": 0}
    if continuous:
        cases = cases[:max(1, int(max_tests))]  # verl scores the first 10: some problems have enormous test sets
    runner = Runner(sandbox_fusion_url or None, int(memory_limit_mb or 1024), float(run_timeout_s),
                    max(1, int(max_concurrent)))
    results = score_cases(runner, cases, all_or_nothing=not continuous)
    n_passed = sum(results)
    every = n_passed == len(cases)
    score = n_passed / len(cases) if continuous else float(every)
    return {"score": score, "acc": every, "tests_passed": n_passed, "tests_run": len(cases)}
