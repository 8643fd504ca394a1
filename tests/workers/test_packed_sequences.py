"""Micro-batch layouts against the padded one, token for token (fp32: log-probs and entropies 1e-5, loss and
grad norm 1e-4) at TP=2, TP=2 with sequence parallelism, a token budget, PP=2 and PP=2 x VPP=2:
- packed sequences (THD, Megatron's PackedSeqParams with cu_seqlens; megatron.packed_sequences): the CPU
  varlen twin (block-diagonal causal attention, one SDPA per sequence) computes no padding;
- shared prompts (megatron.share_prompts): the rows of a prompt as one [prompt | responses...] sequence
  under a tree mask with RoPE positions continuing the prompt, each prompt computed once."""

from __future__ import annotations

import pytest
import torch
from packed_jobs import packed_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed
LAYOUTS = ("tp2", "tp2_sp", "tp2_dynamic", "pp2", "vpp")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("packed")
    model = make_tiny_hf_checkpoint(root / "qwen2", "qwen2", with_tokenizer=False)
    deep = make_tiny_hf_checkpoint(root / "qwen2_4layers", "qwen2", num_layers=4, seed=1, with_tokenizer=False)
    return run_multiprocess(packed_job, 2, str(model), str(deep), timeout_s=600)


@pytest.mark.parametrize("kind", ["packed", "shared"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_equals_padded_token_for_token(results, layout, kind):
    out = results[-1]  # the last rank is on the last pipeline stage in every layout
    for key in ("log_probs", "entropys"):
        torch.testing.assert_close(out[f"{layout}/{kind}/{key}"], out[f"{layout}/padded/{key}"], atol=1e-5, rtol=0)
    padded_tokens, padded_kind = out[f"{layout}/padded/computed_tokens"]
    tokens, computed_kind = out[f"{layout}/{kind}/computed_tokens"]
    assert (padded_kind, computed_kind) == ("padded", kind)
    real = int(out["real_tokens"])
    if kind == "packed":
        assert real <= tokens < padded_tokens, (real, tokens, padded_tokens)
    else:  # each prompt once for its PROMPT_GROUP rows: fewer positions than the rows' real tokens
        assert tokens < real < padded_tokens, (tokens, real, padded_tokens)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert out[f"{layout}/{kind}/metrics"][key] == pytest.approx(out[f"{layout}/padded/metrics"][key], rel=1e-4)


@pytest.mark.parametrize("kind", ["packed", "shared"])
@pytest.mark.parametrize("sp", [0, 1])
def test_critic_values_equal_padded(results, sp, kind):
    out = results[-1]
    values, padded = out[f"critic_sp{sp}/{kind}/values"], out[f"critic_sp{sp}/padded/values"]
    assert padded.abs().max() > 0
    torch.testing.assert_close(values, padded, atol=1e-5, rtol=0)


def test_shared_prompts_refuse_packed_sequences(results):
    message = results[0]["both_layouts_error"]
    assert "share_prompts" in message and "packed_sequences" in message, message


def test_shared_prompt_layout():
    """Rows 0, 2, 3 share a prompt (row 3's with other left padding); row 1 has its own. One sequence per
    prompt: the prompt once, then each row's real response tokens, positions continuing the prompt."""
    from megatron_rl.models.attention import shared_prompt_mask
    from megatron_rl.workers.packing import pack_micro_batch
    from megatron_rl.workers.shared_prompts import pack_shared_prompts

    prompts = torch.tensor([[0, 7, 8], [5, 6, 9], [0, 7, 8], [0, 7, 8]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]])
    responses = torch.tensor([[11, 12, 0], [13, 0, 0], [14, 15, 16], [17, 0, 0]])
    response_mask = (responses > 0).long()
    batch = {"input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([prompt_mask, response_mask], 1),
             "responses": responses}
    shared = pack_shared_prompts(batch, torch.arange(4))
    assert shared.is_shared and not shared.is_thd
    # torch.unique orders the prompts: [7, 8] (rows 0, 2, 3) first, then [5, 6, 9] (row 1)
    assert shared.input_ids.tolist() == [[7, 8, 11, 12, 14, 15, 16, 17], [5, 6, 9, 13, 0, 0, 0, 0]]
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4, 2], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert shared.computed_tokens == 16 < pack_micro_batch(batch, torch.arange(4)).computed_tokens
    # every response token is predicted by the same input token as in the padded layout
    padded = pack_micro_batch(batch, torch.arange(4))
    assert torch.equal(shared.token_rows, padded.token_rows) and torch.equal(shared.labels, padded.labels)
    assert torch.equal(shared.input_ids[shared.predictor_rows, shared.predictor_cols],
                       padded.input_ids[padded.token_rows, padded.predictor_cols])
    allowed = ~shared_prompt_mask(shared.shared_segments)[0, 0]
    # row 2's second response token (column 5) sees the prompt and its own first token, not row 0's response
    assert allowed[5].nonzero().flatten().tolist() == [0, 1, 4, 5]
    assert allowed[7].nonzero().flatten().tolist() == [0, 1, 7]  # row 3's only token
    assert not allowed[1:, 1:][~torch.ones(7, 7, dtype=torch.bool).tril()].any()  # causal
    pads = ~shared_prompt_mask(shared.shared_segments)[1, 0, 4:]
    assert torch.equal(pads, torch.eye(8, dtype=torch.bool)[4:])  # a pad sees only itself


def test_shared_prompts_refuse_rows_without_a_prompt():
    from megatron_rl.workers.shared_prompts import pack_shared_prompts

    batch = {"input_ids": torch.tensor([[3, 4], [0, 4], [3, 4]]), "attention_mask": torch.tensor([[1, 1], [0, 1], [1, 1]]),
             "responses": torch.tensor([[4], [4], [4]])}
    with pytest.raises(ValueError, match=r"share_prompts: rows \[1\] have no prompt token"):  # the batch's row
        pack_shared_prompts(batch, torch.tensor([1, 2]))


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


@pytest.mark.parametrize(("group", "expected"), [(4, "shared"), (1, "padded")])
def test_shared_prompts_keep_the_padded_layout_when_nothing_is_shared(group, expected):
    from types import SimpleNamespace

    from workers_batches import make_rl_batch

    from megatron_rl.workers.forward import pack_batch
    from megatron_rl.workers.micro_batches import MicroBatchSpec

    data = make_rl_batch(8, group=group)
    vocab = SimpleNamespace(vocab_size=int(data.batch["input_ids"].max()) + 1)  # pack_batch checks the labels
    engine = SimpleNamespace(device=torch.device("cpu"), share_prompts=True, packed_sequences=False,
                             sequence_multiple=1, uniform_micro_batch_shape=False, hf_config=vocab, context_parallel=None,
                             routing_replay=None)
    micro_batches = pack_batch(engine, data, MicroBatchSpec(4, False, 0), (), "test")
    assert {"shared" if mb.is_shared else "padded" for mb in micro_batches} == {expected}
