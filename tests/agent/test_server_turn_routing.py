"""Multi-turn with rollout servers and routing replay R3: agent/turns.py's ``generate_turns`` over the servers'
client (servers/client.py, an in-process HF-engine server with --enable-return-routed-experts) keeps each turn's
routing of its context and tokens, as with the colocated engines."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import torch

from megatron_rl.agent.turns import generate_turns
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.routed_experts import RouterCapture
from megatron_rl.servers.client import ServerRolloutClient
from megatron_rl.servers.hf_server import HFServerApp, _handler
from megatron_rl_testing.rollout_models import PAD, VOCAB, make_engine, source_model
from megatron_rl_testing.tiny_models import tiny_hf_config


def test_each_turn_keeps_the_servers_routing_of_its_context_and_tokens():
    config = tiny_hf_config("qwen3_moe", vocab_size=VOCAB, eos_token_id=2, pad_token_id=PAD, bos_token_id=1)
    app = HFServerApp(make_engine(config=config, weights_seed=100, enable_rollout_routing_replay=True), chunk_tokens=2)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(app))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = ServerRolloutClient(RolloutConfig(enable_rollout_routing_replay=True, temperature=0.0),
                                 [f"http://127.0.0.1:{server.server_address[1]}"], response_length=5,
                                 eos_token_id=[10_000], pad_token_id=PAD, timeout_s=60, routing_shape=(2, 2))
    try:
        contexts = [[5, 6, 7], [8, 9, 10, 11, 12]]
        turns = generate_turns(client.generate_sequences, contexts, [5, 3], {"temperature": 0.0}, PAD)
    finally:
        client.close()
        server.shutdown()
    model = source_model(100, config)
    capture = RouterCapture(model)
    for context, turn in zip(contexts, turns):
        full = torch.tensor([context + turn.tokens[:-1]])
        with torch.no_grad():
            model(input_ids=full)
        expected = capture.take(full.shape)[0]
        assert turn.routed.shape == (len(context) + len(turn.tokens), 2, 2)
        assert torch.equal(turn.routed[:-1], expected) and (turn.routed[-1] == -1).all()
