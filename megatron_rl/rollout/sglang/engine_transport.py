"""Transport 1: ``sglang.Engine`` inside the leader rank's process (colocated with the trainer's GPUs).

One engine per rollout replica (rollout/mesh.py): built by the replica's leader with ``tp_size`` = rollout TP
and ``base_gpu_id`` = the leader's device index, so its scheduler processes run on the replica's GPUs, which
the leader's process must see (Ray: RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, controller/ray_init.py).

What SGLang 0.5.23 demands of its host process, and how this class meets it:
- the Engine drives its own event loop: every call must come from the thread that built it (checked here
  with a clear error instead of SGLang's);
- it installs its own SIGTERM handler (log and ignore) and a SIGQUIT handler that kills the process tree,
  forces ``mp.set_start_method("spawn")`` and writes NCCL/CUDA variables into ``os.environ``
  (``_set_envs_and_config``): the environment, start method and both handlers are snapshot before the Engine
  is built and put back after (``_engine_leaves_no_trace``), except the variables every rank agrees on
  (contract ``agreed_env_vars``, set on every rank before any communicator: ``set_agreed_process_env``) and
  SGLang's own ``SGLANG_*``, so the leader creates later communicators with the members' settings;
- without ``nccl_port`` it draws a port with the global ``random`` module, so ranks seeded alike collide:
  each engine gets an explicit port (``port_base + 2 * replica``, the next free one if taken), checked free
  and reserved (``reserved_port``) until the engine is up, so engines starting at once never pick the same;
- released CUDA-graph memory is kept unless SGLANG_MEMORY_SAVER_CUDA_GRAPH=true when the engine starts;
- its scheduler processes join their TP group with ``init_process_group(init_method="tcp://...")``, which
  under torchrun (TORCHELASTIC_USE_AGENT_STORE=True, inherited) only connects to torchrun's agent store and
  never hosts its own: they would wait until their timeout. The engine is started without that variable.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from megatron_rl.distributed.ports import reserved_port
from megatron_rl.rollout.sglang.contract import (
    SGLANG_CONTRACT,
    check_result,
    checked,
    import_sglang,
    set_agreed_process_env,
)

__all__ = ["InProcessTransport"]

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


@contextlib.contextmanager
def _without_launcher_store() -> Iterator[None]:
    """Hide torchrun's agent-store switch from the processes the engine spawns (see the module docstring)."""
    saved = os.environ.pop(AGENT_STORE_ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[AGENT_STORE_ENV] = saved


def _kept(name: str) -> bool:
    return name in SGLANG_CONTRACT["agreed_env_vars"] or name.startswith(SGLANG_CONTRACT["kept_env_prefixes"])


@contextlib.contextmanager
def _engine_leaves_no_trace() -> Iterator[None]:
    """Put back what ``sglang.Engine()`` changes in its caller (see the module docstring)."""
    env = dict(os.environ)
    start_method = multiprocessing.get_start_method(allow_none=True)
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGQUIT)} if main else {}
    try:
        yield
    finally:
        for name in [n for n in os.environ if n not in env and not _kept(n)]:
            del os.environ[name]
        for name, value in env.items():
            if not _kept(name) and os.environ.get(name) != value:
                os.environ[name] = value
        if multiprocessing.get_start_method(allow_none=True) != start_method:
            multiprocessing.set_start_method(start_method, force=True)
        for sig, handler in handlers.items():
            if handler is not None:  # None: installed outside Python, cannot be put back
                signal.signal(sig, handler)


class InProcessTransport:
    colocated = True
    #: the engine copies from our buffers after its calls return (CUDA IPC, asynchronous device copies)
    async_loads = True

    def __init__(self, server_args: dict[str, Any], *, replica_index: int, port_base: int, port_stride: int,
                 engine_kwargs: Mapping[str, Any] | None = None) -> None:
        """``server_args``: the ServerArgs the adapter sets (the contract's); ``engine_kwargs``: the user's
        rollout.engine_kwargs.sglang, already checked against SGLang's own fields (server_args.py)."""
        for name, value in SGLANG_CONTRACT["env_vars"].items():
            os.environ.setdefault(name, value)
        args = dict(server_args)
        self._owner = threading.current_thread()
        engine_cls = import_sglang("sglang", "Engine")
        set_agreed_process_env()  # a no-op where the worker set them at init, as it must on every rank
        # Two ports per engine (scheduler rendezvous, SGLang's own base port), distinct per replica, held
        # from other pickers of the host until the engine is up (its schedulers bind them while it starts).
        what = "actor_rollout_ref.rollout.sglang.port_base"
        with (
            reserved_port(port_base + 2 * replica_index, stride=port_stride, what=what) as nccl_port,
            reserved_port(nccl_port + 1, stride=port_stride, what=what) as port,
            _engine_leaves_no_trace(),
            _without_launcher_store(),
        ):
            args.update(nccl_port=nccl_port, port=port)
            self._engine = engine_cls(**checked("server_args", None, args), **(engine_kwargs or {}))
        self.nccl_port = nccl_port
        self.version = str(import_sglang("sglang", "__version__"))
        self.tp_size = int(args["tp_size"])
        self.routed_experts = bool(args.get("enable_return_routed_experts", False))  # routing replay R3

    def call(self, method: str, **kwargs: Any) -> Any:
        if threading.current_thread() is not self._owner:
            raise RuntimeError(
                f"sglang.Engine.{method} called from thread {threading.current_thread().name!r}; the engine "
                f"belongs to {self._owner.name!r} (SGLang's Engine runs its own event loop)"
            )
        return getattr(self._engine, method)(**checked("engine", method, kwargs))

    # ------------------------------------------------------------------ the transport interface
    def generate(self, input_ids: list[list[int]], sampling: list[dict[str, Any]],
                 image_data: list[list[str] | None] | None = None) -> list[dict]:
        routed = {"return_routed_experts": True} if self.routed_experts else {}
        images = {"image_data": image_data} if image_data is not None else {}
        return self.call("generate", input_ids=input_ids, sampling_params=sampling, return_logprob=True, **routed,
                         **images)

    def session(self, what: str) -> None:
        check_result(self.call(what), what)

    def load_payloads(self, payloads: list, *, version: int) -> None:
        """``payloads[i]``: the serialized bucket for engine TP rank i, made on that rank's GPU."""
        if len(payloads) != self.tp_size:
            raise ValueError(f"SGLang engine of TP {self.tp_size} needs one payload per TP rank, got {len(payloads)}")
        result = self.call(
            "update_weights_from_tensor",
            named_tensors=payloads,
            load_format=SGLANG_CONTRACT["flattened_bucket"]["load_format"],
            flush_cache=False,
        )
        check_result(result, "update_weights_from_tensor")

    def flush_cache(self) -> None:
        self.call("flush_cache")

    def memory(self, what: str, tags: list[str]) -> None:
        self.call(what, tags=tags)

    def shutdown(self) -> None:
        self.call("shutdown")
