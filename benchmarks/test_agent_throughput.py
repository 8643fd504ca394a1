"""Agentic rollouts (issue 54, "Measure"): the OpenAI-compatible agent proxy's cost per request, and
multi-turn samples/s of the fully async trainer against the synchronous one.

1. Proxy overhead per request (``test_proxy_overhead_per_request``). One agent at a time, written with the
   ``openai`` client, talks to ``AgentProxy`` (agent/proxy.py): each session sends ``PROXY_TURNS`` requests,
   the engine answers each with a calculator tool call and the agent sends the product back as a tool message,
   so every request takes the whole path (client -> HTTP -> chat template + tokenize + history check -> the
   engine's thread -> decode + tool-call parse -> JSON -> client). The engine is a scripted one with a fixed
   ``MRL_PROXY_ENGINE_MS`` sleep per call. Reference, in the same run: the same contexts sent straight to the
   same engine through ``generate_turns`` (the agent loop's own path for a model turn, no HTTP). Reported: the
   median request seen by the agent, the median engine call inside it, the median paired overhead (request -
   its engine call), the direct turn, and request / direct; at the proxy's default ``batch_window_s`` (0.02:
   the engine's thread waits 20 ms for other agents' requests to join the call) and at 0 (no batching wait).

2. Multi-turn samples/s, fully async vs synchronous (``test_multi_turn_fully_async_vs_sync``). The
   tool_multiply task (calculator tool, up to 3 model turns a sample; the random tiny model's turns end at
   stop tokens and hold no valid call, so the observations are the tool agent's nudges) trained with
   GRPO on one Megatron rank and one HF-engine rollout server in its own process,
   the agent loop on the driver over the server's client; the synchronous trainer, fully async with
   partial rollouts (``buffer_batches=1 max_staleness=1``: the one-step-off bound), then synchronous again
   (the load drifts: the reference is the mean of the two), the same data and seeds. samples/s = samples /
   the wall clock between step ends (steady state). The trainer and the server share the machine's 2 cores,
   so the measured ratio is the same-machine one. The separate-device case is modelled as
   benchmarks/test_async.py did: from the synchronous runs' steady-state phases, rollout = ``timing_s/gen``
   and training = step - gen (old log-probs, update, weight sync, reward), synchronous samples/s = samples /
   (rollout + training), fully async on its own devices = samples / max(rollout, training).

    pytest benchmarks/test_agent_throughput.py -s                 # ~2-3 min on 2 cores
    pytest benchmarks/test_agent_throughput.py -s -k proxy        # the proxy alone, ~20 s
    MRL_AGENT_STEPS=10 MRL_PROXY_SESSIONS=60 pytest benchmarks/test_agent_throughput.py -s

Timings on a shared machine are noisy; each ratio is paired within one run of this file."""
from __future__ import annotations

import json
import os
import statistics
import threading
import time

import numpy as np
import pytest

from megatron_rl.agent.proxy import AgentProxy
from megatron_rl.agent.turns import generate_turns
from megatron_rl.protocol import DataProto
from megatron_rl_testing.agent_support import CALL, tiny_tokenizer

PROXY_SESSIONS = int(os.environ.get("MRL_PROXY_SESSIONS", "40"))
PROXY_TURNS = 5  # requests per session: each answered with a tool call, the product sent back
ENGINE_MS = float(os.environ.get("MRL_PROXY_ENGINE_MS", "10"))
WINDOWS = (0.02, 0.0)  # the proxy's default batch window, and none

AGENT_STEPS = int(os.environ.get("MRL_AGENT_STEPS", "6"))
AGENT_WARMUP = 2  # first steps: allocations, first collectives, fully async's first batch generated inline
AGENT_PROMPTS, AGENT_N = 8, 4  # 32 multi-turn samples a step


