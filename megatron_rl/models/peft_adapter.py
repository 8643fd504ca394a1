"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``, what
``peft.PeftModel.from_pretrained(<HF base>, dir)`` loads and ``save_pretrained`` writes.

PEFT keeps one (A, B) pair per HF module (``model.layers.{i}.self_attn.q_proj`` ...) under the key
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ([r, in]) / ``.lora_B.weight``
([out, r]) and scales ``B A`` by ``lora_alpha / r``, as our adapters do (models/lora.py keeps the parts of a
fused linear as separate pairs for this reason). The full tensors are our factors gathered over tensor
parallelism (B of a column-parallel adapter on dim 0, A of a row-parallel one on dim 1) and over the pipeline
stages (each stage holds its layers' adapters); loading slices them back for this rank. An MoE model's expert
adapters are PEFT's per-expert modules (``model.layers.{i}.mlp.experts.{e}.gate_proj``, the names of the
model's own expert weights), gathered over the expert-tensor-parallel group and the expert-parallel group (each
EP rank holds its experts'). A multi-latent attention model's adapters are PEFT's modules of its own linears
(``self_attn.q_a_proj``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``); those of
the down projections are whole on every TP rank and are neither gathered nor sliced.

Both functions are collectives: every rank of the model calls them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.config.lora import mla_linears
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.layout import unwrap
from megatron_rl.models.lora import HF_PARTS, LoRAAdapter, adapters_of, expert_hf_modules

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
_DEFAULT_PEFT_CONFIG: dict[str, Any] = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "lora_bias": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "exclude_modules": None,
}


def peft_key(layer: int, hf_module: str, factor: str) -> str:
    """PEFT's state-dict key of a factor (``A``/``B``) of the adapter on ``model.layers.{layer}.{hf_module}``."""
    return f"base_model.model.model.layers.{layer}.{hf_module}.lora_{factor}.weight"


def _factors(adapter: LoRAAdapter):
    """(hf_module, factor, parameter, split dim or None) of each factor of ``adapter``; the split is over TP, or
    over ETP for an expert's adapter (``adapter.split_size()``); an MLA down projection's are whole on every rank."""
    for part, hf_module in zip(adapter.parts, adapter.hf_modules):
        a, b = adapter.factors(part)
        yield hf_module, "A", a, None if adapter.column or adapter.duplicated else 1
        yield hf_module, "B", b, 0 if adapter.column else None


def _gather_split(adapter: LoRAAdapter, tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
    size = adapter.split_size()
    if dim is None or size == 1:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=adapter.split_group())
    return torch.cat(shards, dim=dim)


