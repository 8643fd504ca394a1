"""The optimizer part of a checkpoint at another expert-parallel (EP) layout.

Megatron builds a ``ChainedOptimizer``: at EP > 1 the experts' parameters (not all-reduced over DP) get a second
optimizer, at EP = 1 there is one. The per-parameter state (exp_avg, exp_avg_sq, fp32 master weights) is stored
under model-space keys, ``optimizer.state.<name>.<model key>``, which each chained optimizer prefixes with
``chained_<i>.`` — so the keys, and the nesting of the non-tensor part ({0: dense, 1: experts} vs one dict),
change with EP while the tensors (global shape, offsets per expert) do not. This module maps a resuming
optimizer's request onto what the checkpoint holds:

* each state tensor's key is renamed to the stored key with the same model-space name (``_remap_keys``);
* when the number of chained optimizers differs, the tensors are loaded on their own and put back into the
  resuming optimizer's own structure; its param groups are its own (the LR scheduler's state then sets the
  learning rate and weight decay) and the saved Adam step (one for all, Megatron keeps them equal) is set
  on every parameter (``load_across_chains``).

Megatron-Core 0.16.1's bf16 optimizer (``Float16OptimizerWithFloat16Params``, the non-distributed one) numbers
the Adam state of its parameters over the bf16 ones only: a parameter kept in fp32 (the RMSNorm weights of the
local layer spec, on CPU or without Transformer Engine) shifts every later id, so saving failed ("Param id N does
not match any model sharded param") or would have put state on the wrong keys. ``fix_fp32_param_ids`` gives
such an optimizer a ``sharded_state_dict`` that numbers them as torch does.

Megatron's distributed optimizer also stores per-DP-group objects whose keys follow the layout; it is refused
at another chain length with the saved and the new layout named (``check_chain_change``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)

_CHAIN_PREFIX = re.compile(r"^chained_\d+\.")


def _map_leaves(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """``tree`` (dicts, lists, tuples) with every other value replaced by ``fn(value)``, in a fixed order."""
    if isinstance(tree, dict):
        return {key: _map_leaves(value, fn) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_leaves(value, fn) for value in tree)
    return fn(tree)


def _sharded_leaves(tree: Any) -> list[Any]:
    found: list[Any] = []

    def keep(leaf: Any) -> Any:
        if isinstance(leaf, (ShardedBase, ShardedTensorFactory)):
            found.append(leaf)
        return leaf

    _map_leaves(tree, keep)
    return found


def model_space_key(key: str) -> str:
    """A state tensor's key without the chained optimizer's ``chained_<i>.`` prefix."""
    return _CHAIN_PREFIX.sub("", key)


def chain_length(optimizer: Any) -> int | None:
    """How many optimizers Megatron chained (None: not a Megatron optimizer, e.g. a test's stand-in)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return None if chained is None else len(chained)


def saved_chain_length(common: dict[str, Any]) -> int:
    """The number of chained optimizers that saved: their states are {0: ..., 1: ...}; one is saved bare."""
    state = common.get("optimizer", {})
    if isinstance(state, dict) and state and all(isinstance(key, int) for key in state):
        return len(state)
    return 1


def has_state_tensors(optimizer_tree: Any) -> bool:
    return any(isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) for leaf in _sharded_leaves(optimizer_tree))


def remap_keys(optimizer_tree: Any, stored_keys: set[str], where: str, layouts: str) -> None:
    """Rename (in place) each state tensor of the resuming optimizer to the stored key of the same model-space
    name; a name the checkpoint lacks is an error naming it, ``where`` (the checkpoint) and ``layouts``."""
    stored: dict[str, str] = {}
    for key in stored_keys:
        if key.startswith("optimizer.") or _CHAIN_PREFIX.match(key):
            stored.setdefault(model_space_key(key), key)
    for leaf in _sharded_leaves(optimizer_tree):
        if not isinstance(leaf, (ShardedTensor, ShardedTensorFactory)):
            continue
        name = model_space_key(leaf.key)
        if name not in stored:
            raise ValueError(f"{where}: the checkpoint holds no optimizer state {name!r} for this model "
                             f"({layouts}); it was saved for other parameters")
        leaf.key = stored[name]


def check_chain_change(distributed_optimizer: bool, saved: int, now: int, where: str, layouts: str) -> None:
    if distributed_optimizer and saved != now:
        raise ValueError(
            f"{where}: its distributed-optimizer state was saved by {saved} chained optimizer(s) and this engine "
            f"has {now} ({layouts}): Megatron's distributed optimizer keeps per-DP-group state whose keys follow "
            "the expert-parallel layout, so it resumes at the EP that saved it only. Resume at that EP, or pass "
            "load_optimizer=False (weights only)")


