"""Routing agreement between the rollout engine and the trainer (megatron_rl.models.moe_routing): the recorder
maps Megatron's token order back to batch rows, the comparison counts sets and overlap, the HF engine reports
its routers' choices. The whole path (Megatron at EP=2 against the HF engines) runs in tests/e2e/test_moe_train.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from megatron_rl.models.moe_routing import RoutingRecorder, routing_agreement


def top_k_choices(router_logits: torch.Tensor, k: int) -> torch.Tensor:
    """[tokens, experts] logits -> [tokens, experts] bool, True at each token's k largest."""
    top = router_logits.float().topk(k, dim=-1).indices
    return torch.zeros(router_logits.shape, dtype=torch.bool).scatter_(1, top, True)

EXPERTS, K = 4, 2


def _choices(tokens: int, seed: int) -> torch.Tensor:
    return top_k_choices(torch.randn(tokens, EXPERTS, generator=torch.Generator().manual_seed(seed)), K)


def _record(recorder: RoutingRecorder, micro_batch, routing_map: torch.Tensor) -> None:
    recorder.expect(micro_batch)
    recorder._hook(0)(None, None, (None, routing_map))


def test_the_recorder_maps_padded_and_packed_micro_batches_back_to_their_rows():
    lengths, rows = [3, 1, 2], [5, 0, 7]  # batch rows 5, 0, 7 in this micro-batch; one empty padding row after
    choices = [_choices(n, seed) for seed, n in enumerate(lengths)]
    width, count = max(lengths), len(lengths) + 1
    mask = torch.zeros(count, width, dtype=torch.bool)
    by_position = torch.zeros(width, count, EXPERTS, dtype=torch.bool)  # Megatron's [seq, batch] token order
    for j, (n, choice) in enumerate(zip(lengths, choices)):
        mask[j, :n] = True
        by_position[:n, j] = choice
    padded = SimpleNamespace(rows=torch.tensor(rows), attention_mask=mask, is_thd=False, is_shared=False,
                             cu_seqlens=None)
    recorder = RoutingRecorder([])
    _record(recorder, padded, by_position.reshape(width * count, EXPERTS))
    assert all(torch.equal(recorder.choices[0][row], c) for row, c in zip(rows, choices))

    cu = torch.tensor([0, 3, 4, 6, 8], dtype=torch.int32)  # the rows end to end, then a padding sequence
    packed = SimpleNamespace(rows=torch.tensor(rows), attention_mask=None, is_thd=True, is_shared=False, cu_seqlens=cu)
    recorder = RoutingRecorder([])
    _record(recorder, packed, torch.cat([*choices, torch.zeros(2, EXPERTS, dtype=torch.bool)]))
    assert all(torch.equal(recorder.choices[0][row], c) for row, c in zip(rows, choices))

    recorder = RoutingRecorder([])  # sequence parallel: the router sees a slice of the tokens
    _record(recorder, padded, by_position.reshape(width * count, EXPERTS)[: width * count // 2])
    assert "saw 6 of 12 tokens" in recorder.unsupported and recorder.gathered() is None

    recorder = RoutingRecorder([])  # shared prompts: a prompt's tokens are routed once for its whole group
    _record(recorder, SimpleNamespace(rows=torch.tensor(rows), is_thd=False, is_shared=True), by_position[0])
    assert "megatron.share_prompts" in recorder.unsupported and recorder.gathered() is None


def test_agreement_counts_equal_sets_and_overlap_and_names_a_row_it_cannot_compare():
    ours = {0: {0: _choices(5, 0), 1: _choices(2, 1)}}
    theirs = {0: {row: c.clone() for row, c in ours[0].items()}}
    assert routing_agreement(ours, theirs) == {"rollout/moe_routing_agreement": 1.0, "rollout/moe_routing_overlap": 1.0}
    ours[0][1][0] = torch.tensor([True, True, False, False])
    theirs[0][1][0] = torch.tensor([True, False, True, False])  # one of the two experts in common
    metrics = routing_agreement(ours, theirs)
    assert metrics["rollout/moe_routing_agreement"] == pytest.approx(6 / 7)
    assert metrics["rollout/moe_routing_overlap"] == pytest.approx((6 + 0.5) / 7)
    with pytest.raises(RuntimeError, match=r"probe row 1 at layer 0, the rollout engine \(2, 4\)"):
        routing_agreement({0: {0: ours[0][0]}}, theirs)


def test_the_hf_engine_reports_the_experts_its_routers_pick_for_real_tokens_only(tmp_path):
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint
    from megatron_rl.protocol import DataProto
    from megatron_rl.rollout.hf_engine import HFEngine

    path = make_tiny_hf_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    engine = HFEngine(OmegaConf.structured(RolloutConfig(name="hf")), path, weights_path=path, device="cpu",
                      response_length=4)
    ids = torch.tensor([[0, 0, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    choices = engine.expert_choices(data)
    k = engine.model.config.num_experts_per_tok
    with torch.no_grad():
        alone = engine.model(input_ids=ids[:1, 2:], output_router_logits=True).router_logits
    assert len(choices) == engine.model.config.num_hidden_layers
    assert choices[0][0].shape == (4, engine.model.config.num_experts) and (choices[0][0].sum(-1) == k).all()
    assert torch.equal(choices[1][0], top_k_choices(alone[1].reshape(4, -1), k))  # the padding left out
    gate = engine.model.model.layers[0].mlp.gate.weight
    with torch.no_grad():  # swap experts 0 and 1 in the first layer's router: its choices swap with them
        gate[[0, 1]] = gate[[1, 0]].clone()
    swapped = engine.expert_choices(data)[0][1]
    assert torch.equal(swapped[:, [1, 0, *range(2, swapped.shape[1])]], choices[0][1])
