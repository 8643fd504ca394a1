"""SGLangEngine (colocated, in-process transport) against the strict SGLang 0.5.23 stand-in: the weights it
holds after a sync are exactly what was sent (asynchronous copies, no buffer reuse), SGLang's memory state
machine is respected, ports are explicit and distinct, the engine is driven from its own thread, and the
trainer's SIGTERM handler survives the engine's start."""

from __future__ import annotations

import random
import signal
import threading

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.sglang import build_sglang_engine
from megatron_rl.weights.sync import WeightSyncError, sync_weights
from megatron_rl.weights.verify import verify_sync
from megatron_rl_testing.rollout_models import (
    prompt_batch, source_model, tiny_qwen2_config, trainer_log_probs,
)


@pytest.fixture
def model_dir(tmp_path):
    tiny_qwen2_config().save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def engine_for(model_dir: str, *, tp: int = 1, replica_index: int = 0, base_gpu_id: int = 0, **rollout):
    config = RolloutConfig(name="sglang", tensor_model_parallel_size=tp, response_length=5,
                           **{"dtype": "float32", **rollout})
    return build_sglang_engine(config, model_dir, replica_index=replica_index, base_gpu_id=base_gpu_id,
                               eos_token_id=2, pad_token_id=0)


def held(engine) -> dict[str, torch.Tensor]:
    return engine.transport._engine.stand_in_state_dict()


def assert_holds(engine, model) -> None:
    got, want = held(engine), model.state_dict()
    assert got.keys() == want.keys()
    bad = [name for name in want if not torch.equal(got[name], want[name])]
    assert not bad, f"the engine does not hold what was sent: {bad[:4]}"


def test_every_bucket_arrives_exactly_although_copies_run_after_the_call(sglang_stand_in, model_dir):
    engine = engine_for(model_dir)
    try:
        for version, seed in ((1, 11), (2, 12)):
            source = source_model(seed)
            # small buckets: many loads in flight while the next bucket is filled
            stats = sync_weights(source.state_dict().items(), engine, version=version, bucket_bytes=4096)
            assert stats.num_buckets > 10 and engine.weight_version == version
            assert_holds(engine, source)
        metrics = verify_sync(trainer_log_probs(source), engine, prompt_batch([3, 4]), threshold=1e-5)
        assert metrics["rollout/logprob_diff_max"] < 1e-5
    finally:
        engine.shutdown()


def test_memory_is_released_and_resumed_in_sglangs_order(sglang_stand_in, model_dir):
    engine = engine_for(model_dir)
    stand_in = engine.transport._engine
    try:
        # a fresh engine has released nothing: its first sync resumes nothing (SGLang would kill the trainer)
        sync_weights(source_model(1).state_dict().items(), engine, version=0)
        assert engine.released == set() and engine.generate_sequences(prompt_batch([3])).meta_info["weight_version"] == 0
        engine.sleep()
        engine.sleep()  # nothing is released twice (the stand-in refuses a double release)
        memory = stand_in.stand_in_memory()[0]
        assert engine.released == {"weights", "kv_cache", "cuda_graph"}
        assert memory["weights"] == memory["kv_cache"] == memory["cuda_graph"] == 0  # really gone
        with pytest.raises(RuntimeError, match="cannot generate yet: its weights were released"):
            engine.generate_sequences(prompt_batch([3]))
        source = source_model(2)
        sync_weights(source.state_dict().items(), engine, version=1)
        assert engine.released == set() and all(v > 0 for v in stand_in.stand_in_memory()[0].values())
        assert_holds(engine, source)
        out = engine.generate_sequences(prompt_batch([3]))
        assert out.meta_info["weight_version"] == 1
    finally:
        engine.shutdown()


def test_engines_seeded_alike_get_distinct_explicit_ports(sglang_stand_in, model_dir):
    engines = []
    try:
        for index in range(2):
            random.seed(0)  # what identical trainer seeds do to SGLang's own port choice
            engines.append(engine_for(model_dir, replica_index=index, base_gpu_id=index))
        ports = [e.transport.nccl_port for e in engines]
        assert ports[0] != ports[1] and [e.transport._engine.stand_in_port() for e in engines] == ports
    finally:
        for engine in engines:
            engine.shutdown()


def test_the_trainers_sigterm_handler_survives_the_engine(sglang_stand_in, model_dir):
    def checkpoint_and_stop(signum, frame):
        pass

    signal.signal(signal.SIGTERM, checkpoint_and_stop)
    engine = engine_for(model_dir)
    try:
        assert signal.getsignal(signal.SIGTERM) is checkpoint_and_stop
    finally:
        engine.shutdown()


def test_the_engine_is_driven_from_its_own_thread(sglang_stand_in, model_dir):
    engine = engine_for(model_dir)
    errors: list[BaseException] = []

    def from_helper():
        try:
            engine.generate_sequences(prompt_batch([3]))
        except BaseException as exc:  # noqa: BLE001 - the assertion is on the message
            errors.append(exc)

    try:
        sync_weights(source_model(3).state_dict().items(), engine, version=1, bucket_bytes=4096)  # no helper thread
        thread = threading.Thread(target=from_helper, name="helper")
        thread.start()
        thread.join()
        assert errors and "called from thread 'helper'" in str(errors[0])
    finally:
        engine.shutdown()


def test_cuda_graph_memory_is_really_released(sglang_stand_in, model_dir):
    engine = engine_for(model_dir)
    try:
        engine.sleep()
        assert engine.transport._engine.stand_in_memory()[0]["cuda_graph"] == 0
    finally:
        engine.shutdown()


def test_a_failed_sync_leaves_an_engine_that_refuses_to_generate(sglang_stand_in, model_dir):
    engine = engine_for(model_dir)
    try:
        broken = list(source_model(4).state_dict().items())
        broken[3] = (broken[3][0], torch.zeros(7))  # a wrong shape, named by the engine
        with pytest.raises(Exception, match=broken[3][0]):
            sync_weights(broken, engine, version=1)
        with pytest.raises(RuntimeError, match="cannot generate yet"):
            engine.generate_sequences(prompt_batch([3]))
        with pytest.raises(WeightSyncError, match="no tensors"):
            sync_weights([], engine, version=1)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("checkpoint_dtype", ["float32", "float16"])
def test_rollout_dtype_auto_reaches_sglang_resolved(sglang_stand_in, tmp_path, checkpoint_dtype):
    """rollout.dtype=auto is resolved once (bf16 on CUDA) and passed to SGLang as such: the engine serves the
    dtype the trainer syncs in. Passed as "auto", SGLang serves the checkpoint's dtype (fp16 for fp32 and fp16
    checkpoints) and the stand-in refuses the bf16 buckets (issue 32, item 12)."""
    tiny_qwen2_config(torch_dtype=checkpoint_dtype).save_pretrained(tmp_path / "model")
    engine = engine_for(str(tmp_path / "model"), dtype="auto")
    try:
        assert engine.dtype == torch.bfloat16
        source = source_model(3)
        sync_weights(source.state_dict().items(), engine, version=1)
        got = held(engine)
        bad = [n for n, t in source.state_dict().items() if not torch.equal(got[n], t.to(torch.bfloat16).float())]
        assert not bad, f"the engine does not serve the bf16 weights the trainer sent: {bad[:4]}"
    finally:
        engine.shutdown()
