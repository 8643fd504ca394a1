"""What the colocated vLLM engine (``engine.py``) and the client of vLLM servers (``server.py``) share: a
weight-update session whose buckets are staged in /dev/shm segments (``shm.py``: one copy each, so the trainer
may reuse its bucket at once) and loaded all together when it ends (a fused layer whose parts were reloaded
separately would be repacked half old), the refusal to generate while a session is open or the weights are not
the trainer's, and the sampling parameters of a call."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from megatron_rl.bucket import WeightBucket
from megatron_rl.rollout.base import RolloutEngine, WeightUpdateError
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.batch_io import check_prompt_batch
from megatron_rl.rollout.sampling import SamplingParams, resolve_sampling_params
from megatron_rl.rollout.vllm.shm import ShmSegment, new_segment_name

__all__ = ["StagedWeightsEngine", "stage_payload"]


class _Owned:
    """A segment another rank wrote and this engine unlinks once loaded (the leader owns the session's cleanup)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class StagedWeightsEngine(RolloutEngine):
    """Subclasses set ``tp_size`` (segments per load: one layout per engine TP rank) and ``dtype``, call
    ``_start_sessions(needs_sync)`` and implement ``end_weight_update`` over ``_staged``."""

    def _start_sessions(self, needs_sync: str | None) -> None:
        self._in_session = False
        self._session_version = 0
        self._staged: list[list[dict[str, Any]]] = []  # per load: one segment layout per engine TP rank
        self._segments: list[ShmSegment | _Owned] = []
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

    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._require_session()
        items = [(name, t.to(self.dtype) if t.is_floating_point() else t) for name, t in named_tensors]
        if items:
            self._stage(items)

    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """A bucket of this process: every engine TP rank reads it (each worker shards the full tensors)."""
        self._require_session()
        if len(bucket):
            self._stage(bucket.named_tensors())

    def load_payloads(self, payloads: list[dict[str, Any]]) -> None:
        """One segment layout per engine TP rank, each written by the trainer rank feeding it (``stage_payload``);
        this engine unlinks them once loaded."""
        self._require_session()
        if len(payloads) != self.tp_size:
            raise WeightUpdateError(f"{len(payloads)} payloads for an engine of TP {self.tp_size}")
        self._staged.append(list(payloads))
        self._segments.extend(_Owned(p["path"]) for p in payloads)

    def _stage(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        segment = ShmSegment(new_segment_name(f"v{self._session_version}"), tensors)
        self._segments.append(segment)
        self._staged.append([segment.layout] * self.tp_size)

    def _require_session(self) -> None:
        if not self._in_session:
            raise WeightUpdateError("load outside a weight-update session; call begin_weight_update() first")

    def _layouts_by_rank(self) -> list[list[dict[str, Any]]]:
        return [[load[rank] for load in self._staged] for rank in range(self.tp_size)]

    def abort_weight_update(self, reason: str) -> None:
        self._needs_sync = reason
        self._in_session = False
        self._release_segments()

    def _release_segments(self) -> None:
        for segment in self._segments:
            segment.unlink()
        self._segments, self._staged = [], []


def stage_payload(bucket: WeightBucket) -> dict[str, Any]:
    """A member rank's copy of a bucket for its engine TP rank: written to shared memory, its layout returned
    (the leader's engine loads it and unlinks it)."""
    return ShmSegment(new_segment_name("member"), bucket.named_tensors()).layout
