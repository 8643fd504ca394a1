"""A fake node of GPUs for CPU tests, and a recording double of ``vllm.LLM`` that keeps vLLM 0.32's GPU rules.

The real start-up code (device binding, the rollout mesh, the engines' construction, the memory schedule) runs
as on an 8-GPU node; the test then reads where everything landed and how many bytes each GPU holds.

    node = FakeGpuNode(monkeypatch)               # patches torch.cuda.* and vllm.LLM; 8 GPUs of 80 GiB
    with node.process("rank0", {"LOCAL_RANK": "0"}):   # one simulated process: its environment and CUDA state
        bind_device(...); node.hold_cache(30 << 30)    # its allocator keeps 30 GiB reserved on its device
        engine = VLLMEngine(..., device="cuda")        # vllm.LLM is the double
    node.engines[0].gpus, node.engines[0].bytes_on, node.free_bytes(3)

API (kept small: the planner's tests use it too):
- ``FakeGpuNode(monkeypatch, gpus=8, total_bytes=80 GiB, model_bytes=4 GiB, with_vllm=True, with_sglang=False)``:
  ``model_bytes`` are the weights of the model every engine serves (each TP worker holds its share);
  ``with_vllm``: install the ``vllm.LLM`` double; ``with_sglang``: install a module ``sglang`` whose ``Engine`` is
  the ``sglang.Engine`` double (``__version__`` 0.5.23; SGLang has no CPU build, so it is never the real one).
- ``process(name, env)``: a simulated process. Its environment is applied to ``os.environ`` for the block (and
  restored after); CUDA initialises on the first call that needs a device, reading ``CUDA_VISIBLE_DEVICES``
  then, as CUDA does (a later change of the variable does not change this process's view, only that of the
  processes it starts). Device index i is the i-th visible physical GPU.
- ``hold_cache(nbytes)``: this process's caching allocator holds ``nbytes`` reserved but unused on its current
  device (what training freed); ``torch.cuda.empty_cache()`` of this process gives them back.
- ``hold_tensors(nbytes)``: this process's live tensors (the trainer's state) take ``nbytes`` on its current
  device; ``empty_cache`` does not give them back. A process entered again under the same name keeps both.
- ``free_bytes(gpu)`` / ``total_bytes``: a physical GPU's free and total memory (``torch.cuda.mem_get_info``).
- ``engines``: one ``EngineRecord`` per ``vllm.LLM`` or ``sglang.Engine`` built, in build order: ``engine``
  ("vllm" | "sglang"), ``gpus`` (physical, TP worker order), ``bytes_on`` ({gpu: {"weights": n, "kv_cache": n}}
  of what is resident), ``free_at_start`` ({gpu: free bytes its start measured}), ``kwargs``, ``calls``,
  ``asleep``, ``received`` ({gpu: {name: tensor}} each TP worker opened over CUDA IPC).
- ``record_server_launches(monkeypatch)``: server processes (servers/fleet.py ``start_server``) are not started;
  each launch's command and environment are recorded and a sleeping process of its own session stands in for it.
  ``LaunchRecordingServerActor``: servers/ray_pool.py's ``ServerActor`` on a fake GPU node with its launches
  recorded (a Ray actor class: Ray's workers import it from here), its ``address()`` reporting them under
  "launches".

torch.cuda functions patched: is_available, is_initialized, device_count, current_device, set_device,
mem_get_info, memory_reserved, empty_cache, synchronize.

The ``vllm.LLM`` double (``RecordingLLM``) enforces, as read in vllm 0.32.0's source:
- device index semantics: TP worker i runs on ``cuda:i`` of the environment it inherits when the engine is
  built (vllm/v1/worker/gpu_worker.py:498-501, ``logical_device_id_to_visible_device_id(local_rank)``;
  vllm/platforms/interface.py:288-341: logical id i -> the i-th entry of ``CUDA_VISIBLE_DEVICES``, or
  ``device_ids`` composed with it, vllm/engine/arg_utils.py:2101-2140), and refuses a rank beyond the visible
  devices (gpu_worker.py:492);
- the start-up memory check: every worker refuses to start when its GPU's free memory is below
  ``gpu_memory_utilization`` x total (vllm/v1/worker/utils.py:716-772 ``request_memory``, default 0.92 from
  vllm/config/cache.py:102), with vLLM's message; then it holds its weights and the rest of that budget as
  KV cache (``kv_cache_memory_bytes`` when given), refusing a budget that leaves none
  (vllm/v1/core/kv_cache_utils.py:1009);
- sleep / wake tags: ``sleep`` needs ``enable_sleep_mode`` and releases weights and KV cache (a second sleep
  does nothing, vllm/v1/executor/abstract.py:382-392; level 2 discards the weights); ``wake_up(tags)`` drops
  "scheduling" (vllm/v1/engine/core.py:1007), does nothing when awake or when a tag is not asleep
  (abstract.py:394-404), else maps the tags' memory back, failing like cuMemCreate when the GPU lacks it;
- weights: vLLM's CUDA IPC weight transfer with its session and UUID rules (``fake_cuda_ipc.py``; each TP worker
  opens the handle made on its own GPU); a /dev/shm load (``mrl_load_weights``, a host copy) is refused unless the
  engine drafts with MTP layers, whose weights have no IPC session here.

The ``sglang.Engine`` double (``RecordingSGLangEngine``) enforces, as read in sglang 0.5.23's wheel:
- device index semantics: TP worker i runs on device ``base_gpu_id + i * gpu_id_step`` of the environment the
  engine's scheduler processes inherit (python/sglang/srt/entrypoints/engine.py:935-939), i.e. that entry
  of ``CUDA_VISIBLE_DEVICES``; an index beyond the visible devices fails SGLang's
  ``assert gpu_id < num_gpus`` (srt/utils/common.py:436, get_available_gpu_memory, the worker's first
  measurement);
- mem_fraction_static: the free memory measured before the weights load, the minimum over the TP group
  (srt/distributed/bootstrap.py:207-212), is the base; the KV cache is what stays free after the weights minus
  ``base x (1 - mem_fraction_static)`` (srt/mem_cache/kv_cache_configurator.py:2990-3060), i.e.
  ``mem_fraction_static x base - weights`` on each GPU; none left is SGLang's ValueError (:3043-3058);
- release / resume_memory_occupation(tags): no tags means all of "weights", "kv_cache", "cuda_graph"
  (srt/managers/scheduler_components/weight_updater.py:345-346, :386-387); released tags give their bytes
  back (the double holds no CUDA-graph bytes: SGLang's graphs live outside mem_fraction_static); resuming a tag
  that is not released fails (``offload_tags.remove``, :389-390) and a resume the GPU lacks room for fails as
  CUDA's allocator does. Both need ``enable_memory_saver`` (without it SGLang frees nothing).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl_testing.fake_cuda_ipc import WeightTransferDouble, install_export
__all__ = ["EngineRecord", "FakeGpuNode", "LaunchRecordingServerActor", "RecordingLLM", "RecordingSGLangEngine",
           "record_server_launches"]

GiB = 1 << 30
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.92  # vllm/config/cache.py:102
SLEEP_TAGS = ("weights", "kv_cache")  # vllm/v1/executor/abstract.py:37
SGLANG_VERSION = "0.5.23"
SGLANG_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES


@dataclass
class _Process:
    name: str
    visible: list[int] | None = None  # set when CUDA initialises
    device_index: int = 0


@dataclass
class EngineRecord:
    """One ``vllm.LLM`` or ``sglang.Engine`` the code built: where its TP workers run and what they hold."""

    index: int
    kwargs: dict[str, Any]
    gpus: tuple[int, ...]
    bytes_on: dict[int, dict[str, int]]
    calls: list[str] = field(default_factory=list)
    asleep: set[str] = field(default_factory=set)
    alive: bool = True
    engine: str = "vllm"
    free_at_start: dict[int, int] = field(default_factory=dict)
    received: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # per GPU, over CUDA IPC


class FakeGpuNode:
    def __init__(self, monkeypatch: Any, gpus: int = 8, total_bytes: int = 80 * GiB, model_bytes: int = 4 * GiB,
                 with_vllm: bool = True, with_sglang: bool = False) -> None:
        """``with_vllm``: install the ``vllm.LLM`` double too (importing vLLM costs seconds); ``with_sglang``: the
        ``sglang.Engine`` double, as the module ``sglang`` for the test's duration."""
        self.gpus, self.total_bytes, self.model_bytes = gpus, total_bytes, model_bytes
        self.engines: list[EngineRecord] = []
        # physical GPU -> (owner, kind) -> bytes
        self._held: dict[int, dict[tuple[str, str], int]] = {g: {} for g in range(gpus)}
        self._proc = _Process("main")
        cuda = torch.cuda
        for name, fn in {
            "is_available": lambda: True,
            "is_initialized": lambda: self._proc.visible is not None,
            "device_count": self._device_count,
            "current_device": self._current_device,
            "set_device": self._set_device,
            "mem_get_info": self._mem_get_info,
            "memory_reserved": self._memory_reserved,
            "empty_cache": self._empty_cache,
            "synchronize": lambda device=None: None,
        }.items():
            monkeypatch.setattr(cuda, name, fn)
        if with_vllm:
            import vllm

            monkeypatch.setattr(vllm, "LLM", functools.partial(RecordingLLM, self))
            # a bucket's CUDA IPC export names this process's GPU (fake_cuda_ipc.py)
            self._ipc_dir = tempfile.TemporaryDirectory(prefix="fake_cuda_ipc_")
            install_export(monkeypatch.setattr, self._ipc_dir.name, self.physical)
        if with_sglang:
            sglang = types.ModuleType("sglang")
            sglang.Engine = functools.partial(RecordingSGLangEngine, self)
            sglang.__version__ = SGLANG_VERSION
            monkeypatch.setitem(sys.modules, "sglang", sglang)

    # ------------------------------------------------------------------ simulated processes
    @contextlib.contextmanager
    def process(self, name: str, env: Mapping[str, str] | None = None) -> Iterator[None]:
        """One simulated process: ``env`` over ``os.environ`` for the block, CUDA not yet initialised."""
        saved, outer = dict(os.environ), self._proc
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        self._proc = _Process(name)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)
            self._proc = outer

    def visible_in(self, env: Mapping[str, str]) -> list[int]:
        """Physical GPUs a process started with ``env`` sees (CUDA_VISIBLE_DEVICES; unset: all)."""
        raw = env.get("CUDA_VISIBLE_DEVICES")
        if raw is None:
            return list(range(self.gpus))
        ids = [int(x) for x in raw.split(",") if x.strip()]
        bad = [i for i in ids if not 0 <= i < self.gpus]
        if bad:
            raise RuntimeError(f"CUDA_VISIBLE_DEVICES={raw} names GPUs {bad}; the node has {self.gpus}")
        return ids

    def _visible(self) -> list[int]:
        if self._proc.visible is None:  # CUDA initialises: it reads CUDA_VISIBLE_DEVICES once
            self._proc.visible = self.visible_in(os.environ)
        return self._proc.visible

    def _device_count(self) -> int:
        return len(self._visible() if self._proc.visible is not None else self.visible_in(os.environ))

    def _current_device(self) -> int:
        self._visible()
        return self._proc.device_index

    def _set_device(self, device: Any) -> None:
        index = self._index(device)
        if not 0 <= index < len(self._visible()):
            raise RuntimeError(f"CUDA error: invalid device ordinal ({index}; {len(self._visible())} visible)")
        self._proc.device_index = index

    def _index(self, device: Any) -> int:
        if device is None:
            return self._current_device()
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            return self._current_device() if device.index is None else device.index
        return int(device)

    def physical(self, device: Any = None) -> int:
        """The physical GPU of a device index of the current process."""
        visible = self._visible()
        index = self._index(device)
        if not 0 <= index < len(visible):
            raise RuntimeError(f"CUDA error: invalid device ordinal ({index}; {len(visible)} visible)")
        return visible[index]

    # ------------------------------------------------------------------ memory
    def free_bytes(self, gpu: int) -> int:
        return self.total_bytes - sum(self._held[gpu].values())

    def hold_cache(self, nbytes: int) -> None:
        self._held[self.physical()][(self._proc.name, "cache")] = int(nbytes)

    def hold_tensors(self, nbytes: int) -> None:
        self._allocate(self.physical(), self._proc.name, "tensors", int(nbytes), f"{self._proc.name}'s tensors")

    def _mem_get_info(self, device: Any = None) -> tuple[int, int]:
        gpu = self.physical(device)
        return self.free_bytes(gpu), self.total_bytes

    def _memory_reserved(self, device: Any = None) -> int:
        return self._held[self.physical(device)].get((self._proc.name, "cache"), 0)

    def _empty_cache(self) -> None:
        for held in self._held.values():  # every device's unused cached blocks of this process
            held.pop((self._proc.name, "cache"), None)

    def _allocate(self, gpu: int, owner: str, kind: str, nbytes: int, what: str) -> None:
        free = self.free_bytes(gpu)
        if nbytes > free:
            # what cuMemCreate reports when vLLM's CuMemAllocator maps memory back (vllm/device_allocator/cumem.py)
            raise RuntimeError(f"CUDA Error: out of memory: {what} needs {nbytes / GiB:.2f} GiB on GPU {gpu}, "
                               f"{free / GiB:.2f} GiB free")
        self._held[gpu][(owner, kind)] = nbytes

    def _release(self, gpu: int, owner: str, kind: str) -> None:
        self._held[gpu].pop((owner, kind), None)


