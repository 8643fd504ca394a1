"""reward.reward_manager=dapo (DAPO's soft overlong penalty, reward/overlong.py) and =prime.

Hand-computed expectations always run. verl 0.9.1's DAPORewardManager is the oracle when it imports (optional, as
in tests/algos/conftest.py):
  MEGATRON_RL_VERL_PATH=/tmp/verl_src:/tmp/verl_deps pytest tests/reward/test_dapo_reward_manager.py
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.schema import (
    CustomRewardFunctionConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardKwargsConfig,
)
from megatron_rl.plan.validate import validate
from megatron_rl.protocol import DataProto
from megatron_rl.reward import RewardManager
from megatron_rl.reward.overlong import OverlongPenalty
from megatron_rl.trainer.reward_setup import build_reward_fn
from megatron_rl_testing.verl_oracle import verl_module

SCORERS = textwrap.dedent("""
    import time

    def number_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str == ground_truth else len(solution_str) / 10

    def dict_score(data_source, solution_str, ground_truth, extra_info=None):
        right = solution_str == ground_truth
        return {"score": float(right) - 0.5 * (len(solution_str) % 2), "acc": right, "pred": solution_str[:3]}

    def bare_dict_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5}

    def tuple_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(3600)
        if solution_str == "raise":
            raise RuntimeError("scorer exploded")
        return (1.0 if solution_str == ground_truth else 0.25, {"meta": "ignored"})
