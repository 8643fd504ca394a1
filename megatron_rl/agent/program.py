"""Rollouts by an agent program of the user's: one program run per sample, talking to the model through the agent
proxy (agent/proxy.py), each finished session a training sample (``rollout.multi_turn.agent_program``).

A program is a function ``program(task: AgentTask) -> float | None`` named as ``module:function`` or
``path/to/file.py:function``. It gets its session's OpenAI ``base_url`` and ``api_key``, the row's prompt messages
and its ``data_source`` / ``reward_model`` / ``extra_info``, and may do anything an agent does between model turns
(call tools, services, other programs). Programs run on a thread pool while the calling thread (the engine's owner)
serves their model turns in batches. A number it returns is the sample's reward (``agent_reward``, which the
reward manager takes in place of a scorer); None leaves scoring to the run's reward function, on the decoded
response as for every sample.

The sample: the session's first prompt (its chat-template rendering of the first request's messages and tools:
the prompt the model saw, which may differ from the dataset's rendering) left-padded, then every model and
observation token in order, ``response_mask`` 1 on model tokens only, ``rollout_log_probs`` the engine's, per-token
``token_weight_versions``; the agent loop's columns (``num_turns``, ``tool_call_counts``, ``stop_reason``) and
``agent_error`` (the program's exception, or None). A program that raises keeps what its session recorded
(``stop_reason`` ``agent_error``); one that never asked the model gives an empty response (``no_request``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rl.agent.chat_session import ChatSession
from megatron_rl.agent.proxy import AgentProxy
from megatron_rl.agent.turns import GenerateFn, record_tensors
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.batch_io import check_prompt_batch, prompt_token_lists

__all__ = ["AGENT_REWARD", "AgentProgramRollout", "AgentTask", "load_agent_program"]

logger = logging.getLogger(__name__)

# the column of a sample's reward given by its program (None: scored as every sample; reward/manager.py reads it)
AGENT_REWARD = "agent_reward"


@dataclass(frozen=True)
class AgentTask:
    """What one program run gets: where its model is, and the sample it works on."""

    base_url: str
    api_key: str
    model: str
    session_id: str
    messages: list[dict[str, Any]]
    sample: dict[str, Any] = field(default_factory=dict)  # data_source, reward_model, extra_info, uid


AgentProgram = Callable[[AgentTask], "float | None"]


def load_agent_program(spec: str) -> AgentProgram:
    """``module:function`` or ``path/to/file.py:function`` -> the function; ValueError naming what is wrong."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"rollout.multi_turn.agent_program={spec!r}: expected module:function or file.py:function")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"rollout.multi_turn.agent_program={spec!r}: {where} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_agent_program_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ValueError(f"rollout.multi_turn.agent_program={spec!r}: {exc}") from None
    program = getattr(module, name, None)
    if not callable(program):
        raise ValueError(f"rollout.multi_turn.agent_program={spec!r}: {where} has no function {name!r}")
    return program


