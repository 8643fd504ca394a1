"""vLLM OpenAI-compatible rollout servers the run starts itself (``rollout.name=vllm``, ``rollout.mode=server``,
``rollout.num_servers=N``), and the driver's generation client to vLLM servers for the async loops.

A server is ``python -m vllm.entrypoints.openai.api_server`` (``server_command``) in a process group of its own
(vLLM's engine core is a child of it: ``stop`` ends both), listening on 127.0.0.1, every route of it (the dev
routes and ``/health`` included) behind the run's secret (``route_auth.py``, given as ``VLLM_API_KEY``, never on
the command line), ready once ``/health`` answers 200 to the secret. Started as child processes
(``VLLMServerPool``: torchrun, no Ray) or one per Ray actor on the servers' own resource pool
(``ray_vllm_server_pool``: the actor starts and watches its server process; Ray reserves the CPUs, and on a
cluster with GPUs rollout-TP GPUs per server, which are all its server sees).
Both are ``ServerPool``s: ``check``/``dead``/``replace`` and servers/restarts.py work unchanged; a replacement
holds random weights (version -1) and serves nothing before the next sync.

The client (``VLLMServerRolloutClient``) is servers/client.py's with vLLM's routes: one ``/v1/completions``
per row (at most ``rollout.max_num_seqs`` in flight at each server, as rank 0's engine sends them), the samples
tagged with the weight version of the server that made them (read from the servers' workers,
rollout/vllm/server.py). Partial rollouts: ``pause_generation`` pauses every server with
``/pause?mode=abort`` (in-flight rows come back with their tokens so far) and aborts what reaches a server
after its pause, until none of this client's requests is left in flight; rows wait in the client (not in the
server) for ``continue_generation``, which reads the servers' new version, so every token is tagged with the
version that sampled it; the rows are sent again as prompt + their tokens.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from megatron_rl.config.schema import PPOTrainerConfig, RolloutConfig
from megatron_rl.distributed.device import visible_gpus
from megatron_rl.distributed.ports import free_port
from megatron_rl.models.hf_config import plain_overrides
from megatron_rl.rollout.hf_engine import resolve_dtype
from megatron_rl.rollout.server_key import ensure_server_api_key
from megatron_rl.rollout.vllm.server import (
    SERVER_EXTENSION,
    VLLMServerError,
    VLLMServerHTTP,
    completion_request,
    map_bounded,
    parse_choice,
)
from megatron_rl.rollout.vllm.engine import engine_args
from megatron_rl.rollout.vllm.vision import torchvision_free_env
from megatron_rl.servers.client import ServerRolloutClient, _Replaced
from megatron_rl.servers.pool import RolloutServerDied, ServerPool, require_servers
from megatron_rl.servers.route_auth import KEY_ENV, MIDDLEWARE

__all__ = ["VLLMServerActor", "VLLMServerPool", "VLLMServerRolloutClient", "VLLMServerSettings",
           "ray_vllm_server_pool", "server_command", "start_vllm_server", "vllm_server_settings"]

SERVED_NAME = "megatron-rl-policy"


@dataclass(frozen=True)
class VLLMServerSettings:
    """What every started server runs: ``engine_args`` are vLLM engine arguments built by the colocated engine's
    own ``engine_args`` (rollout/vllm/engine.py), so each rollout key means the same in both modes."""

    engine_args: tuple[tuple[str, Any], ...]
    threads: int = 1
    cpu_threads_bind: str = "auto"
    start_timeout_s: float = 300.0
    # from_rollout's arguments: the settings are computed again where a server runs (``where_it_runs``)
    recipe: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def model_path(self) -> str:
        return str(dict(self.engine_args)["model"])

    @property
    def tensor_parallel_size(self) -> int:
        return int(dict(self.engine_args).get("tensor_parallel_size", 1))

    def where_it_runs(self, gpus: Sequence[Any] | None) -> "VLLMServerSettings":
        """These servers' settings computed in the process that starts one, for ``gpus`` (the GPUs that server
        gets; none: vLLM-CPU), not on the driver, which may be a CPU head node (fp32, a CPU-sized KV cache).
        A server given no GPU on a host with CUDA is refused: it would run on the GPUs its process sees first."""
        if not gpus:
            import torch

            if torch.cuda.is_available():
                raise RuntimeError(f"a vLLM rollout server for {self.model_path} got no GPU on a host with CUDA: it "
                                   "would allocate on the first GPUs it sees (the trainer's); give it GPUs (Ray: the "
                                   "servers' pool asks for rollout.tensor_model_parallel_size each)")
        if self.recipe is None:
            return self
        return VLLMServerSettings.from_rollout(**self.recipe, on_cpu=not gpus)

    @property
    def serves_images(self) -> bool:
        """A vision-language model's servers (rollout/vllm/engine.py ``engine_args`` limits their videos to 0)."""
        return "limit_mm_per_prompt" in dict(self.engine_args)

    @property
    def seed(self) -> int:
        """The first server's seed; server i runs with seed + i."""
        return int(dict(self.engine_args)["seed"])

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, model_path: str, *, max_model_len: int, model_override: Any = None,
                     start_timeout_s: float | None = None, on_cpu: bool | None = None) -> "VLLMServerSettings":
        """Servers of ``rollout`` (the rollout config) serving ``model_path``; ``on_cpu`` None: this process's
        device decides (``where_it_runs`` computes them again where each server starts)."""
        import torch

        recipe = {"rollout": rollout, "model_path": model_path, "max_model_len": max_model_len,
                  "model_override": model_override, "start_timeout_s": start_timeout_s}
        if on_cpu is None:
            on_cpu = not torch.cuda.is_available()
        args = engine_args(rollout, model_path, max_model_len=max_model_len, on_cpu=on_cpu,
                           dtype=resolve_dtype(str(rollout.dtype), torch.device("cpu" if on_cpu else "cuda")),
                           model_override=model_override)
        args.pop("enable_sleep_mode", None)  # a server keeps its memory: its devices are not the trainer's
        args.update(worker_extension_cls=SERVER_EXTENSION, disable_log_stats=True)
        if on_cpu and args["tensor_parallel_size"] == 1:
            # vLLM-CPU's default runs even one model runner in a worker process of its own, which imports torch
            # and vLLM a second time (~10 CPU-s of each server's start): the engine core runs it itself
            args["distributed_executor_backend"] = "uni"
        return cls(engine_args=tuple(args.items()), threads=int(rollout.server_threads),
                   cpu_threads_bind=str(rollout.vllm.cpu_threads_bind),
                   start_timeout_s=float(rollout.vllm.server_start_timeout_s if start_timeout_s is None
                                         else start_timeout_s), recipe=recipe)


