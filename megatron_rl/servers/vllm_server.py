"""vLLM OpenAI-compatible rollout servers the run starts itself (``rollout.name=vllm``, ``rollout.mode=server``,
``rollout.num_servers=N``), and the driver's generation client to vLLM servers for the async loops.

A server is ``python -m vllm.entrypoints.openai.api_server`` (``server_command``), every route of it (the dev
routes and ``/health`` included) behind the run's secret (``route_auth.py``, given as ``VLLM_API_KEY``, never on
the command line). ``VLLMServerSettings`` is its launch spec (servers/fleet.py ``ServerLaunch``): fleet.py starts
it in a process group of its own (vLLM's engine core is a child of it: ``stop`` ends both), ready once
``/health`` answers 200 to the secret, as child processes (``ServerProcessPool``: torchrun, no Ray; on this
host's GPUs after the trainer's, ``host_server_gpus``) or one per Ray actor on the servers' own resource pool
(servers/ray_pool.py: Ray reserves the CPUs, and on a cluster with GPUs rollout-TP GPUs per server, which are all
its server sees). A replacement holds random weights (version -1) and serves nothing before the next sync.

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

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from megatron_rl.config.schema import PPOTrainerConfig, RolloutConfig
from megatron_rl.distributed.device import visible_gpus
from megatron_rl.models.hf_config import plain_overrides
from megatron_rl.rollout.hf_engine import resolve_dtype
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
from megatron_rl.servers.pool import RolloutServerDied
from megatron_rl.servers.route_auth import KEY_ENV, MIDDLEWARE

__all__ = ["VLLMServerRolloutClient", "VLLMServerSettings", "host_server_gpus", "server_command",
           "vllm_server_settings"]

SERVED_NAME = "megatron-rl-policy"


@dataclass(frozen=True)
class VLLMServerSettings:
    """What every started server runs: ``engine_args`` are vLLM engine arguments built by the colocated engine's
    own ``engine_args`` (rollout/vllm/engine.py), so each rollout key means the same in both modes."""

    engine: ClassVar[str] = "vLLM"
    timeout_key: ClassVar[str] = "actor_rollout_ref.rollout.vllm.server_start_timeout_s"
    one_node_reason: ClassVar[str] = ("vLLM rollout servers take their weights through /dev/shm of trainer rank 0's "
                                      "host, so they cannot spread over nodes")

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

    def command(self, *, host: str, port: int, seed: int) -> list[str]:
        return server_command(self, port=port, host=host, seed=seed)

    def environment(self, api_key: str, gpus: Sequence[Any]) -> dict[str, str]:
        env = {"VLLM_SERVER_DEV_MODE": "1", KEY_ENV: api_key, "OMP_NUM_THREADS": str(self.threads),
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        if self.cpu_threads_bind != "auto":
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_threads_bind
        if dict(self.engine_args).get("distributed_executor_backend") == "uni":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # else vLLM-CPU turns "uni" back into "mp"
        if gpus:  # vLLM's TP worker i takes the i-th
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        if self.serves_images:  # vLLM's Qwen-VL code without torchvision (a no-op where torchvision imports)
            env["PYTHONPATH"] = torchvision_free_env()["PYTHONPATH"]
        return env

    def host_gpus(self, num_servers: int) -> list[tuple[Any, ...]]:
        return host_server_gpus(num_servers, self.tensor_parallel_size)

    def ray_gpus(self, cluster_has_gpus: bool) -> int:
        return self.tensor_parallel_size if cluster_has_gpus else 0

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
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` where it says ``--distributed-executor-backend uni``: ``environment``).
    ``--middleware`` puts every route behind the secret (route_auth.py); vLLM alone guards ``/v1`` only."""
    args = dict(settings.engine_args)
    if seed is not None:
        args["seed"] = seed
    # images come through vLLM's token-in route (/inference/v1/generate), which --enable-scale-out opens
    images = ["--enable-scale-out"] if settings.serves_images else []
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--served-model-name", SERVED_NAME,
            "--host", host, "--port", str(port), "--middleware", MIDDLEWARE, *cli_flags(args), *images]


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
