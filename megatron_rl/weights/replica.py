"""One trainer rank's part in its rollout engine replica (rollout/mesh.py): sync, generate, release, verify.

The replica's leader holds the engine; every rank takes part in a weight sync. Colocated SGLang of rollout TP
k > 1, and colocated vLLM on GPUs: each of the k ranks puts each bucket on its own GPU and makes a payload of it
there (a CUDA IPC handle), and the leader gathers the k payloads (over a gloo group of the replica's ranks,
ordered by engine TP rank) and hands them to the engine (SGLang: ``named_tensors=[payload_tp0, ...]``; vLLM: one
IPC update, each worker opening its own GPU's copy). Colocated vLLM on CPU (and drafting with MTP): its workers
each read the full tensors and shard them themselves, so the leader alone materialises and stages the buckets
(one host copy per replica); the members only take part in the export. A rank that feeds no engine (server
mode: only global rank 0 sends; vLLM's members on CPU) consumes the export stream without sending.

Colocated, at every rollout TP: every rank of the engine's GPUs gives its cached training memory back before
the engine wakes its weights and again before it wakes its KV cache (as verl empties the cache before each
``resume``); at TP > 1 the ranks meet on the replica's gloo group after it, so the leader wakes nothing before
every GPU the engine spans has room.

Verification runs the fixed probe once per replica (on its leader); the other ranks wait for the leaders on the
host group (long timeout: a device collective's watchdog would end the job during a long probe), then the probe
outputs are gathered to every rank, and every rank scores the same concatenated batch with the trainer, which
makes that scoring a valid collective for any actor layout. Metrics are the worst replica's; above
``verify_max_logprob_diff`` (null: by the dtypes compared, ``weights.verify.default_threshold``) every rank raises
the same WeightSyncError, naming the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.bucket import WeightBucket
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.device import release_cached_memory
from megatron_rl.distributed.host_group import new_host_group, wait_for_all
from megatron_rl.models.moe_routing import routing_agreement
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.base import RolloutEngine
from megatron_rl.rollout.engines import engine_of
from megatron_rl.rollout.mesh import EngineReplica, RolloutMesh
from megatron_rl.weights.export import ExportPlan
from megatron_rl.weights.sync import WeightItem, WeightSyncError, sync_weights
from megatron_rl.weights.verify import (
    check_logprob_diff,
    explain_mismatch,
    logprob_diff,
    probe_rollout,
    resolve_threshold,
)

__all__ = ["RolloutReplica"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree_on_failure(failure: Exception | None, version: int) -> None:
    """Server mode: only the sender (rank 0) can fail a sync. Every rank raises its failure, so they all stop
    (or retry, servers/restarts.py) together instead of the others going on alone into the next
    collective."""
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    for rank, reason in enumerate(reasons):
        if reason is not None:
            raise WeightSyncError(f"rank {rank}, the rollout servers' sender, failed the weight sync to version "
                                  f"{version}: {reason}")


class _EngineGPUs:
    """The ranks whose GPUs one colocated engine spans. ``cache_released``: this rank gives its cached training
    memory back to its GPU, then (TP > 1) waits for the others on the replica's gloo group, so the leader wakes
    the engine's weights or KV cache only once every GPU the engine spans has room for them."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def cache_released(self) -> None:
        release_cached_memory()
        if self.group is not None:
            dist.barrier(group=self.group)


class _PayloadGather:
    """SGLang, and vLLM on GPUs, at TP > 1: each rank makes a payload of its copy of a bucket on its own GPU (a
    CUDA IPC handle: ``EngineSpec.bucket_payload``), and the leader receives the replica's payloads ordered by
    engine TP rank."""

    def __init__(self, replica: EngineReplica, group: dist.ProcessGroup, serialize: Callable[[WeightBucket], Any]
                 ) -> None:
        self.replica, self.group, self.serialize = replica, group, serialize
        self._order = [sorted(replica.ranks).index(rank) for rank in replica.ranks]  # group rank of TP rank i

    def gather(self, bucket: WeightBucket, is_leader: bool) -> list | None:
        received: list | None = [None] * self.replica.tp_size if is_leader else None
        dist.gather_object(self.serialize(bucket), received, dst=self.replica.leader, group=self.group)
        return [received[i] for i in self._order] if is_leader else None


