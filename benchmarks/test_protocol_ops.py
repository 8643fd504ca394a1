"""DataProto's hot-path row operations (repeat, union, concat, split, chunk) on 8192 rows, TensorDict-backed (megatron_rl.protocol) against the
dict-backed version it replaced (benchmarks/protocol_dict_baseline.py), in the same run.

A trainer-shaped batch: 512 prompts x 16 samples, 1024 prompt+response tokens, the usual tensors and
uid/data_source/reward_model object fields. Each op's best-of-ROUNDS time is recorded in extra_info and
printed with the ratio new/old:

    pytest benchmarks/test_protocol_ops.py -s --benchmark-columns=min,mean,rounds
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
import torch

from megatron_rl.protocol import DataProto
from megatron_rl_testing.timing import best_seconds

_spec = importlib.util.spec_from_file_location(
    "protocol_dict_baseline", pathlib.Path(__file__).with_name("protocol_dict_baseline.py"))
baseline = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = baseline  # dataclasses look their module up
_spec.loader.exec_module(baseline)

ROWS, PROMPTS, SEQ, RESP = 8192, 512, 1024, 512
ROUNDS = 5


def _parts(n: int):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "input_ids": torch.randint(0, 32000, (n, SEQ), generator=gen),
        "attention_mask": torch.ones(n, SEQ, dtype=torch.int64),
        "position_ids": torch.arange(SEQ).expand(n, SEQ).contiguous(),
        "responses": torch.randint(0, 32000, (n, RESP), generator=gen),
        "response_mask": torch.ones(n, RESP),
        "old_log_probs": torch.randn(n, RESP, generator=gen),
    }
    non_tensors = {"uid": np.array([f"u{i // 16}" for i in range(n)], dtype=object),
                   "data_source": np.array(["openai/gsm8k"] * n, dtype=object),
                   "reward_model": np.array([{"ground_truth": str(i)} for i in range(n)], dtype=object)}
    extra = {"advantages": torch.randn(n, RESP, generator=gen), "returns": torch.randn(n, RESP, generator=gen)}
    return tensors, non_tensors, extra


def _ops(cls):
    tensors, non_tensors, extra = _parts(ROWS)
    prompts = cls.from_dict({k: v[:PROMPTS] for k, v in tensors.items()},
                            {k: v[:PROMPTS] for k, v in non_tensors.items()})
    full = cls.from_dict(tensors, non_tensors)
    parts = full.split(1024)
    return {
        "repeat": lambda: prompts.repeat(16, interleave=True),
        "union": lambda: cls.from_dict(tensors, non_tensors).union(cls.from_dict(extra)),
        "concat": lambda: cls.concat(parts),
        "split": lambda: full.split(1024),
        "chunk": lambda: full.chunk(8),
    }


@pytest.mark.parametrize("op", ["repeat", "union", "concat", "split", "chunk"])
def test_protocol_op_against_dict_baseline(benchmark, op):
    ours, theirs = _ops(DataProto)[op], _ops(baseline.DataProto)[op]
    old = best_seconds(ROUNDS, theirs)
    new = best_seconds(ROUNDS, ours)
    benchmark.pedantic(ours, rounds=ROUNDS, iterations=1)
    benchmark.extra_info.update(old_ms=old * 1e3, new_ms=new * 1e3, ratio=new / old)
    print(f"\n{op:7s} 8192 rows: dict {old * 1e3:8.2f} ms  TensorDict {new * 1e3:8.2f} ms  ratio {new / old:.2f}")
