"""``megatron.param_offload`` / ``megatron.optimizer_offload``: a role's state leaves the GPU in the phases
of a colocated step that do not need it, so the rollout engine can have the memory (verl's megatron
workers do the same).

What lives where, by phase (``EngineOffload.enter``):

    phase      needs on the device             with param_offload          with optimizer_offload
    generate   nothing                         weights, grads -> host      optimizer state -> host
    compute    weights (log-probs, values,     weights -> device
               weight export to the engine)
    update     weights, grads, optimizer       all -> device               all -> device
    (after an update)                          grads -> host               optimizer state -> host

A move keeps every tensor object (and so every view Megatron holds: DDP's bucket views, ``main_grad``,
the optimizer's references): the storage's bytes are copied to a host buffer (pinned with CUDA) and the
storage is resized to 0, which frees its memory; the way back resizes it and copies the bytes in. On a
CPU machine the "device" is the CPU too, and the storages really are emptied, so the bookkeeping (what
moved, in which phase, how many bytes) and the numbers after a round trip are tested there
(tests/workers/test_offload.py). Megatron-Core 0.16.1's own helpers (``offload_grad_buffers``,
``MegatronOptimizer.offload_to_cpu``) move only CUDA tensors and change tensor objects; this moves storages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

PHASES = ("generate", "compute", "update", "after_update")
KINDS = ("weights", "grads", "optimizer")


@dataclass(frozen=True)
class OffloadEvent:
    phase: str
    kind: str  # weights | grads | optimizer
    to: str  # host | device
    nbytes: int


@dataclass
class _Storages:
    """The distinct storages of one kind of state, and their host copies while offloaded."""

    tensors: list[torch.Tensor]  # one tensor per storage (a 1-D uint8 view of all of it)
    host: list[torch.Tensor | None] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


def _unique_storages(tensors, exclude: set[int]) -> list[torch.Tensor]:
    seen, out = set(exclude), []
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        whole.set_(storage, 0, (storage.nbytes(),))
        out.append(whole)
    return out


def _inner_optimizers(optimizer: Any) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(opt, "optimizer", opt) for opt in chained]


class EngineOffload:
    """The offload state machine of one MegatronEngine (``engine.offload``)."""

    def __init__(self, engine: Any, params: bool, optimizer: bool) -> None:
        self.engine = engine
        self.params, self.optimizer = bool(params), bool(optimizer)
        self.residency = {kind: "device" for kind in KINDS}
        self.log: list[OffloadEvent] = []

    @property
    def active(self) -> bool:
        return self.params or self.optimizer

    # ------------------------------------------------------------------ what belongs to each kind
    def _weights(self) -> list[torch.Tensor]:
        return [p for chunk in self.engine.model for p in chunk.parameters()]

    def _grads(self) -> list[torch.Tensor]:
        out = []
        for chunk in self.engine.model:
            for buffer in getattr(chunk, "buffers", []) or []:
                if getattr(buffer, "grad_data", None) is not None:
                    out.append(buffer.grad_data)
        return out

    def _optimizer_state(self) -> list[torch.Tensor]:
        if self.engine.optimizer is None:
            return []
        out = []
        for inner in _inner_optimizers(self.engine.optimizer):
            for group in inner.param_groups:
                out.extend(group["params"])  # fp32 master weights (the model's own with fp32 params: excluded)
            for state in inner.state.values():
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        # Megatron's CPU Adam (optim.override_optimizer_config.optimizer_cpu_offload) keeps its share of the state
        # in host memory already: with the weights on the GPU only the state on the GPU moves. On a CPU machine
        # everything is "device" and moves, as before.
        weights_on_gpu = any(p.is_cuda for p in self._weights())
        return [t for t in out if not weights_on_gpu or not isinstance(t, torch.Tensor) or t.is_cuda]

    def _storages(self, kind: str) -> list[torch.Tensor]:
        weights = _unique_storages(self._weights(), set())
        if kind == "weights":
            return weights
        taken = {t.untyped_storage().data_ptr() for t in weights}
        grads = _unique_storages(self._grads(), taken)
        if kind == "grads":
            return grads
        taken |= {t.untyped_storage().data_ptr() for t in grads}
        return _unique_storages(self._optimizer_state(), taken)

    # ------------------------------------------------------------------ moves
    def _move(self, kind: str, to: str, phase: str) -> None:
        if self.residency[kind] == to:
            return
        nbytes = 0
        if to == "host":
            self._held = getattr(self, "_held", {})
            held = []
            for whole in self._storages(kind):
                size = whole.numel()
                host = torch.empty(size, dtype=torch.uint8, pin_memory=whole.is_cuda)
                if kind != "grads":  # gradients are zeroed when they come back: nothing to keep
                    host.copy_(whole, non_blocking=whole.is_cuda)
                held.append((whole, host, size))
                nbytes += size
            if any(whole.is_cuda for whole, _, _ in held):
                torch.cuda.synchronize()
            for whole, _, _ in held:
                whole.untyped_storage().resize_(0)
            self._held[kind] = held
        else:
            for whole, host, size in self._held.pop(kind, []):
                storage = whole.untyped_storage()
                storage.resize_(size)
                whole.set_(storage, 0, (size,))
                if kind == "grads":
                    whole.zero_()
                else:
                    whole.copy_(host, non_blocking=whole.is_cuda)
                nbytes += size
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.residency[kind] = to
        self.log.append(OffloadEvent(phase, kind, to, nbytes))
        if to == "host" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def enter(self, phase: str) -> None:
        """Put each kind of state where ``phase`` needs it (see the module docstring)."""
        if phase not in PHASES:
            raise ValueError(f"offload phase must be one of {PHASES}, got {phase!r}")
        if not self.active:
            return
        trainable = self.engine.optimizer is not None
        if phase == "generate":
            if self.params:
                self._move("weights", "host", phase)
                if trainable:
                    self._move("grads", "host", phase)
            if self.optimizer and trainable:
                self._move("optimizer", "host", phase)
        elif phase == "compute":
            self._move("weights", "device", phase)
        elif phase == "update":
            for kind in KINDS:
                self._move(kind, "device", phase)
        elif phase == "after_update":
            if self.params and trainable:
                self._move("grads", "host", phase)
            if self.optimizer and trainable:
                self._move("optimizer", "host", phase)

    def host_bytes(self) -> dict[str, int]:
        """Bytes of each kind now held on the host."""
        return {kind: sum(size for _, _, size in getattr(self, "_held", {}).get(kind, [])) for kind in KINDS}