class AgentProgramRollout:
    """``generate_sequences(prompts)``: every prompt row through ``program``, served by ``generate_fn``."""

    def __init__(self, generate_fn: GenerateFn, tokenizer: Any, program: AgentProgram | str, *,
                 response_length: int, finish_token_ids: list[int], max_concurrency: int = 32,
                 timeout_s: float = 600.0, batch_window_s: float = 0.02) -> None:
        self.generate_fn, self.tokenizer = generate_fn, tokenizer
        self.program = load_agent_program(program) if isinstance(program, str) else program
        self.response_length, self.timeout_s = int(response_length), float(timeout_s)
        self.max_concurrency = max(1, int(max_concurrency))
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(finish_token_ids)
        self.proxy = AgentProxy(tokenizer, budget=self.response_length, finish_token_ids=set(finish_token_ids),
                                api_key=secrets.token_hex(16), batch_window_s=batch_window_s).start()

    def close(self) -> None:
        self.proxy.close()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompt_batch(prompts)
        start = time.perf_counter()
        nt = prompts.non_tensor_batch
        if "raw_prompt" not in nt:
            raise ValueError("an agent program needs each row's prompt messages (non_tensor_batch['raw_prompt'], "
                             "which the dataset gives every row)")
        run = secrets.token_hex(4)
        sessions = [self.proxy.open_session(f"{run}-{i}") for i in range(len(prompts))]
        futures: list[Future] = []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts)),
                                thread_name_prefix="agent-program") as pool:
            for i, session in enumerate(sessions):
                task = AgentTask(self.proxy.base_url(session.session_id), self.proxy.api_key, self.proxy.model_name,
                                 session.session_id, [dict(m) for m in nt["raw_prompt"][i]],
                                 {k: nt[k][i] for k in ("data_source", "reward_model", "extra_info", "uid") if k in nt})
                futures.append(pool.submit(self.program, task))
            deadline = time.monotonic() + self.timeout_s
            try:
                self.proxy.serve(self.generate_fn, prompts.meta_info,
                                 until=lambda: all(f.done() for f in futures) or time.monotonic() > deadline)
            finally:
                for session in sessions:  # later requests of a late program are refused (404), not served
                    self.proxy.close_session(session.session_id)
        rewards, errors = [], []
        for i, future in enumerate(futures):
            reward, error = None, None
            if not future.done():
                error = f"the program did not finish within rollout.multi_turn.agent_timeout_s={self.timeout_s:g}"
            elif future.exception() is not None:
                exc = future.exception()
                error = f"{type(exc).__name__}: {exc}"
            else:
                reward = future.result()
                if reward is not None and not isinstance(reward, (int, float)):
                    error = f"the program returned {type(reward).__name__}, not a number or None"
                    reward = None
            if error is not None:
                logger.warning("agent program on sample %d: %s", i, error)
                sessions[i].stop_reason = "agent_error"
            rewards.append(None if reward is None else float(reward))
            errors.append(error)
        return self._build(prompts, sessions, rewards, errors, time.perf_counter() - start)

    def _build(self, prompts: DataProto, sessions: list[ChatSession], rewards: list[float | None],
               errors: list[str | None], seconds: float) -> DataProto:
        dataset_prompts = prompt_token_lists(prompts)
        prompt_lists = [s.prompt if s.prompt is not None else p for s, p in zip(sessions, dataset_prompts)]
        width = max(len(p) for p in prompt_lists)
        prompt_ids = torch.full((len(sessions), width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(sessions), width), dtype=torch.long)
        for row, prompt in enumerate(prompt_lists):
            prompt_ids[row, width - len(prompt):] = torch.as_tensor(prompt)
            prompt_mask[row, width - len(prompt):] = 1
        packed = record_tensors(sessions, self.response_length, self.pad_token_id)
        attention_mask = torch.cat([prompt_mask, packed["response_attention"]], -1)
        batch = {"prompts": prompt_ids, "responses": packed["responses"], "response_mask": packed["response_mask"],
                 "input_ids": torch.cat([prompt_ids, packed["responses"]], -1), "attention_mask": attention_mask,
                 "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
                 "rollout_log_probs": packed["rollout_log_probs"]}
        turns = [1 + s.model_turns + s.obs_turns for s in sessions]
        non_tensor = {k: v for k, v in prompts.non_tensor_batch.items() if k != "raw_prompt_ids"}
        non_tensor |= {
            "__num_turns__": np.array(turns, dtype=object), "num_turns": np.array(turns, dtype=object),
            "tool_call_counts": np.array([s.tool_calls for s in sessions], dtype=object),
            "stop_reason": np.array([s.stop_reason or ("no_request" if s.prompt is None else "final")
                                     for s in sessions], dtype=object),
            AGENT_REWARD: np.array(rewards, dtype=object), "agent_error": np.array(errors, dtype=object),
            "agent_session": np.array([s.session_id for s in sessions], dtype=object),
            "token_weight_versions": packed["token_weight_versions"], "weight_version": packed["weight_version"],
        }
        meta = {**prompts.meta_info, "timing": {"generate_sequences": seconds}}
        known = packed["weight_version"][packed["weight_version"] >= 0]
        if len(known):
            meta["weight_version"] = int(known.min())
        return DataProto(batch, non_tensor, meta)