# ------------------------------------------------------------------------------------------------ 1. proxy
class SleepingEngine:
    """``generate_sequences``: every row answered with the calculator call + eos after ``ENGINE_MS`` of sleep
    (the same work every call, so the proxy's and the direct path's engine calls cost alike); records each
    call's duration and its first row's context and the call's response length."""

    def __init__(self, tokenizer) -> None:
        self.reply = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.pad = tokenizer.pad_token_id
        self.seconds: list[float] = []
        self.contexts: list[tuple[list[int], int]] = []

    def __call__(self, data: DataProto) -> DataProto:
        import torch

        start = time.perf_counter()
        time.sleep(ENGINE_MS / 1000)
        length = int(data.meta_info["response_length"])
        rows = data.batch["input_ids"].shape[0]
        toks = self.reply[:length]
        out = torch.full((rows, length), self.pad, dtype=torch.long)
        out[:, :len(toks)] = torch.as_tensor(toks)
        mask = torch.zeros((rows, length), dtype=torch.long)
        mask[:, :len(toks)] = 1
        result = DataProto.from_dict(
            {"responses": out, "response_mask": mask, "rollout_log_probs": mask * -0.5},
            meta_info={"weight_version": 0})
        first = data.batch["input_ids"][0][data.batch["attention_mask"][0].bool()].tolist()
        self.contexts.append((first, length))
        self.seconds.append(time.perf_counter() - start)
        return result


def _agent(proxy: AgentProxy, session_ids: list[str], request_s: list[float]) -> None:
    """One agent after the other, each ``PROXY_TURNS`` requests; the product of each tool call sent back."""
    import openai

    for session_id in session_ids:
        client = openai.OpenAI(base_url=proxy.base_url(session_id), api_key=proxy.api_key, max_retries=0)
        messages = [{"role": "user", "content": "What is 123456 * 654321? Use the calculator tool."}]
        for _ in range(PROXY_TURNS):
            start = time.perf_counter()
            reply = client.chat.completions.create(model=proxy.model_name, messages=messages)
            request_s.append(time.perf_counter() - start)
            message = reply.choices[0].message.model_dump(exclude_none=True)
            assert message.get("tool_calls"), message
            messages.append(message)
            for call in message["tool_calls"]:
                a, b = (int(x) for x in json.loads(call["function"]["arguments"])["expression"].split("*"))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(a * b)})
        client.close()


def _proxy_run(tok, window: float) -> dict[str, float]:
    engine = SleepingEngine(tok)
    request_s: list[float] = []
    with AgentProxy(tok, budget=2048, finish_token_ids={tok.eos_token_id}, api_key="bench-secret",
                    batch_window_s=window) as proxy:
        ids = [f"bench-{window:g}-{k}" for k in range(PROXY_SESSIONS + 2)]
        for session_id in ids:
            proxy.open_session(session_id)
        agent = threading.Thread(target=_agent, args=(proxy, ids, request_s))
        agent.start()
        proxy.serve(engine, {"temperature": 1.0}, until=lambda: not agent.is_alive())
        agent.join()
    assert len(request_s) == len(engine.seconds) == (PROXY_SESSIONS + 2) * PROXY_TURNS  # one engine call each
    skip = 2 * PROXY_TURNS  # the first two sessions: connection set-up, first template render, imports
    proxied, engine_s = request_s[skip:], engine.seconds[skip:]
    # the reference: the same contexts, straight into the same engine through the agent loop's turn function
    contexts = engine.contexts[skip:]
    engine.seconds.clear()
    direct = []
    for context, room in contexts:
        start = time.perf_counter()
        generate_turns(engine, [context], [room], {"temperature": 1.0}, tok.pad_token_id)
        direct.append(time.perf_counter() - start)
    med = statistics.median
    return {"requests": len(proxied), "request_ms": 1e3 * med(proxied), "engine_ms": 1e3 * med(engine_s),
            "overhead_ms": 1e3 * med([r - e for r, e in zip(proxied, engine_s)]),
            "overhead_p90_ms": 1e3 * float(np.percentile([r - e for r, e in zip(proxied, engine_s)], 90)),
            "direct_ms": 1e3 * med(direct), "direct_engine_ms": 1e3 * med(engine.seconds),
            "ratio": med(proxied) / med(direct)}