class _LeaderSink:
    """The leader's side of a colocated engine: the buckets (its own, or every rank's payloads), and the
    trainer's cache given back on every GPU of the engine before the KV cache wakes (before the weights wake:
    ``RolloutReplica.sync``)."""

    def __init__(self, engine: RolloutEngine, gpus: _EngineGPUs, payloads: _PayloadGather | None) -> None:
        self.engine, self.gpus, self.payloads = engine, gpus, payloads
        self.dtype, self.thread_affine = engine.dtype, engine.thread_affine
        self.async_loads = True if payloads is not None else engine.async_loads

    def begin_weight_update(self, version: int) -> None:
        self.engine.begin_weight_update(version)

    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        if self.payloads is None:
            self.engine.load_weight_bucket(bucket)
        else:
            self.engine.load_payloads(self.payloads.gather(bucket, is_leader=True))

    def end_weight_update(self) -> None:
        self.gpus.cache_released()
        self.engine.end_weight_update()

    def abort_weight_update(self, reason: str) -> None:
        self.engine.abort_weight_update(reason)
        # members that sent every bucket wait at the end-of-sync meeting: join it, so they are not left there
        self.gpus.cache_released()


class _MemberSink:
    """A non-leader rank of a TP > 1 SGLang engine: its GPU's copy of every bucket, serialized on that GPU, sent
    to the leader."""

    async_loads, thread_affine = True, False

    def __init__(self, dtype: torch.dtype, gpus: _EngineGPUs, payloads: _PayloadGather) -> None:
        self.dtype, self.gpus, self.payloads = dtype, gpus, payloads

    def begin_weight_update(self, version: int) -> None:
        pass

    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        self.payloads.gather(bucket, is_leader=False)

    def end_weight_update(self) -> None:
        self.gpus.cache_released()  # before the leader wakes the KV cache on this rank's GPU too

    def abort_weight_update(self, reason: str) -> None:
        pass