def _gather_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every EP rank's expert-adapter tensors, on the first rank of this rank's expert-parallel group (None on
    the others)."""
    group = parallel_state.get_expert_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return tensors
    first = dist.get_global_rank(group, 0)
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(tensors, gathered, dst=first, group=group)
    return {k: v for part in gathered for k, v in part.items()} if gathered is not None else None


def _alpha(adapter: LoRAAdapter) -> float | int:
    alpha = adapter.scale * adapter.rank
    return round(alpha) if abs(alpha - round(alpha)) < 1e-9 else alpha


def _hf_linears(hf: HFModelConfig) -> set[str]:
    """Every HF linear of the model an adapter can sit on (of an MoE layer: each expert's and the shared one's)."""
    names = set()
    for i in range(hf.num_layers):
        mlp_targets = ("linear_fc1", "linear_fc2")
        if hf.moe is not None and hf.moe.is_moe_layer(i):
            experts = [*range(hf.moe.num_experts)] + ([None] if hf.moe.shared_expert_size is not None else [])
            modules = [m for t in mlp_targets for e in experts for m in expert_hf_modules(hf.moe, i, t, e)]
        else:
            modules = [m for t in mlp_targets for m in HF_PARTS[t]]
        if hf.mla is None:
            modules += [*HF_PARTS["linear_qkv"], *HF_PARTS["linear_proj"]]
        else:  # multi-latent attention: q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj
            modules += [m for linear in mla_linears(hf.mla) for m in HF_PARTS[linear]]
        names |= {f"model.layers.{i}.{m}" for m in modules}
    return names


def _target_modules(names: set[str], hf: HFModelConfig) -> list[str]:
    """PEFT's ``target_modules``: the HF leaf names when every linear of the model with those leaves has an
    adapter, else the full module names (PEFT matches a list entry against a module name's end)."""
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    everywhere = {name for name in _hf_linears(hf) if name.rsplit(".", 1)[-1] in leaves}
    return leaves if names == everywhere else sorted(names)


@torch.no_grad()
def save_peft_adapter(
    chunks: Sequence[torch.nn.Module], out_dir: str | Path, base_model_path: str | Path
) -> None:
    """Write the adapters of ``chunks`` (every model chunk of this rank) as a PEFT adapter directory.

    Collective: every rank calls it; the TP ranks gather their shards, each pipeline group gathers its
    stages' adapters to its first rank, and global rank 0 writes ``adapter_config.json`` (``base_model_name_or_path``
    is ``base_model_path``) and ``adapter_model.safetensors`` in the adapters' dtype.
    """
    from safetensors.torch import save_file

    adapters = adapters_of(chunks)
    tensors: dict[str, torch.Tensor] = {}
    expert_tensors: dict[str, torch.Tensor] = {}
    for adapter in adapters:
        for hf_module, factor, param, dim in _factors(adapter):
            held = tensors if adapter.expert is None else expert_tensors
            held[peft_key(adapter.layer, hf_module, factor)] = _gather_split(adapter, param, dim).cpu()
    if expert_tensors:  # every rank of a stage holds the same layers: all of an EP group take this branch
        expert_tensors = _gather_experts(expert_tensors)
        tensors |= expert_tensors or {}
    modules = {key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for key in tensors}
    local: dict[str, Any] = {"tensors": tensors, "modules": modules, "spec": None}
    if adapters:
        first = adapters[0]
        local["spec"] = {"r": first.rank, "lora_alpha": _alpha(first), "lora_dropout": float(first.dropout)}

    holds_rank_zero = (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
    )
    if holds_rank_zero and expert_tensors is None:
        raise RuntimeError("save_peft_adapter: the rank that writes its stage's adapters is not the first of its "
                           "expert-parallel group, so it does not hold every expert's adapters")
    stages = [local]
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if holds_rank_zero and dist.get_world_size(pp_group) > 1:
        first_rank = dist.get_global_rank(pp_group, 0)
        stages = [None] * dist.get_world_size(pp_group) if dist.get_rank() == first_rank else None
        dist.gather_object(local, stages, dst=first_rank, group=pp_group)

    if dist.get_rank() == 0:
        everything: dict[str, torch.Tensor] = {}
        names: set[str] = set()
        spec = None
        for stage in stages:
            everything.update(stage["tensors"])
            names |= stage["modules"]
            spec = spec or stage["spec"]
        if spec is None:
            raise ValueError(
                "save_peft_adapter: the model has no LoRA adapters (<role>.model.lora.rank is 0)"
            )
        config = {
            **_DEFAULT_PEFT_CONFIG,
            **spec,
            "base_model_name_or_path": str(base_model_path),
            "target_modules": _target_modules(names, unwrap(chunks[0]).hf_config),
        }
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: everything[k].contiguous() for k in sorted(everything)},
            str(out / WEIGHTS_FILE),
            metadata={"format": "pt"},
        )
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    dist.barrier()


