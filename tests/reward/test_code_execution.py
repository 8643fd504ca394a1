"""The code-execution reward (megatron_rl/reward/code_execution.py): right, wrong and hanging programs against a
row's unit tests, in this machine's sandbox and on the HTTP sandbox service, through the scorer, verl's
default_compute_score and the reward manager."""

from __future__ import annotations

import json

import pytest

from megatron_rl.agent.sandbox import sandbox_report
from megatron_rl.agent.sandbox_service import serve
from megatron_rl.compat.verl.utils.reward_score import default_compute_score
from megatron_rl.config.schema import RewardConfig, SandboxFusionConfig
from megatron_rl.reward import RewardManager, get_scorer
from megatron_rl.reward.code_execution import SandboxUnavailable, compute_score, extract_code
from megatron_rl.rollout.server_key import API_KEY_ENV

from reward_batches import response_batch

SECRET = "code-reward-secret"
ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
MUL = "I think it is a product.\n```python\na, b = map(int, input().split())\nprint(a * b)\n```"
HANG = "```python\nwhile True:\n    pass\n```"
TESTS = {"inputs": ["1 2\n", "2 2\n", "3 4\n"], "outputs": ["3\n", "4\n", "7\n"]}
needs_sandbox = pytest.mark.skipif(not sandbox_report().empty_root,
                                   reason="this machine gives the sandbox no empty root (namespaces refused)")


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, SECRET)
    filesystem = "empty_root" if sandbox_report().empty_root else "host"
    box = serve(max_concurrency=2, filesystem=filesystem).start()
    yield box
    box.stop()


def score(solution: str, tests, **kw) -> dict:
    return compute_score("apps", solution, json.dumps(tests), None, **kw)


def test_the_code_is_the_last_python_block():
    assert extract_code("a\n```\nx = 1\n```\n```python\nprint(2)\n```\n```\nz\n```") == "print(2)\n"
    assert extract_code("```py\nprint(3)\n```") == "print(3)\n"
    assert extract_code("```\nprint(4)\n```") == "print(4)\n"
    assert extract_code("print(5)") == "print(5)"


@needs_sandbox
def test_right_wrong_and_hanging_programs_here():
    assert score(ADD, TESTS) == {"score": 1.0, "acc": True, "tests_passed": 3, "tests_run": 3}
    wrong = score(MUL, TESTS)  # 2 * 2 == 2 + 2: one case passes by accident
    assert wrong["score"] == pytest.approx(1 / 3) and wrong["acc"] is False
    assert score(MUL, TESTS, continuous=False)["score"] == 0.0
    hung = score(HANG, {"inputs": ["1 2"], "outputs": ["3"]}, run_timeout_s=1)
    assert hung == {"score": 0.0, "acc": False, "tests_passed": 0, "tests_run": 1}
    crash = score("```python\nraise ValueError\n```", {"inputs": [""], "outputs": [""]})
    assert crash["score"] == 0.0


@needs_sandbox
def test_call_based_and_assert_cases_and_the_first_ten():
    fn = "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```"
    assert score(fn, {"fn_name": "add", "inputs": [[1, 2], "3\n4"], "outputs": [[3], "7"]})["score"] == 1.0
    asserts = {"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    plain = "```python\ndef add(a, b):\n    return a + b\n```"
    assert score(plain, asserts)["score"] == 0.5 and score(plain, asserts, continuous=False)["score"] == 0.0
    many = {"inputs": [f"{i} 1" for i in range(12)], "outputs": [str(i + 1) for i in range(12)]}
    assert score(ADD, many)["tests_run"] == 10 and score(ADD, many, continuous=False)["tests_run"] == 12
    with pytest.raises(ValueError, match="malformed"):
        score(ADD, {"inputs": ["1"], "outputs": []})


def test_on_the_http_sandbox_as_verl_configures_it(service):
    url = service.url + "/run_code"
    assert score(ADD, TESTS, sandbox_fusion_url=url)["score"] == 1.0
    assert score(MUL, TESTS, sandbox_fusion_url=service.url)["score"] == pytest.approx(1 / 3)
    assert score(HANG, {"inputs": ["1 2"], "outputs": ["3"]}, sandbox_fusion_url=url, run_timeout_s=1)["score"] == 0.0
    assert service.service.peak_in_flight >= 1
    # verl's entry point, with verl's keywords (a float, as verl returns for the code sources)
    assert default_compute_score("codecontests", ADD, json.dumps(TESTS), sandbox_fusion_url=url,
                                 memory_limit_mb=512) == 1.0


def test_a_sandbox_that_cannot_run_the_cases_fails_the_scoring_by_name(service, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "another-runs-secret")
    with pytest.raises(SandboxUnavailable, match="could not run a case: .*not authorized"):
        score(ADD, TESTS, sandbox_fusion_url=service.url + "/run_code", max_concurrent=1)
    with pytest.raises(SandboxUnavailable, match="unreachable"):
        score(ADD, TESTS, sandbox_fusion_url="http://127.0.0.1:1/run_code")


class CharTokenizer:
    """One token per character (code round-trips exactly); 0 is eos and padding."""

    eos_token_id = pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def batch_decode(self, rows: list, skip_special_tokens: bool = True) -> list[str]:
        return ["".join(chr(t) for t in row if t) for row in rows]


def test_the_manager_gives_the_code_scorer_the_sandbox_settings(service):
    tokenizer = CharTokenizer()
    assert get_scorer("taco").sandbox
    cfg = RewardConfig(num_workers=0, timeout_s=60,
                       sandbox_fusion=SandboxFusionConfig(url=service.url + "/run_code", max_concurrent=2))
    batch = response_batch(tokenizer, [ADD, MUL], [json.dumps(TESTS)] * 2, width=160, data_source="taco")
    with RewardManager(tokenizer, cfg) as manager:
        out = manager(batch)
    assert list(out.non_tensor_batch["score"]) == pytest.approx([1.0, 1 / 3])
    assert out.meta_info["reward_metrics"]["reward/errors"] == 0.0
    assert service.service.peak_in_flight == 2  # the cases ran there, two at a time