def test_proxy_overhead_per_request(benchmark, tmp_path):
    tok = tiny_tokenizer(tmp_path)
    results: dict[float, dict[str, float]] = {}

    def both():
        for window in WINDOWS:
            results[window] = _proxy_run(tok, window)

    benchmark.pedantic(both, rounds=1, iterations=1)
    print(f"\nproxy: {PROXY_SESSIONS} sessions x {PROXY_TURNS} requests (one agent at a time, tool call "
          f"each), engine {ENGINE_MS:g} ms a call; medians:")
    for window, r in results.items():
        print(f"  batch_window_s={window:<5g} request {r['request_ms']:6.2f} ms (engine "
              f"{r['engine_ms']:5.2f}) overhead {r['overhead_ms']:6.2f} ms "
              f"(p90 {r['overhead_p90_ms']:6.2f})  "
              f"direct turn {r['direct_ms']:5.2f} ms (engine {r['direct_engine_ms']:5.2f})  request / direct "
              f"{r['ratio']:.2f}x")
        benchmark.extra_info.update({f"window{window:g}/{k}": v for k, v in r.items()})
    print(json.dumps({f"{w:g}": r for w, r in results.items()}))
    # every request carries the window the engine's thread waits for other agents' requests
    assert results[0.02]["overhead_ms"] > results[0.0]["overhead_ms"]
    assert all(r["direct_ms"] >= ENGINE_MS for r in results.values())


