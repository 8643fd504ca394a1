"""What a transformers (or PEFT) model outputs for the response tokens: the oracle the worker tests compare with."""

from __future__ import annotations

import torch


def hf_predictor_outputs(model, data) -> torch.Tensor:
    """[B, R, ...] the model's outputs (``.logits``) at the positions that predict each response token of ``data``
    (verl's layout: input_ids = left-padded prompt + right-padded response)."""
    batch = data.batch
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    response_len = batch["responses"].shape[1]
    return logits[:, -response_len - 1 : -1]


def hf_response_log_softmax(model, data, temperature: float) -> torch.Tensor:
    """[B, R, V] log-softmax of the logits (divided by ``temperature``) that predict each response token."""
    return torch.log_softmax(hf_predictor_outputs(model, data) / temperature, dim=-1)


def hf_response_log_probs(model, data, temperature: float) -> torch.Tensor:
    """[B, R] log-probs of the response tokens (padding included: mask them as needed)."""
    log_softmax = hf_response_log_softmax(model, data, temperature)
    return log_softmax.gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)
