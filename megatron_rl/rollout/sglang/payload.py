"""One rank's SGLang ``flattened_bucket`` payload: a weight bucket as SGLang's TP worker reads it.

Every trainer rank of an engine's group serializes its OWN copy, on its own GPU: SGLang's TP rank i opens
only entry i of ``named_tensors`` (managers/tp_worker.py), and entry i must be a handle to memory on TP rank
i's GPU, which is the GPU of the group's i-th rank (rollout/mesh.py). With CUDA the serialized tensor is a
CUDA IPC handle (no copy); the engine copies from it asynchronously, so the bucket behind a payload must never
be rewritten (weight_sync hands out a fresh one per load).
"""

from __future__ import annotations

import torch

from megatron_rl.bucket import WeightBucket
from megatron_rl.rollout.sglang.contract import BUCKET_FORMAT, import_sglang

__all__ = ["serialize_bucket"]


def serialize_bucket(bucket: WeightBucket, *, as_text: bool = False) -> bytes | str:
    """The bucket as SGLang's flattened_bucket dict, serialized with its MultiprocessingSerializer
    (base64 text for HTTP when ``as_text``)."""
    serializer = import_sglang("sglang.srt.utils.common", "MultiprocessingSerializer")
    metadata_cls = import_sglang("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
    flat = bucket.flat()
    if flat.is_cuda:  # device UUIDs in the IPC handles, so the engine opens the right GPU
        import_sglang("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions")()
    metadata = [
        metadata_cls(
            name=e.name,
            shape=torch.Size(e.shape),
            dtype=e.dtype,
            start_idx=e.start,
            end_idx=e.end,
            numel=e.end - e.start,
        )
        for e in bucket.entries
    ]
    payload = dict(zip(BUCKET_FORMAT["payload_keys"], (flat, metadata)))
    return serializer.serialize(payload, output_str=as_text)