class RecordingLLM:
    """``vllm.LLM`` as far as the rollout uses it, with vLLM's GPU rules (module docstring)."""

    def __init__(self, node: FakeGpuNode, **kwargs: Any) -> None:
        self.node = node
        env = dict(os.environ)  # what vLLM's spawned engine core and workers inherit now
        tp = int(kwargs.get("tensor_parallel_size", 1)) * int(kwargs.get("pipeline_parallel_size", 1))
        visible = node.visible_in(env)
        device_ids = kwargs.get("device_ids")
        if device_ids:  # arg_utils.py:2120-2140: indices into CUDA_VISIBLE_DEVICES when it is set
            assigned = [visible[i] for i in device_ids] if env.get("CUDA_VISIBLE_DEVICES") else list(device_ids)
        else:
            assigned = visible
        for rank in range(tp):  # gpu_worker.py:492
            if rank >= len(assigned):
                raise AssertionError(f"DP adjusted local rank {rank} is out of bounds for {len(assigned)} devices.")
        gpus = tuple(assigned[:tp])
        util = float(kwargs.get("gpu_memory_utilization", VLLM_DEFAULT_GPU_MEMORY_UTILIZATION))
        weights = node.model_bytes // tp
        self.record = EngineRecord(len(node.engines), dict(kwargs), gpus, {g: {} for g in gpus})
        owner = f"vllm{self.record.index}"
        for rank, gpu in enumerate(gpus):  # each worker's request_memory (v1/worker/utils.py:761-770)
            free, total = node.free_bytes(gpu), node.total_bytes
            self.record.free_at_start[gpu] = free
            requested = math.ceil(total * util)
            if free < requested:
                self._free_all()
                raise ValueError(
                    f"Free memory on device cuda:{rank} ({free / GiB:.2f}/{total / GiB:.2f} GiB) on startup is less "
                    f"than desired GPU memory utilization ({util}, {requested / GiB:.2f} GiB). Decrease GPU memory "
                    "utilization or reduce GPU memory used by other processes.")
            kv = int(kwargs["kv_cache_memory_bytes"]) if kwargs.get("kv_cache_memory_bytes") else requested - weights
            if kv <= 0:  # kv_cache_utils.py:1009
                self._free_all()
                raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                                 "when initializing the engine.")
            for kind, nbytes in (("weights", weights), ("kv_cache", kv)):
                node._allocate(gpu, owner, kind, nbytes, f"vLLM engine {self.record.index} start")
                self.record.bytes_on[gpu][kind] = nbytes
        self._sizes = {g: dict(b) for g, b in self.record.bytes_on.items()}
        self.transfer = WeightTransferDouble(kwargs, gpus)  # vLLM's CUDA IPC weight transfer (fake_cuda_ipc.py)
        self.record.received = self.transfer.received
        self.weights_valid = kwargs.get("load_format") != "dummy"
        node.engines.append(self.record)
        self.llm_engine = _Engine(self)

    @property
    def _owner(self) -> str:
        return f"vllm{self.record.index}"

    def _free_all(self, kinds: tuple[str, ...] = SLEEP_TAGS) -> None:
        for gpu in self.record.bytes_on:
            for kind in kinds:
                self.node._release(gpu, self._owner, kind)
                self.record.bytes_on[gpu].pop(kind, None)

    def sleep(self, level: int = 1) -> None:
        assert self.record.kwargs.get("enable_sleep_mode"), "sleep() on an engine built without enable_sleep_mode"
        self.record.calls.append(f"sleep{level}")
        if "weights" in self.record.asleep:  # abstract.py:383: already sleeping
            return
        self._free_all()
        self.record.asleep = set(SLEEP_TAGS)
        if level == 2:
            self.weights_valid = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.record.calls.append(f"wake:{','.join(tags) if tags else 'all'}")
        if tags is not None:
            tags = [t for t in tags if t != "scheduling"]  # core.py:1007
            if not tags:
                return
        if not self.record.asleep or (tags and any(t not in self.record.asleep for t in tags)):
            return  # abstract.py:394-404: a warning, nothing woken
        for tag in list(tags or self.record.asleep):
            for gpu, sizes in self._sizes.items():
                what = f"vLLM engine {self.record.index} wake_up({tag})"
                self.node._allocate(gpu, self._owner, tag, sizes[tag], what)
                self.record.bytes_on[gpu][tag] = sizes[tag]
            self.record.asleep.discard(tag)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        self.record.calls.append(method)
        if method in ("start_weight_update", "mrl_ipc_update", "mrl_load_weights"):
            assert "weights" not in self.record.asleep, "weights loaded into memory that is asleep"
        if method == "mrl_load_weights":  # /dev/shm: a host copy, only for an engine that drafts (engine.py)
            assert "speculative_config" in self.record.kwargs, "host-staged weights (/dev/shm) into a GPU engine"
            self.weights_valid = True
        elif self.transfer.call(method, args, kwargs) and method == "mrl_finish_ipc_update":
            self.weights_valid = True
        return [None] * len(self.record.gpus)

    def reset_prefix_cache(self) -> None:
        self.record.calls.append("reset_prefix_cache")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the placement double of vllm.LLM does not generate")


