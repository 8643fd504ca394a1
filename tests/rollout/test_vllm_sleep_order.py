"""The GPU colocation schedule of VLLMEngine, against a vllm.LLM double that keeps vLLM's sleep-mode rules (vLLM
has no sleep mode on CPU, so the real engine cannot show them here): level 2 discards the weights, waking the
weights gives garbage until a load, nothing generates while asleep, the KV cache comes back only after the load,
and the engine was built with enable_sleep_mode. On CPU sleep() must leave the engine alone."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl_testing.fake_cuda_ipc import WeightTransferDouble, install_export
from megatron_rl_testing.vllm_support import skip_without_vllm

skip_without_vllm()


class SleepingLLM:
    """vllm.LLM as far as the adapter uses it, with the state machine of vLLM's sleep mode (CuMemAllocator)."""

    instances: list["SleepingLLM"] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.calls = kwargs, []
        self.asleep: set[str] = set()
        self.transfer = WeightTransferDouble(kwargs, [0])  # GPU: vLLM's CUDA IPC weight transfer
        self.weights_valid = kwargs.get("load_format") != "dummy"
        SleepingLLM.instances.append(self)

    def sleep(self, level: int = 1) -> None:
        assert self.kwargs.get("enable_sleep_mode"), "sleep() on an engine built without enable_sleep_mode"
        assert not self.asleep, "sleep() twice"
        self.calls.append(f"sleep{level}")
        self.asleep = {"weights", "kv_cache"}
        if level == 2:
            self.weights_valid = False

    def wake_up(self, tags=None) -> None:
        tags = set(tags or ("weights", "kv_cache"))
        assert tags <= self.asleep, f"wake_up({sorted(tags)}) of memory that is not asleep ({sorted(self.asleep)})"
        self.calls.append(f"wake:{','.join(sorted(tags))}")
        self.asleep -= tags

    def collective_rpc(self, method, args=(), kwargs=None):
        if method != "init_weight_transfer_engine":  # at start, before any sleep
            assert "weights" not in self.asleep, "weights loaded into memory that is asleep"
        self.calls.append(method)
        # valid once loaded: the CPU path's reload, or the end of a GPU session (vLLM's post-load processing)
        if method == "mrl_load_weights" or (self.transfer.call(method, args, kwargs) and method == "mrl_finish_ipc_update"):
            self.weights_valid = True
        return [0]

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def generate(self, *args, **kwargs):
        raise AssertionError("not reached in this test")


@pytest.fixture
def engine(monkeypatch, tmp_path):
    import vllm

    from megatron_rl.rollout.vllm import VLLMEngine

    monkeypatch.setattr(vllm, "LLM", SleepingLLM)
    install_export(monkeypatch.setattr, tmp_path, lambda: 0)
    return VLLMEngine(RolloutConfig(name="vllm", response_length=4), tmp_path, max_model_len=16, eos_token_id=1,
                      pad_token_id=0, device="cuda")


def test_gpu_sleep_releases_everything_and_the_sync_wakes_weights_then_kv(engine):
    llm = engine.llm
    assert llm.kwargs["enable_sleep_mode"] and "kv_cache_memory_bytes" not in llm.kwargs
    engine.update_weights([("w", torch.zeros(2))], version=1)
    engine.sleep()
    with pytest.raises(RuntimeError, match="released by sleep"):
        engine.generate_sequences(None)
    engine.begin_weight_update(2)
    engine.load_named_tensors([("w", torch.ones(2))])
    engine.end_weight_update()
    session = ["start_weight_update", "mrl_ipc_update", "mrl_finish_ipc_update", "reset_prefix_cache"]
    assert llm.calls == ["init_weight_transfer_engine", *session, "sleep2", "wake:weights", *session, "wake:kv_cache"]
    assert not llm.asleep and llm.weights_valid and engine.weight_version == 2
    engine.sleep()
    engine.sleep()  # a second release phase before the next sync does nothing more
    assert llm.calls.count("sleep2") == 2


def test_cpu_sleep_keeps_the_engine(monkeypatch, tmp_path):
    import vllm

    from megatron_rl.rollout.vllm import VLLMEngine

    monkeypatch.setattr(vllm, "LLM", SleepingLLM)
    engine = VLLMEngine(RolloutConfig(name="vllm", response_length=4), tmp_path, max_model_len=16, eos_token_id=1,
                        pad_token_id=0, device="cpu")
    engine.update_weights([("w", torch.zeros(2))], version=1)
    engine.sleep()
    assert engine.llm.calls == ["mrl_load_weights", "reset_prefix_cache"]
    assert engine.llm.kwargs["kv_cache_memory_bytes"] == 256 << 20 and "enable_sleep_mode" not in engine.llm.kwargs
