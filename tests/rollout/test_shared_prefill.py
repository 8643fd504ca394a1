"""The HF engine prefills rollout.n identical prompt rows once (batch_io.repeated_prompt_rows) and copies
their KV-cache rows: the samples are those of the unshared prefill, the log-probs still equal rescoring."""

from __future__ import annotations

import torch

import megatron_rl.rollout.hf_engine as hf_engine
from megatron_rl.protocol import DataProto
from megatron_rl_testing.rollout_models import make_engine, prompt_batch


def _repeated(n: int) -> DataProto:
    prompts = prompt_batch([2, 6, 4], prompt_seed=5, seed=11)  # a fixed sampling seed per call
    return DataProto.from_dict({k: v.repeat_interleave(n, dim=0) for k, v in prompts.batch.items()},
                               meta_info=prompts.meta_info)


def test_one_prefill_per_prompt_gives_the_unshared_samples(monkeypatch):
    engine = make_engine(response_length=8)
    prompts = _repeated(4)
    prefill_rows = []
    forward = engine.model.forward

    def counting_forward(*args, **kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            prefill_rows.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", counting_forward)
    shared = engine.generate_sequences(prompts)
    assert prefill_rows == [3]  # 12 rows, 3 distinct prompts
    monkeypatch.setattr(hf_engine, "repeated_prompt_rows", lambda *rows: None)  # the unshared prefill
    unshared = engine.generate_sequences(prompts)
    assert prefill_rows == [3, 12]
    assert torch.equal(shared.batch["responses"], unshared.batch["responses"])
    torch.testing.assert_close(shared.batch["rollout_log_probs"], unshared.batch["rollout_log_probs"],
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(engine.compute_log_probs(shared), shared.batch["rollout_log_probs"],
                               atol=1e-5, rtol=0)
