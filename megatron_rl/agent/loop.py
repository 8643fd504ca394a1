"""The agent loop: multi-turn rollouts through any ``generate_sequences`` (HF engine, SGLang, a replica).

A sample is a sequence of turns. Each model turn is one ``generate_sequences`` call on the sample's exact
token context (prompt + every earlier turn, as token ids: nothing is re-tokenized, so the trainer sees
the tokens the engine saw). The sample's environment then returns an observation (tool results, a user
message) that is rendered with the chat template, tokenized once and appended. A sample stops at a final
answer (the environment says done), after ``max_assistant_turns`` model turns or ``max_user_turns``
observations, or when the response length budget is spent.

Concurrency: samples are not run in lock-step. Model turns of all samples that are ready go to the engine
as one batch; environment steps (tool calls) run on a thread pool meanwhile, each bounded by
``tool_timeout_s``; a sample whose tool is slow simply joins a later batch, so it never stalls the others.

Output (verl's layout): ``responses`` hold all turns, right-padded to the call's response length;
``response_mask`` is 1 on model tokens and 0 on observation tokens; ``rollout_log_probs`` is the engine's
log-prob on model tokens and 0 elsewhere; ``attention_mask`` is 1 on every real token (observations are
context). ``non_tensor_batch`` gains ``__num_turns__`` / ``num_turns`` (verl's count: 1 for the prompt +
model turns + observation turns), ``tool_call_counts``, ``tool_error_counts`` and ``tool_error_reasons``
(calls that failed on the tool's side: a ``ToolError`` such as a tool service's timeout, a tool that raised,
a call abandoned at ``tool_timeout_s``; one reason per failed call), ``agent_name`` and ``stop_reason``
(final | max_turns | max_user_turns | length).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron_rl.config.schema import MultiTurnConfig
from megatron_rl.protocol import DataProto
from megatron_rl.agent.env import AgentEnv, StepResult, get_env
from megatron_rl.agent.tools import Tool, build_tools, load_tool_config
from megatron_rl.agent.turns import GenerateFn, TokenRecord, generate_turns, record_routing, record_tensors
from megatron_rl.rollout.batch_io import check_prompt_batch, prompt_token_lists

__all__ = ["AgentLoop", "AgentLoopSettings", "observation_token_ids"]

logger = logging.getLogger(__name__)



@dataclass
class AgentLoopSettings:
    """The ``actor_rollout_ref.rollout.multi_turn`` block (verl's key names plus ours)."""

    max_assistant_turns: int | None = 5
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_config_path: str | None = None
    tools: list[Any] = field(default_factory=lambda: ["calculator"])
    default_agent: str = "tool_agent"
    tool_timeout_s: float = 10.0
    num_tool_workers: int = 8
    batch_window_s: float = 0.02

    @classmethod
    def from_config(cls, cfg: MultiTurnConfig | AgentLoopSettings | Mapping[str, Any] | None) -> AgentLoopSettings:
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        get = cfg.get if isinstance(cfg, Mapping) or hasattr(cfg, "get") else lambda k, d=None: getattr(cfg, k, d)
        out = cls()
        for name in cls.__dataclass_fields__:
            value = get(name, None)
            if value is not None:
                setattr(out, name, list(value) if name == "tools" else value)
        return out


def observation_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The tokens the chat template puts between the end of a model turn and the start of the next one:
    the observation messages followed by the generation prompt. Rendered after a dummy conversation and cut
    at its end, so templates that add a default system prompt do not repeat it (verl does the same)."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    prefix = tokenizer.apply_chat_template(base, tokenize=False, add_generation_prompt=False)
    full = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
    text = full[len(prefix):] if full.startswith(prefix) else tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class _Sample(TokenRecord):
    index: int
    prompt: list[int]
    env: AgentEnv
    agent_name: str
    model_turns: int = 0
    obs_turns: int = 0
    tool_calls: int = 0
    tool_errors: list[str] = field(default_factory=list)
    stop_reason: str | None = None


class AgentLoop:
    """``AgentLoop(generate_fn, tokenizer, settings).generate_sequences(prompts)`` -> the rollout batch.

    ``generate_fn``: one call of an engine's (or replica's) ``generate_sequences``; it is called from this
    thread only (thread-affine engines are safe). ``response_length``: the total budget of all turns
    (``meta_info['response_length']`` overrides it per call)."""

    def __init__(self, generate_fn: GenerateFn, tokenizer: Any,
                 settings: MultiTurnConfig | AgentLoopSettings | Mapping[str, Any] | None = None, *,
                 response_length: int, tools: Mapping[str, Tool] | None = None,
                 finish_token_ids: list[int] | None = None) -> None:
        self.generate_fn = generate_fn
        self.tokenizer = tokenizer
        self.settings = AgentLoopSettings.from_config(settings)
        fmt = settings.get("format", "hermes") if hasattr(settings, "get") else getattr(settings, "format", "hermes")
        if fmt not in (None, "hermes"):
            raise ValueError(f"rollout.multi_turn.format={fmt!r}: only 'hermes' (<tool_call>{{json}}</tool_call>, "
                             "Qwen's format) is parsed")
        if self.settings.tool_response_truncate_side not in ("left", "right", "middle"):
            raise ValueError("rollout.multi_turn.tool_response_truncate_side must be left, right or middle, got "
                             f"{self.settings.tool_response_truncate_side!r}")
        self.response_length = int(response_length)
        if tools is None:
            tools = (load_tool_config(self.settings.tool_config_path) if self.settings.tool_config_path
                     else build_tools(self.settings.tools))
        self.tools = dict(tools)
        eos = finish_token_ids if finish_token_ids is not None else tokenizer.eos_token_id
        self.finish_token_ids = set([eos] if isinstance(eos, int) else list(eos or []))
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.finish_token_ids)

    # ------------------------------------------------------------------ per-sample set-up
    def _env_for(self, prompts: DataProto, i: int) -> tuple[str, AgentEnv]:
        nt = prompts.non_tensor_batch
        extra = nt["extra_info"][i] if "extra_info" in nt else None
        extra = extra if isinstance(extra, Mapping) else {}
        name = None
        if "agent_name" in nt and nt["agent_name"][i]:
            name = str(nt["agent_name"][i])
        elif extra.get("agent_name"):
            name = str(extra["agent_name"])
        name = name or self.settings.default_agent
        s = self.settings
        env = get_env(name)(self.tools, max_parallel_calls=s.max_parallel_calls,
                            max_tool_response_length=s.max_tool_response_length,
                            tool_response_truncate_side=s.tool_response_truncate_side)
        sample = {k: nt[k][i] for k in ("raw_prompt", "reward_model", "data_source", "uid") if k in nt}
        sample["extra_info"] = extra
        env.reset(sample)
        return name, env

    # ------------------------------------------------------------------ the loop
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompt_batch(prompts)
        start = time.perf_counter()
        budget = int(prompts.meta_info.get("response_length", self.response_length))
        samples = []
        for i, prompt in enumerate(prompt_token_lists(prompts)):
            name, env = self._env_for(prompts, i)
            samples.append(_Sample(i, prompt, env, name))
        pool = ThreadPoolExecutor(max_workers=max(1, int(self.settings.num_tool_workers)),
                                  thread_name_prefix="agent-tool")
        pending: dict[Future, tuple[_Sample, float]] = {}
        ready = list(samples)
        rounds = 0
        try:
            while ready or pending:
                if ready:
                    for sample, text in self._model_turn(prompts, ready, budget, rounds):
                        future = pool.submit(sample.env.step, text)
                        pending[future] = (sample, time.monotonic() + float(self.settings.tool_timeout_s))
                    rounds += 1
                    ready = []
                if not pending:
                    continue
                deadline = min(d for _, d in pending.values())
                done, _ = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()),
                               return_when=FIRST_COMPLETED)
                if done and len(done) < len(pending) and self.settings.batch_window_s > 0:
                    wait(list(pending), timeout=float(self.settings.batch_window_s))  # batch near-simultaneous tools
                now = time.monotonic()
                for future in list(pending):
                    sample, dl = pending[future]
                    if future.done():
                        del pending[future]
                        try:
                            result = future.result()
                        except Exception as exc:  # an environment must not take the batch down
                            logger.warning("agent env %s raised on sample %d: %r", sample.agent_name, sample.index, exc)
                            result = StepResult([{"role": "tool", "content":
                                                  f"Error: the environment failed: {type(exc).__name__}: {exc}"}],
                                                tool_errors=["env_error"])
                    elif now >= dl:
                        del pending[future]
                        future.cancel()
                        result = StepResult([{"role": "tool", "content": "Error: the tool call did not finish "
                                              f"within {float(self.settings.tool_timeout_s):g}s and was abandoned."}],
                                            tool_calls=1, tool_errors=["tool_timeout"])
                    else:
                        continue
                    if self._observe(sample, result, budget):
                        ready.append(sample)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return self._build(prompts, samples, budget, time.perf_counter() - start)

    def _model_turn(self, prompts: DataProto, ready: list[_Sample], budget: int,
                    round_: int) -> list[tuple[_Sample, str]]:
        """One engine call for every ready sample; returns the samples that go on to their environment."""
        meta = dict(prompts.meta_info)
        if meta.get("seed") is not None:
            meta["seed"] = int(meta["seed"]) + 7919 * round_
        turns = generate_turns(self.generate_fn, [s.prompt + s.tokens for s in ready],
                               [budget - len(s.tokens) for s in ready], meta, self.pad_token_id)
        going_on = []
        for sample, turn in zip(ready, turns):
            sample.add_turn(turn)
            sample.model_turns += 1
            ended = bool(turn.tokens) and turn.tokens[-1] in self.finish_token_ids
            if not ended or len(sample.tokens) >= budget:
                sample.stop_reason = "length"
            elif self.settings.max_assistant_turns and sample.model_turns >= int(self.settings.max_assistant_turns):
                sample.stop_reason = "max_turns"
            else:
                going_on.append((sample, self.tokenizer.decode(turn.tokens, skip_special_tokens=False)))
        return going_on

    def _observe(self, sample: _Sample, result: StepResult, budget: int) -> bool:
        """Apply an environment step; True when the sample wants another model turn."""
        sample.tool_calls += int(result.tool_calls)
        sample.tool_errors += list(result.tool_errors)
        if result.done or not result.observation:
            sample.stop_reason = "final"
            return False
        if self.settings.max_user_turns and sample.obs_turns >= int(self.settings.max_user_turns):
            sample.stop_reason = "max_user_turns"
            return False
        obs = observation_token_ids(self.tokenizer, list(result.observation))
        if len(sample.tokens) + len(obs) >= budget:  # no room for the observation and a model token
            sample.stop_reason = "length"
            return False
        sample.add_observation(obs)
        sample.obs_turns += 1
        return True

    # ------------------------------------------------------------------ output
    def _build(self, prompts: DataProto, samples: list[_Sample], budget: int, seconds: float) -> DataProto:
        """verl's layout; the samples' per-token ``token_weight_versions`` and oldest ``weight_version`` (a turn
        resumed after a weight swap, in async training, holds two)."""
        prompt_ids = prompts.batch["input_ids"]
        device = prompt_ids.device
        packed = record_tensors(samples, budget, self.pad_token_id)
        prompt_pos = prompts.batch["position_ids"]
        steps = torch.arange(1, budget + 1, dtype=prompt_pos.dtype, device=prompt_pos.device)
        attention = packed["response_attention"].to(device, prompts.batch["attention_mask"].dtype)
        batch = {
            "prompts": prompt_ids,
            "responses": packed["responses"].to(device, prompt_ids.dtype),
            "response_mask": packed["response_mask"].to(device, prompts.batch["attention_mask"].dtype),
            "input_ids": torch.cat([prompt_ids, packed["responses"].to(device, prompt_ids.dtype)], dim=-1),
            "attention_mask": torch.cat([prompts.batch["attention_mask"], attention], dim=-1),
            "position_ids": torch.cat([prompt_pos, prompt_pos[:, -1:] + steps.unsqueeze(0)], dim=-1),
            "rollout_log_probs": packed["rollout_log_probs"].to(device),
        }
        lengths = prompts.batch["attention_mask"].sum(-1).tolist()
        routed = record_routing(samples, lengths, prompt_ids.shape[1], budget)
        if routed is not None:
            batch["routed_experts"] = routed.to(device)
        turns = [1 + s.model_turns + s.obs_turns for s in samples]
        non_tensor = dict(prompts.non_tensor_batch)
        non_tensor |= {
            "__num_turns__": np.array(turns, dtype=object),
            "num_turns": np.array(turns, dtype=object),
            "tool_call_counts": np.array([s.tool_calls for s in samples], dtype=object),
            "tool_error_counts": np.array([len(s.tool_errors) for s in samples], dtype=object),
            "tool_error_reasons": _one_per_row([list(s.tool_errors) for s in samples]),
            "stop_reason": np.array([s.stop_reason or "length" for s in samples], dtype=object),
            "token_weight_versions": packed["token_weight_versions"],
            "weight_version": packed["weight_version"],
        }
        if "agent_name" not in non_tensor:  # the data's column, when it has one, passes through as it was
            non_tensor["agent_name"] = np.array([s.agent_name for s in samples], dtype=object)
        meta = {**prompts.meta_info, "timing": {"generate_sequences": seconds}}
        known = packed["weight_version"][packed["weight_version"] >= 0]
        if len(known):
            meta["weight_version"] = int(known.min())
        return DataProto(batch, non_tensor, meta)


def _one_per_row(rows: list[list[str]]) -> np.ndarray:
    """An object array with one list per sample (numpy would make a 2-D array of equally long lists)."""
    out = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        out[i] = row
    return out
