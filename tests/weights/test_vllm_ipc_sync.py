"""Issue 49, item 3: colocated vLLM on GPUs receives its weights over CUDA IPC, through vLLM's own weight-transfer
engine (``weight_transfer_config={"backend": "ipc"}``, packed mode), with no host copy: one ``update_weights`` per
bucket inside one session, the post-load processing once at ``finish_weight_update``; at rollout TP 2 each TP
worker opens the copy of every bucket made on its own GPU (every rank of the replica sends its payload, the
leader merges them).

The old path staged every bucket in /dev/shm on GPUs too (141 GB written per sync per node at 70B) and loaded it
with ``mrl_load_weights``. The engine is the real VLLMEngine and the sync the real RolloutReplica over gloo; the
``vllm.LLM`` double keeps vLLM 0.32's weight-transfer rules (megatron_rl_testing/fake_cuda_ipc.py: session order,
each worker looks its GPU's UUID up, the packed buffer split by tensor sizes) and refuses a /dev/shm load."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_rl.bucket import WeightBucket
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.rollout.base import WeightUpdateError
from megatron_rl.rollout.vllm import ipc
from megatron_rl_testing.fake_cuda_ipc import WeightTransferDouble, gpu_uuid, install_export
from megatron_rl_testing.vllm_support import skip_without_vllm

skip_without_vllm()


class IpcLLM:
    """vllm.LLM on the GPUs 0..TP-1 of a node, as the colocated engine drives its weight transfer."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.calls = kwargs, []
        self.transfer = WeightTransferDouble(kwargs, range(int(kwargs["tensor_parallel_size"])))
        self.fail_update: int | None = None  # the update that fails (a worker's copy dies), counted from 0

    def collective_rpc(self, method, args=(), kwargs=None):
        assert method != "mrl_load_weights", "host-staged weights (/dev/shm) into a GPU engine"
        self.calls.append(method)
        if method == "mrl_ipc_update" and self.fail_update == self.calls.count("mrl_ipc_update") - 1:
            self.transfer.active = False  # vLLM's worker closes the session of a failed update
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        assert self.transfer.call(method, args, kwargs), f"unexpected RPC {method}"
        return [None] * len(self.transfer.gpus)

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        pass


def _weights() -> list[tuple[str, torch.Tensor]]:
    """Three layers of non-trivial values, an embedding and a head, 256 KiB each: the 1 MiB buckets split layers."""
    g = torch.Generator().manual_seed(3)
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{p}.weight" for i in range(3)
              for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj", "input_layernorm")]
    return [(name, torch.randn(256, 256, generator=g)) for name in [*names, "lm_head.weight"]]


def _install(setattr_, root: str) -> None:
    import vllm

    setattr_(vllm, "LLM", IpcLLM)
    setattr_(torch.cuda, "is_available", lambda: True)
    setattr_(torch.cuda, "synchronize", lambda device=None: None)
    setattr_(torch.cuda, "empty_cache", lambda: None)
    install_export(setattr_, root, lambda: dist.get_rank() if dist.is_initialized() else 0)


def _sync_twice(root: str, rollout_tp: int) -> dict | None:
    """Two syncs of the same replica through the real RolloutReplica; the leader returns what its engine's
    workers received and the RPCs it made."""
    from megatron_rl.config.schema import RolloutConfig, WeightSyncConfig
    from megatron_rl.distributed.device import rank_place
    from megatron_rl.rollout.mesh import build_rollout_mesh
    from megatron_rl.rollout.vllm import VLLMEngine
    from megatron_rl.weights import RolloutReplica

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    config = RolloutConfig(name="vllm", tensor_model_parallel_size=rollout_tp, response_length=4, dtype="float32",
                           weight_sync=WeightSyncConfig(bucket_size_mb=1, verify_freq=0))
    os.environ["MEGATRON_RL_SHM_DIR"] = os.path.join(root, "shm")  # where a host copy would land
    os.makedirs(os.environ["MEGATRON_RL_SHM_DIR"], exist_ok=True)

    def build(_replica):
        return VLLMEngine(config, root, max_model_len=16, eos_token_id=1, pad_token_id=0, device="cuda")

    replica = RolloutReplica(config, build_rollout_mesh([rank_place(r, r) for r in range(world)], rollout_tp), rank,
                             build, member_dtype=torch.float32)
    weights = _weights()
    try:
        for version in (1, 2):
            replica.sync(lambda plan: iter(weights), version=version)
        if not replica.is_leader:
            return None
        llm = replica.engine.llm
        return {"received": llm.transfer.received, "calls": llm.calls, "sessions": llm.transfer.sessions,
                "every_rank": replica.export_plan().consumers is None, "version": replica.engine.weight_version}
    finally:
        replica.shutdown()


