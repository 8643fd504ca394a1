"""Server mode keeps as many requests in flight at each vLLM server as its engine batches (rollout.max_num_seqs),
not 64 over all servers; no thread idles between calls; every request carries no seed and neutral values for
the fields vLLM would take from the checkpoint. Against stub servers (threads on 127.0.0.1) that answer the
routes rollout/vllm/server.py uses and hold each completion until the expected number is in flight."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.vllm.contract import NEUTRAL_SAMPLING

EOS, PAD = 95, 0
MAX_NUM_SEQS = 40  # per server; 2 servers x 50 rows: more than the old cap of 64 over all servers
ROWS_PER_SERVER = 50
HOLD_S = 10.0  # a held completion gives up after this (then the peak stays below the target: the test fails)


class Flight:
    """Completions in flight over all stub servers: each is held until ``target`` are in flight at once (then
    all pass, or after HOLD_S), the peak recorded."""

    def __init__(self, target: int) -> None:
        self.target, self.total, self.peak = target, 0, 0
        self.reached = threading.Event()
        self.lock = threading.Lock()


class StubVLLMServer:
    """The routes of a vLLM server the client uses; ``/v1/completions`` held as ``flight`` says, this server's
    peak in flight recorded."""

    def __init__(self, flight: Flight) -> None:
        self.flight, self.in_flight, self.peak, self.version = flight, 0, 0, 0
        self.bodies: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._answer({"data": [{"id": "stub-model"}]})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else None
                route = self.path.split("?")[0]
                if route == "/v1/completions":
                    self._answer(stub.complete(body))
                elif route == "/collective_rpc":
                    if body["method"] == "mrl_set_weight_version":
                        stub.version = int(body["args"][0])
                    self._answer({"results": [str(stub.version) if "version" in body["method"] else "None"]})
                else:  # /pause, /resume, /reset_prefix_cache
                    self._answer(None)

            def _answer(self, payload) -> None:
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 1024  # every row connects at once

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> dict:
        flight = self.flight
        with flight.lock:
            self.bodies.append(body)
            self.in_flight += 1
            flight.total += 1
            self.peak, flight.peak = max(self.peak, self.in_flight), max(flight.peak, flight.total)
            if flight.total >= flight.target:
                flight.reached.set()
        flight.reached.wait(HOLD_S)
        with flight.lock:
            self.in_flight -= 1
            flight.total -= 1
        n = int(body["max_tokens"])
        return {"choices": [{"token_ids": [5] * n, "logprobs": {"token_logprobs": [-0.5] * n},
                             "finish_reason": "length"}]}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    flight = Flight(2 * MAX_NUM_SEQS)
    stubs = [StubVLLMServer(flight), StubVLLMServer(flight)]
    yield stubs
    for stub in stubs:
        stub.close()


def rollout_config(urls) -> RolloutConfig:
    return RolloutConfig(name="vllm", mode="server", server_urls=list(urls), max_num_seqs=MAX_NUM_SEQS,
                         temperature=0.7, seed=0)


def prompts(rows: int) -> DataProto:
    ids = torch.arange(3, 3 + 4 * rows).reshape(rows, 4) % 90 + 1
    mask = torch.ones_like(ids)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1)}, meta_info={"seed": 7})


def row_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("vllm-rows")]


def check_servers_saw(stubs: list[StubVLLMServer]) -> None:
    assert stubs[0].flight.peak == MAX_NUM_SEQS * len(stubs), (
        f"{stubs[0].flight.peak} requests in flight over {len(stubs)} servers, not {len(stubs)} x rollout.max_num_seqs")
    assert [s.peak for s in stubs] == [MAX_NUM_SEQS] * len(stubs), (
        f"requests in flight at each server: {[s.peak for s in stubs]}, not rollout.max_num_seqs={MAX_NUM_SEQS}")
    bodies = [b for s in stubs for b in s.bodies]
    assert len(bodies) == ROWS_PER_SERVER * len(stubs)
    assert not [b for b in bodies if "seed" in b], "a request carries a seed: vLLM samples such rows one by one"
    assert all({k: b[k] for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING for b in bodies)


def test_rank0_engine_keeps_max_num_seqs_in_flight_at_every_server(servers):
    from megatron_rl.rollout.vllm.server import VLLMServerEngine

    urls = [s.url for s in servers]
    engine = VLLMServerEngine(rollout_config(urls), urls, response_length=2, eos_token_id=EOS, pad_token_id=PAD)
    try:
        engine.update_weights([("w", torch.zeros(2))], version=1)
        out = engine.generate_sequences(prompts(ROWS_PER_SERVER * len(servers)))
        assert out.batch["responses"].shape == (ROWS_PER_SERVER * len(servers), 2)
        check_servers_saw(servers)
        assert row_threads() == [], "request threads left idle after the call"
    finally:
        engine.shutdown()


def test_driver_client_keeps_max_num_seqs_in_flight_at_every_server(servers):
    from megatron_rl.servers.vllm_server import VLLMServerRolloutClient

    urls = [s.url for s in servers]
    client = VLLMServerRolloutClient(rollout_config(urls), urls, response_length=2, eos_token_id=EOS,
                                     pad_token_id=PAD)
    try:
        out = client.generate_sequences(prompts(ROWS_PER_SERVER * len(servers)))
        assert out.batch["responses"].shape == (ROWS_PER_SERVER * len(servers), 2)
        check_servers_saw(servers)
        assert row_threads() == [], "request threads left idle after the call"
    finally:
        client.close()
