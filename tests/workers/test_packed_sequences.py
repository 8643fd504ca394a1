"""Packed sequences (THD, Megatron's PackedSeqParams with cu_seqlens; megatron.packed_sequences): the CPU
varlen twin (block-diagonal causal attention, one SDPA per sequence) gives the padded path's numbers token
for token (fp32: log-probs and entropies 1e-5, loss and grad norm 1e-4) at TP=2, TP=2 with sequence
parallelism, a token budget, PP=2 and PP=2 x VPP=2; and computes no padding."""

from __future__ import annotations

import pytest
import torch
from packed_jobs import packed_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed
LAYOUTS = ("tp2", "tp2_sp", "tp2_dynamic", "pp2", "vpp")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rl.models.testing import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("packed")
    model = make_tiny_hf_checkpoint(root / "qwen2", "qwen2", with_tokenizer=False)
    deep = make_tiny_hf_checkpoint(root / "qwen2_4layers", "qwen2", num_layers=4, seed=1, with_tokenizer=False)
    return run_multiprocess(packed_job, 2, str(model), str(deep), timeout_s=600)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_padded_token_for_token(results, layout):
    out = results[-1]  # the last rank is on the last pipeline stage in every layout
    for key in ("log_probs", "entropys"):
        torch.testing.assert_close(out[f"{layout}/packed/{key}"], out[f"{layout}/padded/{key}"], atol=1e-5, rtol=0)
    padded_tokens, padded_thd = out[f"{layout}/padded/computed_tokens"]
    packed_tokens, packed_thd = out[f"{layout}/packed/computed_tokens"]
    assert packed_thd and not padded_thd
    real = int(out["real_tokens"])
    assert real <= packed_tokens < padded_tokens, (real, packed_tokens, padded_tokens)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert out[f"{layout}/packed/metrics"][key] == pytest.approx(out[f"{layout}/padded/metrics"][key], rel=1e-4)


@pytest.mark.parametrize("sp", [0, 1])
def test_packed_critic_values_equal_padded(results, sp):
    out = results[-1]
    packed, padded = out[f"critic_sp{sp}/packed/values"], out[f"critic_sp{sp}/padded/values"]
    assert padded.abs().max() > 0
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


def test_packing_computes_only_real_tokens():
    from megatron_rl.workers.packing import pack_micro_batch, to_thd

    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    batch = {"input_ids": torch.arange(18).view(3, 6) * attention_mask, "attention_mask": attention_mask,
             "responses": (torch.arange(18).view(3, 6) * attention_mask)[:, 3:]}
    padded = pack_micro_batch(batch, torch.arange(3))
    packed = to_thd(padded)
    assert padded.computed_tokens == 3 * 6 and packed.computed_tokens == 3 + 6 + 3
    assert packed.cu_seqlens.tolist() == [0, 3, 9, 12]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2]]
    # each response token is predicted by the same input token in both layouts
    assert torch.equal(packed.input_ids[0, packed.thd_index], padded.input_ids[padded.token_rows, padded.predictor_cols])
    rounded = to_thd(padded, multiple=8)  # sequence parallelism at TP=8: a pad sequence fills 12 -> 16
    assert rounded.computed_tokens == 16 and rounded.cu_seqlens.tolist() == [0, 3, 9, 12, 16]


def test_packed_token_budget_bounds_the_sum_of_lengths():
    from megatron_rl.workers.micro_batches import split_by_token_budget

    lengths = [5, 1, 1, 1, 1, 3]
    # Rectangles (rows x longest <= 6): [5], [3, 1], [1, 1, 1] -> 3; packs (sum <= 6): [5, 1], [3, 1, 1, 1] -> 2.
    packed = split_by_token_budget(lengths, 6, packed=True)
    assert len(packed) == 2 and all(sum(lengths[i] for i in rows) <= 6 for rows in packed)
    assert len(split_by_token_budget(lengths, 6)) == 3
    assert sorted(i for rows in packed for i in rows) == list(range(6))


def useful_fractions(lengths: list[int], budget: int, micro_batch_size: int) -> dict[str, float]:
    from megatron_rl.workers.micro_batches import split_by_token_budget, split_fixed

    real = sum(lengths)

    def rectangles(groups) -> int:
        return sum(len(rows) * max(lengths[i] for i in rows) for rows in groups)

    packs = split_by_token_budget(lengths, budget, packed=True)
    assert all(sum(lengths[i] for i in rows) <= budget for rows in packs)
    return {
        "padded, fixed micro-batches": real / rectangles(split_fixed(len(lengths), micro_batch_size)),
        "padded, token budget": real / rectangles(split_by_token_budget(lengths, budget)),
        "packed, token budget": 1.0,  # a THD pack computes exactly its rows' tokens
        "micro-batches padded/packed": len(split_by_token_budget(lengths, budget)) / len(packs),
    }


def test_useful_token_fraction_of_packed_vs_padded_micro_batches():
    """What the model computes for GRPO-like lengths (prompts 64-1024, responses 16-2048 tokens; 512 rows)
    at an 8192-token budget, and fixed micro-batches of 4 rows in batch order. docs/workers.md quotes it."""
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.randint(64, 1025, (512,), generator=gen) + torch.randint(16, 2049, (512,), generator=gen)).tolist()
    fractions = useful_fractions(lengths, 8192, 4)
    print(fractions)
    assert fractions["padded, fixed micro-batches"] < 0.9
    assert fractions["micro-batches padded/packed"] >= 1.0
