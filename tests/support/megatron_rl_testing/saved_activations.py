"""What autograd keeps for backward: the bytes of the distinct non-parameter storages saved while inside,
the activation memory of a training step measured on any device (the benchmarks and the planner's tests)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedActivations:
    """``with SavedActivations(model.parameters()) as saved: loss.backward()`` ... ``saved.nbytes``.

    Storages are counted once however many views of them are saved; run one micro-batch inside, so that
    everything counted is alive at once (between its forward and its backward)."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())