# ---------------------------------------------------------------------------------------------- 2. trainer
STOPS = list(range(40, 52))  # 12 of 200 tokens: the random model's turns end after ~15 tokens
MULTI_TURN = [
    "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    "data.max_prompt_length=192", "data.max_response_length=96", f"data.train_batch_size={AGENT_PROMPTS}",
    f"actor_rollout_ref.rollout.n={AGENT_N}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={AGENT_PROMPTS // 2}",
    f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={AGENT_PROMPTS * AGENT_N // 2}",
    f"actor_rollout_ref.rollout.stop_token_ids={STOPS}",
    "actor_rollout_ref.rollout.multi_turn.enable=true",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    "actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_servers=1",
    "actor_rollout_ref.rollout.weight_sync.verify_freq=0",  # fully async's partial rollouts cannot run it
    "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
]
AGENT_LAYOUTS = {
    "sync": [],
    # one batch ahead, partial rollouts (a sync pauses the server mid-turn): the one-step-off bound
    "fully_async": ["async_training.mode=fully_async", "async_training.max_staleness=1",
                    "async_training.buffer_batches=1"],
}
# the synchronous run first and last: the machine's load drifts, the reference is the mean of the two
AGENT_ORDER = os.environ.get("MRL_AGENT_LAYOUTS", "sync,fully_async,sync").split(",")


def _train(name: str, layout: str, assets: dict, out, monkeypatch) -> dict[str, float]:
    from megatron_rl.config import load_config
    from megatron_rl.train import run
    from megatron_rl.trainer import loop
    from megatron_rl.trainer.tracking import read_metrics

    # the wall clock at the end of each step: the period between two is what a step costs, whatever the
    # trainer overlaps (fully async's timing_s/step leaves out its wait for the rollouter's batch)
    ends: list[float] = []
    end_step = loop.end_step

    def timed_end_step(*args, **kwargs):
        result = end_step(*args, **kwargs)
        ends.append(time.perf_counter())
        return result

    monkeypatch.setattr(loop, "end_step", timed_end_step)
    cfg = load_config(overrides=[
        "+experiment=grpo_tiny_cpu", f"data.train_files=[{assets['train']}]",
        f"actor_rollout_ref.model.path={assets['model']}", *MULTI_TURN,
        f"trainer.default_local_dir={out / name}",
        f"trainer.total_training_steps={AGENT_STEPS}", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.logger=[jsonl]", "trainer.save_hf_at_end=false", *AGENT_LAYOUTS[layout],
    ])
    start = time.perf_counter()
    result = run(cfg)
    wall = time.perf_counter() - start
    monkeypatch.setattr(loop, "end_step", end_step)
    records = read_metrics(result.metrics_path)
    assert len(records) == len(ends) == AGENT_STEPS
    steady = records[AGENT_WARMUP:]
    mean = lambda key: float(np.mean([r.get(key, 0.0) for r in steady]))  # noqa: E731
    period = (ends[-1] - ends[AGENT_WARMUP - 1]) / (AGENT_STEPS - AGENT_WARMUP)
    samples = AGENT_PROMPTS * AGENT_N
    gen = mean("timing_s/gen")  # synchronous: the rollout; fully async: the wait for the rollouter's batch
    # timing_s/step: synchronous, rollout + the rest; fully async, the rest only (the wait is taken before it)
    train = mean("timing_s/step") - (gen if layout == "sync" else 0.0)
    return {"period_s": period, "samples_per_s": samples / period, "gen_s": gen, "train_s": train,
            "old_log_prob_s": mean("timing_s/old_log_prob"), "update_s": mean("timing_s/update_actor"),
            "sync_weights_s": mean("timing_s/sync_weights"), "wall_s": wall,
            "num_turns_mean": mean("num_turns/mean"), "tool_calls_mean": mean("tool_call_counts/mean"),
            "turn_length_mean": mean("turn_response_length/mean"), "score_mean": mean("critic/score/mean"),
            "staleness_max": float(max(r.get("async/staleness_max", 0.0) for r in records)),
            "partial_samples": float(sum(r.get("async/partial_samples", 0.0) for r in records))}


def test_multi_turn_fully_async_vs_sync(benchmark, tmp_path, monkeypatch):
    from megatron_rl.demo import prepare_assets

    train, _val, model = prepare_assets(tmp_path / "assets", task="tool_multiply", n_train=64, n_val=8,
                                        tokenizer_kwargs={"vocab_size": 200}, max_positions=512)
    assets = {"train": train, "model": model}
    runs: list[tuple[str, dict[str, float]]] = []

    def all_layouts():
        for k, name in enumerate(AGENT_ORDER):
            runs.append((name, _train(f"{k}_{name}", name, assets, tmp_path, monkeypatch)))

    benchmark.pedantic(all_layouts, rounds=1, iterations=1)
    samples = AGENT_PROMPTS * AGENT_N
    sync = [r for n, r in runs if n == "sync"]
    base = float(np.mean([r["samples_per_s"] for r in sync]))
    gen, train = float(np.mean([r["gen_s"] for r in sync])), float(np.mean([r["train_s"] for r in sync]))
    modelled_sync, modelled_async = samples / (gen + train), samples / max(gen, train)
    print(f"\nmulti-turn tool_multiply, {AGENT_PROMPTS} prompts x {AGENT_N} = {samples} samples a step, "
          f"{AGENT_STEPS} steps, steady state from step {AGENT_WARMUP + 1} (wall clock between step ends):")
    for name, r in runs:
        print(f"  {name:12s} {r['samples_per_s']:6.1f} samples/s ({r['samples_per_s'] / base:.2f}x)  period "
              f"{r['period_s']:.3f} s: gen{' wait' if name != 'sync' else ''} {r['gen_s']:.3f} + rest "
              f"{r['train_s']:.3f} (old log-prob {r['old_log_prob_s']:.3f}, update {r['update_s']:.3f}, sync "
              f"{r['sync_weights_s']:.3f})  turns {r['num_turns_mean']:.2f}  tool calls "
              f"{r['tool_calls_mean']:.2f}  turn length {r['turn_length_mean']:.1f}  staleness max "
              f"{r['staleness_max']:.0f}  partial {r['partial_samples']:.0f}  wall {r['wall_s']:.0f} s")
    print(f"  modelled from the synchronous runs' phases (rollout {gen:.3f} s, training {train:.3f} s): "
          f"synchronous {modelled_sync:.1f} samples/s, fully async on separate devices "
          f"{modelled_async:.1f} samples/s ({modelled_async / modelled_sync:.2f}x)")
    measured = float(np.mean([r["samples_per_s"] for n, r in runs if n == "fully_async"]))
    print(f"  measured on this machine: fully async / synchronous {measured / base:.2f}x")
    benchmark.extra_info.update({f"{k}_{n}/{key}": v for k, (n, r) in enumerate(runs)
                                 for key, v in r.items()})
    benchmark.extra_info.update({"modelled_ratio": modelled_async / modelled_sync,
                                 "measured_ratio": measured / base})
    print(json.dumps({"runs": runs, "modelled_ratio": modelled_async / modelled_sync,
                      "measured_ratio": measured / base}))
    assert all(r["num_turns_mean"] > 3 for _, r in runs)  # multi-turn: prompt + model turns + observations
    assert all(r["staleness_max"] == 0 for r in sync)
    assert all(r["staleness_max"] <= 1 for n, r in runs if n == "fully_async")