""")

PROMPT_LEN = 3
ONE = 5  # the tiny tokenizer's id of "1" (checked in the fixture)


@pytest.fixture(scope="module")
def scorer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dapo") / "dapo_scorers.py"
    path.write_text(SCORERS)
    return path


@pytest.fixture(scope="module")
def tok(tokenizer):
    assert tokenizer("1", add_special_tokens=False)["input_ids"] == [ONE]
    return tokenizer


def dapo_config(
    path: Path,
    name: str = "number_score",
    manager: str = "dapo",
    enable: bool = True,
    buffer_len: int = 4,
    penalty_factor: float = 0.5,
    log: bool = True,
    max_resp_len: int | None = None,
    num_workers: int = 0,
    timeout_s: float = 10.0,
) -> RewardConfig:
    return RewardConfig(
        reward_manager=manager,
        num_workers=num_workers,
        timeout_s=timeout_s,
        custom_reward_function=CustomRewardFunctionConfig(str(path), name),
        reward_kwargs=RewardKwargsConfig(OverlongBufferConfig(enable, buffer_len, penalty_factor, log), max_resp_len),
    )


def rows_batch(rows: list[list[int]], truths: list[str], width: int) -> DataProto:
    """Responses given as token ids, right-padded to ``width``; left-padded prompts of PROMPT_LEN tokens, and
    ``attention_mask`` [B, P+R] over both, as the rollout returns them."""
    b = len(rows)
    responses = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, row in enumerate(rows):
        responses[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    prompt_mask = torch.ones((b, PROMPT_LEN), dtype=torch.long)
    prompt_mask[::2, 0] = 0  # some left padding
    prompts = torch.full((b, PROMPT_LEN), ONE) * prompt_mask
    non_tensor = {
        "data_source": ["synthetic/copy"] * b,
        "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
        "extra_info": [{"index": i} for i in range(b)],
    }
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": mask,
            "attention_mask": torch.cat([prompt_mask, mask], dim=-1),
        },
        non_tensor,
    )


def ones_batch(tokenizer, lengths: list[int], truths: list[str], width: int = 8) -> DataProto:
    """Response i: "1" * (lengths[i] - 1) + eos (lengths[i] tokens; empty for 0)."""
    rows = [[ONE] * (n - 1) + [tokenizer.eos_token_id] if n else [] for n in lengths]
    return rows_batch(rows, truths, width)


# ---------------------------------------------------------------------- the penalty
def test_penalty_is_zero_up_to_the_buffer_then_linear_to_minus_factor():
    penalty = OverlongPenalty(max_resp_len=8, buffer_len=4, penalty_factor=0.5, log=False)
    out = penalty(torch.tensor([0, 3, 4, 5, 6, 7, 8]))
    assert out.dtype == torch.float32
    assert out.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    # the buffer may be the whole response budget
    assert OverlongPenalty(8, 8, 2.0, False)(torch.tensor([0, 4, 8])).tolist() == [0.0, -1.0, -2.0]


def test_dapo_adds_the_penalty_on_the_last_token_and_logs_it(tok, scorer_file):
    # max_resp_len 8 (the response length), buffer 4, factor 0.5: penalties from 5 tokens on
    lengths = [0, 3, 4, 5, 8]
    batch = ones_batch(tok, lengths, ["", "", "111", "", ""])
    out = RewardManager(tok, dapo_config(scorer_file), max_response_length=8)(batch)
    # decoded "", "11", "111", "1111", "1111111": number_score 1.0 (right), 0.2, 1.0 (right), 0.4, 0.7
    score = [1.0, 0.2, 1.0, 0.4, 0.7]
    penalty = [0.0, 0.0, 0.0, -0.125, -0.5]
    assert list(out.non_tensor_batch["score"]) == pytest.approx(score)  # the scorer's score, verl's "score"
    placed = out.batch["token_level_scores"]
    expected = torch.zeros(5, 8)
    expected[0, 0], expected[1, 2], expected[2, 3], expected[3, 4], expected[4, 7] = [
        s + p for s, p in zip(score, penalty)
    ]
    torch.testing.assert_close(placed, expected)
    assert list(out.non_tensor_batch["acc"]) == pytest.approx(score)  # verl's DAPO: a bare number is acc too
    assert list(out.non_tensor_batch["overlong_reward"]) == penalty
    assert list(out.non_tensor_batch["overlong"]) == [False, False, False, True, True]
    metrics = out.meta_info["reward_metrics"]
    assert metrics["reward/overlong_reward/mean"] == pytest.approx(-0.125)
    assert metrics["reward/overlong/mean"] == pytest.approx(0.4)
    assert metrics["reward/score/mean"] == pytest.approx(0.66)
    assert metrics["reward/acc/mean"] == pytest.approx(0.66)


def test_dapo_without_log_or_without_the_buffer(tok, scorer_file):
    batch = ones_batch(tok, [2, 8], ["", ""])
    quiet = RewardManager(tok, dapo_config(scorer_file, log=False), max_response_length=8)(batch)
    assert "overlong_reward" not in quiet.non_tensor_batch and "overlong" not in quiet.non_tensor_batch
    assert "reward/overlong/mean" not in quiet.meta_info["reward_metrics"]
    assert quiet.batch["token_level_scores"].sum(-1).tolist() == pytest.approx([0.1, 0.7 - 0.5])
    off = RewardManager(tok, dapo_config(scorer_file, enable=False), max_response_length=8)(batch)
    assert off.batch["token_level_scores"].sum(-1).tolist() == pytest.approx([0.1, 0.7])
    assert list(off.non_tensor_batch["acc"]) == pytest.approx([0.1, 0.7])
    # the same scorer under naive: no acc (verl's naive manager does not add it)
    naive = RewardManager(tok, dapo_config(scorer_file, manager="naive", enable=False))(batch)
    assert "acc" not in naive.non_tensor_batch


def test_dapo_keeps_a_dict_scorers_extras_and_adds_no_acc(tok, scorer_file):
    batch = ones_batch(tok, [3, 8], ["11", ""])
    out = RewardManager(tok, dapo_config(scorer_file, name="dict_score"), max_response_length=8)(batch)
    assert list(out.non_tensor_batch["acc"]) == [True, False]  # the scorer's own
    assert list(out.non_tensor_batch["pred"]) == ["11", "111"]
    assert out.batch["token_level_scores"].sum(-1).tolist() == pytest.approx([1.0, -0.5 - 0.5])
    only_score = RewardManager(tok, dapo_config(scorer_file, name="bare_dict_score"), max_response_length=8)(batch)
    assert "acc" not in only_score.non_tensor_batch  # a dict, though it holds "score" alone: no acc, as verl


def test_dapo_penalises_a_failed_sample_and_gives_it_no_acc(tok, scorer_file):
    raise_id = tok("raise", add_special_tokens=False)["input_ids"]
    batch = rows_batch([raise_id + [tok.eos_token_id] * 6, [ONE, ONE]], ["x", "11"], 8)  # "raise", "11"
    out = RewardManager(tok, dapo_config(scorer_file, name="tuple_score"), max_response_length=8)(batch)
    # the scorer raised for sample 0 (score 0, an error); its length still costs; sample 1's tuple is an error
    # under dapo (only prime takes a tuple's first item)
    assert out.meta_info["reward_metrics"]["reward/errors"] == 2
    assert "acc" not in out.non_tensor_batch
    n0 = len(raise_id) + 6
    assert out.batch["token_level_scores"].sum(-1).tolist() == pytest.approx([-(n0 - 4) / 4 * 0.5, 0.0])


def test_dapo_counts_the_response_on_attention_mask_tool_tokens_included(tok, scorer_file):
    """Multi-turn: response_mask 0 on a tool observation, attention_mask 1 there; verl counts attention_mask."""
    batch = ones_batch(tok, [7], ["111111"])
    batch.batch["response_mask"][0, 2:4] = 0  # tokens 2, 3 are tool output
    out = RewardManager(tok, dapo_config(scorer_file), max_response_length=8)(batch)
    assert out.non_tensor_batch["overlong_reward"][0] == pytest.approx(-(7 - 4) / 4 * 0.5)


# ---------------------------------------------------------------------- prime
def test_prime_scores_in_workers_with_time_limits_and_reports_acc(tok, scorer_file):
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ("11", "hang", "raise", "3")]
    batch = rows_batch(ids, ["11", "x", "x", "x"], 4)
    # 5 s: a replaced worker's first call also unpickles the scorer (imports) on a loaded machine; "hang"
    # sleeps 3600 s, so it is still cut off only by the limit
    cfg = dapo_config(scorer_file, name="tuple_score", manager="prime", enable=False, num_workers=2,
                      timeout_s=5.0)
    with RewardManager(tok, cfg, max_response_length=4) as manager:
        out = manager(batch)
    # a tuple scores its first item; the hanging and the raising sample score 0 (verl's PRIME: None -> 0.0)
    assert list(out.non_tensor_batch["score"]) == [1.0, 0.0, 0.0, 0.25]
    assert list(out.non_tensor_batch["acc"]) == [1.0, 0.0, 0.0, 0.25]  # verl's data.batch["acc"]
    metrics = out.meta_info["reward_metrics"]
    assert metrics["reward/timeouts"] == 1 and metrics["reward/errors"] == 2
    assert metrics["reward/acc/mean"] == pytest.approx(0.3125)
    assert out.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.0, 0.0, 0.25]


# ---------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "kwargs,response_length,message",
    [
        ({"buffer_len": 0}, 8, r"overlong_buffer_cfg.len must be a positive integer .* got 0"),
        ({"buffer_len": -2}, 8, r"overlong_buffer_cfg.len must be a positive integer .* got -2"),
        ({"buffer_len": 9}, 8, r"overlong_buffer_cfg.len=9 must be <= reward.reward_kwargs.max_resp_len=8"),
        ({"penalty_factor": -0.5}, 8, r"overlong_buffer_cfg.penalty_factor must be >= 0 .* got -0.5"),
        ({"max_resp_len": 6}, 8, r"reward_kwargs.max_resp_len=6 differs from the response length 8"),
        ({}, None, r"enable=true needs reward.reward_kwargs.max_resp_len"),
        ({"manager": "naive"}, 8, r"enable=true is applied by reward.reward_manager=dapo only, but "
         r"reward.reward_manager=naive"),
        ({"manager": "prime", "enable": False}, 8, r"reward_manager=prime .* reward.num_workers=0"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(tok, scorer_file, kwargs, response_length, message):
    with pytest.raises(ValueError, match=message):
        RewardManager(tok, dapo_config(scorer_file, **kwargs), max_response_length=response_length)


def test_an_explicit_max_resp_len_stands_alone():
    cfg = dapo_config(Path("unused.py"), max_resp_len=16, buffer_len=4)
    assert OverlongPenalty.from_config(cfg, None) == OverlongPenalty(16, 4, 0.5, True)
    assert OverlongPenalty.from_config(dapo_config(Path("unused.py"), enable=False), None) is None


def test_batches_without_a_usable_attention_mask_are_named(tok, scorer_file):
    manager = RewardManager(tok, dapo_config(scorer_file), max_response_length=8)
    batch = ones_batch(tok, [2], ["1"])
    narrow = copy.deepcopy(batch)
    narrow.batch["attention_mask"] = narrow.batch["attention_mask"][:, :5]
    with pytest.raises(ValueError, match=r"attention_mask \(1, 5\) must be \[B, P\+R\] for responses \(1, 8\)"):
        manager(narrow)
    batch.pop(batch_keys=["attention_mask"])
    with pytest.raises(ValueError, match=r"missing \['attention_mask'\] for RewardManager \(reward.reward_kwargs"):
        manager(batch)


BASE = [
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=2",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "reward.reward_manager=dapo",
    "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
    "reward.reward_kwargs.overlong_buffer_cfg.len=128",
]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["reward.reward_kwargs.overlong_buffer_cfg.len=0"], r"overlong_buffer_cfg.len must be a positive integer"),
        (["reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=-1"], r"penalty_factor must be >= 0"),
        (["data.max_response_length=100"], r"len=128 must be <= reward.reward_kwargs.max_resp_len=100"),
        # the response length is rollout.response_length when set
        (["actor_rollout_ref.rollout.response_length=64"], r"len=128 must be <= .*max_resp_len=64"),
        (["reward.reward_kwargs.max_resp_len=1024"], r"max_resp_len=1024 differs from the response length 512"),
        (["reward.reward_manager=naive"], r"applied by reward.reward_manager=dapo only"),
        (["reward.reward_manager=prime", "reward.reward_kwargs.overlong_buffer_cfg.enable=false",
          "reward.num_workers=0"], r"reward_manager=prime .* reward.num_workers=0"),
    ],
)
def test_validate_refuses_bad_reward_kwargs_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(overrides=[*BASE, *overrides]))


def test_validate_accepts_verls_dapo_settings():
    validate(load_config(overrides=[*BASE, "reward.reward_kwargs.max_resp_len=512",
                                    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                                    "reward.reward_kwargs.overlong_buffer_cfg.log=true"]))


def test_the_trainer_wiring_builds_the_dapo_manager(tok, scorer_file):
    """megatron_rl/trainer/reward_setup.py: max_resp_len null is the run's response length."""
    cfg = load_config(overrides=[*BASE, "data.max_response_length=8", "reward.reward_kwargs.overlong_buffer_cfg.len=4",
                                 "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
                                 "reward.num_workers=0", f"reward.custom_reward_function.path={scorer_file}",
                                 "reward.custom_reward_function.name=number_score"])
    validate(cfg)
    manager = build_reward_fn(cfg, tok)
    assert isinstance(manager, RewardManager) and manager.kind == "dapo"
    assert manager.overlong == OverlongPenalty(max_resp_len=8, buffer_len=4, penalty_factor=0.5, log=False)
    out = manager(ones_batch(tok, [8], [""]))
    assert out.batch["token_level_scores"].sum(-1).tolist() == pytest.approx([0.7 - 0.5])