def _check(result: dict, rollout_tp: int, root) -> None:
    sent = dict(_weights())
    assert result["every_rank"], "every rank must materialise the buckets: each worker opens its own GPU's copy"
    for gpu in range(rollout_tp):
        got = result["received"][gpu]
        assert sorted(got) == sorted(sent), f"GPU {gpu} received {sorted(got)}"
        for name, tensor in sent.items():
            assert torch.equal(got[name], tensor), f"GPU {gpu}: {name} differs from what the trainer sent"
    calls = [c for c in result["calls"] if c != "reset_prefix_cache"]
    assert calls[0] == "init_weight_transfer_engine", calls
    # per sync: one session (start ... finish: the post-load processing once) and one update per bucket
    assert calls.count("start_weight_update") == calls.count("mrl_finish_ipc_update") == result["sessions"] == 2
    assert calls.count("mrl_ipc_update") >= 2 * 4, f"{calls}: the buckets were not sent one by one"
    assert result["version"] == 2
    assert not os.listdir(root / "shm"), "a host copy was staged"


def test_rollout_tp1_sync_goes_over_cuda_ipc_without_a_host_copy(tmp_path, monkeypatch):
    _install(monkeypatch.setattr, str(tmp_path))
    monkeypatch.setenv("MEGATRON_RL_SHM_DIR", str(tmp_path / "shm"))
    result = _sync_twice(str(tmp_path), rollout_tp=1)
    _check(result, 1, tmp_path)


def _two_ranks(root: str) -> dict | None:
    _install(setattr, root)  # a process of its own
    return _sync_twice(root, rollout_tp=2)


@pytest.mark.distributed
def test_rollout_tp2_each_worker_opens_the_bucket_made_on_its_own_gpu(tmp_path):
    leader, member = run_multiprocess(_two_ranks, 2, str(tmp_path), timeout_s=300)
    assert member is None
    _check(leader, 2, tmp_path)


def test_a_failed_update_aborts_the_session_and_the_next_sync_starts_afresh(tmp_path, monkeypatch):
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.vllm import VLLMEngine

    _install(monkeypatch.setattr, str(tmp_path))
    engine = VLLMEngine(RolloutConfig(name="vllm", response_length=4, dtype="float32"), tmp_path, max_model_len=16,
                        eos_token_id=1, pad_token_id=0, device="cuda")
    engine.llm.fail_update = 0
    with pytest.raises(WeightUpdateError, match="version 1"):
        engine.update_weights(_weights(), version=1)
    with pytest.raises(RuntimeError, match="cannot generate"):
        engine.generate_sequences(None)
    engine.update_weights(_weights(), version=2)  # vLLM would refuse a start while its session were still open
    assert engine.weight_version == 2 and engine.llm.transfer.sessions == 1
    assert torch.equal(engine.llm.transfer.received[0]["lm_head.weight"], dict(_weights())["lm_head.weight"])


def test_a_trainer_side_failure_closes_the_workers_session(tmp_path, monkeypatch):
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.vllm import VLLMEngine

    _install(monkeypatch.setattr, str(tmp_path))
    engine = VLLMEngine(RolloutConfig(name="vllm", response_length=4, dtype="float32"), tmp_path, max_model_len=16,
                        eos_token_id=1, pad_token_id=0, device="cuda")

    def broken_stream():
        yield _weights()[0]
        raise OSError("the export's gather failed")

    with pytest.raises(OSError, match="gather failed"):
        engine.update_weights(broken_stream(), version=1)
    assert not engine.llm.transfer.active, "the workers' session is left open: the next start_weight_update fails"
    engine.update_weights(_weights(), version=2)
    assert engine.weight_version == 2