class _Engine:
    """``llm.llm_engine.engine_core``: what VLLMEngine.shutdown calls."""

    def __init__(self, llm: RecordingLLM) -> None:
        self.engine_core = self
        self._llm = llm

    def shutdown(self) -> None:
        self._llm._free_all()
        self._llm.record.alive = False


class RecordingSGLangEngine:
    """``sglang.Engine`` (0.5.23) as far as the colocated rollout uses it, with SGLang's GPU rules (module
    docstring). Weight updates are recorded, not applied; it does not generate."""

    def __init__(self, node: FakeGpuNode, **kwargs: Any) -> None:
        self.node = node
        visible = node.visible_in(os.environ)  # what its scheduler processes inherit now
        tp, base, step = (int(kwargs.get(k, d)) for k, d in (("tp_size", 1), ("base_gpu_id", 0), ("gpu_id_step", 1)))
        indices = [base + rank * step for rank in range(tp)]  # entrypoints/engine.py:935-939
        for rank, index in enumerate(indices):  # utils/common.py:436
            if not 0 <= index < len(visible):
                mask = os.environ.get("CUDA_VISIBLE_DEVICES")
                raise AssertionError(f"SGLang TP worker {rank}: gpu_id {index} (base_gpu_id={base}) < num_gpus "
                                     f"{len(visible)} fails (CUDA_VISIBLE_DEVICES={mask})")
        gpus = tuple(visible[i] for i in indices)
        self.record = EngineRecord(len(node.engines), dict(kwargs), gpus, {g: {} for g in gpus}, engine="sglang")
        self.record.free_at_start = {g: node.free_bytes(g) for g in gpus}
        fraction = float(kwargs["mem_fraction_static"])  # SGLang's own default depends on the GPU: we always pass it
        base_bytes = min(self.record.free_at_start.values())  # distributed/bootstrap.py:207-212: min over TP
        weights = node.model_bytes // tp
        kv = int(fraction * base_bytes) - weights  # kv_cache_configurator.py:3038: free - weights - base x (1 - f)
        if kv <= 0:  # kv_cache_configurator.py:3043-3058
            minimum = 1 - (base_bytes - weights) / base_bytes
            raise ValueError(f"Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static="
                             f"{fraction}. Raise --mem-fraction-static above {math.ceil(minimum * 1000) / 1000:.3f}")
        self._sizes = {g: {"weights": weights, "kv_cache": kv, "cuda_graph": 0} for g in gpus}
        for gpu in gpus:
            for kind, nbytes in self._sizes[gpu].items():
                node._allocate(gpu, self._owner, kind, nbytes, f"SGLang engine {self.record.index} start")
                self.record.bytes_on[gpu][kind] = nbytes
        node.engines.append(self.record)

    @property
    def _owner(self) -> str:
        return f"sglang{self.record.index}"

    def _tags(self, method: str, tags: list[str] | None) -> list[str]:
        assert self.record.kwargs.get("enable_memory_saver"), f"{method} on an engine without enable_memory_saver"
        self.record.calls.append(f"{method}:{','.join(tags) if tags else 'all'}")
        return list(tags or SGLANG_MEMORY_TAGS)  # weight_updater.py:345-346, :386-387

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        for tag in self._tags("release", tags):
            self.record.asleep.add(tag)
            for gpu in self.record.gpus:
                self.node._release(gpu, self._owner, tag)
                self.record.bytes_on[gpu].pop(tag, None)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        for tag in self._tags("resume", tags):
            if tag not in self.record.asleep:
                raise KeyError(tag)  # weight_updater.py:389-390, ``offload_tags.remove(tag)``
            try:
                for gpu in self.record.gpus:
                    nbytes = self._sizes[gpu][tag]
                    what = f"SGLang engine {self.record.index} resume({tag})"
                    self.node._allocate(gpu, self._owner, tag, nbytes, what)
                    self.record.bytes_on[gpu][tag] = nbytes
            except RuntimeError:  # the tag stays released on every GPU
                for gpu in self.record.gpus:
                    self.node._release(gpu, self._owner, tag)
                    self.record.bytes_on[gpu].pop(tag, None)
                raise
            self.record.asleep.discard(tag)

    def _recorded(self, method: str) -> tuple[bool, str]:
        self.record.calls.append(method)
        return True, "Succeeded"

    def begin_weight_update(self) -> tuple[bool, str]:
        return self._recorded("begin_weight_update")

    def end_weight_update(self) -> tuple[bool, str]:
        return self._recorded("end_weight_update")

    def update_weights_from_tensor(self, **kwargs: Any) -> tuple[bool, str]:
        assert "weights" not in self.record.asleep, "weights loaded into memory that is released"
        return self._recorded("update_weights_from_tensor")

    def flush_cache(self) -> None:
        self.record.calls.append("flush_cache")

    def generate(self, **kwargs: Any) -> Any:
        raise NotImplementedError("the placement double of sglang.Engine does not generate")

    def shutdown(self) -> None:
        for gpu in self.record.gpus:
            for kind in SGLANG_MEMORY_TAGS:
                self.node._release(gpu, self._owner, kind)
            self.record.bytes_on[gpu].clear()
        self.record.alive = False


