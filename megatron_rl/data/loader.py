"""A resumable data loader that yields DataProto batches.

The order of epoch ``e`` is a pure function of (seed, e), and the loader counts the batches it has
handed out, so ``state_dict()`` (epoch + position) saved with a checkpoint is enough to continue with
exactly the batch an uninterrupted run would have seen next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from megatron_rl.protocol import DataProto, collate_dicts

__all__ = ["ResumableDataLoader", "collate_to_dataproto", "make_dataloader"]


def collate_to_dataproto(rows: Sequence[Mapping[str, Any]]) -> DataProto:
    """Dataset rows -> one DataProto: tensors stacked into ``batch``, the rest into ``non_tensor_batch``."""
    return DataProto.from_single_dict(collate_dicts(rows))


class ResumableDataLoader:
    """Iterating yields the remaining batches of the current epoch, then moves on to the next epoch.

    A trainer writes ``for epoch in range(loader.epoch, total_epochs): for batch in loader: ...`` and saves
    ``loader.state_dict()`` with its checkpoints. ``num_workers`` > 0 collates in worker processes.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool = True,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], DataProto] = collate_to_dataproto,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(dataset):
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts): with "
                f"drop_last there would be no batch at all"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.epoch = 0
        self.batches_done = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (the same for every run with this seed)."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> Iterator[DataProto]:
        order = self.epoch_order(self.epoch)
        batches = [order[i * self.batch_size : (i + 1) * self.batch_size].tolist() for i in range(len(self))]
        loader = DataLoader(
            self.dataset,
            batch_sampler=batches[self.batches_done :],
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
        )
        for batch in loader:
            # Counted before the caller sees the batch: a checkpoint saved after training on it
            # resumes after it.
            self.batches_done += 1
            yield batch
        self.epoch += 1
        self.batches_done = 0

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "dataset_size": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position; refuse when the order it refers to cannot be reproduced."""
        expected = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "dataset_size": len(self.dataset),
        }
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in changed.items())
            raise ValueError(
                f"cannot resume the data loader: {detail}; the saved position would point at "
                f"different prompts"
            )
        if not 0 <= state["batches_done"] <= len(self):
            raise ValueError(
                f"cannot resume the data loader: batches_done={state['batches_done']} is outside "
                f"[0, {len(self)}] batches per epoch"
            )
        self.epoch = int(state["epoch"])
        self.batches_done = int(state["batches_done"])


def make_dataloader(
    dataset: Dataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool = True, num_workers: int = 0,
    collate_fn: Callable[[list[Any]], DataProto] = collate_to_dataproto,
) -> ResumableDataLoader:
    """The loader for training (``drop_last=True``) or validation (``shuffle=False, drop_last=False``);
    ``collate_fn``: the dataset's items -> one batch (picklable when ``num_workers`` > 0)."""
    return ResumableDataLoader(dataset, batch_size, shuffle, seed, drop_last, num_workers, collate_fn)
