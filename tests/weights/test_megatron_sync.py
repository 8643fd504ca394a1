"""Megatron actor (TP=2 or PP=2, gloo) -> export_hf_weights -> sync_weights -> HF engine on every rank.

After a sync the engine's greedy tokens are the trainer's argmax and its log-probs equal the trainer's
(fp32, 1e-5); a training step makes them disagree (and verification says the engine holds what was
sent); the next sync restores agreement; a tensor corrupted inside the engine is named by verification.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_multiprocess

R = 6
LR = 0.5


def _prompts():
    from megatron_rl_testing.rollout_models import prompt_batch

    batch = prompt_batch([3, 6, 2, 5])  # token ids < 96 < the tiny checkpoint's 300
    batch.batch["input_ids"][batch.batch["attention_mask"] == 0] = 256  # the checkpoint's pad id
    return batch


def _last_stage_to_all(tensor: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Pipeline-parallel: only the last stage has logits; give every stage the result."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    buffer = tensor.contiguous() if tensor is not None else torch.empty(shape)
    dist.broadcast(
        buffer, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    return buffer


def _trainer_logits(chunks, batch) -> torch.Tensor:
    from megatron_rl.models import compute_full_logits

    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    vocab = chunks[0].hf_config.vocab_size
    return _last_stage_to_all(compute_full_logits(chunks, ids, mask), (*ids.shape, vocab))


def _trainer_log_prob_fn(chunks):
    from megatron_rl.ops import log_probs_from_logits

    def fn(batch):
        width = batch.batch["responses"].shape[-1]
        logits = _trainer_logits(chunks, batch)[:, -width - 1 : -1]
        return log_probs_from_logits(logits, batch.batch["responses"]) * batch.batch["response_mask"]

    return fn


def _training_step(chunks, batch) -> None:
    """One SGD step on the responses' negative log-likelihood, through Megatron's pipeline schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.models import causal_padding_mask, position_ids_from_mask
    from megatron_rl.ops import log_probs_from_logits

    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    width, vocab = batch.batch["responses"].shape[-1], chunks[0].hf_config.vocab_size
    tp_group = ps.get_tensor_model_parallel_group()

    def forward_step(data_iterator, model):
        ids, mask, responses, response_mask = next(data_iterator)
        logits = model(ids, position_ids_from_mask(mask), causal_padding_mask(mask))  # vocab-parallel

        def loss_fn(output):
            lp = log_probs_from_logits(
                output[:, -width - 1 : -1], responses, tp_group=tp_group, vocab_size=vocab
            )
            loss = -(lp * response_mask).sum() / response_mask.sum()
            return loss, {"loss": loss.detach()}

        return logits, loss_fn

    for chunk in chunks:
        chunk.train()
        chunk.zero_grad()
    data = [(ids, mask, batch.batch["responses"], batch.batch["response_mask"].float())]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(data),
        model=chunks[0],
        num_microbatches=1,
        seq_length=ids.shape[1],
        micro_batch_size=ids.shape[0],
        forward_only=False,
    )
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)


def sync_and_verify(ckpt_dir: str, tp: int, pp: int) -> dict:
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf
    from megatron_rl.weights import export_hf_weights, WeightSyncError, sync_weights, verify_sync
    from megatron_rl.rollout import HFEngine

    init_model_parallel(tp=tp, pp=pp)
    chunks = build_from_hf(ckpt_dir)
    torch.manual_seed(7)  # every rank's engine starts from the same random weights
    engine = HFEngine(RolloutConfig(response_length=R), ckpt_dir)
    log_prob_fn, probe = _trainer_log_prob_fn(chunks), _prompts()
    result: dict = {}

    def sync(version: int):
        return sync_weights(
            export_hf_weights(chunks), engine, version=version, bucket_bytes=16 << 10, compute_checksums=True
        )

    stats = sync(1)
    result["num_buckets"] = stats.num_buckets
    result["v1"] = verify_sync(log_prob_fn, engine, probe, threshold=1e-5, source_checksums=stats.checksums)
    greedy = engine.generate_sequences(_with_meta(_prompts(), do_sample=False))
    argmax = _trainer_logits(chunks, greedy)[:, -R - 1 : -1].argmax(-1)
    valid = greedy.batch["response_mask"].bool()
    result["greedy_equal"] = bool(torch.equal(argmax[valid], greedy.batch["responses"][valid]))

    _training_step(chunks, greedy)
    try:
        verify_sync(log_prob_fn, engine, probe, threshold=1e-5, source_checksums=stats.checksums)
        result["after_step"] = "no error"
    except WeightSyncError as exc:
        result["after_step"] = str(exc)

    stats = sync(2)
    result["v2"] = verify_sync(log_prob_fn, engine, probe, threshold=1e-5, source_checksums=stats.checksums)
    result["version"] = engine.generate_sequences(_prompts()).meta_info["weight_version"]

    with torch.no_grad():
        engine.model.model.layers[0].self_attn.k_proj.bias[1] += 1.0
    try:
        verify_sync(log_prob_fn, engine, probe, threshold=1e-5, source_checksums=stats.checksums)
        result["corrupted"] = "no error"
    except WeightSyncError as exc:
        result["corrupted"] = str(exc)
    return result


def _with_meta(batch, **meta):
    batch.meta_info.update(meta)
    return batch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", "qwen2", seed=3))


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_megatron_to_hf_engine_sync(checkpoint, tp, pp):
    for rank, result in enumerate(run_multiprocess(sync_and_verify, 2, checkpoint, tp, pp, timeout_s=600)):
        where = f"rank {rank}"
        assert result["num_buckets"] > 3, where
        assert result["v1"]["rollout/logprob_diff_max"] < 1e-5, (where, result["v1"])
        assert result["greedy_equal"], where
        assert "all" in result["after_step"] and "checksums agree" in result["after_step"], (where, result)
        assert result["v2"]["rollout/logprob_diff_max"] < 1e-5, (where, result["v2"])
        assert result["version"] == 2, where
        assert "first: ['model.layers.0.self_attn.k_proj.bias']" in result["corrupted"], (
            where,
            result["corrupted"],
        )
