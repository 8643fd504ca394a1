"""The strict CPU stand-in of SGLang 0.5.23 (tests/stand_ins/sglang): each test asserts a rule that real
SGLang on a GPU cluster enforces, so an adapter tested against the stand-in cannot rely on CPU leniency."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_rl_testing.rollout_models import source_model, tiny_qwen2_config

STAND_INS = Path(__file__).resolve().parents[1] / "stand_ins"
# bound by the module fixture ``stand_in_root``: the stand-in is importable as ``sglang`` only while this
# module runs, so no other test module can pick it up by accident
sglang = Engine = ShardLayout = MultiprocessingSerializer = get_free_port_below_ephemeral = None
FlattenedTensorMetadata = None

ENV_KEYS = (
    "SGLANG_STAND_IN_ROOT",
    "SGLANG_STAND_IN_NODE",
    "SGLANG_STAND_IN_GPUS_PER_NODE",
    "CUDA_VISIBLE_DEVICES",
    "MEGATRON_RL_DEVICE_INDEX",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH",
    "SGLANG_STAND_IN_COPY_DELAY_S",
    "SGLANG_STAND_IN_COPY_HOLD",
    "PYTHONPATH",
)


@contextlib.contextmanager
def env(**values: str | None):
    """Set (None: unset) environment variables for the block."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def keep_signals():
    """Engine() replaces SIGTERM/SIGQUIT handlers like SGLang; keep them from leaking into other tests."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGQUIT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.fixture(scope="module", autouse=True)
def stand_in_root(tmp_path_factory):
    global sglang, Engine, ShardLayout, MultiprocessingSerializer, get_free_port_below_ephemeral
    global FlattenedTensorMetadata
    sys.path.insert(0, str(STAND_INS))
    sharing = torch.multiprocessing.get_sharing_strategy()
    import sglang as _sglang
    from sglang._stand_in.sharding import ShardLayout as _layout
    from sglang.srt.entrypoints.engine import Engine as _engine
    from sglang.srt.utils import MultiprocessingSerializer as _serializer
    from sglang.srt.utils.network import get_free_port_below_ephemeral as _port
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as _meta

    sglang, Engine, ShardLayout, MultiprocessingSerializer = _sglang, _engine, _layout, _serializer
    get_free_port_below_ephemeral, FlattenedTensorMetadata = _port, _meta
    root = tmp_path_factory.mktemp("sglang_stand_in")
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ["SGLANG_STAND_IN_ROOT"] = str(root)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STAND_INS), saved["PYTHONPATH"]]))
    with keep_signals():
        yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch.multiprocessing.set_sharing_strategy(sharing)
    sys.path.remove(str(STAND_INS))
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]


def _model_dir(tmp_path_factory, name: str, **overrides) -> tuple[str, object]:
    path = tmp_path_factory.mktemp(name)
    config = tiny_qwen2_config(**overrides)
    config.save_pretrained(path)
    return str(path), config


@pytest.fixture(scope="module")
def kv1_model(tmp_path_factory):
    """4 q heads, 1 kv head: with tp=2 the kv head is replicated on both ranks."""
    return _model_dir(tmp_path_factory, "kv1", num_key_value_heads=1)


@pytest.fixture(scope="module")
def kv2_model(tmp_path_factory):
    return _model_dir(tmp_path_factory, "kv2")


def engine_kwargs(model_dir: str, **overrides):
    kwargs = {
        "model_path": model_dir,
        "tp_size": 1,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,
        "mem_fraction_static": 0.5,
        "random_seed": 3,
    }
    kwargs.update(overrides)
    return kwargs


@pytest.fixture(scope="module")
def tp2(kv1_model, stand_in_root):
    """tp=2 on node A, GPUs 0 and 1 (no CUDA_VISIBLE_DEVICES): records the SIGTERM handler around it."""

    def trainer_handler(signum, frame):  # what a trainer installs to checkpoint on SIGTERM
        pass

    # while this file exists the engine's copies wait: a test that must act before a copy holds them
    hold = stand_in_root / "tp2_copy_hold"
    with keep_signals(), env(SGLANG_STAND_IN_NODE="nodeA", SGLANG_STAND_IN_COPY_HOLD=str(hold)):
        signal.signal(signal.SIGTERM, trainer_handler)
        engine = Engine(**engine_kwargs(kv1_model[0], tp_size=2, nccl_port=get_free_port_below_ephemeral()))
        engine.sigterm_after_init = signal.getsignal(signal.SIGTERM)
    engine.trainer_handler = trainer_handler
    engine.copy_hold = hold
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tp1(kv2_model):
    """tp=1 on node B with CUDA_VISIBLE_DEVICES=3,5 (so on physical GPU 3), cuda_graph memory saver on."""
    with (
        keep_signals(),
        env(SGLANG_STAND_IN_NODE="nodeB", CUDA_VISIBLE_DEVICES="3,5", SGLANG_MEMORY_SAVER_CUDA_GRAPH="true"),
    ):
        engine = Engine(**engine_kwargs(kv2_model[0], nccl_port=get_free_port_below_ephemeral()))
    yield engine
    engine.shutdown()


def flatten(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """A flattened uint8 bucket like SGLang's FlattenedTensorBucket (a fresh buffer)."""
    parts, metadata, offset = [], [], 0
    for name, t in state.items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(
            FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + raw.numel(), t.numel())
        )
        parts.append(raw)
        offset += raw.numel()
    return torch.cat(parts), metadata


