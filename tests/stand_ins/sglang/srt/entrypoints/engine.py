"""Stand-in of ``sglang.srt.entrypoints.engine.Engine`` (0.5.23 surface, CPU, TP over processes).

See the package docstring (``sglang/__init__.py``) for how it is stricter than, or differs from, SGLang.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import uuid
import weakref
from multiprocessing.connection import wait
from types import SimpleNamespace
from typing import Any, Self

from sglang._stand_in import devices

logger = logging.getLogger("sglang_stand_in.engine")

__all__ = ["Engine"]

SERVER_ARGS_DEFAULTS: dict[str, Any] = {
    "model_path": None,
    "tp_size": 1,
    "mem_fraction_static": 0.5,
    "enable_memory_saver": False,
    "base_gpu_id": 0,
    "skip_tokenizer_init": False,
    "load_format": "auto",
    "random_seed": None,
    "dtype": "auto",
    "log_level": "error",
    "nccl_port": None,
    "port": 30000,
    "gpu_id_step": 1,
    # MoE routing capture (srt/layers/moe/routed_experts_capturer.py); requests ask with return_routed_experts
    "enable_return_routed_experts": False,
    # expert parallelism (srt/arg_groups/fields/parallel.py, exec_.py): checked and recorded, computed as TP
    "ep_size": 1,
    "moe_runner_backend": "auto",
    "moe_a2a_backend": "none",
}
# srt/arg_groups/choices.py MOE_RUNNER_BACKEND_CHOICES and fields/exec_.py moe_a2a_backend's Literal (0.5.23)
MOE_CHOICES = {
    "moe_runner_backend": (
        "auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm",
        "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl",
        "flashinfer_megamoe", "cutlass", "aiter", "marlin", "humming", "experimental_sgl_marlin", "lora_cutedsl",
        "lora_triton", "lora_marlin", "hpc_ops", "megamoe", "intel_xpu",
    ),
    "moe_a2a_backend": (
        "none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe", "deepep_v2", "pplx",
        "ascend_tp", "flashinfer_megamoe",
    ),
}
SAMPLING_FIELDS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
SESSION_OPEN_MSG = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_MSG = "no weight-update session is open; call begin_weight_update() first"


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _set_envs_and_config() -> None:
    """What 0.5.23's ``_set_envs_and_config`` (srt/entrypoints/engine.py) does to the caller's process, with
    the defaults we run it with (no symm-mem, no NVLS, one node, no DCP, no metrics, no gc threshold); the
    handlers are installed by ``_install_sigterm_handler``."""
    if "NCCL_CUMEM_ENABLE" not in os.environ:
        os.environ["NCCL_CUMEM_ENABLE"] = "0"
    if "NCCL_NVLS_ENABLE" not in os.environ:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    if os.environ.get("TRTLLM_ENABLE_PDL", "1") != "0":
        os.environ["TRTLLM_ENABLE_PDL"] = "1"
    os.environ.setdefault("CUTE_DSL_LOG_LEVEL", "30")
    os.environ.setdefault("CUTE_DSL_LOG_TO_CONSOLE", "1")
    os.environ["SGLANG_RUN_ID"] = f"sglang-run-{time.time()}-{uuid.uuid4().int % 100000000}"
    multiprocessing.set_start_method("spawn", force=True)


def _check_expert_parallel(args: dict[str, Any]) -> None:
    """0.5.23 splits tp_size ranks into ep_size expert groups of tp_size // ep_size (srt/runtime_context.py
    derive_parallel_widths) and builds its groups from that; with a remainder SGLang fails later, in its
    schedulers: refused here at once (stricter). Choices as argparse would refuse them."""
    ep, tp = args["ep_size"], args["tp_size"]
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or tp % ep:
        raise ValueError(f"ep_size={ep!r} must be a positive int dividing tp_size={tp}")
    for name, choices in MOE_CHOICES.items():
        if args[name] not in choices:
            raise ValueError(f"{name}={args[name]!r} is not one of {list(choices)}")


class EngineDead(RuntimeError):
    pass


class Engine:
    """In-process engine: ``tp_size`` scheduler processes, one per (simulated) physical GPU."""

    def __init__(self, **kwargs: Any) -> None:
        self._thread = threading.get_ident()
        self._dead: str | None = None
        self._closed = False
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._claims: list[Any] = []
        for name in kwargs:
            if name not in SERVER_ARGS_DEFAULTS:
                raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument {name!r}")
        args = {**SERVER_ARGS_DEFAULTS, **kwargs}
        if not args["model_path"]:
            raise TypeError("ServerArgs.__init__() missing 1 required argument: 'model_path'")
        if args["load_format"] != "dummy":
            raise ValueError(
                f"the SGLang stand-in only supports load_format='dummy' (random weights from config.json), "
                f"got {args['load_format']!r}"
            )
        if args["gpu_id_step"] != 1:
            raise ValueError(f"the SGLang stand-in needs gpu_id_step=1, got {args['gpu_id_step']!r}")
        if not args["skip_tokenizer_init"]:
            raise ValueError(
                "the SGLang stand-in has no tokenizer: pass skip_tokenizer_init=True and token ids "
                "(without it SGLang would load a tokenizer and return text)"
            )
        if args["dtype"] not in ("auto", "float32", "bfloat16", "float16", "half"):
            raise ValueError(f"unknown dtype {args['dtype']!r}")
        if args["mem_fraction_static"] is None:
            args["mem_fraction_static"] = SERVER_ARGS_DEFAULTS["mem_fraction_static"]
        tp = args["tp_size"]
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp!r}")
        if not 0.0 < float(args["mem_fraction_static"]) < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {args['mem_fraction_static']!r}")
        _check_expert_parallel(args)
        self._given = dict(kwargs)
        self._args = args
        self._tp = tp
        self._memory_saver = bool(args["enable_memory_saver"])
        self._root = devices.stand_in_root()
        self._node = devices.node_name()
        visible = devices.visible_devices()
        base = int(args["base_gpu_id"])
        gpus = []
        for rank in range(tp):
            index = base + rank
            if not 0 <= index < len(visible):
                raise RuntimeError(
                    f"GPU index {index} (base_gpu_id={base} + tp rank {rank}) is not visible "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}; {len(visible)} visible "
                    f"on node {self._node})"
                )
            gpus.append(visible[index])
        self._gpus = gpus
        _set_envs_and_config()
        self._install_sigterm_handler()
        time.sleep(_env_float("SGLANG_STAND_IN_BUILD_DELAY_S", 0.0))  # test hook: a cold build (CUDA graphs, JIT)
        if args["nccl_port"] is None:
            from sglang.srt.utils.network import get_free_port_below_ephemeral

            args["nccl_port"] = get_free_port_below_ephemeral()  # test-bound only; schedulers bind later
        self._port = int(args["nccl_port"])
        self._engine_id = f"{self._node}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._session_open = False
        self._groups: set[str] = set()
        self.weight_version = "default"
        self._timeout = _env_float("SGLANG_STAND_IN_TIMEOUT_S", 60.0)
        _LIVE.add(self)
        try:
            for rank, gpu in enumerate(gpus):
                self._claims.append(devices.claim_gpu(self._root, self._node, gpu, self._engine_id, rank))
            self._start(args, kwargs)
        except BaseException:
            self._teardown()
            raise

    # ------------------------------------------------------------------ lifecycle
    def _install_sigterm_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def sigterm_handler(signum, frame):  # 0.5.23: log and wait for the rank-0 shutdown broadcast
            logger.warning(
                "SIGTERM received; waiting for the rank-0 ShutdownReq broadcast to stop the schedulers."
            )

        signal.signal(signal.SIGTERM, sigterm_handler)

        def launch_phase_sigquit_handler(signum, frame):  # 0.5.23: a child failed -> kill the tree
            logger.error("Received sigquit from a child process. It usually means the child failed.")
            _kill_leftovers()
            os.kill(os.getpid(), signal.SIGKILL)

        signal.signal(signal.SIGQUIT, launch_phase_sigquit_handler)

    def _start(self, args: dict[str, Any], kwargs: dict[str, Any]) -> None:
        from sglang._stand_in.scheduler import scheduler_main

        ctx = multiprocessing.get_context("spawn")
        log_dir = self._root / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        seed = args["random_seed"] if args["random_seed"] is not None else 42
        for rank, gpu in enumerate(self._gpus):
            parent, child = ctx.Pipe()
            sched_args = {
                "engine_id": self._engine_id,
                "tp_rank": rank,
                "tp_size": self._tp,
                "node": self._node,
                "physical_gpu": gpu,
                "nccl_port": self._port,
                "model_path": str(args["model_path"]),
                "random_seed": seed,
                "mem_fraction_static": float(args["mem_fraction_static"]),
                # an Engine built without dtype (the HTTP stand-in's launcher passes none) is not dtype-checked
                "dtype": str(args["dtype"]) if "dtype" in kwargs else None,
                "registry_root": str(self._root),
                "cuda_graph_saver": os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "").lower()
                in ("1", "true"),
                "collective_timeout_s": self._timeout,
                "log_dir": str(log_dir),
            }
            proc = ctx.Process(
                target=scheduler_main, args=(child, sched_args), daemon=True, name=f"sglang-stand-in-TP{rank}"
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._memory_at_start = self._collect(
            _env_float("SGLANG_STAND_IN_START_TIMEOUT_S", 180.0), starting=True
        )

    def _collect(self, timeout: float, starting: bool = False) -> list[Any]:
        """One answer per scheduler; a dead scheduler or a timeout kills the engine."""
        deadline = time.monotonic() + timeout
        pending = set(range(self._tp))
        results: list[Any] = [None] * self._tp
        errors: list[tuple[int, str]] = []
        fatal: str | None = None
        while pending:
            waitables = [self._conns[i] for i in pending] + [self._procs[i].sentinel for i in pending]
            remaining = deadline - time.monotonic()
            ready = wait(waitables, timeout=max(0.0, remaining)) if remaining > 0 else []
            if not ready:
                fatal = f"schedulers {sorted(pending)} did not answer within {timeout:.0f} s"
                break
            for i in sorted(pending):
                conn, proc = self._conns[i], self._procs[i]
                if conn in ready or conn.poll():
                    try:
                        status, value, is_fatal = conn.recv()
                    except (EOFError, OSError):
                        proc.join(1)
                        status, value, is_fatal = (
                            "error",
                            (f"scheduler TP{i} (GPU {self._gpus[i]}) died with exit code {proc.exitcode}"),
                            True,
                        )
                    pending.discard(i)
                    if status == "error":
                        errors.append((i, value))
                        if is_fatal:
                            fatal = fatal or value
                    else:
                        results[i] = value
                elif proc.sentinel in ready:
                    pending.discard(i)
                    proc.join(1)
                    msg = f"scheduler TP{i} (GPU {self._gpus[i]}) died with exit code {proc.exitcode}"
                    errors.append((i, msg))
                    fatal = fatal or msg
            if fatal is not None:
                break
        if fatal is not None:
            what = "failed to start" if starting else "is dead"
            detail = "; ".join(f"TP{i}: {m}" for i, m in errors) or fatal
            self._dead = f"engine {what}: {detail}"
            self._teardown(graceful=False)  # like SGLang killing the process tree: no drain
            raise EngineDead(self._dead)
        if errors:
            raise RuntimeError("; ".join(f"TP{i}: {m}" for i, m in errors))
        return results

    def _check(self) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "SGLang Engine methods must be called from the thread that created the Engine "
                "(it drives its own asyncio event loop)"
            )
        if self._dead is not None:
            raise EngineDead(f"engine is dead: {self._dead}")
        if self._closed:
            raise RuntimeError("engine is shut down")

    def _call(
        self, name: str, per_rank: list[dict] | None = None, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        self._check()
        for i, conn in enumerate(self._conns):
            conn.send((name, per_rank[i] if per_rank is not None else kwargs))
        return self._collect(timeout if timeout is not None else self._timeout + 30.0)

    def _teardown(self, graceful: bool = True) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if not graceful and proc.is_alive():
                proc.kill()
            elif proc.is_alive():
                try:
                    conn.send(("shutdown", {}))
                except (OSError, BrokenPipeError):
                    pass
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        for claim in self._claims:
            devices.release_gpu(claim, self._engine_id)
        self._claims = []
        _LIVE.discard(self)

    def shutdown(self) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError("SGLang Engine methods must be called from the thread that created the Engine")
        if self._closed:
            return
        self._closed = True
        self._teardown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt: Any = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[list[int]] | list[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        stream: bool = False,
        return_routed_experts: bool = False,
        image_data: Any = None,
    ) -> Any:
        self._check()
        if prompt is not None:
            raise ValueError("the stand-in has no tokenizer (skip_tokenizer_init=True): pass input_ids")
        if stream:
            raise ValueError("the stand-in does not stream")
        if input_ids is None:
            raise ValueError("input_ids is required")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        rows = [list(input_ids)] if single else [list(r) for r in input_ids]
        if not rows or any(not r for r in rows):
            raise ValueError("every request needs at least one input id")
        if sampling_params is None:
            sampling_params = {}
        sampling = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(rows)
        if len(sampling) != len(rows):
            raise ValueError(f"{len(sampling)} sampling_params for {len(rows)} requests")
        for sp in sampling:
            unknown = sorted(set(sp) - SAMPLING_FIELDS)
            if unknown:
                raise ValueError(
                    f"unknown sampling params {unknown} (the stand-in knows {sorted(SAMPLING_FIELDS)})"
                )
        if image_data is not None:
            self._check_images(rows, image_data, single)
        if self._session_open:
            raise RuntimeError(
                "generate during an open weight-update session: the weights are not finalized until "
                "end_weight_update()"
            )
        if return_routed_experts and not self._args.get("enable_return_routed_experts"):
            # SGLang has no capturer without the server flag: the request is refused rather than answered without
            raise ValueError("return_routed_experts=True needs the engine started with enable_return_routed_experts=True")
        results = self._call("generate", rows=rows, sampling=[dict(sp) for sp in sampling],
                             routed=bool(return_routed_experts))[0]
        for r in results:
            r["meta_info"]["weight_version"] = self.weight_version
            if not return_logprob:
                r["meta_info"].pop("output_token_logprobs")
        return results[0] if single else results

    def _check_images(self, rows: list[list[int]], image_data: Any, single: bool) -> None:
        """SGLang's GenerateReqInput.image_data: one list per request (an image: a data URL, base64 or a path).
        SGLang's processor decodes input_ids and matches each image token with one image (then expands it), so a
        request whose image tokens and images differ in number fails there; the stand-in refuses it here, and
        refuses images altogether, as SGLang cannot process them without its tokenizer (skip_tokenizer_init=True,
        the only way the stand-in starts) and the stand-in has no vision tower."""
        per_request = [image_data] if single else image_data
        if not isinstance(per_request, list) or len(per_request) != len(rows):
            got = f"{type(image_data).__name__}" + (f" of {len(image_data)}" if isinstance(image_data, list) else "")
            raise ValueError(f"image_data must hold one entry per request ({len(rows)}), got {got}")
        image_token = self._image_token_id()
        for i, (ids, images) in enumerate(zip(rows, per_request)):
            images = [] if images is None else images
            if not isinstance(images, list) or not all(isinstance(x, str) and x for x in images):
                raise ValueError(f"image_data[{i}] must be a list of images as strings (data URL, base64 or path)")
            tokens = sum(1 for t in ids if t == image_token) if image_token is not None else 0
            if images and image_token is None:
                raise ValueError(f"request {i} has image_data but the model takes no images")
            if tokens != len(images):
                raise ValueError(f"request {i}: {tokens} image tokens (id {image_token}) in input_ids for "
                                 f"{len(images)} image(s) in image_data: SGLang matches each image token with one "
                                 "image (send one per image; SGLang expands it)")
        if any(per_request) and self._args["skip_tokenizer_init"]:
            raise ValueError("image_data needs SGLang's multimodal processor, which an engine started with "
                             "skip_tokenizer_init=True has not (the stand-in runs no vision tower either)")

    def _image_token_id(self) -> int | None:
        """The checkpoint's image token (config.json image_token_id), None for a text model."""
        import json

        path = os.path.join(str(self._args["model_path"]), "config.json")
        try:
            with open(path) as f:
                token = json.load(f).get("image_token_id")
        except OSError:
            return None
        return token if isinstance(token, int) else None

    def get_server_info(self) -> dict[str, Any]:
        """A small subset of SGLang's: the server args given, version, weight_version."""
        self._check()
        return {**self._args, "version": "0.5.23", "weight_version": self.weight_version}

    def flush_cache(self) -> Any:
        self._call("flush_cache")
        return SimpleNamespace(success=True)

    # ------------------------------------------------------------------ weight-update session
    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        self._check()
        if selector != "all":
            return False, f"the stand-in supports selector='all' only, got {selector!r}"
        if self._session_open:
            return False, SESSION_OPEN_MSG
        self._session_open = True
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        self._check()
        if not self._session_open:
            return False, NO_SESSION_MSG
        self._session_open = False
        return True, "Success"

    def update_weights_from_tensor(
        self, named_tensors: Any, load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        return self._update_weights_from_tensor(named_tensors, load_format, flush_cache, None)

    def _update_weights_from_tensor(
        self, named_tensors: Any, load_format: str | None, flush_cache: bool, weight_version: str | None
    ) -> tuple[bool, str]:
        self._check()
        if not self._session_open:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        from sglang.srt.utils.common import MultiprocessingSerializer

        if load_format is None:
            import torch

            if not isinstance(named_tensors, list) or not all(
                isinstance(x, tuple)
                and len(x) == 2
                and isinstance(x[0], str)
                and isinstance(x[1], torch.Tensor)
                for x in named_tensors
            ):
                return False, "load_format=None needs a list of (name, torch.Tensor) tuples"
            # SGLang serializes them here, once per rank; the handles name the caller's GPU (not checked:
            # CUDA IPC opens on a peer GPU of the same node)
            payloads = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(self._tp)]
            return self._update_weights_from_serialized(payloads, None, weight_version, check_gpu=False)
        return self._update_weights_from_serialized(named_tensors, load_format, weight_version)

    def _update_weights_from_serialized(
        self, payloads: Any, load_format: str | None, weight_version: str | None, check_gpu: bool = True
    ) -> tuple[bool, str]:
        """Per-rank serialized payloads (what the HTTP route carries): scheduler i gets only entry i."""
        self._check()
        if not self._session_open:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payload

        if load_format not in (None, "flattened_bucket"):
            return False, f"Unknown load_format={load_format}"
        if not isinstance(payloads, list) or len(payloads) != self._tp:
            n = len(payloads) if isinstance(payloads, list) else type(payloads).__name__
            return False, (
                f"{load_format or 'load_format=None'} needs a list of exactly tp_size={self._tp} serialized "
                f"payloads (one per TP rank), got {n}"
            )
        try:
            raw = [normalize_serialized_named_tensor_payload(p) for p in payloads]
        except (TypeError, ValueError) as exc:
            return False, str(exc)
        try:
            self._call(
                "update_tensor",
                per_rank=[{"payload": p, "load_format": load_format, "check_gpu": check_gpu} for p in raw],
            )
        except EngineDead:
            raise
        except RuntimeError as exc:
            return False, f"Failed to update weights: {exc}"
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return True, "Success"

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        self._check()
        if group_name in self._groups:
            return False, f"weight-update group {group_name!r} already exists; destroy it first"
        if rank_offset < 0 or rank_offset + self._tp > world_size:
            return False, (
                f"rank_offset {rank_offset} + tp_size {self._tp} = {rank_offset + self._tp} exceeds "
                f"world_size {world_size}"
            )
        if rank_offset == 0:
            return False, "rank 0 of a weight-update group is the trainer; rank_offset must be >= 1"
        try:
            self._call(
                "init_group",
                master_address=master_address,
                master_port=int(master_port),
                rank_offset=int(rank_offset),
                world_size=int(world_size),
                group_name=group_name,
                backend=backend,
            )
        except EngineDead:
            raise
        except RuntimeError as exc:
            return False, f"Failed to initialize custom process group: {exc}"
        self._groups.add(group_name)
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        self._check()
        if not self._session_open:
            return (
                False,
                (
                    "update_weights_from_distributed must run between begin_weight_update() and "
                    "end_weight_update()"
                ),
            )
        if group_name not in self._groups:
            return (
                False,
                (
                    f"Group {group_name} not in {sorted(self._groups)}. "
                    "Please call `init_weights_update_group` first."
                ),
            )
        try:
            self._call(
                "update_distributed",
                names=list(names),
                dtypes=list(dtypes),
                shapes=[list(s) for s in shapes],
                group_name=group_name,
                load_format=load_format,
            )
        except EngineDead:
            raise
        except RuntimeError as exc:
            return False, f"Failed to update weights: {exc}"
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return True, "Success"

    def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        self._check()
        if group_name not in self._groups:
            return False, f"Group {group_name} not in {sorted(self._groups)}"
        self._groups.discard(group_name)
        self._call("destroy_group", group_name=group_name)
        return True, "Succeeded to destroy custom process group."

    # ------------------------------------------------------------------ memory
    def _tags(self, tags: list[str] | None, op: str) -> list[str]:
        if not self._memory_saver:
            raise RuntimeError(f"{op} needs enable_memory_saver=True (without it SGLang frees nothing)")
        tags = list(MEMORY_TAGS) if not tags else list(tags)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; SGLang's are {list(MEMORY_TAGS)}")
        return tags

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._check()
        self._call("release", tags=self._tags(tags, "release_memory_occupation"))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._check()
        self._call("resume", tags=self._tags(tags, "resume_memory_occupation"))

    # ------------------------------------------------------------------ stand-in inspection
    def stand_in_state_dict(self) -> dict[str, Any]:
        import torch

        full = self._call("state_dict")[0]
        return {k: torch.from_numpy(v) for k, v in full.items()}

    def stand_in_shards(self) -> list[dict[str, Any] | None]:
        """Per scheduler its shard by SGLang name (qkv_proj, gate_up_proj, ...); None while released."""
        import torch

        return [
            None if s is None else {k: torch.from_numpy(v) for k, v in s.items()}
            for s in self._call("shards")
        ]

    def stand_in_memory(self) -> list[dict[str, int]]:
        return self._call("memory")

    def stand_in_gpus(self) -> list[tuple[str, int]]:
        self._check()
        return [(self._node, gpu) for gpu in self._gpus]

    def stand_in_port(self) -> int:
        return self._port

    def stand_in_given_args(self) -> dict[str, Any]:
        """The keyword arguments Engine() was given, as given."""
        return dict(self._given)

    def stand_in_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    for engine in list(_LIVE):
        with contextlib.suppress(Exception):
            engine._teardown()
