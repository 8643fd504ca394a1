"""Streaming in the fully async loop (trainer/fully_async.py ``Rollouter`` + servers/client.py lanes): with
room for two batches, the next batch starts while the first still generates, and a server that finished its
part of the first goes on with its part of the second instead of idling behind the slowest server. Two real
in-process HF-engine servers over HTTP; server 0 is held inside its first decode call (a slow server) until the
test lets it go, so the overlap is forced, not raced. Streaming changes when a batch generates, not what: the
batches come back in order and equal the same batches generated one after the other."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.servers.hf_server import HFServerApp, _handler
from megatron_rl.servers.client import ServerRolloutClient
from megatron_rl.trainer.fully_async import Rollouter
from megatron_rl_testing.rollout_models import PAD, make_engine, prompt_batch

LENGTH = 4
WAIT_S = 60


class SlowFirstCall:
    """The engine, except that its first decode call returns only once ``go`` is set."""

    def __init__(self, engine) -> None:
        self._engine, self.go, self.entered = engine, threading.Event(), threading.Event()

    def generate_sequences(self, prompts):
        if not self.entered.is_set():
            self.entered.set()
            assert self.go.wait(WAIT_S), "the test never let the slow server go on"
        return self._engine.generate_sequences(prompts)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class Answered:
    """Counts the /generate requests a server answered."""

    def __init__(self, app: HFServerApp) -> None:
        self.count, self.state, self._generate = 0, threading.Condition(), app.generate
        app.generate = self

    def __call__(self, body):
        out = self._generate(body)
        with self.state:
            self.count += 1
            self.state.notify_all()
        return out

    def wait_for(self, count: int) -> bool:
        with self.state:
            return self.state.wait_for(lambda: self.count >= count, WAIT_S)


@pytest.fixture
def two_servers():
    slow = SlowFirstCall(make_engine(weights_seed=100))
    apps, servers = [HFServerApp(slow, chunk_tokens=2), HFServerApp(make_engine(weights_seed=100), chunk_tokens=2)], []
    for app in apps:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(app))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    # a stop token the tiny vocabulary never reaches keeps every response LENGTH long
    client = ServerRolloutClient(RolloutConfig(temperature=1.0),
                                 [f"http://127.0.0.1:{s.server_address[1]}" for s in servers],
                                 response_length=LENGTH, eos_token_id=[10_000], pad_token_id=PAD, timeout_s=WAIT_S)
    yield slow, apps, client
    slow.go.set()
    client.close()
    for server in servers:
        server.shutdown()


def _batches():
    return [prompt_batch([3, 5, 4, 2], do_sample=True, seed=7 + i, prompt_seed=i) for i in range(2)]


def test_the_next_batch_streams_onto_a_server_done_with_its_part(two_servers):
    slow, apps, client = two_servers
    fast = Answered(apps[1])
    batches = iter(_batches())
    rollouter = Rollouter(lambda: next(batches, None), client.generate_sequences, capacity=2, ready=[])
    rollouter.start()
    try:
        assert slow.entered.wait(WAIT_S)
        # server 1 answers its part of batch 1, then its part of batch 2, while server 0 still holds batch 1
        assert fast.wait_for(2), (f"server 1 answered {fast.count} request(s) while server 0 was busy: the next "
                                  "batch did not start on it before the first batch finished")
        slow.go.set()
        streamed = [rollouter.take(), rollouter.take()]
        assert rollouter.take() is None
    finally:
        slow.go.set()
        rollouter.stop()

    # the same batches one after the other: what streaming generates is what a sequential rollout would
    for got, prompts in zip(streamed, _batches()):
        want = client.generate_sequences(prompts)
        torch.testing.assert_close(got.batch["responses"], want.batch["responses"], rtol=0, atol=0)
        torch.testing.assert_close(got.batch["rollout_log_probs"], want.batch["rollout_log_probs"], rtol=0, atol=1e-6)
        assert [v.tolist() for v in got.non_tensor_batch["token_weight_versions"]] == [[0] * LENGTH] * 4


def test_a_failed_batch_is_raised_at_its_turn_and_earlier_ones_are_kept(two_servers):
    slow, _apps, client = two_servers
    slow.go.set()
    good, bad = _batches()
    bad.meta_info["temperature"] = -1.0  # refused by the sampling parameters
    claims = iter([good, bad])
    rollouter = Rollouter(lambda: next(claims, None), client.generate_sequences, capacity=2, ready=[])
    rollouter.start()
    try:
        assert rollouter.take() is not None
        with pytest.raises(RuntimeError, match="the rollout thread failed: .*temperature"):
            rollouter.take()
    finally:
        rollouter.stop()