def payloads(flat, metadata, tp: int, device_indices=None, **env_values) -> list[str]:
    """One payload per TP rank, each serialized 'on' the GPU of trainer rank i (its current device)."""
    out = []
    for i in range(tp):
        index = i if device_indices is None else device_indices[i]
        with env(MEGATRON_RL_DEVICE_INDEX=str(index), **env_values):
            out.append(
                MultiprocessingSerializer.serialize(
                    {"flattened_tensor": flat, "metadata": metadata}, output_str=True
                )
            )
    return out


def load(engine, state, tp, **kw) -> tuple[bool, str]:
    assert engine.begin_weight_update() == (True, "Success")
    flat, metadata = flatten(state)
    result = engine.update_weights_from_tensor(
        payloads(flat, metadata, tp, **kw), load_format="flattened_bucket"
    )
    assert engine.end_weight_update() == (True, "Success")
    return result


def hf_state(seed: int, config) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in source_model(seed, config).state_dict().items()}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, tensor in want.items():
        assert torch.equal(got[k], tensor), k


# ---------------------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("num_kv", [1, 2])
def test_sharding_reassembles_hf_weights(tp, num_kv):
    config = tiny_qwen2_config(num_key_value_heads=num_kv)
    full = hf_state(5, config)
    layouts = [ShardLayout(config, {k: v.shape for k, v in full.items()}, tp, r) for r in range(tp)]
    shards = [layout.shard(full) for layout in layouts]
    assert_same(layouts[0].reassemble(shards), full)
    hd, q_per, kv_per = 8, 4 // tp, max(1, num_kv // tp)
    qkv = shards[-1]["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((q_per + 2 * kv_per) * hd, 32)
    q = full["model.layers.0.self_attn.q_proj.weight"]
    k = full["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(qkv[: q_per * hd], q[(tp - 1) * q_per * hd : tp * q_per * hd])
    kv_head = (tp - 1) * num_kv // tp  # last rank's kv head (replicated when tp > num_kv)
    assert torch.equal(qkv[q_per * hd : (q_per + kv_per) * hd], k[kv_head * hd : (kv_head + kv_per) * hd])
    assert shards[0]["model.layers.0.mlp.down_proj.weight"].shape == (32, 64 // tp)
    assert shards[0]["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 64 // tp, 32)
    assert shards[0]["model.embed_tokens.weight"].shape == (128 // tp, 32)  # vocab 96 padded to 128
    with pytest.raises(ValueError, match="model.norm.weight"):
        layouts[0].plan("model.norm.weight", (31,))
    with pytest.raises(ValueError, match="not a parameter"):
        layouts[0].plan("model.layers.9.mlp.up_proj.weight", (64, 32))


def test_engine_holds_only_its_shard_and_reassembles_exactly(tp2, tp1, kv1_model, kv2_model):
    for engine, (path, config), tp in ((tp2, kv1_model, 2), (tp1, kv2_model, 1)):
        want = hf_state(11, config)
        where = (
            {"SGLANG_STAND_IN_NODE": "nodeA"}
            if tp == 2
            else {"SGLANG_STAND_IN_NODE": "nodeB", "CUDA_VISIBLE_DEVICES": "3,5"}
        )  # trainer rank on GPU 3
        assert load(engine, want, tp, **where) == (True, "Success")
        assert_same(engine.stand_in_state_dict(), want)
        shards = engine.stand_in_shards()
        layouts = [ShardLayout(config, {k: v.shape for k, v in want.items()}, tp, r) for r in range(tp)]
        for layout, shard in zip(layouts, shards):
            assert_same(shard, layout.shard(want))
    # replicated kv head, different q heads on the two ranks
    a, b = (s["model.layers.1.self_attn.qkv_proj.weight"] for s in tp2.stand_in_shards())
    assert torch.equal(a[16:], b[16:]) and not torch.equal(a[:16], b[:16])


def test_generate_is_the_hf_model_greedy(tp2, kv1_model):
    _, config = kv1_model
    want = hf_state(12, config)
    assert load(tp2, want, 2, SGLANG_STAND_IN_NODE="nodeA")[0]
    model = source_model(12, config)
    prompt = [5, 17, 33, 8]
    out = tp2.generate(
        input_ids=[prompt],
        sampling_params={"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
        return_logprob=True,
    )[0]
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1], -1)
    assert out["output_ids"] == logp.argmax(-1).tolist()
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, logp.gather(-1, ids[0, len(prompt) :, None])[:, 0], atol=1e-4, rtol=0)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    with pytest.raises(ValueError, match="unknown sampling params"):
        tp2.generate(input_ids=[prompt], sampling_params={"max_tokens": 3})


# ---------------------------------------------------------------------------------------------- devices
def test_second_engine_on_a_claimed_gpu_is_rejected(tp1, kv2_model):
    with (
        keep_signals(),
        env(SGLANG_STAND_IN_NODE="nodeB", CUDA_VISIBLE_DEVICES="5,3"),  # physical GPU 3 again
        pytest.raises(RuntimeError, match=r"GPU 3 on node nodeB already holds an SGLang scheduler"),
    ):
        Engine(**engine_kwargs(kv2_model[0], base_gpu_id=1))
    assert tp1.stand_in_memory()[0]["weights"] > 0  # the first engine is unharmed


def test_base_gpu_id_outside_visible_devices_is_rejected(kv2_model):
    with (
        keep_signals(),
        env(SGLANG_STAND_IN_NODE="nodeB", CUDA_VISIBLE_DEVICES="3,5"),
        pytest.raises(RuntimeError, match=r"GPU index 2 .* not visible \(CUDA_VISIBLE_DEVICES=3,5"),
    ):
        Engine(**engine_kwargs(kv2_model[0], tp_size=2, base_gpu_id=1))


def test_engine_needs_its_root_and_known_kwargs(kv2_model):
    with (
        keep_signals(),
        env(SGLANG_STAND_IN_ROOT=None),
        pytest.raises(RuntimeError, match="SGLANG_STAND_IN_ROOT"),
    ):
        Engine(**engine_kwargs(kv2_model[0]))
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        Engine(**engine_kwargs(kv2_model[0], tensor_parallel_size=2))
    with pytest.raises(ValueError, match="load_format='dummy'"):
        Engine(**engine_kwargs(kv2_model[0], load_format="auto"))
    assert sglang.__version__ == "0.5.23"


def test_payload_serialized_on_the_wrong_gpu_is_rejected(tp2, kv1_model):
    state = hf_state(13, kv1_model[1])
    ok, message = load(tp2, state, 2, device_indices=[0, 0], SGLANG_STAND_IN_NODE="nodeA")
    assert not ok
    assert "node nodeA GPU 0" in message and "runs on node nodeA GPU 1" in message
    ok, message = load(tp2, state, 2, SGLANG_STAND_IN_NODE="nodeZ")
    assert not ok and "nodeZ" in message
    ok, message = tp2.begin_weight_update()
    flat, metadata = flatten(state)
    short = tp2.update_weights_from_tensor(
        payloads(flat, metadata, 1, SGLANG_STAND_IN_NODE="nodeA"), load_format="flattened_bucket"
    )
    tp2.end_weight_update()
    assert short[0] is False and "exactly tp_size=2" in short[1]


def test_unpickler_refuses_foreign_globals():
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        MultiprocessingSerializer.deserialize(pickle.dumps((1, Evil())))


# ---------------------------------------------------------------------------------------------- async copies
def test_copies_are_asynchronous_and_read_the_producer_buffer_later(tp2, kv1_model):
    config = kv1_model[1]
    sent = hf_state(21, config)
    flat, metadata = flatten(sent)
    assert tp2.begin_weight_update()[0]
    blobs = payloads(flat, metadata, 2, SGLANG_STAND_IN_NODE="nodeA")
    tp2.copy_hold.touch()  # the copy waits until zero_() is done, however long this process is stalled
    try:
        assert tp2.update_weights_from_tensor(blobs, load_format="flattened_bucket") == (True, "Success")
        flat.zero_()  # the producer reuses its buffer as soon as the call returns: the copy has not run yet
    finally:
        tp2.copy_hold.unlink()
    assert tp2.end_weight_update()[0]
    got = tp2.stand_in_state_dict()
    assert sum(float(t.abs().sum()) for t in got.values()) == 0.0
    assert sum(float(t.abs().sum()) for t in sent.values()) > 0.0

    # a fresh buffer per load (kept untouched until the next read) gives exact weights
    assert load(tp2, sent, 2, SGLANG_STAND_IN_NODE="nodeA") == (True, "Success")
    assert_same(tp2.stand_in_state_dict(), sent)


def test_weight_update_session_rules(tp2, kv1_model):
    flat, metadata = flatten(hf_state(22, kv1_model[1]))
    blobs = payloads(flat, metadata, 2, SGLANG_STAND_IN_NODE="nodeA")
    assert tp2.update_weights_from_tensor(blobs, load_format="flattened_bucket") == (
        False,
        "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
    )
    assert tp2.end_weight_update() == (
        False,
        "no weight-update session is open; call begin_weight_update() first",
    )
    assert tp2.begin_weight_update() == (True, "Success")
    assert tp2.begin_weight_update() == (
        False,
        "a weight-update session is already open; call end_weight_update() first",
    )
    bucket = {
        "model.norm.weight": torch.full((32,), 7.0),
        "model.layers.0.input_layernorm.weight": torch.ones(31),
    }
    ok, message = tp2.update_weights_from_tensor(
        payloads(*flatten(bucket), 2, SGLANG_STAND_IN_NODE="nodeA"), load_format="flattened_bucket"
    )
    assert not ok and "model.layers.0.input_layernorm.weight" in message and "(31,)" in message
    assert tp2.end_weight_update() == (True, "Success")
    # like SGLang's load loop, what came before the bad tensor was loaded: a failed update is a partial one
    assert torch.equal(tp2.stand_in_state_dict()["model.norm.weight"], torch.full((32,), 7.0))


# ------------------------------------------------------------------------------------- threads, signals
def test_calls_from_another_thread_are_rejected(tp2):
    errors = []

    def call():
        try:
            tp2.stand_in_memory()
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors and "thread that created the Engine" in errors[0]


def test_engine_replaces_the_callers_sigterm_handler(tp2):
    assert tp2.sigterm_after_init is not tp2.trainer_handler
    assert callable(tp2.sigterm_after_init) and tp2.sigterm_after_init.__name__ == "sigterm_handler"


# ---------------------------------------------------------------------------------------------- memory
def test_released_weights_are_freed_and_nan_after_resume(tp2, kv1_model):
    want = hf_state(31, kv1_model[1])
    assert load(tp2, want, 2, SGLANG_STAND_IN_NODE="nodeA")[0]
    held = tp2.stand_in_memory()
    tp2.release_memory_occupation(["weights", "kv_cache"])
    mem = tp2.stand_in_memory()
    assert all(m["weights"] == 0 and m["kv_cache"] == 0 for m in mem)
    assert all(m["cuda_graph"] == h["cuda_graph"] for m, h in zip(mem, held))
    with pytest.raises(RuntimeError, match="weights are released"):
        tp2.generate(input_ids=[[4, 5]], sampling_params={"max_new_tokens": 2})
    tp2.resume_memory_occupation(["weights", "kv_cache"])
    assert tp2.stand_in_memory() == held
    assert all(bool(t.isnan().all()) for t in tp2.stand_in_state_dict().values())
    with pytest.raises(RuntimeError, match="NaN"):
        tp2.generate(input_ids=[[4, 5]], sampling_params={"max_new_tokens": 2})
    assert load(tp2, want, 2, SGLANG_STAND_IN_NODE="nodeA")[0]
    assert_same(tp2.stand_in_state_dict(), want)
    assert len(tp2.generate(input_ids=[[4, 5]], sampling_params={"max_new_tokens": 2})[0]["output_ids"]) >= 1


def test_cuda_graph_memory_is_released_only_with_the_env_var(tp2, tp1):
    before = tp2.stand_in_memory()
    tp2.release_memory_occupation(["cuda_graph"])  # built without SGLANG_MEMORY_SAVER_CUDA_GRAPH
    assert [m["cuda_graph"] for m in tp2.stand_in_memory()] == [m["cuda_graph"] for m in before]
    tp2.resume_memory_occupation(["cuda_graph"])
    tp1.release_memory_occupation(["cuda_graph"])  # built with SGLANG_MEMORY_SAVER_CUDA_GRAPH=true
    assert tp1.stand_in_memory()[0]["cuda_graph"] == 0
    tp1.resume_memory_occupation(["cuda_graph"])
    assert tp1.stand_in_memory()[0]["cuda_graph"] > 0


def test_distinct_explicit_ports_coexist(tp2, tp1):
    assert tp2.stand_in_port() != tp1.stand_in_port()
    assert tp2.stand_in_gpus() == [("nodeA", 0), ("nodeA", 1)]
    assert tp1.stand_in_gpus() == [("nodeB", 3)]
    assert len(tp2.stand_in_memory()) == 2 and len(tp1.stand_in_memory()) == 1


def test_unmatched_resume_kills_the_engine(tp1, stand_in_root):
    with pytest.raises(RuntimeError, match="kv_cache"):
        tp1.resume_memory_occupation(["kv_cache"])  # never released: SGLang's scheduler dies (KeyError)
    with pytest.raises(RuntimeError, match="engine is dead"):
        tp1.stand_in_memory()
    with pytest.raises(RuntimeError, match="engine is dead"):
        tp1.generate(input_ids=[[4, 5]], sampling_params={"max_new_tokens": 2})
    assert not (stand_in_root / "nodeB" / "gpu3").exists()  # the dead engine's GPU claim is gone
    tp1.shutdown()
    tp1.shutdown()  # idempotent


# ---------------------------------------------------------------------------------------------- ports
@pytest.fixture
def keep_random_state():
    state = random.getstate()
    yield
    random.setstate(state)


def test_engines_seeded_alike_pick_the_same_port_and_the_second_fails(
    kv2_model, keep_random_state, monkeypatch
):
    import sglang.srt.utils.network as network

    random.seed(1234)
    port = get_free_port_below_ephemeral()
    outcomes: dict[str, object] = {}
    done = threading.Event()
    drew = {"first": threading.Event(), "second": threading.Event()}
    draw = network.get_free_port_below_ephemeral

    def draw_in_turn(*args, **kwargs):  # what Engine() calls for its nccl_port, in the thread named by key
        chosen = draw(*args, **kwargs)
        key = threading.current_thread().name
        drew[key].set()
        if key == "first":  # both draw before either binds, however slow the second thread is to start
            drew["second"].wait(60)
        return chosen

    monkeypatch.setattr(network, "get_free_port_below_ephemeral", draw_in_turn)

    def build(key: str, base: int) -> None:
        try:
            engine = Engine(**engine_kwargs(kv2_model[0], base_gpu_id=base))  # nccl_port chosen for us
        except Exception as exc:  # noqa: BLE001
            outcomes[key] = exc
            return
        outcomes[key] = engine.stand_in_port()
        done.wait(120)
        engine.shutdown()

    with env(SGLANG_STAND_IN_NODE="nodeC"):
        random.seed(1234)  # two launcher processes seeded alike
        first = threading.Thread(target=build, args=("first", 0), name="first")
        first.start()
        assert drew["first"].wait(60), outcomes  # it has drawn its port; its scheduler binds it later
        random.seed(1234)
        second = threading.Thread(target=build, args=("second", 1), name="second")
        second.start()
        start = time.monotonic()
        while len(outcomes) < 2 and time.monotonic() - start < 150:
            time.sleep(0.1)
        done.set()
        first.join(60)
        second.join(60)
    errors = [v for v in outcomes.values() if isinstance(v, Exception)]
    ports = [v for v in outcomes.values() if isinstance(v, int)]
    assert ports == [port] and len(errors) == 1, outcomes
    assert f"nccl_port {port}" in str(errors[0]) and "EADDRINUSE" in str(errors[0])


# ---------------------------------------------------------------------------------------------- server
def http(url: str, route: str, body=None, method: str = "POST", timeout: float = 120.0):
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + route, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def in_thread(fn, *args):
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", fn(*args)), daemon=True)
    thread.start()
    return thread, box


SERVER_PROCS: dict = {}


@pytest.fixture(scope="module")
def server(kv1_model):
    import sglang_server

    proc, url = sglang_server.start(
        kv1_model[0],
        tp_size=2,
        env={"SGLANG_STAND_IN_NODE": "nodeD"},
        nccl_port=get_free_port_below_ephemeral(),
    )
    SERVER_PROCS[url] = proc
    yield url
    with contextlib.suppress(Exception):  # killed below if it does not stop on its own
        http(url, "/stand_in/shutdown", {}, timeout=30)
        proc.wait(30)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def test_server_single_session(server):
    assert http(server, "/server_info", method="GET")[1]["version"] == "0.5.23"
    assert http(server, "/server_info", method="GET")[1]["tp_size"] == 2
    status, answer = http(
        server,
        "/update_weights_from_distributed",
        {
            "names": ["model.norm.weight"],
            "dtypes": ["float32"],
            "shapes": [[32]],
            "group_name": "weight_update_group",
        },
    )
    assert (
        status == 400
        and "must run between begin_weight_update() and end_weight_update()" in answer["message"]
    )
    assert http(server, "/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
    status, answer = http(server, "/begin_weight_update", {})  # a second owner cannot open a session
    assert status == 400 and answer["message"] == (
        "a weight-update session is already open; call end_weight_update() first"
    )
    assert http(server, "/end_weight_update", {})[0] == 200
    status, answer = http(server, "/end_weight_update", {})
    assert status == 400 and "no weight-update session is open" in answer["message"]
    assert http(server, "/begin_weight_update", {"unknown_field": 1})[0] == 400


def test_server_group_world_size_is_checked(server):
    status, answer = http(
        server,
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 29999,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "too_small",
            "backend": "gloo",
        },
    )
    assert status == 400 and "rank_offset 1 + tp_size 2 = 3 exceeds world_size 2" in answer["message"]


def test_server_distributed_update_gives_exact_weights(server, kv1_model):
    import hashlib

    import torch.distributed as dist

    from megatron_rl.rollout.update_group import init_weight_update_group

    port = get_free_port_below_ephemeral()
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "wu",
        "backend": "gloo",
    }
    thread, box = in_thread(http, server, "/init_weights_update_group", init)
    group = init_weight_update_group("127.0.0.1", port, rank=0, world_size=3, group_name="wu", backend="gloo")
    thread.join(120)
    assert box["result"][0] == 200, box
    status, answer = http(server, "/init_weights_update_group", init)  # rank 0 inits the group once
    assert status == 400 and "already exists" in answer["message"]
    try:
        sent = hf_state(41, kv1_model[1])
        flat, metadata = flatten(sent)
        request = {
            "names": [m.name for m in metadata],
            "dtypes": ["float32"] * len(metadata),
            "shapes": [list(m.shape) for m in metadata],
            "group_name": "wu",
            "load_format": "flattened_bucket",
            "weight_version": "v7",
            "flush_cache": True,
        }
        assert http(server, "/begin_weight_update", {})[0] == 200
        thread, box = in_thread(http, server, "/update_weights_from_distributed", request)
        dist.broadcast(flat, src=0, group=group)
        thread.join(120)
        assert box["result"] == (200, {"success": True, "message": "Success"})
        assert http(server, "/end_weight_update", {})[0] == 200
        status, digests = http(server, "/stand_in/weights_sha256", method="GET")
        assert digests == {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in sent.items()}
        status, out = http(
            server,
            "/generate",
            {
                "input_ids": [[4, 5, 6]],
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            },
        )
        assert status == 200 and out[0]["meta_info"]["weight_version"] == "v7"
        assert len(out[0]["meta_info"]["output_token_logprobs"]) == len(out[0]["output_ids"])
    finally:
        assert http(server, "/destroy_weights_update_group", {"group_name": "wu"})[0] == 200
        dist.destroy_process_group(group)


def test_engine_start_fails_fast_when_a_scheduler_dies(kv1_model, stand_in_root):
    start = time.monotonic()
    with (
        keep_signals(),
        env(SGLANG_STAND_IN_NODE="nodeE", SGLANG_STAND_IN_CRASH_RANK="0"),  # TP1 then waits for TP0 forever
        pytest.raises(RuntimeError, match=r"failed to start: .*TP0 \(GPU 0\) died with exit code 3"),
    ):
        Engine(**engine_kwargs(kv1_model[0], tp_size=2, nccl_port=get_free_port_below_ephemeral()))
    assert time.monotonic() - start < 90
    assert not list((stand_in_root / "nodeE").iterdir())  # both GPU claims released


def test_generate_is_refused_inside_a_weight_update_session(tp2):
    assert tp2.begin_weight_update()[0]
    try:
        with pytest.raises(RuntimeError, match="open weight-update session"):
            tp2.generate(input_ids=[[4, 5]], sampling_params={"max_new_tokens": 1})
    finally:
        assert tp2.end_weight_update()[0]


def test_server_update_from_tensor_checks_each_rank_gpu(server, kv1_model):
    import hashlib

    sent = hf_state(42, kv1_model[1])
    flat, metadata = flatten(sent)
    request = {"load_format": "flattened_bucket", "flush_cache": True, "weight_version": "v8"}
    assert http(server, "/begin_weight_update", {})[0] == 200
    try:
        wrong = payloads(flat, metadata, 2, device_indices=[0, 0], SGLANG_STAND_IN_NODE="nodeD")
        status, answer = http(
            server, "/update_weights_from_tensor", {**request, "serialized_named_tensors": wrong}
        )
        assert status == 400 and "node nodeD GPU 0" in answer["message"] and "GPU 1" in answer["message"]
        right = payloads(flat, metadata, 2, SGLANG_STAND_IN_NODE="nodeD")
        assert (
            http(server, "/update_weights_from_tensor", {**request, "serialized_named_tensors": right})[0]
            == 200
        )
    finally:
        assert http(server, "/end_weight_update", {})[0] == 200
    digests = http(server, "/stand_in/weights_sha256", method="GET")[1]
    assert digests == {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in sent.items()}
    assert http(server, "/server_info", method="GET")[1]["weight_version"] == "v8"


def test_server_dies_with_its_engine(server):  # keep last: it kills the module's server
    status, answer = http(server, "/resume_memory_occupation", {"tags": ["weights"]})  # nothing released
    assert status == 500 and "engine is dead" in answer["message"] and "'weights'" in answer["message"]
    assert SERVER_PROCS[server].wait(30) == 1  # the server went down with its scheduler