# ---------------------------------------------------------------------------------------------- started servers
def record_server_launches(monkeypatch: Any) -> list[dict[str, Any]]:
    """servers/fleet.py starts no server: each launch is recorded ({"cmd": [...], "env": {...}}), a sleeping
    process in a session of its own (killed as a server's group is) takes its place, /health answers."""
    from megatron_rl.servers import fleet

    launches: list[dict[str, Any]] = []

    def popen(cmd: list[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        launches.append({"cmd": list(cmd), "env": dict(os.environ if env is None else env)})
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    recording = types.SimpleNamespace(**{n: getattr(subprocess, n) for n in ("STDOUT", "TimeoutExpired")}, Popen=popen)
    monkeypatch.setattr(fleet, "subprocess", recording)
    monkeypatch.setattr(fleet, "_healthy", lambda url, api_key: True)
    return launches


def _launch_recording_actor() -> type:
    from megatron_rl.servers.ray_pool import ServerActor

    class LaunchRecordingServerActor(ServerActor):
        def __init__(self, *args: Any) -> None:
            import pytest

            patch = pytest.MonkeyPatch()  # for the actor's life: its process is its own
            FakeGpuNode(patch, with_vllm=False)
            self.launches = record_server_launches(patch)
            super().__init__(*args)

        def address(self) -> dict[str, Any]:
            return {**super().address(), "launches": self.launches}

    return LaunchRecordingServerActor


LaunchRecordingServerActor = _launch_recording_actor()
