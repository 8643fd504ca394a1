"""Megatron actor (TP 2, gloo) -> the weight export every trainer rank runs -> sync_weights -> vLLM: what vLLM
serves, read back through its kernels, equals the exported buckets bit for bit, before and after a change of the
actor's weights; vLLM's sampled log-probs then equal the trainer's. Dense Qwen2, and the MoE families at EP 2
(Qwen3-MoE, Mixtral, Qwen2-MoE with its gated shared expert and a dense layer): vLLM's fused experts (w13 / w2)
hold the exported experts (issue 38)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.vllm_support import EOS, MAX_LEN, PAD, assert_served_equal, skip_without_vllm, tiny_model

skip_without_vllm()


class _Recorder:
    """A rank's sink: keeps a copy of every exported tensor and passes the bucket on (to vLLM on rank 0)."""

    def __init__(self, engine=None) -> None:
        self.engine, self.sent = engine, {}
        self.dtype, self.async_loads, self.thread_affine = torch.float32, False, False

    def begin_weight_update(self, version: int) -> None:
        self.sent = {}
        if self.engine is not None:
            self.engine.begin_weight_update(version)

    def load_weight_bucket(self, bucket) -> None:
        self.sent.update({name: t.clone() for name, t in bucket.named_tensors()})
        if self.engine is not None:
            self.engine.load_weight_bucket(bucket)

    def end_weight_update(self) -> None:
        if self.engine is not None:
            self.engine.end_weight_update()

    def abort_weight_update(self, reason: str) -> None:
        if self.engine is not None:
            self.engine.abort_weight_update(reason)


def sync_into_vllm(ckpt_dir: str, ep: int = 1) -> dict:
    import torch.distributed as dist

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, compute_full_logits
    from megatron_rl.ops import log_probs_from_logits
    from megatron_rl.rollout.vllm import VLLMEngine
    from megatron_rl.weights import export_hf_weights, sync_weights
    from megatron_rl_testing.rollout_models import prompt_batch

    init_model_parallel(tp=2, pp=1, ep=ep, etp=1 if ep > 1 else None)
    chunks = build_from_hf(ckpt_dir)
    engine = None
    if dist.get_rank() == 0:
        engine = VLLMEngine(RolloutConfig(name="vllm", response_length=6), ckpt_dir, max_model_len=MAX_LEN,
                            eos_token_id=EOS, pad_token_id=PAD)
    sink = _Recorder(engine)
    result: dict = {"served_equal": []}
    try:
        for version in (1, 2):
            stats = sync_weights(export_hf_weights(chunks), sink, version=version, bucket_bytes=16 << 10)
            result.setdefault("num_buckets", stats.num_buckets)
            if engine is not None:
                assert_served_equal(engine.read_weights()[0], sink.sent)
                result["served_equal"].append(version)
            if version == 1:  # change every weight of the actor: the second sync must carry all of them
                torch.manual_seed(11)  # same on both ranks: a replicated tensor gets the same noise on each
                with torch.no_grad():
                    for chunk in chunks:
                        for p in chunk.parameters():
                            p.add_(0.01 * torch.randn_like(p))
        batch = prompt_batch([3, 6, 2, 5])
        batch.batch["input_ids"][batch.batch["attention_mask"] == 0] = PAD
        batch.meta_info.update(temperature=1.0, seed=3)
        out = [None]
        if engine is not None:
            out[0] = engine.generate_sequences(batch)
        dist.broadcast_object_list(out, src=0)
        rollout = out[0]
        width = rollout.batch["responses"].shape[-1]
        ids, mask = rollout.batch["input_ids"], rollout.batch["attention_mask"]
        logits = compute_full_logits(chunks, ids, mask)[:, -width - 1:-1]
        trainer = log_probs_from_logits(logits, rollout.batch["responses"])
        valid = rollout.batch["response_mask"].bool()
        result["logprob_diff_max"] = float((trainer - rollout.batch["rollout_log_probs"])[valid].abs().max())
    finally:
        if engine is not None:
            engine.shutdown()
    return result


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("family, ep", [("qwen2", 1), ("qwen3_moe", 2), ("mixtral", 2), ("qwen2_moe", 2)])
def test_exported_buckets_are_what_vllm_serves(tmp_path, family, ep):
    # TP 2 splits the heads and kv heads; EP 2 puts half the experts on each rank
    ckpt = str(tiny_model(tmp_path / family, seed=3, num_kv_heads=2, family=family))
    results = run_multiprocess(sync_into_vllm, 2, ckpt, ep, timeout_s=900)
    assert results[0]["served_equal"] == [1, 2]
    assert results[0]["num_buckets"] > 3  # several buckets, one reload
    for rank, result in enumerate(results):
        assert result["logprob_diff_max"] < 1e-5, (rank, result)