def test_a_mixed_dtype_bucket_goes_as_runs_vllm_can_split(tmp_path, monkeypatch):
    """A bucket with alignment padding (a bf16 tensor of odd length before an fp32 one): vLLM splits a buffer by
    tensor sizes from its start and views each piece as its dtype, so one handle over both fails the fp32 view
    (offset 6); the payload sends each back-to-back run as an update of its own, and both arrive exactly."""
    bucket = WeightBucket(1 << 10, "cpu")
    odd, wide, tail = torch.arange(3, dtype=torch.bfloat16), torch.arange(4.0) + 0.5, torch.arange(2.0) - 7
    for name, tensor in (("a", odd), ("b", wide), ("c", tail)):
        bucket.add(name, tensor, tensor.dtype)
    assert [e.start for e in bucket.entries] == [0, 8, 24]  # 6 bytes of "a", 2 of padding
    install_export(monkeypatch.setattr, tmp_path, lambda: 0)
    payload = ipc.bucket_payload(bucket.seal())
    assert [run["names"] for run in payload] == [["a"], ["b", "c"]]
    consumer = WeightTransferDouble({"weight_transfer_config": ipc.BACKEND}, [0])
    for method, args, kwargs in (("init_weight_transfer_engine", (), {"init_info": ipc.INIT_INFO}),
                                 ("start_weight_update", (), None), ("mrl_ipc_update", (ipc.merged_update([payload]),),
                                                                     None), ("finish_weight_update", (), None)):
        consumer.call(method, args, kwargs)
    got = consumer.received[0]
    assert torch.equal(got["a"], odd) and torch.equal(got["b"], wide) and torch.equal(got["c"], tail)
    uuid, handle = ipc.export_handle(bucket.flat())
    whole = [{"names": ["a", "b", "c"], "dtype_names": ["bfloat16", "float32", "float32"], "shapes": [[3], [4], [2]],
              "tensor_sizes": [6, 16, 8], "ipc_handles": {uuid: handle}}]
    consumer.call("start_weight_update", (), None)
    with pytest.raises(RuntimeError, match="divisible"):  # what one handle over the padded bucket would meet
        consumer.call("mrl_ipc_update", (whole,), None)


def test_ranks_that_disagree_or_share_a_gpu_are_refused_by_name():
    base = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "tensor_sizes": [8]}
    merged = ipc.merged_update([[{**base, "ipc_handles": {gpu_uuid(0): {"h": 0}}}],
                                [{**base, "ipc_handles": {gpu_uuid(1): {"h": 1}}}]])
    assert merged == [{**base, "ipc_handles": {gpu_uuid(0): {"h": 0}, gpu_uuid(1): {"h": 1}}}]
    with pytest.raises(ValueError, match="TP rank 1's weight bucket differs .* shapes"):
        ipc.merged_update([[{**base, "ipc_handles": {"a": {}}}], [{**base, "shapes": [[3]], "ipc_handles": {"b": {}}}]])
    with pytest.raises(ValueError, match="same GPU"):
        ipc.merged_update([[{**base, "ipc_handles": {"a": {}}}], [{**base, "ipc_handles": {"a": {}}}]])
    with pytest.raises(ValueError, match=r"\[1, 2\] runs"):
        ipc.merged_update([[base], [base, base]])


def test_a_cuda_handle_crosses_msgpack_as_plain_data_and_is_rebuilt_exactly():
    """torch's rebuild_cuda_tensor arguments (reduce_tensor of a CUDA uint8 tensor) round-trip through the plain
    form vLLM's msgpack carries; anything but a plain uint8 tensor is refused."""
    import msgspec

    args = (torch.Tensor, torch.Size([64]), (1,), 16, torch.storage.TypedStorage, torch.uint8, 3, b"\x01handle",
            4096, 512, False, b"/torch_ref", 7, b"\x02event", True)
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(ipc.plain_handle(args)))
    assert ipc.handle_args(plain) == args
    with pytest.raises(TypeError, match="plain uint8"):
        ipc.plain_handle((torch.Tensor, torch.Size([4]), (1,), 0, torch.storage.TypedStorage, torch.float32,
                          *args[6:]))
