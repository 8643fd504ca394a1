"""Validation metrics as verl 0.9.1 reports them (mean/std/best/worst/maj@N, val-core vs val-aux), pass@k, the
response length, the validation pass end to end with a stub generator, and the samples it logs.

verl as an oracle (optional, as in tests/algos/conftest.py): its process_validation_metrics, and its trainer's
_val_metrics_update read from verl's source (ray_trainer.py does not import without its whole stack):
  MEGATRON_RL_VERL_PATH=/tmp/verl_src:/tmp/verl_deps pytest tests/trainer/test_validation_metrics.py
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.protocol import DataProto
from megatron_rl.trainer.val_metrics import (
    compute_validation_metrics,
    majority_positions,
    pass_at_k,
    per_source_metrics,
    subset_sizes,
)
from megatron_rl.trainer.validation import check_validation_settings, pick_generations, validate, validation_metrics
from megatron_rl_testing.verl_oracle import verl_module


@pytest.fixture(scope="module")
def verl_metric_utils():
    return verl_module("verl.trainer.ppo.metric_utils")


@pytest.fixture(scope="module")
def verl_val_metrics_update(verl_metric_utils):
    """verl's RayPPOTrainer._val_metrics_update, compiled from its source with the module's globals it uses."""
    source = Path(verl_metric_utils.__file__).with_name("ray_trainer.py").read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "RayPPOTrainer")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_val_metrics_update")
    namespace = {"np": np, "process_validation_metrics": verl_metric_utils.process_validation_metrics}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "ray_trainer.py", "exec"), namespace)
    return lambda sources, uids, infos: namespace["_val_metrics_update"](None, sources, uids, infos, [])


def _random_groups(seed: int, n: int, with_pred: bool, sources=("gsm8k", "math", "synthetic/copy")):
    """Prompts of several data sources with n responses each: reward, acc (0/1 or bool), a numeric extra with
    some None, and pred votes; rows of different prompts interleave as batches do."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(7):
        source = sources[p % len(sources)]
        for _ in range(n):
            correct = bool(rng.random() < 0.4)
            row = {"source": source, "uid": f"{seed}-{p}", "reward": float(rng.normal()),
                   "acc": correct if p % 2 else float(correct), "score": float(rng.integers(-1, 2)),
                   "extra": None if rng.random() < 0.2 else float(rng.random())}
            if with_pred:
                row["pred"] = str(rng.integers(0, 3))
            rows.append(row)
    rng.shuffle(rows)
    keys = ["reward", "acc", "score", "extra"] + (["pred"] if with_pred else [])
    return [r["source"] for r in rows], [r["uid"] for r in rows], {k: [r[k] for r in rows] for k in keys}


# ---------------------------------------------------------------------- verl as the oracle
@pytest.mark.parametrize("n", [1, 2, 5, 8])
@pytest.mark.parametrize("with_pred", [True, False])
def test_same_numbers_and_names_as_verl(verl_metric_utils, verl_val_metrics_update, n, with_pred):
    sources, uids, infos = _random_groups(seed=n * 10 + with_pred, n=n, with_pred=with_pred)
    expected = verl_metric_utils.process_validation_metrics(sources, uids, infos)
    ours = per_source_metrics(sources, uids, infos)
    # every number equal (not approximately: the same draws, the same reductions), pass@k ours only
    stripped = {s: {v: {m: x for m, x in ms.items() if not m.startswith("pass@")} for v, ms in vs.items()}
                for s, vs in ours.items()}
    assert stripped == {s: {v: dict(ms) for v, ms in vs.items()} for s, vs in expected.items()}
    flat = compute_validation_metrics(sources, uids, infos)
    verl_flat = verl_val_metrics_update(np.array(sources, dtype=object), uids, infos)
    assert {k: v for k, v in flat.items() if "/pass@" not in k} == verl_flat
    if n > 1:
        assert any(k.startswith("val-core/") and "/maj@" in k for k in flat) == with_pred
        assert {k for k in flat if "/pass@" in k} == {f"val-aux/{s}/acc/pass@{k}" for s in set(sources)
                                                     for k in subset_sizes(n)}


def test_uneven_groups_and_the_global_generator_as_verl(verl_metric_utils):
    """Prompts with different response counts (names per count, as verl's) and a numeric pred (then a variable
    too). verl reseeds numpy's global generator; ours leaves it alone."""
    sources = ["a"] * 3 + ["a"] * 2 + ["b"] * 4
    uids = ["p"] * 3 + ["q"] * 2 + ["r"] * 4
    infos = {"reward": [1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.0, 1.0, 0.25], "pred": [1, 2, 1, 3, 3, 0, 0, 0, 1]}
    np.random.seed(7)
    before = np.random.random()
    np.random.seed(7)
    ours = per_source_metrics(sources, uids, infos)
    assert np.random.random() == before
    expected = verl_metric_utils.process_validation_metrics(sources, uids, infos)
    assert {s: {v: {m: x for m, x in ms.items() if not m.startswith("pass@")} for v, ms in vs.items()}
            for s, vs in ours.items()} == {s: {v: dict(ms) for v, ms in vs.items()} for s, vs in expected.items()}