def _saved_values(common_optimizer: Any, name: str) -> list[Any]:
    """Every value stored under ``name`` in the saved non-tensor optimizer state."""
    values: list[Any] = []

    def walk(tree: Any) -> None:
        if isinstance(tree, dict):
            for key, value in tree.items():
                if key == name:
                    values.append(value)
                else:
                    walk(value)
        elif isinstance(tree, (list, tuple)):
            for value in tree:
                walk(value)

    walk(common_optimizer)
    return values


def _torch_optimizer_states(tree: Any) -> Iterator[dict[str, Any]]:
    """The torch optimizer state dicts (``state`` + ``param_groups``) in ``tree``."""
    if isinstance(tree, dict):
        if "state" in tree and "param_groups" in tree:
            yield tree
            return
        for value in tree.values():
            yield from _torch_optimizer_states(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _torch_optimizer_states(value)


def load_across_chains(state: dict[str, Any], path: str, where: str, layouts: str) -> dict[str, Any]:
    """``dist_checkpointing.load`` of ``state`` whose ``optimizer`` request has another chain length than the
    checkpoint: the state tensors load by key, then fill the request's own structure (its param groups, the
    saved step). Returns what ``dist_checkpointing.load`` would, ``optimizer`` ready for ``load_state_dict``."""
    request = state.pop("optimizer")
    leaves = _sharded_leaves(request)
    state["optimizer_tensors"] = {str(i): leaf for i, leaf in enumerate(leaves)}
    loaded = dist_checkpointing.load(state, path)
    flat = loaded.pop("optimizer_tensors")
    tensors = iter([flat[str(i)] for i in range(len(leaves))])

    def fill(leaf: Any) -> Any:
        if isinstance(leaf, (ShardedBase, ShardedTensorFactory)):
            return next(tensors)
        return leaf.unwrap() if isinstance(leaf, LocalNonpersistentObject) else leaf

    rebuilt = _map_leaves(request, fill)
    steps = _saved_values(loaded.get("optimizer", {}), "common_step")
    if len({float(step) for step in steps}) > 1:
        raise ValueError(f"{where}: its chained optimizers saved different Adam steps {steps} ({layouts})")
    for optimizer_state in _torch_optimizer_states(rebuilt):
        if steps:
            optimizer_state["state"]["common_step"] = steps[0]
        else:
            optimizer_state["state"].pop("common_step", None)
    scalers = _saved_values(loaded.get("optimizer", {}), "grad_scaler")
    if scalers:  # fp16 loss scaling: one scale for all, as the chain keeps it
        for sub in (rebuilt.values() if isinstance(rebuilt, dict) and all(isinstance(k, int) for k in rebuilt)
                    else [rebuilt]):
            if isinstance(sub, dict) and "grad_scaler" in sub:
                sub["grad_scaler"] = scalers[0]
    loaded["optimizer"] = rebuilt
    return loaded


def _float16_sharded_state_dict(opt: Any, model_sharded_state_dict: dict[str, Any], is_loading: bool = False,
                                metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Megatron's Float16OptimizerWithFloat16Params.sharded_state_dict with torch's parameter ids: each id is a
    bf16 parameter's fp32 master copy or a parameter kept in fp32, in the order of the optimizer's groups."""
    if is_loading:
        opt.init_state_fn(opt.optimizer, opt.config)
    state_dict = opt.state_dict()
    model_of = {id(master): param for params, masters in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                for param, master in zip(params, masters)}
    in_torch_order = [p for group in opt.optimizer.param_groups for p in group["params"]]
    id_of = {id(p): index for index, p in enumerate(in_torch_order)}
    sharded_param = get_param_id_to_sharded_param_map(
        model_sharded_state_dict, [model_of.get(id(p), p) for p in in_torch_order])
    state_dict["fp32_from_fp16_params"] = [
        [make_sharded_optimizer_tensor(sharded_param[id_of[id(master)]], master, prefix="optimizer.state.fp32_param")
         for master in masters]
        for masters in opt.fp32_from_float16_groups
    ]
    step = opt._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], sharded_param, exclude_keys="step")
    if step:  # one step for all parameters, as Megatron saves it
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


def fix_fp32_param_ids(optimizer: Any) -> None:
    """Give each chained bf16 optimizer that holds fp32 parameters ``_float16_sharded_state_dict`` (idempotent);
    the ChainedOptimizer calls it as Megatron's own, prefixes included."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, Float16OptimizerWithFloat16Params) and any(opt.fp32_from_fp32_groups):
            opt.sharded_state_dict = _float16_sharded_state_dict.__get__(opt)
