"""Context parallelism's layout on one process: the zig-zag split Megatron's RoPE and TE expect, the THD
pack each CP rank gets (sequences padded to 2 x CP chunks, global cu_seqlens, per-rank positions), and the
attention core the layer spec picks (TE's CP attention with TE, SDPAttention's exact all-gather without)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.distributed.context_parallel import chunk_positions, local_pack_positions


def test_zigzag_chunks_match_megatrons_rope_split():
    """Rank r holds chunks r and 2CP-1-r: the positions megatron's get_pos_emb_on_this_cp_rank hands it."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    positions = torch.arange(24)[:, None]
    for cp in (2, 3):
        for rank in range(cp):
            mine = chunk_positions(24, cp, rank)
            freqs = _get_thd_freqs_on_this_cp_rank(rank, cp, torch.empty(24 // cp), positions)
            assert mine.tolist() == freqs[:, 0].tolist()
        everything = torch.cat([chunk_positions(24, cp, r) for r in range(cp)])
        assert sorted(everything.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="2 x CP = 4 equal chunks"):
        chunk_positions(6, 2, 0)


def test_local_pack_positions_cover_the_pack_once():
    cu = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
    per_rank = [local_pack_positions(cu, 2, rank).tolist() for rank in range(2)]
    assert per_rank[0] == [0, 3, 4, 5, 10, 11, 12, 15]
    assert per_rank[1] == [1, 2, 6, 7, 8, 9, 13, 14]


def _micro_batch():
    from megatron_rl.workers.packing import pack_micro_batch

    # row 0: 3 prompt + 4 response tokens; row 1: 1 + 1 (shorter than the 4 chunks); row 2: 2 + 3
    ids = torch.tensor([[5, 6, 7, 11, 12, 13, 14], [0, 0, 8, 15, 0, 0, 0], [0, 9, 10, 16, 17, 18, 0]])
    mask = (ids > 0).long()
    batch = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, 3:]}
    return pack_micro_batch(batch, torch.arange(3))


def test_each_cp_rank_gets_its_chunks_of_every_padded_sequence():
    from megatron_rl.workers.packing import to_thd

    whole = to_thd(_micro_batch())
    assert whole.cu_seqlens.tolist() == [0, 7, 9, 14]
    shards = [to_thd(_micro_batch(), cp=(None, 2, rank)) for rank in range(2)]
    # each sequence padded at its end to a multiple of 2 x CP = 4: 8 + 4 + 8
    assert [s.cu_seqlens.tolist() for s in shards] == [[0, 8, 12, 20]] * 2
    assert [s.input_ids.shape[1] for s in shards] == [10, 10]
    padded = torch.zeros(20, dtype=torch.long)
    for shard in shards:
        padded[shard.cp.positions] = shard.input_ids[0]
    assert padded.tolist() == [5, 6, 7, 11, 12, 13, 14, 0, 8, 15, 0, 0, 9, 10, 16, 17, 18, 0, 0, 0]
    # RoPE positions restart per sequence and follow the chunks
    assert shards[0].position_ids.tolist() == [[0, 1, 6, 7, 0, 3, 0, 1, 6, 7]]
    # every response token is predicted on exactly one rank, at the same global position as without CP
    owned = torch.stack([s.owned_tokens for s in shards])
    assert owned.sum(dim=0).tolist() == [1] * len(whole.labels)
    assert shards[0].thd_index.tolist() == [2, 3, 4, 5, 8, 13, 14, 15]
    assert shards[0].last_index.tolist() == [6, 9, 16]
    # to one TP x CP unit (sequence parallelism at TP=2): multiples of 8
    assert to_thd(_micro_batch(), multiple=2, cp=(None, 2, 1)).cu_seqlens.tolist() == [0, 8, 16, 24]


def test_te_runs_context_parallel_attention_sdpa_everything_else(monkeypatch):
    """With TE and CP > 1 the TE spec's own core attention stays (TE's CP exchange); anywhere else the core
    is SDPAttention. TE does not import on CPU, so its spec is stood in by the local one with a marker."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_rl.models import builder
    from megatron_rl.models.attention import SDPAttention
    from megatron_rl.models.hf_config import parse_hf_config
    from megatron_rl_testing.tiny_models import tiny_hf_config

    class TECoreAttention:  # stands for TEDotProductAttention
        pass

    def te_spec(**kwargs):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=kwargs.get("num_experts"))
        spec.submodules.self_attention.submodules.core_attention = TECoreAttention
        return spec

    monkeypatch.setattr(builder, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    hf = parse_hf_config(tiny_hf_config("qwen2").to_dict())

    def core(use_te, cp):
        return builder.gpt_layer_spec(hf, use_te, context_parallel=cp).submodules.self_attention.submodules.core_attention

    assert core(True, True) is TECoreAttention
    assert core(True, False) is SDPAttention and core(False, True) is SDPAttention
