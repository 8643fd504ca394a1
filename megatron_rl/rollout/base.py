"""The rollout engine interface every engine implements (HF on CPU/GPU, SGLang on GPU).

Generation: ``generate_sequences(prompts) -> DataProto`` (layout in ``batch_io``); the output's meta_info
carries ``weight_version`` (the version of the weights that produced every sample of the call) and
``timing``. Engines that can also score given responses implement ``compute_log_probs(data)``.

Weights arrive as HF-named full tensors. A weight update is a session:
``begin_weight_update(version)`` -> ``load_weight_bucket(bucket)`` / ``load_named_tensors(...)`` any
number of times -> ``end_weight_update()``. An engine with ``async_loads`` (SGLang: CUDA IPC handles, device
copies still running when the call returns) may read a bucket after its load returned, so the caller hands it a
fresh buffer every time; otherwise loads block until the data is copied and the buffer may be reused. A
``thread_affine`` engine must be called from the thread that built it. ``update_weights(named_tensors, version)`` is the
one-call form. While a session is open (or after a failed one) the engine refuses to generate, so
partially updated weights never produce samples.

Colocation: ``sleep()`` frees the engine's device memory for training; the next weight update brings it back
(``begin_weight_update`` resumes what ``sleep`` released, in the engine's own order). Weights released by
``sleep()`` may be gone (SGLang): such an engine refuses to generate until that update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from megatron_rl.protocol import DataProto
from megatron_rl.bucket import WeightBucket
from megatron_rl.rollout.checksum import TensorChecksum

__all__ = ["RolloutEngine", "WeightUpdateError"]


class WeightUpdateError(RuntimeError):
    """A weight update the engine refused or could not complete; the message names the tensor."""


class RolloutEngine(ABC):
    #: Version of the weights currently served (0: the weights the engine was built with).
    weight_version: int = 0
    #: dtype the engine computes in; weight syncs cast to it.
    dtype: torch.dtype = torch.float32
    #: the engine may still read a loaded bucket after its load call returned: never rewrite one
    async_loads: bool = False
    #: every call must come from the thread that built the engine
    thread_affine: bool = False

    # ------------------------------------------------------------------ generation
    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample one response per prompt row (n is applied by the caller with ``DataProto.repeat``)."""

    def compute_log_probs(self, data: DataProto) -> torch.Tensor:
        """Log-probs [B, R] of ``data``'s ``responses`` (0 at padding), at meta_info ``temperature``
        (default 1.0), using the same convention as the sampler (temperature-scaled, full vocabulary)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot score given responses; compare the "
            "rollout_log_probs of generate_sequences instead (verify_sync does)"
        )

    # ------------------------------------------------------------------ weights
    @abstractmethod
    def begin_weight_update(self, version: int) -> None:
        """Open a weight-update session for weight version ``version``."""

    @abstractmethod
    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors inside an open session (unknown names and shape mismatches raise)."""

    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Load one bucket inside an open session; returns once the engine no longer needs its memory."""
        self.load_named_tensors(bucket.named_tensors())

    @abstractmethod
    def end_weight_update(self) -> None:
        """Close the session; from now on samples carry the session's version."""

    @abstractmethod
    def abort_weight_update(self, reason: str) -> None:
        """Close a session that failed part-way; the engine refuses to serve until a complete update."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load a complete set of weights in one call."""
        self.begin_weight_update(version)
        try:
            self.load_named_tensors(named_tensors)
        except BaseException as exc:
            self.abort_weight_update(f"update to version {version} failed: {exc}")
            raise
        self.end_weight_update()

    def weight_checksums(self) -> dict[str, TensorChecksum] | None:
        """Checksums of the served weights by HF name, or None when the engine cannot report them."""
        return None

    # ------------------------------------------------------------------ memory
    @abstractmethod
    def sleep(self) -> None:
        """Free device memory (weights and caches) for the trainer; generation is refused until wake_up."""

    @abstractmethod
    def wake_up(self) -> None:
        """Restore what sleep freed."""

    def shutdown(self) -> None:
        """Release processes and connections the engine holds (no-op by default)."""
