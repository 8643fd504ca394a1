"""Rank job of test_lora_sp_memory.py: what one LoRA adapter saves for backward under sequence parallelism."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel


def saved_bytes_job(target: str, seq: int, batch: int, hidden: int, ffn: int, rank: int) -> int:
    """Bytes of the activations autograd saves in one adapter's forward (unique storages), at
    TP = the world size, sequence parallel; the input is this rank's slice of the sequence."""
    from megatron_rl.models.lora import LoRAAdapter, LoRASpec, _target_sizes

    init_model_parallel(tp=torch.distributed.get_world_size())
    try:
        config = SimpleNamespace(sequence_parallel=True, hidden_size=hidden, kv_channels=hidden // 4,
                                 num_attention_heads=4, num_query_groups=2, ffn_hidden_size=ffn)
        spec = LoRASpec(rank=rank, alpha=2.0 * rank, dropout=0.0, a_init="kaiming", b_init="normal",
                        dtype=torch.bfloat16)
        full_in, full_outs = _target_sizes(target, config)
        adapter = LoRAAdapter(spec, target, 0, config, full_in, full_outs, torch.device("cpu"))
        adapter.layout = 2 // torch.distributed.get_world_size()
        tp = torch.distributed.get_world_size()
        width = full_in if adapter.column else full_in // tp
        x = torch.randn(seq // tp if adapter.column else seq, batch, width, dtype=torch.bfloat16, requires_grad=True)
        # the adapter's parameters, and its input: the base linear saves that one itself
        kept = {p.untyped_storage().data_ptr() for p in (*adapter.parameters(), x)}
        tokens = {seq, seq // tp, seq * batch, seq // tp * batch}
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            # activations only (tokens first, [seq, batch, ...] or flattened): the concatenated A of a fused
            # linear ([parts x rank, in]) is weight-sized
            if storage.data_ptr() not in kept and tensor.shape[0] in tokens:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = adapter(x)
        out.float().sum().backward()  # the saved tensors served a backward
        return sum(storages.values())
    finally:
        destroy_model_parallel()
