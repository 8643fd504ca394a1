"""HFEngine: greedy parity with transformers' generate, the output layout, EOS/stop handling, seeds,
log-prob consistency and the strict weight-update session."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.base import WeightUpdateError
from megatron_rl_testing.rollout_models import PAD, make_engine, prompt_batch, source_model

R = 8


def hf_generate(engine, prompts, eos: int) -> torch.Tensor:
    """transformers' greedy generate on the engine's own model, padded to R with PAD."""
    out = engine.model.generate(
        input_ids=prompts.batch["input_ids"],
        attention_mask=prompts.batch["attention_mask"],
        max_new_tokens=R,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
    )[:, prompts.batch["input_ids"].shape[1] :]
    return torch.nn.functional.pad(out, (0, R - out.shape[1]), value=PAD)


def test_greedy_equals_transformers_generate_including_eos(engine):
    first = engine.generate_sequences(prompt_batch([3, 6, 1, 5], do_sample=False, eos_token_id=[]))
    eos = int(first.batch["responses"][0, 3])  # make row 0 stop at step 3 at the latest
    prompts = prompt_batch([3, 6, 1, 5], do_sample=False, eos_token_id=eos)
    out = engine.generate_sequences(prompts)
    expected = hf_generate(engine, prompts, eos)
    assert torch.equal(out.batch["responses"], expected)
    assert int(out.batch["response_mask"][0].sum()) <= 4


def test_output_layout_masks_eos_and_lengths(engine):
    prompts = prompt_batch([2, 5, 4, 1, 3, 5], prompt_seed=1, temperature=1.3, seed=7)
    common = int(engine.generate_sequences(prompts).batch["responses"][:, :3].flatten().mode().values)
    prompts.meta_info["eos_token_id"] = common  # a token sampled early, so some rows stop before R
    out = engine.generate_sequences(prompts)
    b = out.batch
    P = prompts.batch["input_ids"].shape[1]
    assert b["responses"].shape == (6, R) and b["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(b["prompts"], prompts.batch["input_ids"])
    assert torch.equal(b["input_ids"], torch.cat([prompts.batch["input_ids"], b["responses"]], -1))
    assert torch.equal(
        b["attention_mask"], torch.cat([prompts.batch["attention_mask"], b["response_mask"]], -1)
    )
    last_pos = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(b["position_ids"][:, P:], last_pos + torch.arange(1, R + 1))
    stopped = 0
    for row in range(6):
        resp, mask, lp = b["responses"][row], b["response_mask"][row], b["rollout_log_probs"][row]
        n = int(mask.sum())
        assert torch.equal(mask[:n], torch.ones(n, dtype=mask.dtype)) and not mask[n:].any()
        hits = (resp[:n] == common).nonzero().flatten().tolist()
        if n < R:  # stopped early: exactly at its first EOS, which is kept
            assert hits == [n - 1]
            stopped += 1
        else:
            assert hits in ([], [R - 1])
        assert (resp[n:] == PAD).all() and (lp[n:] == 0).all() and (lp[:n] < 0).all()
    assert stopped >= 1
    assert out.meta_info["weight_version"] == 0 and out.meta_info["timing"]["generate_sequences"] > 0


def test_stop_token_ids_from_config_end_responses():
    probe = make_engine(response_length=R).generate_sequences(
        prompt_batch([4, 4], do_sample=False, eos_token_id=[])
    )
    stop = int(probe.batch["responses"][0, 1])
    engine = make_engine(response_length=R, stop_token_ids=[stop])
    out = engine.generate_sequences(prompt_batch([4, 4], do_sample=False, eos_token_id=[]))
    assert int(out.batch["response_mask"][0].sum()) <= 2
    assert int(out.batch["responses"][0, int(out.batch["response_mask"][0].sum()) - 1]) == stop


def test_seeds_reproduce_and_differ(engine):
    prompts = prompt_batch([3, 5, 2, 4], temperature=1.0, seed=11)  # meta_info seed
    a = engine.generate_sequences(prompts)
    b = engine.generate_sequences(prompts)
    prompts.meta_info["seed"] = 12
    c = engine.generate_sequences(prompts)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.equal(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"])
    assert not torch.equal(a.batch["responses"], c.batch["responses"])


def test_engine_generator_advances_without_a_seed_and_restarts_with_config_seed():
    e1 = make_engine(seed=3)
    e2 = make_engine(seed=3)
    prompts = prompt_batch([3, 5])
    first, second = e1.generate_sequences(prompts), e1.generate_sequences(prompts)
    assert not torch.equal(first.batch["responses"], second.batch["responses"])
    assert torch.equal(e2.generate_sequences(prompts).batch["responses"], first.batch["responses"])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_equal_rescoring(engine, temperature):
    """The sampler's log-probs are log_softmax(logits / T) of the drawn tokens: rescoring agrees."""
    prompts = prompt_batch([2, 6, 4], prompt_seed=3, temperature=temperature, top_k=20, top_p=0.9)
    out = engine.generate_sequences(prompts)
    rescored = engine.compute_log_probs(out)
    torch.testing.assert_close(rescored, out.batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_top_k_one_equals_greedy(engine):
    greedy = engine.generate_sequences(prompt_batch([3, 5, 2], prompt_seed=4, do_sample=False))
    top1 = engine.generate_sequences(prompt_batch([3, 5, 2], prompt_seed=4, temperature=1.0, top_k=1))
    assert torch.equal(greedy.batch["responses"], top1.batch["responses"])


def test_validate_uses_val_kwargs():
    engine = make_engine(temperature=1.5)  # val_kwargs default: greedy
    prompts = prompt_batch([3, 4], validate=True)
    a, b = engine.generate_sequences(prompts), engine.generate_sequences(prompts)
    assert torch.equal(a.batch["responses"], b.batch["responses"])  # greedy: no randomness
    assert torch.equal(
        a.batch["responses"],
        engine.generate_sequences(prompt_batch([3, 4], do_sample=False)).batch["responses"],
    )


def test_rejects_right_padded_prompts(engine):
    prompts = prompt_batch([2, 4])
    prompts.batch["attention_mask"] = prompts.batch["attention_mask"].flip(-1)
    with pytest.raises(ValueError, match="LEFT-padded.*row 0"):
        engine.generate_sequences(prompts)


def test_update_weights_is_strict_and_versioned(engine):
    source = source_model(seed=9)
    state = source.state_dict()
    engine.update_weights(state.items(), version=4)
    assert engine.weight_version == 4
    for name, tensor in state.items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name
    with pytest.raises(WeightUpdateError, match="'model.norm.weight' has shape \\(7,\\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(7))], version=5)
    with pytest.raises(RuntimeError, match="cannot serve its weights \\(update to version 5 failed"):
        engine.generate_sequences(prompt_batch([2]))
    with pytest.raises(WeightUpdateError, match="'model.layers.9.mlp.up_proj.weight' is not a parameter"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))], version=5)
    partial = [(k, v) for k, v in state.items() if "layers.1." not in k]
    with pytest.raises(WeightUpdateError, match="not sent: \\['model.layers.1"):
        engine.update_weights(partial, version=5)
    engine.update_weights(state.items(), version=6)  # a complete update makes it servable again
    assert engine.generate_sequences(prompt_batch([2])).meta_info["weight_version"] == 6


def test_session_rules(engine):
    with pytest.raises(WeightUpdateError, match="outside a weight-update session"):
        engine.load_named_tensors([])
    with pytest.raises(WeightUpdateError, match="no weight-update session"):
        engine.end_weight_update()
    engine.begin_weight_update(1)
    with pytest.raises(WeightUpdateError, match="already open"):
        engine.begin_weight_update(2)
    with pytest.raises(RuntimeError, match="open weight-update session"):
        engine.generate_sequences(prompt_batch([2]))


def test_a_never_synced_engine_refuses_to_generate():
    engine = make_engine(weights_seed=None)
    with pytest.raises(RuntimeError, match="random initial weights, never synced"):
        engine.generate_sequences(prompt_batch([2]))


def test_sleep_refuses_generation_until_wake_up(engine):
    prompts = prompt_batch([3, 2], do_sample=False)
    before = engine.generate_sequences(prompts)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate_sequences(prompts)
    engine.wake_up()
    assert torch.equal(engine.generate_sequences(prompts).batch["responses"], before.batch["responses"])
