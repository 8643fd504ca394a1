"""Multi-turn rollouts through the async trainers' server client (agent/rollout.py ``MultiTurnClient``): the agent
loop sends every turn as one request of the client's, so a weight swap that lands mid-turn (the server paused,
the turn returned partial and sent again, servers/client.py) resumes that turn on the new weights with the earlier
turns and tool results in its context. Every token keeps the version that sampled it, observations are masked and
take the version before them, and each model token's log-prob is the trainer's under the weights that sampled it.
Real tiny HF model behind one in-process HF-engine server over real HTTP; an engine hook holds the first decode
until the pause is in place, so the swap lands in the first turn every time."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import pytest
import torch

from megatron_rl.agent import AgentEnv, StepResult, register_env
from megatron_rl.agent.rollout import MultiTurnClient
from megatron_rl.agent.loop import AgentLoop
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.servers.client import ServerRolloutClient
from megatron_rl.servers.hf_server import HFServerApp, _handler
from megatron_rl_testing.agent_support import chat_prompts, tiny_tokenizer
from megatron_rl_testing.rollout_models import make_engine, source_model, tiny_qwen2_config, trainer_log_probs

CHUNK = 2
STOPS = list(range(10, 22))  # 12 of 200 tokens: random weights end a turn after ~16 tokens


@register_env("test_async_echo")
class EchoEnv(AgentEnv):
    def step(self, text):
        return StepResult([{"role": "user", "content": "go on"}])


class HeldFirstDecode:
    """The engine, except that its first decode call returns only once the server is paused."""

    def __init__(self, engine, app_ref: list) -> None:
        self._engine, self._app_ref, self.calls = engine, app_ref, 0
        self.first_chunk_done = threading.Event()

    def generate_sequences(self, prompts):
        out = self._engine.generate_sequences(prompts)
        self.calls += 1
        if self.calls == 1:
            self.first_chunk_done.set()
            app = self._app_ref[0]
            with app.state:
                assert app.state.wait_for(lambda: app.paused, timeout=60), "the test never paused the server"
        return out

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture
def setup(tmp_path):
    tok = tiny_tokenizer(tmp_path)
    cfg = tiny_qwen2_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            max_position_embeddings=512)
    app_ref: list = []
    engine = HeldFirstDecode(make_engine(config=cfg, weights_seed=100), app_ref)
    app = HFServerApp(engine, chunk_tokens=CHUNK)
    app_ref.append(app)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(app))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    finish = [tok.eos_token_id, *STOPS]
    client = ServerRolloutClient(RolloutConfig(temperature=1.0), [f"http://127.0.0.1:{server.server_address[1]}"],
                                 response_length=48, eos_token_id=finish, pad_token_id=tok.pad_token_id,
                                 timeout_s=60)
    loop = AgentLoop(client.generate_sequences, tok, {"max_assistant_turns": 3, "default_agent": "test_async_echo"},
                     response_length=48, finish_token_ids=finish)
    multi_turn = MultiTurnClient(client, loop)
    yield tok, cfg, app, engine, multi_turn
    multi_turn.close()
    server.shutdown()


def test_a_turn_interrupted_by_a_swap_resumes_on_the_new_weights_with_exact_versions(setup):
    tok, cfg, app, engine, client = setup
    prompts = chat_prompts(tok, ["What is 12 * 34?", "abc", "Use the calculator: 5 + 6"], temperature=1.0, seed=11)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", client.generate_sequences(prompts)))
    worker.start()
    assert engine.first_chunk_done.wait(60)
    client.pause_generation()  # the MultiTurnClient passes it on: the turn in flight comes back partial
    new = source_model(200, cfg)
    app.handle("POST", "/begin_weight_update", {})
    with app.lock, app.control():
        app.load_tensors(new.state_dict().items(), weight_version=1)
    app.handle("POST", "/end_weight_update", {})
    client.continue_generation()
    worker.join(120)
    out = result["out"]

    b, nt = out.batch, out.non_tensor_batch
    width = b["prompts"].shape[1]
    mask = b["response_mask"].bool()
    real = b["attention_mask"][:, width:].bool()
    spanning = 0
    for row in range(len(prompts)):
        n = int(real[row].sum())
        versions = nt["token_weight_versions"][row].tolist()
        model = mask[row, :n].tolist()
        assert len(versions) == n
        first_turn = model.index(False) if False in model else n
        # the first turn's first chunk was sampled before the swap, every later model token by the new weights
        assert versions[:min(CHUNK, first_turn)] == [0] * min(CHUNK, first_turn)
        assert all(v == 1 for v, m, k in zip(versions, model, range(n)) if m and k >= CHUNK)
        # an observation takes the version of the token before it
        assert all(versions[k] == versions[k - 1] for k in range(1, n) if not model[k])
        spanning += int(first_turn > CHUNK)
        assert nt["weight_version"][row] == 0  # a sample's version is its oldest token's
    assert spanning >= 1, "no first turn outlived the swap"
    assert max(nt["num_turns"]) >= 5 and (real & ~mask).any()  # several turns, observations between them

    # each model token's log-prob is the trainer's under the weights that sampled it, over the whole sample
    old_lp, new_lp = trainer_log_probs(source_model(100, cfg))(out), trainer_log_probs(new)(out)
    versions = torch.zeros_like(b["rollout_log_probs"], dtype=torch.long)
    for row in range(len(prompts)):
        versions[row, :len(nt["token_weight_versions"][row])] = torch.as_tensor(nt["token_weight_versions"][row])
    expected = torch.where(versions == 0, old_lp, new_lp)
    assert float((expected - b["rollout_log_probs"]).abs()[mask].max()) < 1e-5
    assert float((old_lp - b["rollout_log_probs"]).abs()[mask & (versions == 1)].max()) > 1e-2
    assert torch.all(b["rollout_log_probs"][~mask] == 0)