# ---------------------------------------------------------------------- hand-checked, always run
def test_one_response_per_prompt_reports_means_with_acc_as_the_core_variable():
    metrics = validation_metrics(["a", "a", "b"], ["p", "q", "r"], {"reward": [1.0, 0.5, 0.0], "acc": [1.0, 0.0, 0.0]},
                                 lengths=[3, 5, 1], n=1)
    assert metrics == pytest.approx({
        "val-core/a/acc/mean@1": 0.5, "val-aux/a/reward/mean@1": 0.75, "val-aux/a/response_length/mean@1": 4.0,
        "val-core/b/acc/mean@1": 0.0, "val-aux/b/reward/mean@1": 0.0, "val-aux/b/response_length/mean@1": 1.0})


def test_reward_is_the_core_variable_without_acc_and_the_sections_follow_verl():
    infos = {"reward": [1.0, 0.0, 0.0, 1.0], "pred": ["x", "y", "x", "x"]}
    metrics = compute_validation_metrics(["s"] * 4, ["p"] * 4, infos)
    core = {k.split("/", 3)[-1] for k in metrics if k.startswith("val-core/")}
    aux = {k.split("/", 3)[-1] for k in metrics if k.startswith("val-aux/")}
    # the largest N's mean, best and maj (their std too: verl matches the prefix), nothing of worst or std@N
    assert core == {"mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std"}
    assert aux == {"std@4", "best@2/mean", "best@2/std", "worst@2/mean", "worst@2/std", "worst@4/mean",
                   "worst@4/std", "maj@2/mean", "maj@2/std"}
    assert metrics["val-core/s/reward/mean@4"] == 0.5 and metrics["val-aux/s/reward/std@4"] == 0.5


def test_bootstrap_values_are_seeded_and_near_their_expectation():
    values = [1.0, 0.0]  # best of 2 draws with replacement is 1 unless both draw the 0: 3/4
    first = per_source_metrics(["s", "s"], ["p", "p"], {"reward": values})["s"]["reward"]
    assert first == per_source_metrics(["s", "s"], ["p", "p"], {"reward": values})["s"]["reward"]
    assert first["best@2/mean"] == pytest.approx(0.75, abs=0.05)
    assert first["worst@2/mean"] == pytest.approx(0.25, abs=0.05)
    same = per_source_metrics(["s"] * 3, ["p"] * 3, {"reward": [2.0] * 3})["s"]["reward"]
    assert same["best@3/mean"] == same["worst@3/mean"] == 2.0 and same["best@3/std"] == 0.0


def test_majority_vote_takes_the_first_response_of_the_most_frequent_pred():
    votes = ["x", "y"]
    # draw y, x, x: x is the majority, first seen at position 1
    assert majority_positions(votes, np.array([[1, 0, 0]])).tolist() == [1]
    # draw x, y, y, x: a tie goes to the vote seen first (x, position 0); y, x, x, y: to y
    assert majority_positions(votes, np.array([[0, 1, 1, 0], [1, 0, 0, 1]])).tolist() == [0, 0]
    # the value reported is that response's: maj over responses whose preds all agree is the first value
    metrics = per_source_metrics(["s"] * 2, ["p"] * 2, {"reward": [1.0, 0.0], "pred": ["a", "a"]})["s"]["reward"]
    assert 0.0 < metrics["maj@2/mean"] < 1.0  # the first of each draw: 1 or 0, by the draw
    unanimous = per_source_metrics(["s"] * 3, ["p"] * 3, {"reward": [1.0, 1.0, 0.0], "pred": ["a", "a", "b"]})
    assert unanimous["s"]["reward"]["maj@3/mean"] > unanimous["s"]["reward"]["mean@3"]


