"""The /dev/shm segments of one weight-update session, staged a bounded number at a time.

Each bucket becomes one segment (``shm.py``), written once per replica: every TP worker of the engine reads the
same full tensors and shards them itself. After each segment the staging hands out what is complete: every
tensor staged before the load unit (``load_units.py``: a decoder layer, or one module outside the layers) that
the newest segment ends in, since that unit may continue in the next bucket. Once loaded, a segment none of
whose tensors wait any more is unlinked. So at any time the staged bytes are about one unit plus two buckets,
not the model. A tensor of a unit that was already loaded is refused: it would be loaded into a module whose
other parts vLLM already processed.

Every segment is unlinked by ``release`` (a failed or aborted session), or when the staging is collected or the
interpreter exits (``weakref.finalize``), so none is left behind on a failure.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from megatron_rl.rollout.base import WeightUpdateError
from megatron_rl.rollout.vllm.load_units import load_unit
from megatron_rl.rollout.vllm.shm import ShmSegment, new_segment_name

__all__ = ["ShmStaging", "host_staging_per_node", "staged_peak_bytes"]


def _unlink_all(segments: list[ShmSegment]) -> None:
    for segment in segments:
        segment.unlink()
    segments.clear()


class ShmStaging:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._segments: list[ShmSegment] = []  # staged and not yet unlinked
        self._waiting: list[tuple[ShmSegment, list]] = []  # tensors not loaded yet, in stream order
        self._loaded_units: set[str] = set()
        self.peak_segments = self.peak_bytes = 0
        self._cleanup = weakref.finalize(self, _unlink_all, self._segments)

    def stage(self, tensors: list[tuple[str, torch.Tensor]], tag: str) -> None:
        """Write ``tensors`` into one new segment (refused before writing when /dev/shm cannot hold it)."""
        for name, _ in tensors:
            if load_unit(name) in self._loaded_units:
                raise WeightUpdateError(
                    f"tensor {name!r} arrived after the rest of {load_unit(name)!r} was loaded into vLLM: a "
                    "decoder layer's tensors must arrive together (one after the other in the weight stream)")
        segment = ShmSegment(self.directory, new_segment_name(tag), tensors)
        self._segments.append(segment)
        self._waiting.extend((segment, entry) for entry in segment.layout["tensors"])
        self.peak_segments = max(self.peak_segments, len(self._segments))
        self.peak_bytes = max(self.peak_bytes, sum(s.nbytes for s in self._segments))

    def complete(self) -> list[dict[str, Any]]:
        """Layouts of the waiting tensors before the first one of the unit the newest segment ends in."""
        if not self._waiting:
            return []
        open_unit = load_unit(self._waiting[-1][1][0])
        count = next(i for i, (_, entry) in enumerate(self._waiting) if load_unit(entry[0]) == open_unit)
        return self._layouts(self._waiting[:count])

    def waiting(self) -> list[dict[str, Any]]:
        """Layouts of every tensor not loaded yet (the session's end)."""
        return self._layouts(self._waiting)

    def loaded(self, layouts: list[dict[str, Any]]) -> None:
        """``layouts`` (from ``complete`` or ``waiting``) are in the engine: unlink the segments now unused."""
        count = sum(len(layout["tensors"]) for layout in layouts)
        done, self._waiting = self._waiting[:count], self._waiting[count:]
        self._loaded_units.update(load_unit(entry[0]) for _, entry in done)
        still_read = {id(segment) for segment, _ in self._waiting}
        for segment in [s for s in self._segments if id(s) not in still_read]:
            segment.unlink()
            self._segments.remove(segment)

    def release(self) -> None:
        """Unlink every segment (a failed or aborted session); nothing may be loaded from it any more."""
        self._waiting = []
        _unlink_all(self._segments)

    @staticmethod
    def _layouts(waiting: list[tuple[ShmSegment, list]]) -> list[dict[str, Any]]:
        """One layout per segment, listing only the given tensors of it (in order)."""
        layouts: list[dict[str, Any]] = []
        for segment, entry in waiting:
            if not layouts or layouts[-1]["path"] != segment.path:
                layouts.append({"path": segment.path, "size": segment.nbytes, "tensors": []})
            layouts[-1]["tensors"].append(entry)
        return layouts


def staged_peak_bytes(tensors: list[tuple[str, int]], bucket_bytes: int) -> int:
    """The model of ``ShmStaging``'s peak for a stream of (HF name, bytes) packed as ``sync_weights`` packs it
    (in order into buckets of ``bucket_bytes``; a larger tensor alone): after each segment, the segments from
    the first one holding the open unit on stay staged, the others are loaded and unlinked."""
    segments: list[tuple[int, list[str]]] = []  # the packer's buckets: bytes, units of their tensors
    for name, nbytes in tensors:
        if nbytes > bucket_bytes or not segments or segments[-1][0] + nbytes > bucket_bytes:
            segments.append((0, []))
        used, units = segments[-1]
        segments[-1] = (used + nbytes, units + [load_unit(name)])
    peak, live = 0, []
    for segment in segments:
        live.append(segment)
        peak = max(peak, sum(used for used, _ in live))
        open_unit = segment[1][-1]
        live = live[next(i for i, (_, units) in enumerate(live) if open_unit in units):]
    return peak


def host_staging_per_node(hf: Any, *, rollout_tp: int, gpus_per_node: int, bucket_bytes: int,
                          dtype_bytes: int = 2) -> dict[str, int]:
    """Host bytes a colocated vLLM sync stages in one node's /dev/shm: ``before`` (issue 49: every rank a full
    copy of every bucket, all held to the end), ``written`` (now: one copy per replica) and ``peak`` (now: held
    at once). ``hf``: the model's ``HFModelConfig``."""
    from megatron_rl.models.layout import hf_tensor_groups  # lazy: megatron-core

    tensors = [(t.name, dtype_bytes * _numel(t.shape)) for group in hf_tensor_groups(hf, mtp=False)
               for t in group.tensors]
    model_bytes = sum(nbytes for _, nbytes in tensors)
    replicas = gpus_per_node // rollout_tp
    return {"before": gpus_per_node * model_bytes, "written": replicas * model_bytes,
            "peak": replicas * staged_peak_bytes(tensors, bucket_bytes)}


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count
