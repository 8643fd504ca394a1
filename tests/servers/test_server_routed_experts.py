"""Routing replay R3 with rollout servers: servers/hf_server.py answers SGLang's ``return_routed_experts`` (base64
int32 [prompt + output - 1, layers, top-k]) when started with ``--enable-return-routed-experts``, and
servers/client.py puts each row's routing (that of the request that finished it) at its row of
``batch['routed_experts']``, as the colocated engines do. A tiny Qwen3-MoE, one in-process server over real HTTP,
greedy; an engine hook holds the first chunk until the server is paused (mode abort), so every response is
resumed mid-way. Servers without the flag are refused by name. With server processes: the pool starts them with
the flag, the synchronous server-mode engine places their routing, and rows moved off a killed server keep theirs."""

from __future__ import annotations

import base64
import threading
import time
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.rollout.routed_experts import RouterCapture, decode_sglang_routing
from megatron_rl.rollout.sglang.contract import SGLangServerError
from megatron_rl.rollout.sglang.server_transport import ServerHTTP, ServerTransport
from megatron_rl.servers.client import ServerRolloutClient
from megatron_rl.servers.hf_server import BadRequest, HFServerApp, _handler
from megatron_rl_testing.rollout_models import PAD, VOCAB, make_engine, prompt_batch, source_model
from megatron_rl_testing.tiny_models import tiny_hf_config

CHUNK, LENGTH = 2, 6
LAYERS, TOPK = 2, 2


@pytest.fixture(scope="module")
def moe_config():
    return tiny_hf_config("qwen3_moe", vocab_size=VOCAB, eos_token_id=2, pad_token_id=PAD, bos_token_id=1)


class HeldAfterFirstChunk:
    """The engine, except that (with ``hold``) its first call returns only once the server is paused."""

    def __init__(self, engine, app_ref: list) -> None:
        self._engine, self._app_ref, self.calls, self.hold = engine, app_ref, 0, True
        self.first_chunk_done = threading.Event()

    def generate_sequences(self, prompts):
        out = self._engine.generate_sequences(prompts)
        self.calls += 1
        if self.calls == 1 and self.hold:
            self.first_chunk_done.set()
            app = self._app_ref[0]
            with app.state:
                assert app.state.wait_for(lambda: app.paused, timeout=30), "the test never paused the server"
        return out

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _serve(app: HFServerApp):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(app))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _client(url: str, **rollout) -> ServerRolloutClient:
    # a stop token the tiny vocabulary never reaches keeps every response at LENGTH tokens
    return ServerRolloutClient(RolloutConfig(enable_rollout_routing_replay=True, **rollout), [url],
                               response_length=LENGTH, eos_token_id=[10_000], pad_token_id=PAD, timeout_s=60,
                               routing_shape=(LAYERS, TOPK))


@pytest.fixture
def served(moe_config):
    app_ref: list = []
    engine = HeldAfterFirstChunk(make_engine(config=moe_config, weights_seed=100, enable_rollout_routing_replay=True),
                                 app_ref)
    app = HFServerApp(engine, chunk_tokens=CHUNK)
    app_ref.append(app)
    server, url = _serve(app)
    client = _client(url, temperature=0.0)
    yield app, engine, client
    client.close()
    server.shutdown()


def _generate_across_a_pause(app, engine, client, prompts, swap_to=None):
    """The client's batch, paused (abort) after the first chunk, resumed (with new weights: ``swap_to``)."""
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", client.generate_sequences(prompts)))
    worker.start()
    assert engine.first_chunk_done.wait(60)
    client.pause_generation()  # the in-flight request comes back partial; its rows are resent as prompt + tokens
    if swap_to is not None:
        app.handle("POST", "/begin_weight_update", {})
        with app.lock, app.control():
            app.load_tensors(swap_to.state_dict().items(), weight_version=1)
        app.handle("POST", "/end_weight_update", {})
    client.continue_generation()
    worker.join(60)
    assert engine.calls > 1
    return result["out"]


def test_resumed_rows_routing_equals_the_colocated_engines(served, moe_config):
    """Same weights, greedy: the server's routing (the resumed request's re-prefill) is the colocated HF engine's
    for the same request, element for element ([B, P + R, L, k], -1 on padding and on the last token)."""
    app, engine, client = served
    prompts = prompt_batch([3, 5], temperature=0.0)
    out = _generate_across_a_pause(app, engine, client, prompts)
    colocated = make_engine(response_length=LENGTH, config=moe_config, weights_seed=100,
                            enable_rollout_routing_replay=True, temperature=0.0)
    expected = colocated.generate_sequences(prompt_batch([3, 5], temperature=0.0, eos_token_id=[10_000]))
    assert torch.equal(out.batch["responses"], expected.batch["responses"])
    routed = out.batch["routed_experts"]
    assert routed.dtype == torch.int16 and routed.shape == (2, 5 + LENGTH, LAYERS, TOPK)
    assert torch.equal(routed, expected.batch["routed_experts"])
    real = out.batch["attention_mask"].bool()
    assert (routed[real] >= 0).all(-1).all(-1).sum() == real.sum() - 2  # every computed token routed, the last ones not


