"""An HF engine built without weights_path skips the random initialisation (its weights are never served
before a complete sync), yet computes its buffers, and serves the synced weights exactly."""

from __future__ import annotations

import torch
from transformers import Qwen2PreTrainedModel

from megatron_rl_testing.rollout_models import make_engine, prompt_batch, source_model, trainer_log_probs


def test_no_random_init_before_the_first_sync(monkeypatch):
    def drawn(self, module):
        raise AssertionError("random initial weights drawn although the first sync replaces them")

    monkeypatch.setattr(Qwen2PreTrainedModel, "_init_weights", drawn)
    engine = make_engine(weights_seed=None)
    monkeypatch.undo()
    reference = source_model(100)
    assert torch.equal(engine.model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    engine.update_weights(reference.state_dict().items(), version=1)
    out = engine.generate_sequences(prompt_batch([3, 5], prompt_seed=2))
    rescored = trainer_log_probs(reference)(out)
    torch.testing.assert_close(rescored, out.batch["rollout_log_probs"], atol=1e-5, rtol=0)
