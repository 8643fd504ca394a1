"""Token ids are validated ONCE per batch, where the worker cuts it into micro-batches (pack_batch), not
inside every micro-batch's log-prob: the value check reads the labels on the host (one device sync), which
per micro-batch stalls the pipeline schedule on a GPU (issue 32, item 15)."""

from __future__ import annotations

import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.protocol import DataProto
from megatron_rl.workers import forward
from megatron_rl.workers.micro_batches import MicroBatchSpec

VOCAB, PADDED_VOCAB = 50, 56
ROWS, PROMPT, RESPONSE = 6, 4, 5
# Tensor -> host conversions: each waits for the device on a GPU.
HOST_SYNCS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "nonzero", "numpy"}


class HostSyncCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_SYNCS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def fake_engine(packed: bool) -> types.SimpleNamespace:
    """What pack_batch and response_log_probs read of a MegatronEngine (one rank, no TP)."""
    return types.SimpleNamespace(
        device=torch.device("cpu"), packed_sequences=packed, sequence_multiple=1,
        uniform_micro_batch_shape=False, share_prompts=False, tp_group=None, context_parallel=None, routing_replay=None,
        hf_config=types.SimpleNamespace(vocab_size=VOCAB),
    )


def make_batch(bad: tuple[int, int] | None = None, bad_padding: bool = False) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB, (ROWS, PROMPT), generator=gen)
    responses = torch.randint(0, VOCAB, (ROWS, RESPONSE), generator=gen)
    mask = torch.ones(ROWS, PROMPT + RESPONSE, dtype=torch.long)
    mask[1, :2] = 0  # left-padded prompt
    mask[2, PROMPT + 3 :] = 0  # right-padded response
    responses[2, 3:] = VOCAB + 100 if bad_padding else 0  # what sits under padding is never a label
    if bad is not None:
        responses[bad] = VOCAB + 7
    ids = torch.cat([prompts, responses], dim=1)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "responses": responses})


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "thd"])
def test_an_out_of_vocabulary_response_token_is_refused_before_the_split(packed):
    with pytest.raises(ValueError) as error:
        forward.pack_batch(fake_engine(packed), make_batch(bad=(3, 2)), MicroBatchSpec(2), (), "budget")
    message = str(error.value)
    assert "batch['responses']" in message, message  # the tensor
    assert "shape (6, 5)" in message, message  # its shape
    assert "[3, 2] = 57" in message, message  # where, and the offending value
    assert f"[0, {VOCAB})" in message, message  # what was expected


def test_padding_under_the_response_is_not_a_label():
    forward.pack_batch(fake_engine(False), make_batch(bad_padding=True), MicroBatchSpec(2), (), "budget")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "thd"])
def test_labels_are_checked_once_per_batch_and_micro_batches_do_no_host_sync(monkeypatch, packed):
    from megatron_rl import ops

    checks = []
    original = ops.check_token_ids

    def counting(*args, **kwargs):
        checks.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(forward, "check_token_ids", counting)
    engine = fake_engine(packed)
    micro_batches = forward.pack_batch(engine, make_batch(), MicroBatchSpec(2), (), "budget")
    assert len(micro_batches) == 3 and len(checks) == 1
    gen = torch.Generator().manual_seed(1)
    for micro_batch in micro_batches:
        logits = torch.randn(*micro_batch.input_ids.shape, PADDED_VOCAB, generator=gen, requires_grad=True)
        with HostSyncCounter() as counter:
            log_probs, entropy = forward.response_log_probs(engine, logits, micro_batch, 1.0, with_entropy=True)
            (log_probs.sum() + entropy.sum()).backward()
        assert counter.calls == [], f"host syncs in a micro-batch's log-prob: {counter.calls}"
        assert torch.isfinite(log_probs).all() and log_probs.shape == (micro_batch.num_rows, RESPONSE)