def test_maj_needs_a_pred_for_every_response():
    metrics = per_source_metrics(["s"] * 3, ["p"] * 3, {"reward": [1.0, 0.0, 1.0], "pred": ["a", None, "a"]})
    assert not any(m.startswith("maj@") for m in metrics["s"]["reward"])


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_response(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_per_prompt_averaged_and_correct_means_full_credit():
    # prompt p: 1 of 4 correct; prompt q: 0.5 is partial credit, not correct; bool True counts as 1
    infos = {"reward": [0.0] * 8, "acc": [1.0, 0.0, 0.0, 0.0, 0.5, 0.5, True, False]}
    metrics = compute_validation_metrics(["s"] * 8, ["p"] * 4 + ["q"] * 4, infos)
    assert metrics["val-aux/s/acc/pass@2"] == pytest.approx((0.5 + 0.5) / 2)  # 1 - C(3,2)/C(4,2) each
    assert metrics["val-aux/s/acc/pass@4"] == pytest.approx(1.0)
    assert not any("/reward/pass@" in k for k in metrics)


def test_bad_inputs_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="3 uids for 4 responses"):
        compute_validation_metrics(["s"] * 4, ["p"] * 3, {"reward": [0.0] * 4})
    with pytest.raises(ValueError, match="reward column 'acc' has 2 values for 4 responses"):
        compute_validation_metrics(["s"] * 4, ["p"] * 4, {"reward": [0.0] * 4, "acc": [1.0, 0.0]})
    with pytest.raises(ValueError, match="3 response lengths for 4 responses"):
        validation_metrics(["s"] * 4, ["p"] * 4, {"reward": [0.0] * 4}, lengths=[1, 2, 3], n=4)
    with pytest.raises(ValueError, match="n=3, c=4, k=2"):
        pass_at_k(3, 4, 2)
    with pytest.raises(TypeError, match="'pred' values must be hashable"):
        per_source_metrics(["s"] * 2, ["p"] * 2, {"reward": [1.0, 0.0], "pred": [[1], [2]]})


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.rollout.val_kwargs.n=0", r"val_kwargs.n=0 must be an integer >= 1"),
    ("actor_rollout_ref.rollout.val_kwargs.top_p=0", r"val_kwargs.top_p=0.0 must be in \(0, 1\]"),
    ("actor_rollout_ref.rollout.val_kwargs.top_k=0", r"val_kwargs.top_k=0 must be -1 \(off\) or >= 1"),
    ("actor_rollout_ref.rollout.val_kwargs.temperature=-1", r"val_kwargs.temperature=-1.0 must be a finite"),
    ("trainer.log_val_generations=-2", r"trainer.log_val_generations=-2 must be an integer >= 0"),
])
def test_validation_settings_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        check_validation_settings(load_config(overrides=[override]))


def test_greedy_validation_with_several_responses_warns(caplog):
    check_validation_settings(load_config(overrides=["actor_rollout_ref.rollout.val_kwargs.n=4"]))
    assert "the 4 responses of a prompt are the same" in caplog.text


# ---------------------------------------------------------------------- the validation pass, end to end
P, R = 3, 5


class StubGenerator:
    """Responses of a deterministic length per row; records what each call asked for."""

    def __init__(self, rows_out=None) -> None:
        self.calls: list[DataProto] = []
        self.rows_out = rows_out

    def __call__(self, gen: DataProto) -> DataProto:
        self.calls.append(gen)
        rows = self.rows_out or len(gen)
        lengths = 1 + (torch.arange(rows) * 7 + gen.batch["input_ids"][:rows, -1]) % R
        mask = (torch.arange(R) < lengths[:, None]).long()
        responses = (4 + torch.arange(rows)[:, None] % 3) * mask  # digit tokens of the tiny tokenizer
        prompts = gen.batch["input_ids"][:rows]
        return DataProto.from_dict({"prompts": prompts, "responses": responses, "response_mask": mask,
                                    "input_ids": torch.cat([prompts, responses], 1)})


def stub_reward(full: DataProto) -> DataProto:
    """A dict scorer: score in {-1, 1}, acc (bool), pred (the response's first token as text)."""
    first = full.batch["responses"][:, 0]
    acc = (first % 2 == 0).tolist()
    scores = torch.zeros(len(full), R)
    scores[:, 0] = torch.tensor([1.0 if a else -1.0 for a in acc])
    return DataProto.from_dict({"token_level_scores": scores}, non_tensors={
        "score": np.array(scores[:, 0].tolist(), dtype=object), "acc": np.array(acc, dtype=object),
        "pred": np.array([str(int(t)) for t in first], dtype=object)}, meta_info={"reward_metrics": {"x": 1.0}})


def _val_batches():
    def batch(ids, sources):
        ids = torch.tensor(ids)
        return DataProto.from_single_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                           "position_ids": torch.arange(P).expand_as(ids), "data_source": sources,
                                           "reward_model": [{"ground_truth": "1"}] * len(sources)})
    return lambda: iter([batch([[1, 2, 3], [2, 3, 4]], ["a", "b"]), batch([[3, 4, 5]], ["a"])])


class FakeTracking:
    def __init__(self) -> None:
        self.generations = []

    def log_generations(self, samples, step):
        self.generations.append((step, samples))