def _read_config(directory: Path, adapter: LoRAAdapter | None) -> None:
    """Refuse a PEFT config our adapters would not reproduce (the key named)."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a PEFT adapter: no {CONFIG_FILE}")
    try:
        adapter_config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"{path}: {key}={adapter_config.get(key)!r} {why}")

    if adapter_config.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", "is not a LoRA adapter")
    for key, off in (
        ("use_rslora", False),
        ("use_dora", False),
        ("fan_in_fan_out", False),
        ("lora_bias", False),
    ):
        if adapter_config.get(key, off) not in (off, None):
            refuse(key, "is not supported (our adapters are plain LoRA: W + (lora_alpha / r) B A)")
    if adapter_config.get("bias", "none") != "none":
        refuse("bias", "is not supported (adapters without bias only)")
    for key in ("rank_pattern", "alpha_pattern"):
        if adapter_config.get(key):
            refuse(key, "is not supported: every adapter has one r and lora_alpha (lora.rank, lora.alpha)")
    if adapter_config.get("layer_replication"):
        refuse("layer_replication", "is not supported")
    if adapter is None:
        return
    if adapter_config.get("r") != adapter.rank:
        refuse("r", f"but the model's adapters have rank {adapter.rank} (lora.rank)")
    alpha = adapter.scale * adapter.rank
    if not isinstance(adapter_config.get("lora_alpha"), (int, float)) or abs(
        adapter_config["lora_alpha"] - alpha
    ) > 1e-6 * abs(alpha):
        refuse("lora_alpha", f"but the model's adapters have alpha {_alpha(adapter)} (lora.alpha)")


@torch.no_grad()
def load_peft_adapter(chunks: Sequence[torch.nn.Module], adapter_dir: str | Path) -> None:
    """Load a PEFT LoRA adapter directory into the adapters of ``chunks``, each rank its TP shard of its stage.

    Checks ``r`` and ``lora_alpha`` against the built adapters, that every adapter finds both factors at
    their full shapes and that no tensor of the file is left unused (over all pipeline stages); errors name
    the file and the key. Collective (one object all-gather over the pipeline group): every rank calls it.
    """
    from safetensors import safe_open

    directory = Path(adapter_dir)
    adapters = adapters_of(chunks)
    _read_config(directory, adapters[0] if adapters else None)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        if (directory / PICKLED_WEIGHTS_FILE).is_file():
            raise ValueError(
                f"{directory / PICKLED_WEIGHTS_FILE}: pickled PEFT adapters are not loaded (unpickling can run "
                f"code); save it as {WEIGHTS_FILE} (PeftModel.save_pretrained(dir, safe_serialization=True))"
            )
        raise FileNotFoundError(f"{directory} is not a PEFT adapter: no {WEIGHTS_FILE}")

    expected: set[str] = set()
    errors: list[str] = []
    try:
        opened = safe_open(str(weights), framework="pt")
    except Exception as err:  # noqa: BLE001 - SafetensorError (a damaged header) or OSError: name the file
        raise ValueError(
            f"{weights}: cannot be read as safetensors (corrupt or truncated?): {type(err).__name__}: {err}"
        ) from None
    with opened as file:
        present = set(file.keys())
        for adapter in adapters:
            for hf_module, factor, param, dim in _factors(adapter):
                key = peft_key(adapter.layer, hf_module, factor)
                expected.add(key)
                shape = list(param.shape)
                if dim is not None:
                    shape[dim] *= adapter.split_size()
                if key not in present:
                    errors.append(
                        f"{weights}: no tensor {key!r} (expected shape {shape}): the adapter of "
                        f"model.layers.{adapter.layer}.{hf_module} is targeted (lora.target_modules)"
                    )
                    continue
                full = file.get_tensor(key)
                if full.is_floating_point() and not bool(full.isfinite().all()):
                    bad = int((~full.isfinite()).sum())
                    errors.append(f"{weights}: {key!r} holds {bad} non-finite values (NaN or inf)")
                    continue
                if list(full.shape) != shape:
                    errors.append(
                        f"{weights}: {key!r} has shape {list(full.shape)}, expected {shape} "
                        f"(r={adapter.rank})"
                    )
                    continue
                split = full if dim is None else full.chunk(adapter.split_size(), dim=dim)[adapter.split_rank()]
                param.data.copy_(split)
    # the keys every stage (and every EP rank of a stage: its own experts) expects, and their errors
    for group in (parallel_state.get_expert_model_parallel_group(), parallel_state.get_pipeline_model_parallel_group()):
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            everyone: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, (expected, errors), group=group)
            expected = set().union(*(keys for keys, _ in everyone))
            errors = list(dict.fromkeys(error for _, rank_errors in everyone for error in rank_errors))
    unused = sorted(present - expected)
    if unused:
        errors.append(
            f"{weights}: {len(unused)} tensor(s) match no adapter of the model (lora.target_modules / "
            f"exclude_modules, or another model): {', '.join(repr(k) for k in unused[:5])}"
            + (" ..." if len(unused) > 5 else "")
        )
    if errors:
        raise ValueError("; ".join(errors))
