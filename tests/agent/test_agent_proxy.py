"""The OpenAI-compatible agent proxy (megatron_rl/agent/proxy.py, chat_session.py, program.py): agent programs written
with the ``openai`` client, each run a session, become training samples whose tokens are exactly what the engine
generated (scripted engine: token for token; the HF engine: the trainer's log-probs equal the engine's), with tool
calls returned as OpenAI tool_calls (streamed too), observations masked, and refusals named: an edited history,
a wrong secret, a second choice, an unknown session."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from megatron_rl.agent.program import AgentProgramRollout, AgentTask
from megatron_rl_testing.agent_support import CALL, ScriptedEngine, chat_prompts, tiny_tokenizer

QUESTIONS = ["What is 12 * 34?", "Use the calculator: 5 + 6", "abc"]
FINAL = "#### 80779853376"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("proxy_tok"))


def _stream_message(stream) -> dict:
    """The assistant message of a streamed reply, assembled from its chunks as an agent does."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            calls[call.index] = {"id": call.id, "type": "function",
                                 "function": {"name": call.function.name, "arguments": call.function.arguments}}
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message | {"finish_reason": finish}


def tool_agent(task: AgentTask, stream: bool = False) -> float:
    """Calls the model until it answers without a tool call; runs each call (the calculator's product) and sends
    the result back as a tool message. Reward 1 for the right final answer."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages = list(task.messages)
    for turn in range(6):
        if stream and turn % 2:
            message = _stream_message(client.chat.completions.create(model=task.model, messages=messages,
                                                                     stream=True))
            message.pop("finish_reason")
        else:
            message = client.chat.completions.create(model=task.model, messages=messages).choices[0].message
            message = message.model_dump(exclude_none=True)
        messages.append(message)
        if not message.get("tool_calls"):
            return float((message.get("content") or "").strip() == FINAL)
        for call in message["tool_calls"]:
            expression = json.loads(call["function"]["arguments"])["expression"]
            a, b = (int(x) for x in expression.split("*"))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(a * b)})
    return 0.0


def streaming_tool_agent(task: AgentTask) -> float:
    return tool_agent(task, stream=True)


def _rollout(tok, program, scripts, response_length=256):
    prompts = chat_prompts(tok, QUESTIONS[:len(scripts)], temperature=1.0)
    engine = ScriptedEngine(tok, prompts, scripts)
    generated: list[list[int]] = []

    def recording(data):
        out = engine(data)
        generated.extend(row[m.bool()].tolist() for row, m in zip(out.batch["responses"], out.batch["response_mask"]))
        return out

    rollout = AgentProgramRollout(recording, tok, program, response_length=response_length,
                                  finish_token_ids=[tok.eos_token_id])
    try:
        return rollout.generate_sequences(prompts), engine, generated
    finally:
        rollout.close()


@pytest.mark.parametrize("program", [tool_agent, streaming_tool_agent])
def test_an_openai_client_agent_with_two_tool_calls_becomes_exact_samples(tok, program):
    scripts = [[CALL, CALL, FINAL], [CALL, CALL, FINAL], [CALL, CALL, "no idea"]]
    out, engine, generated = _rollout(tok, program, scripts)
    b, nt = out.batch, out.non_tensor_batch
    assert list(nt["agent_reward"]) == [1.0, 1.0, 0.0] and list(nt["agent_error"]) == [None] * 3
    assert list(nt["tool_call_counts"]) == [2, 2, 2] and list(nt["num_turns"]) == [6, 6, 6]
    assert list(nt["stop_reason"]) == ["final"] * 3
    # the model tokens of each sample are the engine's turns, in order, byte for byte; the rest are observations
    all_spans = []
    for row in range(3):
        n = int(b["attention_mask"][row, b["prompts"].shape[1]:].sum())
        tokens, mask = b["responses"][row, :n], b["response_mask"][row, :n].bool()
        spans, current = [], []
        for t, m in zip(tokens.tolist(), mask.tolist()):
            if m:
                current.append(t)
            elif current:
                spans.append(current)
                current = []
        spans.append(current)
        expected = [tok.encode(s, add_special_tokens=False) + [tok.eos_token_id] for s in scripts[row]]
        assert spans == expected
        all_spans += spans
        assert (~mask).any()  # the tool results are in the context, masked
        assert torch.all(b["rollout_log_probs"][row, :n][mask] == -0.5)
        assert torch.all(b["rollout_log_probs"][row][~b["response_mask"][row].bool()] == 0)
        assert list(nt["token_weight_versions"][row]) == [3] * n
    assert sorted(all_spans) == sorted(generated)  # every engine output is one model turn of one sample
    # the three agents' turns were batched: fewer engine calls than turns
    assert len(engine.calls) < 9


def test_the_prompt_is_the_first_requests_rendering_and_tools_are_declared(tok):
    tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                                "parameters": {"type": "object", "properties": {}}}}]
    seen = {}

    def agent(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        reply = client.chat.completions.create(model=task.model, messages=task.messages, tools=tools)
        seen["usage"] = reply.usage.prompt_tokens
        messages = [*task.messages, reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "go on"}]
        with pytest.raises(openai.BadRequestError, match="tools differ from the first request's"):
            client.chat.completions.create(model=task.model, messages=messages)
        return None

    prompts = chat_prompts(tok, QUESTIONS[:1])
    engine = ScriptedEngine(tok, prompts, [["hello"]])
    engine._sample_of = lambda ctx: 0  # the prompt declares tools: not the dataset's rendering
    rollout = AgentProgramRollout(engine, tok, agent, response_length=64, finish_token_ids=[tok.eos_token_id])
    try:
        out = rollout.generate_sequences(prompts)
    finally:
        rollout.close()
    text = tok.apply_chat_template(list(prompts.non_tensor_batch["raw_prompt"][0]), tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    real = out.batch["prompts"][0][out.batch["attention_mask"][0, :out.batch["prompts"].shape[1]].bool()]
    assert real.tolist() == prompt and seen["usage"] == len(prompt)
    assert out.non_tensor_batch["agent_reward"][0] is None and out.non_tensor_batch["agent_error"][0] is None


def test_an_edited_history_is_refused_naming_the_session(tok):
    def editing_agent(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        first = client.chat.completions.create(model=task.model, messages=task.messages).choices[0].message
        edited = {"role": "assistant", "content": first.content.strip() + " (edited)"}
        client.chat.completions.create(model=task.model,
                                       messages=[*task.messages, edited, {"role": "user", "content": "more"}])

    out, _, _ = _rollout(tok, editing_agent, [["an answer", "more"]])
    error = out.non_tensor_batch["agent_error"][0]
    session = out.non_tensor_batch["agent_session"][0]
    assert error.startswith("BadRequestError") and f"session {session!r}: message 1 (assistant) differs" in error
    assert "re-tokenized" in error
    # what was recorded before the refusal stays: the first turn, and nothing of the edited text
    assert out.non_tensor_batch["stop_reason"][0] == "agent_error"
    assert int(out.batch["response_mask"][0].sum()) == len(tok.encode("an answer", add_special_tokens=False)) + 1


def test_wrong_secret_unknown_session_and_extra_choices_are_refused(tok):
    outcomes = {}

    def probing_agent(task):
        wrong = openai.OpenAI(base_url=task.base_url, api_key="not-the-secret", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=task.model, messages=task.messages)
        other = openai.OpenAI(base_url=task.base_url.replace(task.session_id, "nobody"), api_key=task.api_key,
                              max_retries=0)
        with pytest.raises(openai.NotFoundError, match="session 'nobody' is not open"):
            other.chat.completions.create(model=task.model, messages=task.messages)
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="one choice per request"):
            client.chat.completions.create(model=task.model, messages=task.messages, n=2)
        outcomes["models"] = [m.id for m in client.models.list()]
        return float(client.chat.completions.create(model=task.model, messages=task.messages).choices[0]
                     .finish_reason == "stop")

    out, _, _ = _rollout(tok, probing_agent, [["fine"]])
    assert out.non_tensor_batch["agent_error"][0] is None and out.non_tensor_batch["agent_reward"][0] == 1.0
    assert outcomes["models"] == ["megatron-rl"]


def test_the_response_budget_ends_a_session_with_length(tok):
    def long_agent(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages, reasons = list(task.messages), []
        for _ in range(4):
            reply = client.chat.completions.create(model=task.model, messages=messages).choices[0]
            reasons.append(reply.finish_reason)
            if reply.finish_reason == "length":
                break
            messages += [reply.message.model_dump(exclude_none=True), {"role": "user", "content": "again " * 5}]
        return float(len(reasons))

    out, _, _ = _rollout(tok, long_agent, [["a b c d e f g h"]], response_length=24)
    b = out.batch
    assert int(b["attention_mask"][0, b["prompts"].shape[1]:].sum()) <= 24
    assert out.non_tensor_batch["stop_reason"][0] == "length"


def test_an_agent_that_raises_keeps_its_turns_and_names_the_error(tok):
    def failing_agent(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        client.chat.completions.create(model=task.model, messages=task.messages)
        raise RuntimeError("the agent's own bug")

    out, _, _ = _rollout(tok, failing_agent, [["one turn"]])
    assert out.non_tensor_batch["agent_error"][0] == "RuntimeError: the agent's own bug"
    assert int(out.batch["response_mask"][0].sum()) > 0


def test_hf_engine_agent_samples_score_as_the_engine_sampled(tok):
    """A real engine behind the proxy: the trainer's log-probs of every model token of every session equal the
    engine's (the context of each turn was exactly the sample's tokens)."""
    from megatron_rl_testing.rollout_models import make_engine, source_model, tiny_qwen2_config, trainer_log_probs

    cfg = tiny_qwen2_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            max_position_embeddings=512)
    stops = list(range(10, 26))  # frequent enough that random weights end turns after ~12 tokens
    engine = make_engine(response_length=120, config=cfg, stop_token_ids=stops, temperature=0.8)

    def chatty_agent(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages = list(task.messages)
        for k in range(3):
            reply = client.chat.completions.create(model=task.model, messages=messages).choices[0]
            if reply.finish_reason == "length":
                break
            messages += [reply.message.model_dump(exclude_none=True), {"role": "user", "content": f"step {k}"}]

    prompts = chat_prompts(tok, QUESTIONS, temperature=0.8, seed=5)
    rollout = AgentProgramRollout(engine.generate_sequences, tok, chatty_agent, response_length=120,
                                  finish_token_ids=[tok.eos_token_id, *stops])
    try:
        out = rollout.generate_sequences(prompts)
    finally:
        rollout.close()
    mask = out.batch["response_mask"].bool()
    assert int((~mask & out.batch["attention_mask"][:, out.batch["prompts"].shape[1]:].bool()).sum()) > 0
    trainer = trainer_log_probs(source_model(100, cfg))(out)
    assert float((trainer - out.batch["rollout_log_probs"]).abs()[mask].max()) < 1e-5


def test_closing_the_rollout_leaves_no_thread_or_socket(tok):
    import socket
    import threading

    prompts = chat_prompts(tok, QUESTIONS[:1])
    rollout = AgentProgramRollout(ScriptedEngine(tok, prompts, [["x"]]), tok, tool_agent, response_length=32,
                                  finish_token_ids=[tok.eos_token_id])
    rollout.generate_sequences(prompts)
    host, port = rollout.proxy._server.server_address[:2]
    rollout.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("agent-proxy", "agent-program"))]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=2).close()


@pytest.mark.parametrize("spec, enable, message", [
    ("examples/agents/openai_tool_agent.py:run", False, r"runs only with actor_rollout_ref.rollout.multi_turn.enable"),
    ("examples/agents/missing.py:run", True, r"multi_turn.agent_program='examples/agents/missing.py:run': "
                                            r"examples/agents/missing.py does not exist"),
    ("examples/agents/openai_tool_agent.py:nope", True, r"has no function 'nope'"),
    ("no_such_module_here:run", True, r"No module named 'no_such_module_here'"),
    ("just_a_name", True, r"expected module:function or file.py:function"),
])
def test_a_bad_agent_program_is_refused_before_launch(spec, enable, message, monkeypatch):
    from pathlib import Path

    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.trainer.preflight import check_agent_program

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the spec's path is the repo's examples/
    cfg = load_config(overrides=[f"actor_rollout_ref.rollout.multi_turn.enable={str(enable).lower()}",
                                 f"actor_rollout_ref.rollout.multi_turn.agent_program={spec}"])
    with pytest.raises(ConfigError, match=message):
        check_agent_program(cfg)
    cfg.actor_rollout_ref.rollout.multi_turn.agent_program = "examples/agents/openai_tool_agent.py:run"
    cfg.actor_rollout_ref.rollout.multi_turn.enable = True
    check_agent_program(cfg)