def test_a_row_resumed_under_new_weights_keeps_the_finishing_requests_routing(served, moe_config):
    """Across a weight swap the row's routing is the request that finished it: its re-prefill of the whole row
    under the new weights (what the later tokens attended over), not the first request's under the old ones."""
    app, engine, client = served
    new = source_model(200, moe_config)
    out = _generate_across_a_pause(app, engine, client, prompt_batch([4], temperature=0.0), swap_to=new)
    assert out.non_tensor_batch["token_weight_versions"][0].tolist() == [0] * CHUNK + [1] * (LENGTH - CHUNK)
    tokens = out.batch["input_ids"][0][out.batch["attention_mask"][0].bool()]
    routed = out.batch["routed_experts"][0][out.batch["attention_mask"][0].bool()]

    def routing(model):
        capture = RouterCapture(model)
        with torch.no_grad():
            model(input_ids=tokens[None, :-1])
        return capture.take((1, len(tokens) - 1))[0]

    assert torch.equal(routed[:-1], routing(new)) and (routed[-1] == -1).all()
    assert not torch.equal(routed[:-1], routing(source_model(100, moe_config)))


def test_the_payload_is_sglangs_encoding(moe_config):
    """meta_info.routed_experts: base64 of C-order little-endian int32 [prompt + output - 1, L, k]."""
    app = HFServerApp(make_engine(config=moe_config, weights_seed=100, enable_rollout_routing_replay=True),
                      chunk_tokens=CHUNK)
    body = {"input_ids": [[5, 6, 7]], "return_logprob": True, "return_routed_experts": True,
            "sampling_params": [{"max_new_tokens": 5, "stop_token_ids": [10_000], "temperature": 0.0}]}
    [result] = app.handle("POST", "/generate", body)
    raw = base64.b64decode(result["meta_info"]["routed_experts"])
    array = np.frombuffer(raw, dtype="<i4").reshape(-1, LAYERS, TOPK)
    assert array.shape[0] == 3 + 5 - 1 and ((array >= 0) & (array < 4)).all()
    np.testing.assert_array_equal(array, decode_sglang_routing(result["meta_info"]["routed_experts"], LAYERS, TOPK, "t"))
    assert "routed_experts" not in app.handle("POST", "/generate", {**body, "return_routed_experts": False})[0]["meta_info"]
    assert app.handle("GET", "/server_info", None)["enable_return_routed_experts"] is True


def test_routing_asked_of_a_server_without_capture_is_refused(moe_config):
    """A server started without --enable-return-routed-experts: /generate with return_routed_experts is a 400
    naming the field and the flag; the client and the sync transport refuse such servers before generating."""
    app = HFServerApp(make_engine(config=moe_config, weights_seed=100), chunk_tokens=CHUNK)
    body = {"input_ids": [[5, 6, 7]], "return_logprob": True, "return_routed_experts": True,
            "sampling_params": [{"max_new_tokens": 2, "stop_token_ids": [10_000]}]}
    with pytest.raises(BadRequest, match="return_routed_experts=true, but this server does not capture its "
                                         "routing: start it with --enable-return-routed-experts"):
        app.handle("POST", "/generate", body)
    assert app.handle("GET", "/server_info", None)["enable_return_routed_experts"] is False
    server, url = _serve(app)
    try:
        with pytest.raises(SGLangServerError, match="400.*--enable-return-routed-experts"):
            ServerHTTP(url, 30).request("/generate", body)
        client = _client(url)
        with pytest.raises(ValueError, match=r"enable_rollout_routing_replay=true, but the SGLang servers \['http"
                                             ".*start them with --enable-return-routed-experts"):
            client.generate_sequences(prompt_batch([3]))
        client.close()
        with pytest.raises(ValueError, match="start them with --enable-return-routed-experts"):
            ServerTransport([url], timeout_s=30, weight_transport="distributed", update_group_backend="gloo",
                            master_address="127.0.0.1", engine="HF-engine", routed_experts=True)
    finally:
        server.shutdown()


def _sync_and_generate_with_routing(url: str, model_dir: str) -> dict:
    """This process as the trainer's rank 0 in synchronous server mode (SGLangEngine over the HTTP transport):
    sync the MoE weights, generate greedily with routing replay R3."""
    from test_hf_server import server_replica
    from transformers import AutoConfig

    source = source_model(41, AutoConfig.from_pretrained(model_dir))
    replica = server_replica([url], source, response_length=LENGTH, enable_rollout_routing_replay=True,
                             temperature=0.0, model_path=model_dir)
    try:
        replica.sync(lambda _plan: source.state_dict().items(), version=1)
        out = replica.generate(prompt_batch([3, 5], temperature=0.0))
        return {k: out.batch[k] for k in ("responses", "routed_experts")}
    finally:
        replica.shutdown()


