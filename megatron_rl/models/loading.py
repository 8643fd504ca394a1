"""Load an HF safetensors checkpoint into this rank's Megatron model chunks, reading only its shard."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from megatron.core import parallel_state
from tqdm import tqdm

from megatron_rl.models.fp8_checkpoint import FP8BlockDequantizer, check_fp8_quantization
from megatron_rl.models.hf_checkpoint import CheckpointMismatchError, HFCheckpointReader
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.layout import chunk_mappings, hf_tensor_groups, is_value_model, shard_from_hf, unwrap
from megatron_rl.models.mtp import checkpoint_mtp_tensors, shared_copy_names


def load_hf_weights(
    model_chunks: list[torch.nn.Module], model_dir: str | Path, progress: bool = False
) -> None:
    """Fill the chunks from ``model_dir`` (config.json + safetensors, sharded or not).

    The checkpoint header is checked first against the config (every tensor present, every shape
    right, nothing unexpected); a mismatch raises CheckpointMismatchError naming the tensor, the
    expected and the found shape. Then each rank reads only the slices of its own TP shard of the
    layers its pipeline stage holds (of MoE layers: only the experts its EP rank owns, each expert's
    ETP shard). An FP8 block-scaled checkpoint (config.json's quantization_config: DeepSeek-V3/R1,
    Kimi-K2) is dequantised slice by slice to each parameter's dtype, its ``*_scale_inv`` tensors consumed
    (models/fp8_checkpoint.py). A value model takes ``score.*`` if the checkpoint has it (a saved
    critic) and keeps its initialised head otherwise (a causal LM, whose lm_head is dropped).
    ``progress`` shows a tqdm bar on global rank 0. Collective over the pipeline group.
    """
    chunks = [unwrap(c) for c in model_chunks]
    hf = chunks[0].hf_config
    value_model = is_value_model(chunks)  # collective: the first stage cannot see the head
    reader = HFCheckpointReader(model_dir)
    names = set(reader.names())
    block = check_fp8_quantization(hf.raw, source=str(Path(model_dir) / "config.json"))
    fp8 = FP8BlockDequantizer(reader, block) if block is not None else None

    groups = hf_tensor_groups(hf, value_head=value_model)
    has_score = value_model and "score.weight" in names
    copies = shared_copy_names(hf)
    expected = {
        t.name: t.shape for g in groups if (has_score or not g.key.startswith("score.")) and g.key not in copies
        for t in g.tensors
    }
    # Tied checkpoints may still store lm_head; a critic initialised from a causal LM drops it.
    ignorable = {"lm_head.weight"} if hf.tie_word_embeddings or value_model else set()
    # the multi-token-prediction layers the model does not build (models/mtp.py), and the copies of the embedding
    # and lm_head in those it builds: not read
    ignorable |= checkpoint_mtp_tensors(hf, names) - set(expected)
    if fp8 is not None:
        ignorable |= fp8.scale_names()  # consumed by their weights
    reader.validate(expected, frozenset(ignorable))
    if fp8 is not None:
        fp8.validate()

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    # MoE experts are split over the expert-tensor-parallel group instead (models/moe.py)
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    mappings = [m for chunk in chunks for m in chunk_mappings(chunk)]
    show = progress and torch.distributed.get_rank() == 0
    for mapping in tqdm(mappings, desc=f"loading {reader.model_dir.name}", unit="tensor", disable=not show):
        if (mapping.group.key.startswith("score.") and not has_score) or not mapping.load:
            continue
        param = mapping.param
        rank, size = (tp_rank, tp_size) if mapping.group.expert is None else (etp_rank, etp_size)
        read = reader.read if fp8 is None else functools.partial(fp8.read, dtype=param.dtype)
        shard = shard_from_hf(hf, mapping.group, read, rank, size, local_rows=param.shape[0])
        if tuple(shard.shape) != tuple(param.shape):
            names_str = ", ".join(t.name for t in mapping.group.tensors)
            raise CheckpointMismatchError(
                f"{names_str}: TP shard {rank}/{size} has shape {tuple(shard.shape)}, "
                f"the Megatron parameter expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(shard)
