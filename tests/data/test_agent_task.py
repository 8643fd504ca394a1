"""The tool_multiply task: verl-format rows, the data writer, the scorer, and that the task needs the tool:
an oracle policy that calls the calculator and answers with its result scores 1 through the real loop
(ToolEnv, calculator, tokenized observation, reward decoding of all turns); one that answers without the
tool cannot know the 12-digit product and scores 0; copying the tool output without '####' scores 0."""

from __future__ import annotations

import random
import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from megatron_rl.data.tasks import make_rows, task_texts
from megatron_rl.data.tasks.__main__ import main as write_main
from megatron_rl.data.tasks.tool_multiply import tool_call_text
from megatron_rl.data.tokenizer import build_tiny_tokenizer
from megatron_rl.reward import get_scorer
from megatron_rl.agent import AgentLoop
from megatron_rl_testing.agent_support import ScriptedEngine, chat_prompts


def test_rows_and_writer(tmp_path):
    rows = make_rows("tool_multiply", 5, seed=0, split="train")
    for row in rows:
        a, b = map(int, re.findall(r"(\d{6}) \* (\d{6})", row["prompt"][-1]["content"])[0])
        assert row["reward_model"]["ground_truth"] == str(a * b) and len(str(a * b)) >= 11
        assert row["agent_name"] == row["extra_info"]["agent_name"] == "tool_agent"
        assert row["data_source"] == "synthetic/tool_multiply" and "calculator" in row["prompt"][0]["content"]
    write_main(["tool_multiply", "--out", str(tmp_path), "--train", "6", "--val", "2", "--tokenizer", "--vocab-size", "200"])
    assert pq.read_metadata(tmp_path / "train.parquet").num_rows == 6
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()


def test_scorer():
    score = get_scorer("synthetic/tool_multiply").fn
    assert score("synthetic/tool_multiply", "tool\n42\n#### 42", "42")["score"] == 1.0
    assert score("synthetic/tool_multiply", "tool\n42\nthe answer is 42", "42")["score"] == 0.0  # no ####
    assert score("synthetic/tool_multiply", "#### 41", "42")["score"] == 0.0


def _policy_scripts(rows, use_tool: bool, rng: random.Random):
    scripts = []
    for row in rows:
        a, b = map(int, re.findall(r"(\d{6}) \* (\d{6})", row["prompt"][-1]["content"])[0])
        if use_tool:
            scripts.append([tool_call_text(f"{a} * {b}"), None])  # the answer is read from the observation
        else:  # best guess without the tool: the leading digits of a float product are not enough
            scripts.append([f"#### {round(a * b, -6) + rng.randint(0, 999)}"])
    return scripts


@pytest.mark.parametrize("use_tool", [True, False])
def test_the_task_needs_the_tool(tmp_path, use_tool):
    rows = make_rows("tool_multiply", 6, seed=1, split="val")
    tok = build_tiny_tokenizer(tmp_path / "tok", task_texts(rows) + ["abcdefghijklmnopqrstuvwxyz"], vocab_size=200)
    prompts = chat_prompts(tok, [r["prompt"][-1]["content"] for r in rows])
    # the real rows' prompts (system + user) are what the trainer's dataset renders
    prompts.non_tensor_batch["extra_info"] = np.array([r["extra_info"] for r in rows], dtype=object)
    scripts = _policy_scripts(rows, use_tool, random.Random(0))
    engine = ScriptedEngine(tok, prompts, [[s for s in sc if s is not None] or ["#### 0"] for sc in scripts])
    seen = {}

    def policy(data):  # turn 2 of the tool policy: answer with the number the tool returned
        for row, m in zip(data.batch["input_ids"], data.batch["attention_mask"].bool()):
            ctx = tok.decode(row[m].tolist())
            i = engine._sample_of(row[m].tolist())
            found = re.findall(r"<\|im_start\|>tool\n(\d+)<\|im_end\|>", ctx)
            if found:
                engine.scripts[i] = engine.scripts[i][:1] + [f"#### {found[-1]}"]
                seen[i] = found[-1]
        return engine(data)

    out = AgentLoop(policy, tok, {"max_assistant_turns": 3}, response_length=160).generate_sequences(prompts)
    score = get_scorer("synthetic/tool_multiply").fn
    mask = out.batch["attention_mask"][:, -out.batch["responses"].shape[1]:].bool()
    scores = [score("synthetic/tool_multiply", tok.decode(r[m].tolist()), row["reward_model"]["ground_truth"])["score"]
              for r, m, row in zip(out.batch["responses"], mask, rows)]
    if use_tool:
        assert scores == [1.0] * 6 and len(seen) == 6
        assert list(out.non_tensor_batch["tool_call_counts"]) == [1] * 6
    else:
        assert scores == [0.0] * 6


def test_dataset_carries_verls_agent_name_column(tmp_path):
    from megatron_rl.data.dataset import RLDataset
    from megatron_rl.data.loader import collate_to_dataproto
    from megatron_rl.data.tokenizer import load_tokenizer

    write_main(["tool_multiply", "--out", str(tmp_path), "--train", "3", "--val", "1", "--tokenizer", "--vocab-size", "200"])
    tok = load_tokenizer(tmp_path / "tokenizer")
    data = RLDataset([str(tmp_path / "train.parquet")], tok, max_prompt_length=256)
    batch = collate_to_dataproto([data[i] for i in range(3)])
    assert list(batch.non_tensor_batch["agent_name"]) == ["tool_agent"] * 3
    assert batch.non_tensor_batch["extra_info"][0]["tools_kwargs"]["calculator"]["create_kwargs"]["ground_truth"]