@pytest.mark.distributed
def test_servers_the_run_starts_report_routing_in_synchronous_server_mode(moe_config, tmp_path):
    """The pool starts its servers with --enable-return-routed-experts when asked; the synchronous server-mode
    engine asks each /generate for the routing and places it as the colocated engine does."""
    from megatron_rl.servers.fleet import ServerProcessPool
    from megatron_rl.servers.hf_launch import HFServerLaunch

    moe_config.save_pretrained(tmp_path)
    pool = ServerProcessPool(HFServerLaunch(str(tmp_path), routed_experts=True, chunk_tokens=CHUNK), 1)
    try:
        [got] = run_multiprocess(_sync_and_generate_with_routing, 1, pool.urls[0], str(tmp_path), timeout_s=300)
    finally:
        pool.close()
    colocated = make_engine(response_length=LENGTH, config=moe_config, weights_seed=41,
                            enable_rollout_routing_replay=True, temperature=0.0)
    expected = colocated.generate_sequences(prompt_batch([3, 5], temperature=0.0))
    assert torch.equal(got["responses"], expected.batch["responses"])
    assert torch.equal(got["routed_experts"], expected.batch["routed_experts"])


def _rows_moved_after_a_death(model_dir: str) -> dict:
    """Two servers (routing captured, 1-token chunks); server 0 is killed holding paused requests, replaced, and
    its rows go to the survivor after the sync inside the pause (servers/restarts.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from test_server_restarts import _kill, _ReplicaWorkers, _wait_until
    from transformers import AutoConfig

    from megatron_rl.servers.fleet import ServerProcessPool
    from megatron_rl.servers.hf_launch import HFServerLaunch
    from megatron_rl.servers.restarts import RestartingSync, ServerRestarts

    pool = ServerProcessPool(HFServerLaunch(model_dir, chunk_tokens=1, routed_experts=True), 2)
    source = source_model(41, AutoConfig.from_pretrained(model_dir))
    replica = _server_replica_for(pool.urls, source, model_dir)
    restarts = ServerRestarts(pool, 1)
    workers = RestartingSync(_ReplicaWorkers(replica, source), restarts)
    client = ServerRolloutClient(replica.config, pool.urls, response_length=LENGTH, eos_token_id=[10_000],
                                 pad_token_id=PAD, timeout_s=60, restarts=restarts)  # shape from /server_info
    background = ThreadPoolExecutor(max_workers=1)
    try:
        workers.sync_weights(1)
        client.pause_generation()  # the servers hold every request until the continue: in flight at the kill
        rolled = background.submit(client.generate_sequences, prompt_batch([3, 4, 5, 3], temperature=1.0, seed=3))
        time.sleep(0.5)
        _kill(pool, 0)
        _wait_until(lambda: restarts.count == 1, "the replacement of server 0")
        source.load_state_dict(source_model(42, source.config).state_dict())
        workers.sync_weights(2, True)
        client.continue_generation()
        workers.workers.verify_weights()
        out = rolled.result(timeout=120)
        return {"out": {k: out.batch[k] for k in ("input_ids", "attention_mask", "routed_experts")},
                "versions": [v.tolist() for v in out.non_tensor_batch["token_weight_versions"]],
                "restarts": restarts.count}
    finally:
        background.shutdown(wait=True)
        client.close()
        replica.shutdown()
        pool.close()


def _server_replica_for(urls, source, model_dir):
    from test_hf_server import server_replica

    return server_replica(urls, source, eos_token_id=[10_000], response_length=LENGTH, temperature=1.0,
                          enable_rollout_routing_replay=True, model_path=model_dir)


@pytest.mark.distributed
def test_rows_moved_to_another_server_after_a_death_keep_their_routing(moe_config, tmp_path):
    """Server restarts with R3: the killed server's rows are generated whole by the survivor after the sync; each
    row's routing is the survivor's over the whole row under the new weights (the layers and top-k read from the
    servers' /server_info)."""
    moe_config.save_pretrained(tmp_path)
    [report] = run_multiprocess(_rows_moved_after_a_death, 1, str(tmp_path), timeout_s=300)
    assert report["restarts"] == 1 and report["versions"] == [[2] * LENGTH] * 4
    out = report["out"]
    model = source_model(42, moe_config)
    capture = RouterCapture(model)
    for row in range(4):
        mask = out["attention_mask"][row].bool()
        tokens, routed = out["input_ids"][row][mask], out["routed_experts"][row][mask]
        with torch.no_grad():
            model(input_ids=tokens[None, :-1])
        assert torch.equal(routed[:-1], capture.take((1, len(tokens) - 1))[0]), row
        assert (routed[-1] == -1).all()
