"""The process group that carries weights from trainer rank 0 to SGLang servers on other GPUs/nodes.

SGLang's ``/init_weights_update_group`` joins with ``init_custom_process_group``: a ``tcp://`` rendezvous
(the trainer, rank 0, hosts the store), a ``PrefixStore`` named after the group, and torch's
``_new_process_group_helper`` so the group exists beside (not inside) the default process group.
The trainer must build its end the same way or the two sides never meet, so this mirrors those
calls — ``_new_process_group_helper`` is private torch API, which is exactly what SGLang relies on.

Rank 0 (the trainer) hosts the store itself with an explicit ``TCPStore(is_master=True, multi_tenant=True)``
— the store ``c10d.rendezvous`` would host outside torchrun — instead of calling the rendezvous: under
torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``, set for every rank) the rendezvous only connects, as a
client, to a store nobody hosts on this port, and the servers (not under torchrun) connect to it too, so
the group never forms. The other ranks (SGLang servers, our HF servers) join exactly as SGLang does.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["init_weight_update_group"]


def init_weight_update_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    timeout: timedelta = timedelta(minutes=10),
) -> dist.ProcessGroup:
    """Join (rank 0: create) the named weight-update group; returns the group for ``dist.broadcast``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"weight-update group rank {rank} outside world size {world_size}")
    if rank == 0:
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=True, timeout=timeout, multi_tenant=True
        )
    else:
        store, rank, world_size = next(
            c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
        )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
