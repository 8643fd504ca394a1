"""All-gather through shared memory between the CPU ranks of one host: the CPU stand-in for NVLink.

gloo moves an all-gather's bytes through TCP loopback (a kernel copy out, a kernel copy in, per peer, on the
same cores that then convert the weights); that was half of a TP=2 weight sync on CPU. Ranks of one host
can instead map one buffer: each rank writes its shard straight into its own row, a barrier says every row
is written, and every rank reads the whole buffer in place. NCCL groups never take this path (NVLink is
the real thing there); gloo groups take it when all members share a host and /dev/shm has room.

The buffer may span a larger group than its rows: over the model-parallel group (TP x PP) with one row per TP
rank, only the stage that owns a bucket writes it, and every stage reads it after the barrier. That is the
pipeline broadcast too, with no bytes through gloo (at PP=2 the broadcast was most of a CPU sync).

Two slots (bucket k in slot k % 2, counting only the buckets that go through the buffer: a bucket without a TP
step publishes no barrier, so it takes no slot) let bucket k+1 be written while bucket k is read. A rank writes slot s
for bucket k+1 only after bucket k's barrier, which no rank enters before it finished reading bucket k-1
from slot s (the order of ``export_hf_buckets``: convert k-1, then start k's transfer), so a row is never
overwritten while someone reads it. Across exports the same holds through a barrier when an export takes the
buffer (a rank that finished the previous export early must not write bucket 0 while another still converts
the previous export's last bucket), and an export that starts while another one holds the buffer (two
exports iterated together) uses the backend's all-gather instead.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
enabled = True  # switched off where the interconnect's own collectives are what is measured (traffic counter)


class HostGather:
    """``slots`` x [rows x shard_bytes] uint8 in one shared mapping of the group's host; ``rows`` defaults to the
    group's size and this rank's ``row`` to its rank in the group."""

    def __init__(self, group: dist.ProcessGroup, shard_bytes: int, slots: int = 2, rows: int | None = None,
                 row: int | None = None) -> None:
        self.group, self.shard_bytes, self.slots = group, shard_bytes, slots
        self.in_use = False  # held by an export from its start to its end (export_hf_buckets)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group) if rows is None else rows
        self.own_row = self.rank if row is None else row
        nbytes = slots * self.size * shard_bytes
        # named after its owner's pid: a leftover says whose it was, and a test checks only its own job's
        owned = f"megatron-rl-gather-{os.getpid()}-{uuid.uuid4().hex}"
        name = [os.path.join(SHM_DIR, owned) if self.rank == 0 else None]
        dist.broadcast_object_list(name, group=group, group_src=0)
        if self.rank == 0:
            self.buffer = torch.from_file(name[0], shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=group)
        if self.rank != 0:
            self.buffer = torch.from_file(name[0], shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=group)
        if self.rank == 0:
            os.unlink(name[0])  # the mappings stay; nothing is left behind if a rank dies later
        self._rows = self.buffer.view(slots, self.size, shard_bytes)

    def row(self, slot: int, nbytes: int) -> torch.Tensor:
        """Where this rank puts its shard of the bucket in ``slot`` (the first ``nbytes`` of its row)."""
        return self._rows[slot, self.own_row, :nbytes]

    def gathered(self, slot: int, nbytes: int) -> torch.Tensor:
        """Every row's shard of ``slot``, [rows x nbytes], in place (strided when the bucket is smaller than
        the row: consumers read each rank's row, so no copy makes it contiguous)."""
        return self._rows[slot, :, :nbytes]

    def release(self) -> None:
        """The export that took the buffer is done with it."""
        self.in_use = False

    def publish(self):
        """Start the barrier that says this rank's row is written; ``.wait()`` it before reading the rows."""
        return dist.barrier(group=self.group, async_op=True)


_cache: dict[tuple, HostGather] = {}  # (the group's ranks..., rows) -> its buffer


def _one_host(group: dist.ProcessGroup) -> bool:
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def _room_for(nbytes: int) -> bool:
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize > 2 * nbytes  # touching a tmpfs page past its size is SIGBUS


def host_gather_for(group: dist.ProcessGroup, shard_bytes: int, rows: int | None = None,
                    row: int | None = None) -> HostGather | None:
    """The group's shared gather buffer (made once, grown when a larger shard comes), taken for one export
    (``release`` it at the export's end), or None where the group must use its backend's collectives: NCCL,
    members on several hosts, no /dev/shm room, off, or the buffer held by another export. Every member
    must call it together with the same arguments (it runs collectives); ``rows``/``row`` as ``HostGather``."""
    if not enabled or dist.get_backend(group) != "gloo" or dist.get_world_size(group) == 1:
        return None
    key = (*dist.get_process_group_ranks(group), rows)
    cached = _cache.get(key)
    if cached is not None and cached.in_use:
        return None  # another export on this group is still running (iterated together with this one)
    if cached is not None and cached.group is group and cached.shard_bytes >= shard_bytes:
        dist.barrier(group=group)  # everyone has finished reading the previous export's last bucket
        cached.in_use = True
        return cached
    # every member decides on the same facts: one host, and room on every member's /dev/shm
    verdict = torch.tensor([int(_room_for(2 * (rows or dist.get_world_size(group)) * shard_bytes))])
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
    if not verdict.item() or not _one_host(group):
        log.info("shards over %s collectives for ranks %s (no shared /dev/shm room or several hosts)",
                 dist.get_backend(group), key)
        return None
    _cache.pop(key, None)  # too small, or made for an earlier group of the same ranks (parallel state rebuilt)
    _cache[key] = HostGather(group, shard_bytes, rows=rows, row=row)  # its barriers order it after every earlier use
    _cache[key].in_use = True
    return _cache[key]
