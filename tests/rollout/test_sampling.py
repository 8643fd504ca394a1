"""Sampling parameters resolution and the top-k / top-p filter."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig, ValKwargsConfig
from megatron_rl.rollout.sampling import mask_top_k_top_p, resolve_sampling_params, sample_next_token


def resolve(cfg: RolloutConfig | None = None, **meta):
    return resolve_sampling_params(
        cfg or RolloutConfig(), meta, response_length=16, eos_token_id=2, pad_token_id=None
    )


def test_meta_info_overrides_config_and_validate_uses_val_kwargs():
    cfg = RolloutConfig(
        temperature=0.9,
        top_p=0.8,
        top_k=5,
        stop_token_ids=[7],
        val_kwargs=ValKwargsConfig(temperature=0.5, do_sample=True, top_k=3),
    )
    p = resolve(cfg, temperature=1.2, eos_token_id=[2, 4], response_length=4, seed=3)
    assert (p.temperature, p.top_p, p.top_k, p.max_response_length, p.seed) == (1.2, 0.8, 5, 4, 3)
    assert p.finish_token_ids == (2, 4, 7) and p.pad_token_id == 2  # pad falls back to the first eos
    v = resolve(cfg, validate=True)
    assert (v.temperature, v.top_k, v.do_sample, v.greedy) == (0.5, 3, True, False)
    assert resolve(do_sample=False).greedy and resolve(temperature=0.0).greedy


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"response_length": 0}, "response length"),
    ],
)
def test_bad_values_are_named(meta, message):
    with pytest.raises(ValueError, match=message):
        resolve(**meta)


def test_missing_pad_is_an_error():
    with pytest.raises(ValueError, match="pad_token_id"):
        resolve_sampling_params(RolloutConfig(), {}, response_length=4, eos_token_id=None, pad_token_id=None)


def test_top_k_top_p_keep_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(mask_top_k_top_p(logits, 2, 1.0)).tolist() == [[True, True, False, False]]
    # nucleus 0.8: {0.5, 0.3} reaches 0.8 -> keep two; 0.81 needs the third
    assert torch.isfinite(mask_top_k_top_p(logits, -1, 0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(mask_top_k_top_p(logits, -1, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(mask_top_k_top_p(logits, -1, 0.1)).tolist() == [[True, False, False, False]]


def test_sampled_log_prob_is_temperature_scaled_full_vocab():
    logits = torch.randn(64, 10)
    p = resolve(temperature=0.5, top_k=3)
    tokens, lps = sample_next_token(logits, p, torch.Generator().manual_seed(0))
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tokens[:, None]).any(-1).all()  # only top-k tokens are drawn
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(lps, expected)  # ... but the log-prob is not renormalised over them