def vllm_server_settings(cfg: PPOTrainerConfig) -> VLLMServerSettings:
    """The servers' settings from the run's config (the same keys the colocated engine reads)."""
    rollout = cfg.actor_rollout_ref.rollout
    response = rollout.response_length or cfg.data.max_response_length
    return VLLMServerSettings.from_rollout(rollout, str(cfg.actor_rollout_ref.model.path),
                                           max_model_len=int(cfg.data.max_prompt_length) + int(response),
                                           model_override=plain_overrides(cfg.actor_rollout_ref.model.override_config) or None)


def cli_flags(engine_args: dict[str, Any]) -> list[str]:
    """Engine arguments as the server's command-line flags (vLLM derives its flags from the same fields:
    booleans are ``--x`` / ``--no-x``, dicts JSON)."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def server_command(settings: VLLMServerSettings, *, port: int, host: str = "127.0.0.1", seed: int | None = None) -> list[str]:
    """The command line of one server (start servers for ``rollout.server_urls`` the same way, with
    ``VLLM_SERVER_DEV_MODE=1`` and the run's secret as ``VLLM_API_KEY`` in their environment, and
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` where it says ``--distributed-executor-backend uni``: start_vllm_server).
    ``--middleware`` puts every route behind the secret (route_auth.py); vLLM alone guards ``/v1`` only."""
    args = dict(settings.engine_args)
    if seed is not None:
        args["seed"] = seed
    # images come through vLLM's token-in route (/inference/v1/generate), which --enable-scale-out opens
    images = ["--enable-scale-out"] if settings.serves_images else []
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--served-model-name", SERVED_NAME,
            "--host", host, "--port", str(port), "--middleware", MIDDLEWARE, *cli_flags(args), *images]


def _healthy(url: str, api_key: str) -> bool:
    req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_vllm_server(settings: VLLMServerSettings, *, seed: int | None = None, host: str = "127.0.0.1",
                      api_key: str | None = None, log_dir: str | None = None,
                      gpus: Sequence[Any] | None = None) -> tuple[subprocess.Popen, str, str]:
    """Start one vLLM server on this host; returns (its process, URL, log file) once ``/health`` answers.
    ``gpus``: the physical GPUs it may see (its ``CUDA_VISIBLE_DEVICES``: vLLM's TP worker i takes the i-th)."""
    port = free_port(host)
    url = f"http://{host}:{port}"
    api_key = api_key or ensure_server_api_key()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", KEY_ENV: api_key, "OMP_NUM_THREADS": str(settings.threads)}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if settings.cpu_threads_bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_threads_bind
    if dict(settings.engine_args).get("distributed_executor_backend") == "uni":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # else vLLM-CPU turns "uni" back into "mp"
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    if settings.serves_images:  # vLLM's Qwen-VL code without torchvision (a no-op where torchvision imports)
        env = torchvision_free_env(env)
    log_dir = log_dir or tempfile.mkdtemp(prefix="mrl_vllm_server_")
    log_path = os.path.join(log_dir, f"vllm_server_{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_command(settings, port=port, host=host, seed=seed), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + settings.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RolloutServerDied(f"the vLLM rollout server for {settings.model_path} exited with code "
                                    f"{proc.returncode} before it was ready; its log ({log_path}) ends:\n{_tail(log_path)}")
        if _healthy(url, api_key):
            return proc, url, log_path
        time.sleep(0.5)
    _kill_group(proc)
    raise RolloutServerDied(f"the vLLM rollout server for {settings.model_path} was not ready within "
                            f"{settings.start_timeout_s:g} s (actor_rollout_ref.rollout.vllm.server_start_timeout_s); "
                            f"its log ({log_path}) ends:\n{_tail(log_path)}")


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """End the server and its engine core (its own process group), politely first."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the engine core may outlive a SIGKILLed server for a moment
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class VLLMServerProcess:
    index: int
    proc: subprocess.Popen
    url: str
    log_path: str

    def describe(self) -> str:
        return f"rollout server {self.index} ({self.url}, vLLM pid {self.proc.pid})"

    def exit_status(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"exited with code {code}"

    def stop(self) -> None:
        _kill_group(self.proc)


def host_server_gpus(num_servers: int, tp: int, env: dict[str, str] | None = None) -> list[tuple[int, ...]]:
    """The GPUs of this host's servers (torchrun, no Ray): the trainer's ranks hold the first LOCAL_WORLD_SIZE
    visible devices, server i takes the next ``tp`` after them. No CUDA: none (vLLM-CPU). Refused, naming the
    keys, when the host lacks them, and under a multi-rank torchrun (every rank would start servers on them)."""
    import torch

    env = dict(os.environ) if env is None else env
    if not torch.cuda.is_available():
        return [()] * num_servers
    world = int(env.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(f"vLLM rollout servers started under torchrun with WORLD_SIZE={world}: every rank would "
                         "start its own on this host's same spare GPUs; use trainer.launcher=ray (Ray gives each "
                         "server its GPUs) or start them yourself (rollout.server_urls)")
    visible = visible_gpus(env, torch.cuda.device_count())
    trainer = int(env.get("LOCAL_WORLD_SIZE", "1"))
    spare = visible[trainer:]
    if len(spare) < num_servers * tp:
        raise ValueError(f"actor_rollout_ref.rollout.num_servers={num_servers} vLLM servers of "
                         f"tensor_model_parallel_size={tp} need {num_servers * tp} GPUs beside the trainer's {trainer} "
                         f"on this host, which sees {len(visible)} (CUDA_VISIBLE_DEVICES="
                         f"{env.get('CUDA_VISIBLE_DEVICES')!r}): {len(spare)} spare")
    return [tuple(spare[i * tp:(i + 1) * tp]) for i in range(num_servers)]


class VLLMServerPool(ServerPool):
    """``num_servers`` vLLM servers, child processes of this one (torchrun, or no Ray), on this host's GPUs after
    the trainer's (``host_server_gpus``)."""

    def __init__(self, settings: VLLMServerSettings, num_servers: int) -> None:
        self.settings = settings
        self.gpus = host_server_gpus(num_servers, settings.tensor_parallel_size)
        self.log_dir = tempfile.mkdtemp(prefix="mrl_vllm_servers_")
        super().__init__(num_servers)

    def _start_many(self, indices: Iterable[int]) -> list[VLLMServerProcess]:
        """All at once (they load in parallel), then each waited for."""
        indices = list(indices)
        with ThreadPoolExecutor(max_workers=max(1, len(indices))) as pool:
            futures = [pool.submit(start_vllm_server, self.settings.where_it_runs(self.gpus[i]),
                                   seed=self.settings.seed + i, api_key=self.api_key, log_dir=self.log_dir,
                                   gpus=self.gpus[i]) for i in indices]
            started, error = [], None
            for index, future in zip(indices, futures):
                try:
                    proc, url, log = future.result()
                    started.append(VLLMServerProcess(index, proc, url, log))
                except BaseException as exc:
                    error = error or exc
        if error is not None:
            for server in started:
                server.stop()
            raise error
        return started


# ---------------------------------------------------------------------------------------------- on Ray
class VLLMServerActor:
    """A Ray actor's body: one vLLM server process on this node, started and watched by the actor (the actor's
    CPUs, and on GPU clusters its rollout-TP GPUs, are the server's reservation on the pool ``rollout_servers``).
    Ray workers see every GPU of their node (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), so the server gets
    ``CUDA_VISIBLE_DEVICES`` = the GPUs Ray gave this actor, and its settings are computed here, for them."""

    def __init__(self, settings: VLLMServerSettings, seed: int, api_key: str) -> None:
        import ray

        gpus = sorted(ray.get_gpu_ids(), key=lambda g: (len(str(g)), str(g)))  # Ray's ids come as a set
        self.proc, self.url, self.log_path = start_vllm_server(settings.where_it_runs(gpus), seed=seed,
                                                               api_key=api_key, gpus=gpus)

    def address(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {"url": self.url, "pid": self.proc.pid, "placement_group": context.get_placement_group_id(),
                "resources": context.get_assigned_resources(), "node_id": context.get_node_id(),
                "node_ip": ray.util.get_node_ip_address()}

    def ping(self) -> str | None:
        """None while the server runs; how it ended otherwise."""
        code = self.proc.poll()
        return None if code is None else f"exited with code {code}"

    def stop(self) -> None:
        _kill_group(self.proc)


@functools.cache
def ray_vllm_server_pool() -> type:
    """``RayVLLMServerPool``: servers/ray_pool.py's pool with a vLLM server per actor (built on first use, so
    that torchrun runs never import Ray)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from megatron_rl.servers.ray_pool import RayRolloutServerPool, ServerActor  # lazy: Ray

    actor_class = ray.remote(max_restarts=0, max_concurrency=2)(VLLMServerActor)

    class VLLMServerActorHandle(ServerActor):
        def describe(self) -> str:
            return f"rollout server {self.index} ({self.url}, vLLM pid {self.pid} in a Ray actor)"

        def exit_status(self) -> str | None:
            if self._death is None:
                try:
                    self._death = ray.get(self.actor.ping.remote(), timeout=self.ping_timeout_s)
                except RayActorError as exc:
                    self._death = f"died (its Ray actor is dead: {str(exc).splitlines()[0] if str(exc) else exc})"
                except GetTimeoutError:
                    pass
            return self._death

        def stop(self) -> None:
            try:
                ray.get(self.actor.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - the actor is dead already, or stuck: kill it anyway
                pass
            super().stop()

    class RayVLLMServerPool(RayRolloutServerPool):
        """Each server's actor asks Ray for rollout.tensor_model_parallel_size GPUs on a cluster with GPUs."""

        server_actor = actor_class

        def __init__(self, settings: VLLMServerSettings, num_servers: int, *, cpus_per_server: float,
                     servers_per_node: int | None = None, start_timeout_s: float = 600.0) -> None:
            if servers_per_node is not None:
                raise ValueError("actor_rollout_ref.rollout.servers_per_node: vLLM rollout servers take their weights "
                                 "through /dev/shm of trainer rank 0's host, so they cannot spread over nodes")
            require_servers(num_servers)
            self.settings = settings
            gpus = settings.tensor_parallel_size if ray.cluster_resources().get("GPU", 0) > 0 else 0
            super().__init__(settings.model_path, num_servers, cpus_per_server=cpus_per_server,
                             start_timeout_s=max(start_timeout_s, settings.start_timeout_s + 30), seed=settings.seed,
                             gpus_per_server=gpus)

        def _launch(self, slot, index):
            options = {"num_cpus": self.resource_pool.cpus_per_process, "num_gpus": self.gpus_per_server,
                       "scheduling_strategy": slot.scheduling_strategy()}
            return self.server_actor.options(**options).remote(self.settings, self.settings.seed + index, self.api_key)

        def _await(self, index, actor):
            try:
                where = ray.get(actor.address.remote(), timeout=self.start_timeout_s)
            except GetTimeoutError:
                raise RolloutServerDied(f"rollout server {index} (a Ray actor on pool 'rollout_servers') was not ready "
                                        f"within {self.start_timeout_s:g} s") from None
            except RayActorError as exc:
                raise RolloutServerDied(f"vLLM rollout server {index} for {self.settings.model_path} failed to start: "
                                        f"{exc}") from None
            return VLLMServerActorHandle(index, actor, where, self.ping_timeout_s)

        def close(self) -> None:
            """The actors end with Ray, but a server runs in a session of its own (with its engine core): end
            each group here too, Ray up or not."""
            try:
                super().close()
            finally:
                for server in self.servers:
                    for sig in (signal.SIGTERM, signal.SIGKILL):
                        try:
                            os.killpg(int(server.pid), sig)
                        except (ProcessLookupError, PermissionError):
                            break
                        time.sleep(0.5)

    return RayVLLMServerPool


# ---------------------------------------------------------------------------------------------- the client
class VLLMServerRolloutClient(ServerRolloutClient):
    """servers/client.py's client over vLLM servers (see the module docstring for pauses and versions)."""

    def __init__(self, config: RolloutConfig, urls: Sequence[str], **kwargs: Any) -> None:
        super().__init__(config, urls, **kwargs)
        self._servers = [VLLMServerHTTP(url, s.timeout_s) for url, s in zip(urls, self._servers)]
        self._models: list[str | None] = [None] * len(self._servers)
        self._versions: list[int | None] = [None] * len(self._servers)
        self._in_flight, self._epoch = 0, 0  # requests at a server; pauses so far
        self._flight = threading.Condition()

    def generate_sequences(self, prompts):
        if self._continued.is_set():
            self._versions = [None] * len(self._servers)  # read again: a sync may have happened since
        return super().generate_sequences(prompts)

    def pause_generation(self) -> None:
        """Every server paused with in-flight requests aborted; returns once none of this client's requests is
        left at a server (a request that reached a server after its pause is aborted too)."""
        with self._flight:
            self._continued.clear()
            self._epoch += 1
        try:
            self._on_every_server("/pause?mode=abort", None)
            deadline = time.monotonic() + 60
            while True:
                with self._flight:
                    if self._in_flight:
                        self._flight.wait(timeout=0.1)
                    left = self._in_flight
                if not left:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{left} rollout requests were still running 60 s after the vLLM servers "
                                       "were paused")
                self._on_every_server("/abort_requests", {})  # requests that reached a server after its pause
        except BaseException:
            self._continued.set()
            raise

    def continue_generation(self) -> None:
        try:
            self._on_every_server("/resume", None)
            self._versions = [None] * len(self._servers)
        finally:
            self._continued.set()

    def _on_every_server(self, route: str, body: dict | None) -> None:
        for index in range(len(self._servers)):
            try:
                self._call(index, route, body)
            except _Replaced:
                pass

    def _call(self, index: int, route: str, body: dict | None) -> Any:
        server = self._servers[index]
        try:
            return server.request(route, body)
        except VLLMServerError as exc:
            if self.restarts is not None and self.restarts.handle(server.url):
                self._servers[index] = VLLMServerHTTP(self.pool.urls[index], server.timeout_s)
                self._versions[index], self._models[index] = None, None
                raise _Replaced(index) from exc
            if self.pool is not None:
                self.pool.check()
            raise RolloutServerDied(f"rollout server {server.url} failed {route}: {exc}") from exc

    def _server_state(self, index: int) -> tuple[str, int]:
        if self._models[index] is None:
            self._models[index] = self._checked(index, lambda s: s.model_name())
        if self._versions[index] is None:
            version = self._checked(index, lambda s: s.weight_version())
            if version < 0:
                raise RolloutServerDied(f"rollout server {self._servers[index].url} never received the run's weights "
                                        "(weight version -1)")
            self._versions[index] = version
        return self._models[index], self._versions[index]

    def _checked(self, index: int, what) -> Any:
        server = self._servers[index]
        try:
            return what(server)
        except VLLMServerError as exc:
            if self.restarts is not None and self.restarts.handle(server.url):
                self._servers[index] = VLLMServerHTTP(self.pool.urls[index], server.timeout_s)
                self._versions[index], self._models[index] = None, None
                raise _Replaced(index) from exc
            raise

    def _request(self, index: int, input_ids: list, sampling: list) -> list[dict]:
        """Every row of the part as its own completion, at most rollout.max_num_seqs at once (the server's batch);
        SGLang-shaped results for the base class, each with the version of the server it ran on. Sent only
        outside a pause."""
        while True:  # counted in flight before any pause can begin, with the version read since the last one
            self._continued.wait()
            epoch = self._epoch
            model, version = self._server_state(index)
            with self._flight:
                if self._continued.is_set() and epoch == self._epoch:
                    self._in_flight += 1
                    break
        try:
            bodies = [completion_request(model, ids, max_tokens=s["max_new_tokens"], temperature=s["temperature"],
                                         top_p=s["top_p"], top_k=s["top_k"], stop_token_ids=s["stop_token_ids"])
                      for ids, s in zip(input_ids, sampling)]
            results = map_bounded(lambda body: self._call(index, "/v1/completions", body), bodies,
                                  int(self.config.max_num_seqs))
        finally:
            with self._flight:
                self._in_flight -= 1
                self._flight.notify_all()
        outputs = []
        for result in results:
            tokens, lps, finish = parse_choice(result["choices"][0], self._servers[index].url)
            outputs.append({"meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, tokens)],
                                          "weight_version": version,
                                          "finish_reason": {"type": "abort" if finish == "abort" else str(finish)}}})
        return outputs