def _run(tmp_path, *overrides):
    cfg = load_config(overrides=["actor_rollout_ref.rollout.val_kwargs.n=4",
                                 "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                                 "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
                                 "actor_rollout_ref.rollout.val_kwargs.top_p=0.9",
                                 "actor_rollout_ref.rollout.val_kwargs.top_k=20", *overrides])
    return SimpleNamespace(cfg=cfg, val_batches=_val_batches(), reward_fn=stub_reward,
                           state=SimpleNamespace(global_steps=6))


def test_validate_end_to_end_with_n_4(tmp_path):
    generate = StubGenerator()
    metrics = validate(_run(tmp_path), generate)
    # every prompt went out 4 times, with the val_kwargs, as a validation call
    assert [len(g) for g in generate.calls] == [8, 4]
    meta = generate.calls[0].meta_info
    assert (meta["validate"], meta["do_sample"], meta["temperature"], meta["top_p"], meta["top_k"]) == \
        (True, True, 0.7, 0.9, 20)
    # the same numbers as the metrics of the rows the stubs made, grouped per prompt
    sources, uids, rewards, acc, preds, lengths = [], [], [], [], [], []
    for gen, prefix in zip(generate.calls, ("val-0", "val-1")):
        out = StubGenerator()(gen)
        scored = stub_reward(out)
        sources += [s for s in (["a", "b"] if prefix == "val-0" else ["a"]) for _ in range(4)]
        uids += [f"{prefix}-{i}" for i in range(len(gen) // 4) for _ in range(4)]
        rewards += scored.batch["token_level_scores"].sum(-1).tolist()
        acc += list(scored.non_tensor_batch["acc"])
        preds += list(scored.non_tensor_batch["pred"])
        lengths += out.batch["response_mask"].sum(-1).tolist()
    infos = {"reward": rewards, "score": [float(r) for r in rewards], "acc": acc, "pred": preds}
    assert metrics == validation_metrics(sources, uids, infos, lengths, n=4)
    for key in ("val-core/a/acc/mean@4", "val-core/a/acc/best@4/mean", "val-core/a/acc/maj@4/mean",
                "val-aux/a/reward/mean@4", "val-aux/a/score/worst@2/mean", "val-aux/a/acc/pass@2",
                "val-aux/b/acc/pass@4", "val-aux/b/response_length/mean@4"):
        assert key in metrics, key
    assert not any("/pred/" in k for k in metrics)


def test_a_bare_number_scorer_reports_acc_as_verl_does(tmp_path):
    run = _run(tmp_path)
    run.reward_fn = lambda full: stub_reward(full).select(["token_level_scores"], ["score"], [])
    metrics = validate(run, StubGenerator())
    assert "val-core/a/acc/mean@4" in metrics and not any("/score/" in k for k in metrics)
    assert metrics["val-core/a/acc/mean@4"] == metrics["val-aux/a/reward/mean@4"]


def test_a_rollout_returning_the_wrong_row_count_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"validation batch 0: the rollout returned 7 responses for 2 prompts x "
                                         r"actor_rollout_ref.rollout.val_kwargs.n=4"):
        validate(_run(tmp_path), StubGenerator(rows_out=7))


def test_log_val_generations_logs_verls_pick_of_samples(tmp_path):
    from megatron_rl.data.tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path / "tok", ["0123456789 abc"])
    run = _run(tmp_path, "trainer.log_val_generations=3", f"data.tokenizer={tmp_path / 'tok'}")
    tracking = FakeTracking()
    metrics = validate(run, StubGenerator(), tracking)
    [(step, samples)] = tracking.generations
    assert step == 6 and len(samples) == 3
    assert all(isinstance(i, str) and isinstance(o, str) and s in (1.0, -1.0) for i, o, s in samples)
    assert metrics  # the metrics are unchanged by logging samples
    # nothing is decoded or logged without a tracking (ranks that do not log) or with 0
    assert validate(_run(tmp_path, "trainer.log_val_generations=3", "data.tokenizer=/nowhere"), StubGenerator())


def test_pick_generations_sorts_by_input_then_shuffles_with_seed_42():
    inputs = [f"q{i}" for i in (3, 1, 2, 0)]
    samples = pick_generations(inputs, ["o3", "o1", "o2", "o0"], [3.0, 1.0, 2.0, 0.0], 2)
    order = sorted(zip(inputs, ["o3", "o1", "o2", "o0"], [3.0, 1.0, 2.0, 0.0]))
    np.random.RandomState(42).shuffle(order)
    assert samples == order[:2]
    with pytest.raises(ValueError, match="2 inputs, 1 outputs, 2 scores"):
        pick_generations(["a", "b"], ["x"], [1.0, 2.0], 1)
