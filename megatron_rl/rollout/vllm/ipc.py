"""Weights into a colocated vLLM engine on GPUs over CUDA IPC: vLLM's own weight-transfer engine
(``weight_transfer_config={"backend": "ipc"}``, vllm/distributed/weight_transfer/ipc_engine.py), packed mode.

A session is ``start_weight_update`` (vLLM starts a layerwise reload), one ``update_weights`` per bucket, and
``finish_weight_update`` (vLLM finalises the reload: the post-load processing, once). No host copy: each bucket is
one flat buffer on a trainer GPU, shared by its CUDA IPC handle; vLLM's consumer opens it, clones every tensor out
of it on the worker's GPU and loads them (a module is processed once all of its elements arrived, over as many
buckets as it spans).

vLLM splits a buffer by tensor sizes from its start, so a bucket's tensors go as runs that lie back to back
(``bucket_payload``: one for a single-dtype bucket). vLLM's worker opens the handle made on its OWN GPU (it looks its device's UUID up in the handles), so every trainer
rank of a TP > 1 replica materialises each bucket on its GPU and makes a payload of it (``bucket_payload``); the
leader merges the replica's payloads into one update (``merged_update``). The memory behind a payload must not be
written again until vLLM is done with it: the sync hands out a fresh bucket per load (the engine's ``async_loads``)
and torch's CUDA IPC reference counting keeps its memory until the consumer released it.

vLLM's client serialises ``collective_rpc`` arguments with msgpack, which refuses torch types unless pickling is
allowed (``VLLM_ALLOW_INSECURE_SERIALIZATION``); so a handle travels as plain data (``plain_handle``) and the
worker extension rebuilds torch's ``rebuild_cuda_tensor`` arguments (``handle_args``) inside the worker.
Imported inside vLLM's workers too.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.bucket import WeightBucket

__all__ = ["BACKEND", "INIT_INFO", "bucket_payload", "export_handle", "handle_args", "merged_update",
           "plain_handle"]

BACKEND = {"backend": "ipc"}  # vLLM's weight_transfer_config
INIT_INFO = {"packed": True}  # one handle per bucket; vLLM clones each tensor out of it (packed_ipc_consumer)

# rebuild_cuda_tensor's arguments (torch/multiprocessing/reductions.py reduce_tensor), by position
_FIELDS = ("tensor_cls", "size", "stride", "offset", "storage_cls", "dtype", "device", "handle", "storage_size_bytes",
           "storage_offset_bytes", "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
           "event_sync_required")
_PLAIN = tuple(f for f in _FIELDS if f not in ("tensor_cls", "storage_cls", "dtype", "requires_grad"))


def plain_handle(args: tuple) -> dict[str, Any]:
    """torch's CUDA IPC export of a flat uint8 tensor as msgpack-safe data (ints, bytes, lists)."""
    fields = dict(zip(_FIELDS, args, strict=True))
    if fields["tensor_cls"] is not torch.Tensor or fields["dtype"] != torch.uint8:
        raise TypeError(f"a weight payload shares a plain uint8 tensor, got {fields['tensor_cls'].__name__} of "
                        f"{fields['dtype']}")
    plain = {name: fields[name] for name in _PLAIN}
    plain["size"], plain["stride"] = list(plain["size"]), list(plain["stride"])
    return plain


def handle_args(plain: dict[str, Any]) -> tuple:
    """``plain_handle``'s data back as rebuild_cuda_tensor's arguments (in the worker)."""
    fields = {name: plain[name] for name in _PLAIN}
    fields.update(tensor_cls=torch.Tensor, storage_cls=torch.storage.TypedStorage, dtype=torch.uint8,
                  requires_grad=False, size=torch.Size(plain["size"]), stride=tuple(plain["stride"]))
    return tuple(fields[name] for name in _FIELDS)


def export_handle(flat: torch.Tensor) -> tuple[str, dict[str, Any]]:
    """(this GPU's UUID, the plain CUDA IPC handle of ``flat``): what vLLM's consumer looks up and opens."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(flat)
    return str(torch.cuda.get_device_properties(flat.device).uuid), plain_handle(args)


def _runs(bucket: WeightBucket) -> list[list[Any]]:
    """The bucket's entries in runs that lie back to back. vLLM splits a buffer by tensor sizes from its start and
    views each piece as its dtype (``unpack_tensor``), so alignment padding (a bf16 tensor of odd length before an
    fp32 one) starts a new run: each run goes as a handle of its own, every piece at its aligned offset."""
    runs: list[list[Any]] = []
    for entry in bucket.entries:
        if runs and runs[-1][-1].end == entry.start:
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return runs


def bucket_payload(bucket: WeightBucket) -> list[dict[str, Any]]:
    """This rank's payload of ``bucket`` (on this rank's GPU), one update per run of back-to-back tensors (one for
    a single-dtype bucket): the tensors' names, dtypes, shapes and byte sizes, and the IPC handle of their bytes
    (a view of the bucket, no copy) under this GPU's UUID. Plain data (gathered to the replica's leader)."""
    flat = bucket.flat()
    payload = []
    for run in _runs(bucket):
        uuid, handle = export_handle(flat[run[0].start:run[-1].end])
        payload.append({"names": [e.name for e in run],
                        "dtype_names": [str(e.dtype).removeprefix("torch.") for e in run],
                        "shapes": [list(e.shape) for e in run],
                        "tensor_sizes": [e.end - e.start for e in run],
                        "ipc_handles": {uuid: handle}})
    return payload


def merged_update(payloads: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The ``update_weights`` calls of vLLM's IPC engine for one bucket, from the replica's payloads (engine TP
    order): the same tensors from every rank, each rank's handle under its GPU's UUID. Ranks that disagree on the
    bucket are refused by name: a worker would load another bucket's bytes."""
    if len({len(p) for p in payloads}) != 1:
        raise ValueError(f"the ranks of one vLLM replica sent buckets of {[len(p) for p in payloads]} runs of "
                         "tensors: every rank must export the same buckets")
    return [_merged_run([payload[i] for payload in payloads]) for i in range(len(payloads[0]))]


def _merged_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    handles: dict[str, dict[str, Any]] = {}
    for rank, run in enumerate(runs):
        for key in ("names", "dtype_names", "shapes", "tensor_sizes"):
            if run[key] != first[key]:
                raise ValueError(f"engine TP rank {rank}'s weight bucket differs from TP rank 0's in its {key} "
                                 f"(first tensor {run['names'][:1]} vs {first['names'][:1]}): every rank of a "
                                 "replica must export the same buckets")
        for uuid, handle in run["ipc_handles"].items():
            if uuid in handles:
                raise ValueError(f"two ranks of one vLLM replica sent buckets from the same GPU {uuid}: each engine "
                                 "TP worker needs the copy made on its own GPU")
            handles[uuid] = handle
    return {**{key: first[key] for key in ("names", "dtype_names", "shapes", "tensor_sizes")},
            "ipc_handles": handles}
