"""The agent loop: verl's multi-turn layout (masks, log-probs, turn counts), stop conditions, malformed
calls, tool timeouts, per-sample environments, concurrency across samples."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_rl.trainer.metrics import multi_turn_metrics
from megatron_rl.agent import (
    AgentEnv,
    StepResult,
    Tool,
    observation_token_ids,
    register_env,
)
from megatron_rl_testing.agent_support import CALL, run_scripted, segments, tiny_tokenizer

QUESTION = "What is 123456 * 654321? Use the calculator tool."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("agent_tok"))


def test_tool_turn_layout_masks_and_log_probs(tok):
    out, engine = run_scripted(tok, [QUESTION, QUESTION + " "],
                               [[CALL, "#### 80779853376"], ["#### 1"]])
    b = out.batch
    n0 = int(b["attention_mask"][0, b["prompts"].shape[1]:].sum())
    t1 = len(tok.encode(CALL, add_special_tokens=False)) + 1  # + eos
    obs = observation_token_ids(tok, [{"role": "tool", "content": "80779853376"}])
    t2 = len(tok.encode("#### 80779853376", add_special_tokens=False)) + 1
    assert segments(b["response_mask"][0], n0) == [(1, t1), (0, len(obs)), (1, t2)]
    assert n0 == t1 + len(obs) + t2
    # the observation tokens are exactly the chat-templated tool result, in place
    assert b["responses"][0, t1 : t1 + len(obs)].tolist() == obs
    assert "80779853376" in tok.decode(obs)
    # log-probs on model tokens only, 0 on observation tokens and padding
    lp, mask = b["rollout_log_probs"][0], b["response_mask"][0]
    assert torch.all(lp[mask == 1] == -0.5) and torch.all(lp[mask == 0] == 0)
    # observations are context: attended, but not trained on
    assert int(b["attention_mask"][0, -b["responses"].shape[1]:].sum()) == n0
    assert int(b["response_mask"][0].sum()) == t1 + t2
    nt = out.non_tensor_batch
    assert list(nt["num_turns"]) == [4, 2] and list(nt["__num_turns__"]) == [4, 2]
    assert list(nt["tool_call_counts"]) == [1, 0]
    assert list(nt["stop_reason"]) == ["final", "final"]
    assert out.meta_info["weight_version"] == 3
    assert multi_turn_metrics(out) == {"num_turns/min": 2.0, "num_turns/max": 4.0, "num_turns/mean": 3.0,
                                  "tool_call_counts/min": 0.0, "tool_call_counts/max": 1.0,
                                  "tool_call_counts/mean": 0.5, "tool_error_counts/min": 0.0,
                                  "tool_error_counts/max": 0.0, "tool_error_counts/mean": 0.0,
                                  **_turn_length_metrics([t1, t2, int(b["response_mask"][1].sum())])}
    assert list(nt["weight_version"]) == [3, 3] and [v.tolist() for v in nt["token_weight_versions"]][1] == [3] * int(
        b["response_mask"][1].sum())
    assert list(nt["tool_error_counts"]) == [0, 0] and [list(r) for r in nt["tool_error_reasons"]] == [[], []]
    # input_ids = prompt ++ responses, position ids continue the prompt's
    p = b["prompts"].shape[1]
    assert torch.equal(b["input_ids"][:, p:], b["responses"])
    assert torch.equal(b["position_ids"][:, p] - b["position_ids"][:, p - 1], torch.ones(2, dtype=torch.long))


@pytest.mark.parametrize("bad, expect", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown tool"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call>', "cannot evaluate"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}', "never closed"),
])
def test_malformed_tool_call_is_an_observation(tok, bad, expect):
    out, _ = run_scripted(tok, [QUESTION], [[bad, "#### 2"]])
    b = out.batch
    mask = b["response_mask"][0]
    n = int(b["attention_mask"][0, b["prompts"].shape[1]:].sum())
    obs = b["responses"][0, :n][mask[:n] == 0].tolist()
    assert expect in tok.decode(obs)
    assert out.non_tensor_batch["stop_reason"][0] == "final"
    assert out.non_tensor_batch["tool_call_counts"][0] == 1


def test_max_assistant_turns_stops_the_sample(tok):
    out, engine = run_scripted(tok, [QUESTION], [[CALL]], settings={"max_assistant_turns": 3})
    assert engine.turn == [3]
    nt = out.non_tensor_batch
    assert nt["stop_reason"][0] == "max_turns" and nt["num_turns"][0] == 1 + 3 + 2
    assert nt["tool_call_counts"][0] == 2  # the third turn's call is not run
    runs = segments(out.batch["response_mask"][0], int(out.batch["attention_mask"][0].sum()) - int(out.batch["attention_mask"][0, : out.batch["prompts"].shape[1]].sum()))
    assert [v for v, _ in runs] == [1, 0, 1, 0, 1]


def test_max_user_turns(tok):
    out, engine = run_scripted(tok, [QUESTION], [[CALL]], settings={"max_assistant_turns": 10, "max_user_turns": 1})
    assert out.non_tensor_batch["stop_reason"][0] == "max_user_turns"
    assert engine.turn == [2]


def test_length_budget_bounds_all_turns(tok):
    budget = 60
    out, engine = run_scripted(tok, [QUESTION], [[CALL]], settings={"max_assistant_turns": 50},
                               response_length=budget)
    b = out.batch
    assert b["responses"].shape[1] == budget
    assert out.non_tensor_batch["stop_reason"][0] == "length"
    assert int(b["attention_mask"][0, b["prompts"].shape[1]:].sum()) <= budget


class _SleepTool(Tool):
    name = "sleep"

    def execute(self, arguments, **kwargs):
        time.sleep(float(arguments.get("s", 5)))
        return "woke"


def test_tool_timeout_becomes_observation(tok):
    # a 20 s tool cut off at 0.3 s; the bound leaves a loaded machine 15 s for the rest of the rollout
    call = '<tool_call>{"name": "sleep", "arguments": {"s": 20}}</tool_call>'
    start = time.monotonic()
    out, _ = run_scripted(tok, [QUESTION], [[call, "#### 1"]], tools={"sleep": _SleepTool()},
                          settings={"tool_timeout_s": 0.3})
    assert time.monotonic() - start < 15.0
    b = out.batch
    n = int(b["attention_mask"][0, b["prompts"].shape[1]:].sum())
    obs = b["responses"][0, :n][b["response_mask"][0, :n] == 0].tolist()
    assert "did not finish" in tok.decode(obs) or "abandoned" in tok.decode(obs)
    assert out.non_tensor_batch["stop_reason"][0] == "final"


@register_env("test_slow_first")
class _SlowFirstEnv(AgentEnv):
    """Sample with extra_info.delay sleeps that long in its first step; three tool turns, then done."""

    def reset(self, sample):
        self.delay = float(sample["extra_info"].get("delay", 0.0))
        self.steps = 0
        self.finished_at = None

    def step(self, text):
        if self.steps == 0:
            time.sleep(self.delay)
        self.steps += 1
        if self.steps >= 3:
            return StepResult(done=True)
        return StepResult([{"role": "user", "content": "go on"}])


def test_slow_tool_does_not_stall_the_batch(tok):
    qs = [QUESTION + " " * k for k in range(4)]
    delay = 5.0  # sample 0's first step; long, so the bound below can be generous on a loaded machine
    extra = [{"agent_name": "test_slow_first", "delay": delay if i == 0 else 0.0} for i in range(4)]
    settings = {"max_assistant_turns": 10, "tool_timeout_s": 60}  # the slow step is not cut off
    out, engine = run_scripted(tok, qs, [["#### 1"]] * 4, settings=settings, non_tensors={"extra_info": extra})
    assert list(out.non_tensor_batch["num_turns"]) == [6] * 4
    # the fast samples ran all three of their turns while sample 0's first tool call was still running: it
    # started after the first engine call, so waiting for it would put their last call >= delay after that
    first_call = engine.calls[0][0]
    fast_done = max(t for t, who in engine.calls if set(who) & {1, 2, 3})
    assert fast_done - first_call < delay - 1.0, engine.calls
    assert any(0 not in who for _, who in engine.calls[1:])


def test_environment_chosen_per_sample(tok):
    out, engine = run_scripted(tok, [QUESTION, QUESTION + " "], [[CALL, "#### 1"], [CALL, "#### 1"]],
                               non_tensors={"agent_name": ["single_turn_agent", "tool_agent"]})
    assert list(out.non_tensor_batch["agent_name"]) == ["single_turn_agent", "tool_agent"]
    assert list(out.non_tensor_batch["num_turns"]) == [2, 4]


def test_environment_exception_is_an_observation(tok):
    @register_env("test_raises")
    class _Raises(AgentEnv):
        def step(self, text):
            raise KeyError("boom")

    out, engine = run_scripted(tok, [QUESTION], [["a", "b"]], settings={"max_assistant_turns": 2},
                               non_tensors={"agent_name": ["test_raises"]})
    b = out.batch
    n = int(b["attention_mask"][0, b["prompts"].shape[1]:].sum())
    assert "environment failed" in tok.decode(b["responses"][0, :n][b["response_mask"][0, :n] == 0].tolist())
    assert out.non_tensor_batch["stop_reason"][0] == "max_turns"


def test_settings_from_the_schema_and_refused_formats(tok):
    from megatron_rl.config.schema import MultiTurnConfig
    from megatron_rl.agent import AgentLoop, AgentLoopSettings

    s = AgentLoopSettings.from_config(MultiTurnConfig(max_assistant_turns=2, tools=["calculator", "python"]))
    assert s.max_assistant_turns == 2 and s.tools == ["calculator", "python"]
    loop = AgentLoop(lambda d: d, tok, MultiTurnConfig(tools=["calculator", "python"]), response_length=8)
    assert sorted(loop.tools) == ["calculator", "python"]
    with pytest.raises(ValueError, match="only 'hermes'"):
        AgentLoop(lambda d: d, tok, {"format": "llama3_json"}, response_length=8)
    with pytest.raises(ValueError, match="truncate_side"):
        AgentLoop(lambda d: d, tok, {"tool_response_truncate_side": "top"}, response_length=8)


def test_parallel_call_limit_and_tool_response_truncation(tok):
    two = CALL + CALL + '<tool_call>{"name": "calculator", "arguments": {"expression": "9 ** 999"}}</tool_call>'
    out, _ = run_scripted(tok, [QUESTION], [[two, "#### 1"]],
                          settings={"max_parallel_calls": 2, "max_tool_response_length": 100})
    b = out.batch
    n = int(b["attention_mask"][0, b["prompts"].shape[1]:].sum())
    text = tok.decode(b["responses"][0, :n][b["response_mask"][0, :n] == 0].tolist())
    assert text.count("80779853376") == 2 and "at most 2 tool call" in text
    assert out.non_tensor_batch["tool_call_counts"][0] == 3
    out, _ = run_scripted(tok, [QUESTION], [['<tool_call>{"name": "calculator", "arguments": {"expression": "9 ** 999"}}</tool_call>', "#### 1"]],
                          settings={"max_tool_response_length": 40})
    b = out.batch
    n = int(b["attention_mask"][0, b["prompts"].shape[1]:].sum())
    text = tok.decode(b["responses"][0, :n][b["response_mask"][0, :n] == 0].tolist())
    assert "truncated" in text and len(text) < 120


def _turn_length_metrics(lengths: list[int]) -> dict[str, float]:
    return {"turn_response_length/min": float(min(lengths)), "turn_response_length/max": float(max(lengths)),
            "turn_response_length/mean": sum(lengths) / len(lengths)}