class RolloutReplica:
    """``config``: the rollout config (``weight_sync``, ``free_cache_engine``, ``mode``). ``build_engine`` is
    called on the replica's leader only. ``trainer_log_prob_fn`` (DataProto -> [B, R]) must be callable on
    every rank; it is called on all ranks with the same batch. ``record_trainer_routing`` (MoE) opens a
    ``models.moe_routing.RoutingRecorder`` around that call, so the same forward also gives the trainer's routing
    of the probe, which a leader whose engine reports its own compares (``rollout/moe_routing_agreement``).
    ``drafts_with_mtp``: the engine decodes speculatively with the model's MTP layers, which every sync then carries
    (else they stay with the trainer)."""

    def __init__(
        self,
        config: RolloutConfig,
        mesh: RolloutMesh,
        rank: int,
        build_engine: Callable[[EngineReplica], RolloutEngine],
        *,
        member_dtype: torch.dtype,
        probe_prompts: DataProto | None = None,
        trainer_log_prob_fn: Callable[[DataProto], torch.Tensor] | None = None,
        record_trainer_routing: Callable[[], Any] | None = None,
        trainer_dtype: torch.dtype | None = None,
        drafts_with_mtp: bool = False,
    ) -> None:
        sync_cfg = config.weight_sync
        if sync_cfg.bucket_size_mb <= 0:
            raise ValueError(f"rollout.weight_sync.bucket_size_mb must be positive, got {sync_cfg.bucket_size_mb}")
        if sync_cfg.verify_freq < 0:
            raise ValueError(f"rollout.weight_sync.verify_freq must be >= 0 (0 disables), got {sync_cfg.verify_freq}")
        if sync_cfg.verify_freq and (probe_prompts is None or trainer_log_prob_fn is None):
            raise ValueError(
                "rollout.weight_sync.verify_freq > 0 needs probe_prompts and trainer_log_prob_fn "
                "(or set verify_freq=0 to sync without verification)"
            )
        self.config, self.mesh, self.rank = config, mesh, rank
        self.replica = mesh.replica_of(rank)
        self.is_leader = self.replica.leader == rank
        self.probe_prompts, self.trainer_log_prob_fn = probe_prompts, trainer_log_prob_fn
        self.record_trainer_routing = record_trainer_routing
        self.trainer_dtype = trainer_dtype  # the actor's params dtype: with the engines' it picks the null threshold
        # the engine drafts with the model's MTP layers (model.mtp.enable_rollout): every sync sends them too
        self.drafts_with_mtp = drafts_with_mtp
        self._pending_verify: tuple[int, Any] | None = None  # (version, sender checksums) of a deferred check
        self.version = 0
        self.colocated = config.mode == "colocated"
        spec = engine_of(config)
        self.members_send = (self.colocated and self.mesh.tp > 1
                             and spec.members_send_shards(torch.cuda.is_available(), drafts_with_mtp))
        group = self._replica_group() if self.colocated else None
        self.gpus = _EngineGPUs(group) if self.colocated else None
        self._host = new_host_group()
        if self.gpus is not None:
            # vLLM checks free memory against gpu_memory_utilization x total at start: the trainer's cached blocks
            # (model build, checkpoint load) go back to every GPU of the engine first
            self.gpus.cache_released()
        self.engine = build_engine(self.replica) if self.is_leader else None
        # A cold engine build (CUDA graphs, JIT) can take longer than a collective's timeout: the other ranks
        # wait for it here, not in the first sync's export collectives.
        wait_for_all(self._host, "the leaders build their rollout engines")
        payloads = (_PayloadGather(self.replica, group, spec.bucket_payload())
                    if self.members_send and group is not None else None)
        if not self.colocated:  # server mode: the leader sends everything itself
            self.sink = self.engine
        elif self.is_leader:
            self.sink = _LeaderSink(self.engine, self.gpus, payloads)
        elif payloads is not None:
            self.sink = _MemberSink(member_dtype, self.gpus, payloads)
        else:  # a vLLM member: its part is the export and the cache
            self.sink = None

    def _replica_group(self) -> dist.ProcessGroup | None:
        """Gloo groups of each replica's ranks, created by every rank in the same order (``new_group`` is a
        collective of the whole world); None when no replica has more than one rank."""
        if self.mesh.tp == 1 or not _distributed():
            return None
        mine = None
        for replica in self.mesh.replicas:
            group = dist.new_group(sorted(replica.ranks), backend="gloo")
            if replica is self.replica:
                mine = group
        return mine

    # ------------------------------------------------------------------ the step's phases
    def generate(self, prompts: DataProto) -> DataProto:
        if not self.is_leader:
            raise RuntimeError(
                f"rank {self.rank} holds no rollout engine: generation goes to the leader of engine "
                f"{self.replica.index} (rank {self.replica.leader}); dispatch with ROLLOUT_COMPUTE_PROTO"
            )
        return self.engine.generate_sequences(prompts)

    def release(self) -> None:
        """Entering a training phase: with ``free_cache_engine`` a colocated engine gives its memory back (the
        next sync brings it back with current weights, so every generation runs on them). Servers keep theirs:
        their devices are not the trainer's, and an async loop generates on them during the update."""
        if self.is_leader and self.config.free_cache_engine and self.config.mode == "colocated":
            self.engine.sleep()

    def export_plan(self) -> ExportPlan:
        """Colocated SGLang: every rank feeds its engine, so every rank materialises full tensors. Server mode
        and colocated vLLM: only the leaders do; the other ranks send their shards towards them and skip the
        rest."""
        every_rank = self.members_send or (self.colocated and self.mesh.tp == 1)
        return ExportPlan(
            consumers=None if every_rank else frozenset(self.mesh.leaders),
            bucket_bytes=int(self.config.weight_sync.bucket_size_mb) << 20,
            with_mtp=self.drafts_with_mtp,
        )

    def sync(
        self, export: Callable[[ExportPlan], Iterable[WeightItem]], version: int, *, defer_verify: bool = False
    ) -> dict[str, float]:
        """Push weight version ``version`` (the training step) into the replica's engine; every rank calls this
        with the same ``export``, which streams the weights as the replica's ``export_plan()`` says (the actor's
        ``export_buckets``; any (name, tensor) stream in tests). Returns ``weight_sync/*`` (and
        ``rollout/logprob_diff_*``) metrics.
        ``defer_verify``: a due verification waits for ``verify_pending`` (servers paused around the sync hold
        the probe's generation until they continue, so the probe must come after)."""
        sync_cfg = self.config.weight_sync
        verify = sync_cfg.verify_freq > 0 and version % sync_cfg.verify_freq == 0
        plan = self.export_plan()
        server_mode = not self.colocated
        if self.colocated:
            self.gpus.cache_released()  # before the engine wakes its weights (the first bucket's session)
        stream = iter(export(plan))
        failure: Exception | None = None
        metrics: dict[str, float] = {}
        checksums = None
        if self.sink is None:  # feeds no engine: the export is a collective, take part in it
            for _ in stream:
                pass
            if self.colocated:
                self.gpus.cache_released()  # before the leader wakes the KV cache on this rank's GPU too
        else:
            try:
                stats = sync_weights(
                    stream,
                    self.sink,
                    version=version,
                    bucket_bytes=plan.bucket_bytes,
                    compute_checksums=verify and self.is_leader,
                )
                metrics, checksums = stats.metrics(), stats.checksums
            except Exception as exc:
                if not (server_mode and _distributed()):
                    raise
                failure = exc
                for _ in stream:  # the other ranks' export collectives need this rank to the end
                    pass
        if server_mode and _distributed():
            _agree_on_failure(failure, version)
        self.version = version
        if verify and defer_verify:
            self._pending_verify = (version, checksums)
        elif verify:
            metrics |= self._verify(version, checksums)
        return metrics

    def verify_pending(self) -> dict[str, float]:
        """Run the verification a ``defer_verify`` sync left (every rank calls this); {} when none is due."""
        pending, self._pending_verify = self._pending_verify, None
        return {} if pending is None else self._verify(*pending)

    def _verify(self, version: int, checksums: Any) -> dict[str, float]:
        # Each leader's probe output and its engine's dtype (the null threshold depends on every engine's).
        mine = None
        if self.is_leader:
            mine = (probe_rollout(self.engine, self.probe_prompts), getattr(self.engine, "dtype", None))
        if _distributed():
            # the others wait for the leaders' probes here, not in the gather: its device watchdog ends the job
            wait_for_all(self._host, "the leaders generate the verification probe")
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            answers = [gathered[leader] for leader in self.mesh.leaders]
        else:
            answers = [mine]
        outputs = [output for output, _ in answers]
        threshold = resolve_threshold(self.config.weight_sync.verify_max_logprob_diff, self.trainer_dtype,
                                      [dtype for _, dtype in answers])
        probe = DataProto.concat(outputs)
        recording = self.record_trainer_routing() if self.record_trainer_routing else contextlib.nullcontext()
        with torch.no_grad(), recording as recorder:
            trainer_lp = self.trainer_log_prob_fn(probe)
        per_replica, start = [], 0
        for output in outputs:
            per_replica.append(logprob_diff(output, trainer_lp[start : start + len(output)]))
            start += len(output)
        worst = max(range(len(per_replica)), key=lambda i: per_replica[i]["rollout/logprob_diff_mean"])
        metrics = {
            "rollout/logprob_diff_mean": per_replica[worst]["rollout/logprob_diff_mean"],
            "rollout/logprob_diff_max": max(m["rollout/logprob_diff_max"] for m in per_replica),
            "rollout/logprob_diff_threshold": threshold,
        }

        def explain() -> str:
            replica = self.mesh.replicas[worst]
            where = f"engine {worst} (ranks {list(replica.ranks)} on {replica.node})"
            if self.replica.index == worst and self.is_leader:
                return f"{where}: " + explain_mismatch(self.engine, checksums)
            return f"{where}; its leader, rank {replica.leader}, names the tensors"

        check_logprob_diff(metrics, threshold, f"weight sync v{version}", explain)
        if recorder is not None:
            return metrics | self._routing_agreement(probe, recorder.gathered())
        return metrics

    def _routing_agreement(self, probe: DataProto, trainer: Any) -> dict[str, float]:
        """MoE: ``trainer``'s routing of the probe (merged over every rank, or None) against this leader's
        engine's, when the engine reports its own (the HF engine; SGLang does not)."""
        choices = getattr(self.engine, "expert_choices", None) if self.is_leader else None
        if trainer is None or choices is None:
            return {}
        engine = choices(probe)
        return {} if engine is None else routing_agreement(trainer, engine)

    def replace_servers(self, server_urls: list[str]) -> list[str]:
        """Server mode: the leader's engine talks to these servers from now on (servers/restarts.py);
        the URLs of servers stuck in a broken broadcast, which must be replaced too."""
        return self.engine.replace_servers(server_urls) if self.engine is not None else []

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
