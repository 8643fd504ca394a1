"""What the colocated vLLM engine (``engine.py``) and the client of vLLM servers (``server.py``) share: a
weight-update session whose buckets are staged in /dev/shm segments (``staging.py``: one copy per replica, so
the trainer may reuse its bucket at once), the refusal to generate while a session is open or the weights are
not the trainer's, and the sampling parameters of a call.

An engine that ``loads_by_group`` (the colocated one) loads what is complete after every staged bucket, whole
decoder layers at a time (``load_units.py``), and the rest when the session ends, so a bounded number of
buckets is staged at once; the servers load everything at the session's end (each server paused once)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megatron_rl.bucket import WeightBucket
from megatron_rl.rollout.base import RolloutEngine, WeightUpdateError
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.batch_io import check_prompt_batch
from megatron_rl.rollout.sampling import SamplingParams, resolve_sampling_params
from megatron_rl.rollout.vllm.shm import staging_dir
from megatron_rl.rollout.vllm.staging import ShmStaging

__all__ = ["StagedWeightsEngine"]


class StagedWeightsEngine(RolloutEngine):
    """Subclasses set ``tp_size`` (one layout list per engine TP rank) and ``dtype``, call
    ``_start_sessions(needs_sync)`` and implement ``end_weight_update`` over ``_layouts_by_rank``; with
    ``loads_by_group`` also ``_load_group(layouts)`` (and ``end_weight_update`` loads ``_staging.waiting()``)."""

    loads_by_group = False

    def _start_sessions(self, needs_sync: str | None) -> None:
        self._in_session = False
        self._session_version = 0
        self._staging = ShmStaging(staging_dir())
        self._needs_sync = needs_sync  # why the engine may not generate (None: it serves the trainer's weights)

    def _call_params(self, prompts: DataProto) -> SamplingParams:
        """A generate call's sampling parameters, once the engine may serve it (no open session, the trainer's
        weights) and the prompts are well formed."""
        name = type(self).__name__
        if self._in_session:
            raise RuntimeError(f"{name} has an open weight-update session; call end_weight_update() first")
        if self._needs_sync is not None:
            raise RuntimeError(f"{name} cannot generate yet: {self._needs_sync}; run a complete weight sync")
        check_prompt_batch(prompts)
        return resolve_sampling_params(self.config, prompts.meta_info, response_length=self.response_length,
                                       eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)

    def begin_weight_update(self, version: int) -> None:
        if self._in_session:
            raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
        self._in_session = True
        self._session_version = int(version)
        self._staging = ShmStaging(staging_dir())

    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Staged in segments of at most ``weight_sync.bucket_size_mb`` (a larger tensor alone in its own)."""
        self._require_session()
        limit = int(self.config.weight_sync.bucket_size_mb) << 20
        chunk, used = [], 0
        for name, tensor in named_tensors:
            tensor = tensor.to(self.dtype) if tensor.is_floating_point() else tensor
            nbytes = tensor.numel() * tensor.element_size()
            if chunk and used + nbytes > limit:
                self._stage(chunk)
                chunk, used = [], 0
            chunk.append((name, tensor))
            used += nbytes
        if chunk:
            self._stage(chunk)

    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """A bucket of this process: every engine TP rank reads it (each worker shards the full tensors)."""
        self._require_session()
        if len(bucket):
            self._stage(bucket.named_tensors())

    def _stage(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._staging.stage(tensors, f"v{self._session_version}")
        if self.loads_by_group:
            self._load_staged(self._staging.complete())

    def _load_staged(self, layouts: list[dict[str, Any]]) -> None:
        """Load ``layouts`` into the engine (``_load_group``) and unlink what no later load reads."""
        if not layouts:
            return
        with self._aborting_on_failure("loading the weights"):
            self._load_group(layouts)
        self._staging.loaded(layouts)

    @contextlib.contextmanager
    def _aborting_on_failure(self, step: str) -> Iterator[None]:
        """A step of the open session (``step``: "loading the weights"); its failure aborts the session (every
        segment unlinked, generation refused) and is raised as a WeightUpdateError naming the step and version."""
        try:
            yield
        except BaseException as exc:
            version = self._session_version
            self.abort_weight_update(f"{step} of version {version} failed: {exc}")
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: as they are, once the session is aborted
            raise WeightUpdateError(f"vLLM failed {step} of version {version}: {exc}") from exc

    def _load_group(self, layouts: list[dict[str, Any]]) -> None:
        raise NotImplementedError(f"{type(self).__name__} loads every bucket when the session ends")

    def staged_peak(self) -> tuple[int, int]:
        """The most segments, and bytes, the last session had staged at once."""
        return self._staging.peak_segments, self._staging.peak_bytes

    def _require_session(self) -> None:
        if not self._in_session:
            raise WeightUpdateError("load outside a weight-update session; call begin_weight_update() first")

    def _layouts_by_rank(self) -> list[list[dict[str, Any]]]:
        """Every staged tensor not loaded yet, for each engine TP rank (all read the same segments)."""
        return [self._staging.waiting()] * self.tp_size

    def abort_weight_update(self, reason: str) -> None:
        self._needs_sync = reason
        self._in_session = False
        self._release_segments()

    def _release_segments(self) -> None:
        self._staging.release()