# ---------------------------------------------------------------------- verl 0.9.1 as the oracle


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location("dapo_oracle_scorers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _plain(value):
    return value.item() if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("name", ["number_score", "dict_score"])
@pytest.mark.parametrize("enable,log", [(True, True), (True, False), (False, False)])
def test_dapo_equals_verls_dapo_reward_manager(tok, scorer_file, name, enable, log):
    dapo = verl_module("verl.workers.reward_manager.dapo")
    verl_data = verl_module("verl")
    width, buffer_len, factor = 16, 5, 1.5
    rng = np.random.default_rng(0)
    edges = [0, 1, width - buffer_len - 1, width - buffer_len, width - buffer_len + 1, width - 1, width]
    lengths = edges + rng.integers(0, width + 1, size=25).tolist()
    digits = [tok(str(d), add_special_tokens=False)["input_ids"][0] for d in range(10)]
    rows = []
    for n in lengths:
        row = rng.choice(digits, size=n).tolist()
        if n and rng.random() < 0.5:
            row[-1] = tok.eos_token_id  # some finish with eos, some are cut at the budget
        rows.append(row)
    truths = [tok.decode(r, skip_special_tokens=True) if i % 3 == 0 else "7" for i, r in enumerate(rows)]
    ours = rows_batch(rows, truths, width)
    cfg = dapo_config(scorer_file, name=name, enable=enable, buffer_len=buffer_len, penalty_factor=factor, log=log)
    out = RewardManager(tok, cfg, max_response_length=width)(ours)

    theirs = verl_data.DataProto.from_dict(
        {k: ours.batch[k].clone() for k in ("prompts", "responses", "attention_mask")},
        {k: copy.deepcopy(list(v)) for k, v in ours.non_tensor_batch.items()},
    )
    buffer = SimpleNamespace(enable=enable, len=buffer_len, penalty_factor=factor, log=log)
    manager = dapo.DAPORewardManager(tok, num_examine=0, compute_score=_load(scorer_file, name),
                                     max_resp_len=width, overlong_buffer_cfg=buffer)
    expected = manager(theirs, return_dict=True)
    reward, info = expected["reward_tensor"], expected["reward_extra_info"]

    placed = out.batch["token_level_scores"]
    torch.testing.assert_close(placed.sum(-1), reward.sum(-1), rtol=0, atol=0)
    nonempty = [i for i, n in enumerate(lengths) if n]  # verl puts an empty response's reward at -1, we at 0
    torch.testing.assert_close(placed[nonempty], reward[nonempty], rtol=0, atol=0)
    assert set(info) - {"score"} == set(out.non_tensor_batch) - {"score"}
    for key, values in info.items():
        for i, (mine, verls) in enumerate(zip(out.non_tensor_batch[key], values, strict=True)):
            mine, verls = _plain(mine), _plain(verls)
            assert type(mine) is type(verls) or key == "overlong_reward", (key, i, mine, verls)
            assert mine == (pytest.approx(verls, rel=0, abs=1e-7) if isinstance(verls, float) else verls), (key, i)
    metrics = out.meta_info["reward_metrics"]
    for key, values in info.items():  # verl's trainer keeps these per sample; ours also reports their means
        if key != "score" and key != "pred":
            assert metrics[f"reward/{key}/mean"] == pytest.approx(np.mean([float(_plain(v)) for v in values]))
