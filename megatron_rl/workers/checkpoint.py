"""Distributed checkpoints of one engine with ``megatron.core.dist_checkpointing``.

A checkpoint directory holds the model (every chunk), the optimizer (moments and fp32 master
weights, mapped onto the model's global tensor keys), the LR scheduler, each rank's RNG state and a
caller's ``extra`` dict (step, data-loader position, counters). Tensors are stored by global key and
offset, so a checkpoint saved at one TP/PP layout loads at another; the RNG states then do not apply
(they belong to ranks that no longer exist) and are skipped with a warning.

Context parallelism (CP) changes nothing in what is stored: the CP ranks of one TP x PP shard hold the same
weights and optimizer state (their gradients are reduced over DP x CP), and Megatron marks the copies of
CP ranks > 0 as replicas (``replica_id`` over the DP x CP group), so each tensor is written once and a
checkpoint saved at CP=2 loads at CP=1 and back. Only the RNG states are per rank: they are keyed by
(pp, tp, cp, dp) under CP > 1 (CP peers share their DP rank) and restored only at the layout, CP included,
that saved them.

With LoRA (``engine.lora``) the model part holds only the parameters LoRA trains (the adapters, and a critic's
value head): the frozen base is what ``model.path`` gives at start-up, and the optimizer holds state for the
adapters only, so a LoRA checkpoint is a small fraction of a full one. The metadata records the adapters
(rank, alpha, target_modules, exclude_modules); such a checkpoint loads into an engine with the same adapters, at any TP/PP layout.

Writes go to ``<path>.tmp`` and are renamed to ``<path>`` only when every rank has finished: a crash
mid-save leaves the previous checkpoint at ``<path>`` (if any) intact. All ranks must see the same
filesystem (as Megatron requires) and call these functions together.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_rl.distributed.sharded_save import save_sharded
from megatron_rl.models.checkpoint_safety import check_checkpoint_metadata
from megatron_rl.models.layout import unwrap
from megatron_rl.models.lora import LoRAAdapter
from megatron_rl.models.value_head import ValueHead
from megatron_rl.workers.checkpoint_optimizer import (
    chain_length,
    check_chain_change,
    fix_fp32_param_ids,
    has_state_tensors,
    load_across_chains,
    remap_keys,
    saved_chain_length,
)
from megatron_rl.workers.disk_space import checked_save
from megatron_rl.workers.engine import MegatronEngine

logger = logging.getLogger(__name__)

METADATA_FILE = "megatron_rl_checkpoint.json"
FORMAT_VERSION = 1
# The layout of Megatron's distributed optimizer state in a checkpoint (plain optimizers ignore it).
# ``fully_sharded_model_space`` (megatron-core's default) writes each rank's own shard of the Adam state
# keyed by model-space offsets: no gather, and reshardable across TP/PP/DP. ``fully_reshardable``
# (what checkpoints before it used) all-gathers the whole DP optimizer state into every rank's host
# RAM at save (``get_parameter_state_dp_zero(return_on_all_ranks=True)``); such checkpoints record no
# type and are loaded with it.
OPTIMIZER_SHARDING_TYPE = "fully_sharded_model_space"
LEGACY_OPTIMIZER_SHARDING_TYPE = "fully_reshardable"


def _layout() -> dict[str, int]:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),  # without CP: the CP ranks share a DP rank
        "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
    }


def _saved_layout(metadata: dict[str, Any]) -> dict[str, int]:
    """The layout a checkpoint records; those written before CP was recorded were saved at CP=1."""
    return {"cp": 1, **metadata["layout"]}


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        state["megatron_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _rng_sharded_object() -> ShardedObject:
    """One RNG state per (pp, tp, dp) rank, per (pp, tp, cp, dp) rank under CP > 1: the CP ranks of one
    DP rank must not write the same key (dist_checkpointing refuses duplicate ShardedObjects). At CP=1 the
    key keeps its three axes, so checkpoints saved before CP existed restore their RNG states."""
    layout = _layout()
    shape = [layout["pp"], layout["tp"], layout["dp"]]
    offset = [
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    ]
    if layout["cp"] > 1:
        shape.insert(2, layout["cp"])
        offset.insert(2, parallel_state.get_context_parallel_rank())
    return ShardedObject("rng_state", _rng_state(), tuple(shape), tuple(offset), replica_id=0)


def _sharded_state(
    engine: MegatronEngine, with_optimizer: bool, is_loading: bool, sharding_type: str = OPTIMIZER_SHARDING_TYPE
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i, chunk in enumerate(engine.model):
        model = unwrap(chunk)
        sharded = model.sharded_state_dict()
        if getattr(engine, "lora", None) is not None:  # the base comes from model.path at start-up
            kept = _trained_keys(model)
            sharded = {key: value for key, value in sharded.items() if key in kept}
            if sharded.keys() != kept:
                raise RuntimeError(f"{engine.name}: the sharded state dict of model chunk {i} lacks the "
                                   f"trained parameters {sorted(kept - sharded.keys())[:5]}")
        state[f"model{i}"] = sharded
    if with_optimizer:
        fix_fp32_param_ids(engine.optimizer)  # bf16 with fp32 norm weights (checkpoint_optimizer.py)
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata={"distrib_optim_sharding_type": sharding_type}
        )
        state["scheduler"] = engine.scheduler.state_dict()
    return state


def _trained_keys(model: torch.nn.Module) -> set[str]:
    """LoRA: the state-dict keys a checkpoint holds, those of the parameters LoRA trains (the adapters and a
    critic's value head: workers/engine.py freeze_all_but_adapters); the frozen base is not saved."""
    return {f"{module_name}.{name}".lstrip(".") for module_name, module in model.named_modules()
            if isinstance(module, (LoRAAdapter, ValueHead)) for name, _ in module.named_parameters()}


def _lora_metadata(engine: MegatronEngine) -> dict[str, Any] | None:
    spec = getattr(engine, "lora", None)
    if spec is None:
        return None
    return {"rank": spec.rank, "alpha": spec.alpha, "target_modules": list(spec.target_modules),
            "exclude_modules": list(spec.exclude_modules)}


def _check_lora(engine: MegatronEngine, path: str | Path, metadata: dict[str, Any]) -> None:
    """A LoRA checkpoint holds adapters only: it loads into an engine with the same adapters, only there."""
    saved, built = metadata.get("lora"), _lora_metadata(engine)
    if saved is None and built is not None:
        raise ValueError(f"{path} is a full-model checkpoint but the {engine.name} engine trains LoRA "
                         f"adapters (rank {built['rank']}); a LoRA checkpoint holds the adapters only")
    if saved is not None and built is None:
        raise ValueError(f"{path} holds LoRA adapters only (rank {saved['rank']}, alpha {saved['alpha']}) "
                         f"but the {engine.name} engine has no LoRA (<role>.model.lora.rank is 0)")
    if saved is not None and saved != built:
        raise ValueError(f"{path} holds LoRA adapters {saved} but the {engine.name} engine builds {built} "
                         "(<role>.model.lora.rank / alpha / target_modules / exclude_modules)")


def _on_rank_zero(fn, *args) -> None:
    """Run a filesystem change on global rank 0 only, with every rank waiting for it."""
    if dist.get_rank() == 0:
        fn(*args)
    dist.barrier()


def save_checkpoint(engine: MegatronEngine, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write ``engine``'s checkpoint to ``path`` (collective over all ranks).

    A trainable engine saves model, optimizer and scheduler; a frozen one the model. ``extra``
    (picklable, the same on every rank) is saved once and returned by ``load_checkpoint``.
    """
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")

    def fresh_tmp() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    _on_rank_zero(fresh_tmp)
    state = _sharded_state(engine, with_optimizer=engine.trainable, is_loading=False)
    state["rng"] = _rng_sharded_object()
    state["extra"] = dict(extra or {})
    checked_save(save_sharded, state, tmp)  # a full disk named: device, path, ENOSPC (disk_space.py)

    def publish() -> None:
        metadata = {
            "format_version": FORMAT_VERSION,
            "role": engine.name,
            "layout": _layout(),
            "expert_layout": _expert_layout(),
            # Megatron chains a second optimizer for the experts at EP > 1: a resume at another EP maps onto it
            "optimizer_chain": chain_length(engine.optimizer) if engine.trainable else None,
            "has_optimizer": engine.trainable,
            "optimizer_sharding_type": OPTIMIZER_SHARDING_TYPE,
            "value_head": engine.value_head,
            "params_dtype": str(engine.params_dtype).removeprefix("torch."),
            "lora": _lora_metadata(engine),  # None: the whole model; else the adapters (and value head) only
        }
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)

    _on_rank_zero(publish)


def read_checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """What ``save_checkpoint`` recorded about the run that wrote ``path``."""
    meta_path = Path(path) / METADATA_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{path} is not a complete megatron-rl checkpoint (no {METADATA_FILE}); an interrupted save "
            f"leaves only {Path(path).name}.tmp"
        )
    metadata = json.loads(meta_path.read_text())
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: format_version {metadata.get('format_version')} is not {FORMAT_VERSION}"
        )
    return metadata


def _expert_layout() -> dict[str, int]:
    return {"ep": parallel_state.get_expert_model_parallel_world_size(),
            "etp": parallel_state.get_expert_tensor_parallel_world_size()}


def _saved_expert_layout(metadata: dict[str, Any]) -> dict[str, int] | None:
    """None for checkpoints written before EP was recorded."""
    return metadata.get("expert_layout")


def _load_with_optimizer(engine: MegatronEngine, state: dict[str, Any], path: str | Path,
                         metadata: dict[str, Any]) -> dict[str, Any]:
    """``dist_checkpointing.load`` with the optimizer's state tensors found by model-space key, whatever EP
    (and so whatever chain of optimizers: checkpoint_optimizer.py) saved them."""
    saved_chain = metadata.get("optimizer_chain") or saved_chain_length(
        dist_checkpointing.load_common_state_dict(str(path)))
    chain = chain_length(engine.optimizer) or 1
    saved_experts = _saved_expert_layout(metadata) or "(EP not recorded)"
    layouts = (f"saved at {_saved_layout(metadata)} {saved_experts} with {saved_chain} chained "
               f"optimizer(s), resumed at {_layout()} {_expert_layout()} with {chain}")
    check_chain_change(getattr(engine, "use_distributed_optimizer", False), saved_chain, chain, str(path), layouts)
    remap_keys(state["optimizer"], set(dist_checkpointing.load_tensors_metadata(str(path))), str(path), layouts)
    if saved_chain == chain:
        return dist_checkpointing.load(state, str(path))
    logger.info("%s: optimizer state %s", engine.name, layouts)
    return load_across_chains(state, str(path), str(path), layouts)


def load_checkpoint(engine: MegatronEngine, path: str | Path, load_optimizer: bool = True) -> dict[str, Any]:
    """Restore ``engine`` from ``path`` (collective); returns the ``extra`` dict that was saved.

    ``load_optimizer=False`` (or a frozen engine) restores the weights only. RNG states are
    restored when the TP/PP/CP/DP layout is the one that saved.
    """
    metadata = read_checkpoint_metadata(path)
    if metadata["value_head"] != engine.value_head:
        kinds = {True: "a critic (value head)", False: "a causal LM"}
        raise ValueError(
            f"{path} holds {kinds[metadata['value_head']]} but the {engine.name} engine is "
            f"{kinds[engine.value_head]}"
        )
    _check_lora(engine, path, metadata)
    with_optimizer = load_optimizer and engine.trainable
    if with_optimizer and not metadata["has_optimizer"]:
        raise ValueError(
            f"{path} has no optimizer state (saved by a frozen {metadata['role']} engine); "
            "pass load_optimizer=False"
        )

    saved_experts = _saved_expert_layout(metadata)  # EP changes which ranks' RNG states hold the experts'
    same_layout = _saved_layout(metadata) == _layout() and saved_experts in (None, _expert_layout())
    if not same_layout:
        logger.warning(
            "%s: loading a checkpoint saved at layout %s %s into layout %s %s; RNG states are not restored",
            engine.name,
            _saved_layout(metadata),
            saved_experts or "",
            _layout(),
            _expert_layout(),
        )
    sharding_type = metadata.get("optimizer_sharding_type", LEGACY_OPTIMIZER_SHARDING_TYPE)
    state = _sharded_state(engine, with_optimizer, is_loading=True, sharding_type=sharding_type)
    state["extra"] = {}
    if same_layout:
        state["rng"] = _rng_sharded_object()
    check_checkpoint_metadata(path)  # torch unpickles .metadata with plain pickle: refuse one that runs code
    if with_optimizer and has_state_tensors(state["optimizer"]):
        loaded = _load_with_optimizer(engine, state, path, metadata)
    else:
        loaded = dist_checkpointing.load(state, str(path))

    for index, chunk in enumerate(engine.model):
        if metadata.get("lora") is None:
            unwrap(chunk).load_state_dict(loaded[f"model{index}"], strict=True)
            continue
        # LoRA: the adapters (and a value head) only; the base stays as model.path gave it
        result = unwrap(chunk).load_state_dict(loaded[f"model{index}"], strict=False)
        missing = _trained_keys(unwrap(chunk)) & set(result.missing_keys)
        if missing or result.unexpected_keys:
            raise RuntimeError(f"{path}: model chunk {index}: adapters missing {sorted(missing)[:5]}, "
                               f"unexpected {sorted(result.unexpected_keys)[:5]}")
    if with_optimizer:
        engine.optimizer.load_state_dict(loaded["optimizer"])
        engine.scheduler.load_state_dict(loaded["scheduler"])
    elif engine.trainable:
        engine.optimizer.reload_model_params()  # fp32 master weights follow the loaded weights
    if same_layout:
        _set_rng_state(loaded["rng"])
    return dict(loaded["extra"])


class CheckpointedRole:
    """``save_checkpoint``/``load_checkpoint`` for a trained role holding ``engine`` and ``updates_done``."""

    engine: MegatronEngine
    updates_done: int
    _ROLE_STATE = "__role_state__"

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Model, optimizer, LR schedule, RNG, the role's update count and ``extra`` (collective)."""
        self.engine.offload.enter("update")  # everything on the device while it is written
        save_checkpoint(
            self.engine, path, {**(extra or {}), self._ROLE_STATE: {"updates_done": self.updates_done}}
        )

    def load_checkpoint(self, path: str | Path, load_optimizer: bool = True) -> dict[str, Any]:
        """Restore from ``path`` (any TP/PP layout); returns the ``extra`` given to save_checkpoint."""
        self.engine.offload.enter("update")  # everything on the device while it is read
        extra = load_checkpoint(self.engine, path, load_optimizer)
        self.updates_done = extra.pop(self._ROLE_STATE)["updates_done"]
        return extra
