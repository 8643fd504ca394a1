"""Helpers of the agent-loop tests: a tiny ChatML tokenizer, scripted engines, prompt batches."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from megatron_rl.data.tokenizer import build_tiny_tokenizer
from megatron_rl.protocol import DataProto

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123456 * 654321"}}</tool_call>'
TEXTS = [
    CALL,
    "What is 123456 * 654321? Use the calculator tool. #### 80779853376",
    "tool\nuser\nassistant\nsystem\nError: not valid JSON unknown tool timed out abandoned",
    '{"name": "python", "arguments": {"code": "print(1)"}} python code',
    "0123456789 +-*/()#.,:;'\"[]{}_<>!?=",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def tiny_tokenizer(tmp_path):
    return build_tiny_tokenizer(tmp_path / "tok", TEXTS, vocab_size=200)


def chat_prompts(tokenizer, questions: list[str], **meta) -> DataProto:
    """Left-padded, chat-templated prompts with raw_prompt (and whatever the caller adds)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    raw = np.empty(len(questions), dtype=object)
    raw[:] = [[{"role": "user", "content": q}] for q in questions]
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               non_tensors={"raw_prompt": raw}, meta_info=meta)


class ScriptedEngine:
    """``generate_sequences`` that answers sample i's turn t with ``scripts[i][t]`` (text; eos appended),
    recognising the sample by its prompt. Records every call (which samples, when)."""

    def __init__(self, tokenizer, prompts: DataProto, scripts: list[list[str]], log_prob: float = -0.5):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.log_prob = log_prob
        self.prompts = {}
        for i, (row, m) in enumerate(zip(prompts.batch["input_ids"], prompts.batch["attention_mask"].bool())):
            self.prompts[tuple(row[m].tolist())] = i
        self.scripts = scripts
        self.turn = [0] * len(scripts)
        self.calls: list[tuple[float, list[int]]] = []
        self.lock = threading.Lock()

    def _sample_of(self, ctx: list[int]) -> int:
        for prompt, i in self.prompts.items():
            if tuple(ctx[: len(prompt)]) == prompt:
                return i
        raise AssertionError("unknown context")

    def __call__(self, data: DataProto) -> DataProto:
        length = int(data.meta_info["response_length"])
        rows, who = [], []
        for row, m in zip(data.batch["input_ids"], data.batch["attention_mask"].bool()):
            i = self._sample_of(row[m].tolist())
            who.append(i)
            script = self.scripts[i]
            text = script[min(self.turn[i], len(script) - 1)]
            self.turn[i] += 1
            rows.append((self.tokenizer.encode(text, add_special_tokens=False) + [self.eos])[:length])
        self.calls.append((time.monotonic(), who))
        out = torch.full((len(rows), length), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for r, toks in enumerate(rows):
            out[r, : len(toks)] = torch.tensor(toks)
            mask[r, : len(toks)] = 1
        return DataProto.from_dict({"responses": out, "response_mask": mask,
                                    "rollout_log_probs": mask.float() * self.log_prob},
                                   meta_info={"weight_version": 3})


def run_scripted(tokenizer, questions, scripts, settings=None, response_length=256, tools=None,
                 non_tensors: dict | None = None) -> tuple[DataProto, ScriptedEngine]:
    from megatron_rl.agent import AgentLoop

    prompts = chat_prompts(tokenizer, questions)
    for k, v in (non_tensors or {}).items():
        arr = np.empty(len(v), dtype=object)
        arr[:] = list(v)
        prompts.non_tensor_batch[k] = arr
    engine = ScriptedEngine(tokenizer, prompts, scripts)
    loop = AgentLoop(engine, tokenizer, settings, response_length=response_length, tools=tools)
    return loop.generate_sequences(prompts), engine


def segments(mask_row: torch.Tensor, n: int) -> list[tuple[int, int]]:
    """(value, run length) runs of a response mask over its first n tokens."""
    runs: list[tuple[int, int]] = []
    for v in mask_row[:n].tolist():
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs
