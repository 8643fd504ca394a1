"""Count the bytes a rank sends and receives per link class, and its tensor collectives, by wrapping
torch.distributed's collectives for the duration of a block (the check of megatron_rl.plan.traffic).

Accounting (the traffic model's): a broadcast sends the root's n bytes to each other member; an all-gather (list
or into one tensor) sends each member's n bytes to every other member; a gather sends each member's n bytes to
the root; isend / irecv count n once. A pair of ranks is inter-node when rank // gpus_per_node differs. Only
calls made through the ``torch.distributed`` namespace are seen (``all_gather_object``'s internal calls are not:
it is metadata, not weights). The export's shared-memory TP gather (``host_gather``: gloo ranks of one host, the
CPU stand-in for NVLink) is off inside the block, so what is counted is the collectives the NCCL path makes.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_rl.distributed import host_gather

__all__ = ["KEYS", "count_traffic"]

KEYS = ("inter_recv", "inter_send", "intra_recv", "intra_send", "collectives")


@contextlib.contextmanager
def count_traffic(gpus_per_node: int):
    """Wrap torch.distributed's tensor collectives; yields this rank's counters (node = rank // gpus_per_node)."""
    me = dist.get_rank()
    counts = dict.fromkeys(KEYS, 0)
    originals = {}

    def link(other: int) -> str:
        return "inter" if other // gpus_per_node != me // gpus_per_node else "intra"

    def add(direction: str, other: int, n: int) -> None:
        counts[f"{link(other)}_{direction}"] += n

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def members(group) -> list[int]:
        return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        ranks = members(group)
        root = ranks[group_src] if group_src is not None else src
        counts["collectives"] += 1
        for m in ranks:
            if m != me and root == me:
                add("send", m, nbytes(tensor))
        if root != me:
            add("recv", root, nbytes(tensor))
        return originals["broadcast"](tensor, src=src, group=group, async_op=async_op, group_src=group_src)

    def _gather_all(n: int, group) -> None:
        counts["collectives"] += 1
        for m in members(group):
            if m != me:
                add("send", m, n)
                add("recv", m, n)

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        _gather_all(nbytes(input), group)
        return originals["all_gather_into_tensor"](output, input, group=group, async_op=async_op)

    def all_gather_single(output, input, group=None, async_op=False):
        _gather_all(nbytes(input), group)
        return originals["all_gather_single"](output, input, group=group, async_op=async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        _gather_all(nbytes(tensor), group)
        return originals["all_gather"](tensor_list, tensor, group=group, async_op=async_op)

    def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
        ranks = members(group)
        root = ranks[group_dst] if group_dst is not None else dst
        counts["collectives"] += 1
        for m in ranks:
            if m != me and root == me:
                add("recv", m, nbytes(tensor))
        if root != me:
            add("send", root, nbytes(tensor))
        return originals["gather"](tensor, gather_list, dst=dst, group=group, async_op=async_op, group_dst=group_dst)

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        counts["collectives"] += 1
        add("send", dst, nbytes(tensor))
        return originals["isend"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        counts["collectives"] += 1
        add("recv", src, nbytes(tensor))
        return originals["irecv"](tensor, src=src, group=group, tag=tag, group_src=group_src)

    wrappers = dict(broadcast=broadcast, all_gather_into_tensor=all_gather_into_tensor, all_gather=all_gather,
                    gather=gather, isend=isend, irecv=irecv)
    if hasattr(dist, "all_gather_single"):
        wrappers["all_gather_single"] = all_gather_single
    for name, fn in wrappers.items():
        originals[name] = getattr(dist, name)
        setattr(dist, name, fn)
    shared_gather, host_gather.enabled = host_gather.enabled, False
    try:
        yield counts
    finally:
        host_gather.enabled = shared_gather
        for name, fn in originals.items():
            setattr(dist, name, fn)
