"""Stream full HF-named tensors out of TP/PP-sharded Megatron chunks, and save an HF directory.

``export_hf_weights`` is a collective: every rank of the model-parallel group must iterate it to the
end, in step. Each tensor is TP-all-gathered on the stage that holds it, re-laid out to HF (q/k/v and
gate/up split, vocabulary padding dropped) and broadcast over the pipeline group, so **every rank
receives every tensor** (same order on all ranks). Only one logical tensor is materialised at a time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from megatron_rl.models.hf_checkpoint import INDEX_FILE, SINGLE_FILE
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.layout import (
    Kind,
    ParamMapping,
    chunk_mappings,
    hf_from_shards,
    hf_tensor_groups,
    is_value_model,
    unwrap,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def _gather_tp(tensor: torch.Tensor) -> list[torch.Tensor]:
    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def _full_tensors(hf: HFModelConfig, mapping: ParamMapping, dtype: torch.dtype | None) -> list[torch.Tensor]:
    local = mapping.param.detach()
    if dtype is not None:
        local = local.to(dtype)
    shards = [local] if mapping.group.kind is Kind.REPLICATED else _gather_tp(local)
    return [t.contiguous() for t in hf_from_shards(hf, mapping.group, shards)]


def export_hf_weights(
    model_chunks: list[torch.nn.Module], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` in HF checkpoint order, one tensor at a time, on every rank.

    ``dtype`` casts before communication (e.g. bf16 for rollout engines); default: parameter dtype.
    A value model yields ``score.weight``/``score.bias`` instead of ``lm_head.weight``; a tied model
    yields no ``lm_head.weight``. Tensors live on the current CUDA device (CPU without CUDA).
    """
    chunks = [unwrap(c) for c in model_chunks]
    hf = chunks[0].hf_config
    local = {m.group.key: m for chunk in chunks for m in chunk_mappings(chunk) if m.export}
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = dist.get_world_size(pp_group)
    pp_rank = dist.get_rank(pp_group)

    # Who holds what, and in which dtype: one small object all-gather over the pipeline group.
    holdings = {key: str(dtype or m.param.dtype).removeprefix("torch.") for key, m in local.items()}
    everyone: list[dict[str, str]] = [{} for _ in range(pp_size)]
    if pp_size > 1:
        dist.all_gather_object(everyone, holdings, group=pp_group)
    else:
        everyone = [holdings]
    owner = {key: (rank, dt) for rank, held in enumerate(everyone) for key, dt in held.items()}
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )

    value_model = any("score.weight" in held for held in everyone)  # only the last stage has the head
    for group in hf_tensor_groups(hf, value_head=value_model):
        if group.key not in owner:
            raise RuntimeError(f"no pipeline stage holds {group.key!r}; are all model chunks passed?")
        src, dtype_name = owner[group.key]
        if src == pp_rank:
            tensors = _full_tensors(hf, local[group.key], dtype)
        else:
            tensors = [
                torch.empty(t.shape, dtype=getattr(torch, dtype_name), device=device) for t in group.tensors
            ]
        for spec, tensor in zip(group.tensors, tensors):
            if pp_size > 1:
                dist.broadcast(tensor, group=pp_group, group_src=src)
            yield spec.name, tensor


def _config_for_export(hf: HFModelConfig, value_model: bool, dtype: torch.dtype) -> dict:
    config = dict(hf.raw)
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    if value_model:
        # Loadable as transformers' <Family>ForTokenClassification with one label: the critic.
        config["architectures"] = [hf.architecture.replace("ForCausalLM", "ForTokenClassification")]
        config["num_labels"] = 1
        config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return config


def save_hf_checkpoint(
    model_chunks: list[torch.nn.Module],
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    progress: bool = False,
) -> None:
    """Write a complete HF model directory from the chunks (collective: call on every rank).

    Global rank 0 writes config.json, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors``
    + ``model.safetensors.index.json`` past ``max_shard_bytes``) and copies the tokenizer files found
    in ``tokenizer_dir``. Other ranks take part in the gathers only.
    """
    chunks = [unwrap(c) for c in model_chunks]
    hf = chunks[0].hf_config
    writer = dist.get_rank() == 0
    value_model = is_value_model(chunks)
    out = Path(out_dir)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    stream = export_hf_weights(chunks, dtype=dtype)
    if progress and writer:
        from tqdm import tqdm

        total = sum(len(g.tensors) for g in hf_tensor_groups(hf, value_head=value_model))
        stream = tqdm(stream, total=total, desc=f"writing {out.name}", unit="tensor")

    pending: dict[str, torch.Tensor] = {}
    pending_bytes, total_bytes, saved_dtype = 0, 0, dtype
    written: list[list[str]] = []  # tensor names per shard file, in order
    for name, tensor in stream:
        if not writer:
            continue
        saved_dtype = saved_dtype or tensor.dtype
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            written.append(_write_shard(out, pending, len(written)))
            pending_bytes = 0
        pending[name] = tensor.cpu()
        pending_bytes += size
        total_bytes += size
    if writer:
        written.append(_write_shard(out, pending, len(written)))
        _name_shards(out, written, total_bytes)
        with open(out / "config.json", "w") as f:
            json.dump(_config_for_export(hf, value_model, saved_dtype), f, indent=2)
        if tokenizer_dir is not None:
            for file in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / file).is_file():
                    shutil.copy2(Path(tokenizer_dir) / file, out / file)
    dist.barrier()


def _temp_shard_name(index: int) -> str:
    return f"shard-{index:05d}.tmp.safetensors"


def _write_shard(out: Path, tensors: dict[str, torch.Tensor], index: int) -> list[str]:
    save_file(tensors, str(out / _temp_shard_name(index)), metadata={"format": "pt"})
    names = list(tensors)
    tensors.clear()
    return names


def _name_shards(out: Path, written: list[list[str]], total_bytes: int) -> None:
    """Give the shards HF's names (a single file is model.safetensors) and write the index."""
    if len(written) == 1:
        (out / _temp_shard_name(0)).replace(out / SINGLE_FILE)
        return
    weight_map = {}
    for i, names in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        (out / _temp_shard_name(i)).replace(out / final)
        weight_map.update({name: final for name in names})
    with open(out / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
