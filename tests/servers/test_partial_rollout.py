"""Partial rollouts across a weight swap (servers/hf_server.py's /pause_generation + /continue_generation, driven
by servers/client.py as SGLang servers are): the prefix's log-probs are the old weights', the suffix's
the new weights', each token carries the version that sampled it. Real tiny HF model, one in-process server
over real HTTP; an engine hook holds the generation after its first chunk until the pause is in place, so the
swap lands mid-response every time."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.protocol import DataProto
from megatron_rl.servers.hf_server import HFServerApp, _handler
from megatron_rl.servers.client import ServerRolloutClient
from megatron_rl_testing.rollout_models import (
    EOS, PAD, make_engine, prompt_batch, source_model, trainer_log_probs,
)

CHUNK, LENGTH = 2, 6


class HeldAfterFirstChunk:
    """The engine, except that (with ``hold``) its first decode call returns only once the server is paused."""

    def __init__(self, engine, app_ref: list) -> None:
        self._engine, self._app_ref, self.calls, self.hold = engine, app_ref, 0, False
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


@pytest.fixture
def served():
    app_ref: list = []
    engine = HeldAfterFirstChunk(make_engine(weights_seed=100), app_ref)
    app = HFServerApp(engine, chunk_tokens=CHUNK)
    app_ref.append(app)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(app))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # ignore_eos is not ours to send; a stop token the tiny vocabulary never reaches keeps the length fixed
    client = ServerRolloutClient(RolloutConfig(temperature=1.0), [f"http://127.0.0.1:{server.server_address[1]}"],
                                 response_length=LENGTH, eos_token_id=[10_000], pad_token_id=PAD, timeout_s=60)
    yield app, engine, client
    client.close()
    server.shutdown()


def test_a_response_spans_the_swap_prefix_old_weights_suffix_new(served):
    app, engine, client = served
    prompts = prompt_batch([3, 5], do_sample=True, seed=7)
    engine.hold = True
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", client.generate_sequences(prompts)))
    worker.start()
    assert engine.first_chunk_done.wait(60)
    client.pause_generation()  # answers once the in-flight request came back partial
    calls_at_pause = engine.calls
    new = source_model(200)
    app.handle("POST", "/begin_weight_update", {})
    with app.lock, app.control():
        app.load_tensors(new.state_dict().items(), weight_version=1)
    app.handle("POST", "/end_weight_update", {})
    assert engine.calls == calls_at_pause  # nothing decoded while paused: the resent rows wait there
    client.continue_generation()
    worker.join(60)
    out = result["out"]

    versions = out.non_tensor_batch["token_weight_versions"]
    assert [v.tolist() for v in versions] == [[0, 0, 1, 1, 1, 1]] * 2  # chunk 1 before the swap, the rest after
    assert out.non_tensor_batch["weight_version"].tolist() == [0, 0]  # a sample's version: its oldest token
    lp = out.batch["rollout_log_probs"]
    old_lp, new_lp = trainer_log_probs(source_model(100))(out), trainer_log_probs(new)(out)
    torch.testing.assert_close(lp[:, :CHUNK], old_lp[:, :CHUNK], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[:, CHUNK:], new_lp[:, CHUNK:], atol=1e-5, rtol=0)
    assert (lp[:, CHUNK:] - old_lp[:, CHUNK:]).abs().max() > 1e-2  # the suffix is not the old weights'


def test_pause_modes_and_refusals(served):
    app, engine, client = served
    with pytest.raises(Exception, match="mode must be one of"):
        app.handle("POST", "/pause_generation", {"mode": "later"})
    app.handle("POST", "/pause_generation", {"mode": "in_place"})  # nothing in flight: answers at once
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", client.generate_sequences(prompt_batch([4]))))
    worker.start()
    worker.join(0.5)
    assert worker.is_alive() and engine.calls == 0  # a request sent while paused waits for the continue
    app.handle("POST", "/continue_generation", {})
    worker.join(60)
    assert result["out"].batch["response_mask"].sum().item() == LENGTH
    assert result["out"].non_tensor_batch["token_weight_versions"][0].tolist() == [0] * LENGTH


def test_in_place_parks_the_request_and_it_goes_on_with_the_new_weights(served):
    """SGLang's in_place/retract: the request is not returned, it waits and resumes after the continue. A result
    reports one weight_version (the last token's, as SGLang), so per-token versions need mode abort."""
    app, engine, client = served
    engine.hold = True
    result: dict = {}
    body = {"input_ids": [[5, 6, 7]], "return_logprob": True,
            "sampling_params": [{"max_new_tokens": LENGTH, "stop_token_ids": [10_000], "sampling_seed": 3}]}
    worker = threading.Thread(target=lambda: result.setdefault("out", app.handle("POST", "/generate", body)))
    worker.start()
    assert engine.first_chunk_done.wait(60)
    app.handle("POST", "/pause_generation", {"mode": "in_place"})
    new = source_model(200)
    app.handle("POST", "/begin_weight_update", {})
    with app.lock, app.control():  # a parked request does not hold up the update
        app.load_tensors(new.state_dict().items(), weight_version=1)
    app.handle("POST", "/end_weight_update", {})
    app.handle("POST", "/continue_generation", {})
    worker.join(60)
    [out] = result["out"]
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "1"
    tokens = [e[1] for e in meta["output_token_logprobs"]]
    lps = torch.tensor([e[0] for e in meta["output_token_logprobs"]])
    full = torch.tensor([[5, 6, 7, *tokens]])
    scored = DataProto.from_dict({"input_ids": full, "attention_mask": torch.ones_like(full),
                                  "position_ids": torch.arange(full.shape[1])[None], "responses": full[:, 3:],
                                  "response_mask": torch.ones(1, LENGTH, dtype=torch.long)})
    old_lp, new_lp = trainer_log_probs(source_model(100))(scored)[0], trainer_log_probs(new)(scored)[0]
    torch.testing.assert_close(lps[:CHUNK], old_lp[:CHUNK], atol=1e-5, rtol=0)
    torch.testing.assert_close(lps[CHUNK:], new_lp[CHUNK:], atol=1e-5, rtol=0)
