"""Streaming rollouts (fully async's rollouter with room for two batches) against one batch at a time (room for
one: the rollout of a synchronous or one-step-off loop) on two HF-engine rollout servers in their own processes,
one torch thread each, with no trainer beside them: the same batches, prompts and seeds. A tenth of the
vocabulary ends a response, so response lengths spread widely, a server's part of a batch lasts as long as its
longest response, and the two parts of a batch differ. One batch at a time, the server done first waits for the
other at every batch boundary; streaming lets it go on with its part of the next batch. Reported: batches/s of
each and their ratio, the layouts alternating round by round (paired on a shared machine).

    pytest benchmarks/test_streaming.py -s
    MRL_STREAM_BATCHES=24 MRL_STREAM_ROUNDS=3 MRL_STREAM_SIZE=demo pytest benchmarks/test_streaming.py -s
"""
from __future__ import annotations

import json
import multiprocessing
import os
import time

import numpy as np
import torch

from bench_sizes import SIZES, model_dir
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.demo import prepare_assets
from megatron_rl.protocol import DataProto
from megatron_rl.servers.client import ServerRolloutClient
from megatron_rl.trainer.fully_async import Rollouter

BATCHES = int(os.environ.get("MRL_STREAM_BATCHES", "16"))
ROUNDS = int(os.environ.get("MRL_STREAM_ROUNDS", "2"))
SIZE = os.environ.get("MRL_STREAM_SIZE", "30M")  # bench_sizes.py: the model's shape
ROWS, PROMPT, RESPONSE = 16, 8, 48  # rows per batch (8 per server), prompt and response lengths


def _serve(model: str, ports: multiprocessing.Queue) -> None:
    """A server process holding the model's checkpoint weights (the pool's servers start unsynced, and a sync
    needs a trainer's update group: not what this measures)."""
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.servers.hf_server import HFServerApp, _handler, ThreadingHTTPServer

    torch.set_num_threads(1)
    engine = HFEngine(RolloutConfig(name="hf", response_length=1), model, weights_path=model, device="cpu")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(HFServerApp(engine, chunk_tokens=8)))
    server.daemon_threads = True
    ports.put(server.server_address[1])
    server.serve_forever()


def _batches(vocab: int) -> list[DataProto]:
    out = []
    for i in range(BATCHES):
        ids = torch.randint(3, vocab, (ROWS, PROMPT), generator=torch.Generator().manual_seed(i))
        mask = torch.ones_like(ids)
        out.append(DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1},
                                       meta_info={"do_sample": True, "seed": 1000 + i}))
    return out


def _seconds(client: ServerRolloutClient, batches: list[DataProto], capacity: int) -> tuple[float, list[int]]:
    """Wall time until the last batch is taken (taken at once, as by a trainer that is never the bottleneck)."""
    claims = iter(batches)
    rollouter = Rollouter(lambda: next(claims, None), client.generate_sequences, capacity=capacity, ready=[])
    start = time.perf_counter()
    rollouter.start()
    lengths = []
    try:
        while (rolled := rollouter.take()) is not None:
            lengths += rolled.batch["response_mask"].sum(-1).tolist()
    finally:
        rollouter.stop()
    return time.perf_counter() - start, lengths


def test_streaming_against_one_batch_at_a_time(benchmark, tmp_path):
    _train, _val, assets_model = prepare_assets(tmp_path / "assets")
    model = model_dir(assets_model, SIZES[SIZE]["model"], tmp_path / "model")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    batches = _batches(vocab)
    spawn = multiprocessing.get_context("spawn")
    ports = spawn.Queue()
    servers = [spawn.Process(target=_serve, args=(str(model), ports), daemon=True) for _ in range(2)]
    for server in servers:
        server.start()
    urls = [f"http://127.0.0.1:{ports.get(timeout=300)}" for _ in servers]
    client = ServerRolloutClient(RolloutConfig(temperature=1.0), urls, response_length=RESPONSE,
                                 eos_token_id=list(range(3, 3 + vocab // 10)), pad_token_id=0, timeout_s=600)
    seconds: dict[str, list[float]] = {"one_at_a_time": [], "streaming": []}
    try:
        client.generate_sequences(batches[0])  # warm both servers
        runs = {}

        def rounds():
            for _ in range(ROUNDS):
                for name, capacity in (("one_at_a_time", 1), ("streaming", 2)):
                    s, runs[name] = _seconds(client, batches, capacity)
                    seconds[name].append(s)

        benchmark.pedantic(rounds, rounds=1, iterations=1)
    finally:
        client.close()
        for server in servers:
            server.kill()
    assert runs["one_at_a_time"] == runs["streaming"]  # the same responses, whatever generates beside them
    rate = {name: BATCHES / float(np.median(s)) for name, s in seconds.items()}
    lengths = np.asarray(runs["streaming"])
    print(f"\n{SIZE}: {BATCHES} batches of {ROWS} rows on 2 servers, response lengths mean {lengths.mean():.1f} "
          f"(p10 {np.percentile(lengths, 10):.0f}, p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()}); "
          + "; ".join(f"{name} {rate[name]:.2f} batches/s (runs {', '.join(f'{s:.1f}' for s in seconds[name])} s)"
                      for name in seconds)
          + f" -> streaming / one at a time = {rate['streaming'] / rate['one_at_a_time']:.2f}x")
    benchmark.extra_info.update({f"{name}/batches_per_s": r for name, r in rate.items()})
    benchmark.extra_info["streaming_over_one_at_a_time"] = rate["streaming"] / rate["one_at_a_time"]
