"""LoRA's config surface (issue 36): verl's flat keys folded into the ``model.lora`` block, the checks of the block
before launch, which Megatron modules an adapter sits on, and the PEFT adapter directory a run starts from.

The engine reads ``<actor_rollout_ref|critic>.model.lora`` (``schema.LoRAConfig``) only: after ``fold_lora_aliases``
the flat keys are null, and ``alpha`` is filled (16, verl's default) whenever ``rank > 0``.
"""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf, read_write

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema import LORA_TARGET_MODULES, LoRAConfig, PPOTrainerConfig

LORA_MODEL_KEYS = ("actor_rollout_ref.model", "critic.model")
DEFAULT_ALPHA = 16.0  # verl's lora_alpha default

BUILT_TYPES = ("lora",)
NOT_BUILT_TYPES = ("canonical_lora", "dora")  # verl's other Megatron LoRA types
LORA_A_INIT_METHODS = ("xavier", "kaiming", "normal")
LORA_B_INIT_METHODS = ("zero", "xavier", "kaiming", "normal")
LORA_DTYPES = ("fp32", "float32", "bf16", "bfloat16")

# Megatron's modules of a layer: the attention's fused q/k/v (column-parallel) and output projection (row-parallel),
# the MLP's fused gate/up (column-parallel) and down projection (row-parallel)
MODULE_PATHS = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
                "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
# HF (PEFT) names -> Megatron's, and which part of a fused Megatron linear each HF one is
HF_TO_MEGATRON = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                  "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
FUSED_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}
HF_PATH_PARTS = {"model": "decoder", "self_attn": "self_attention", "mlp": "mlp"}
ALL_LINEAR = "all-linear"
# Multi-latent attention (DeepSeek-V3 / Kimi-K2 / Moonlight, models/mla.py) has no fused q/k/v: its attention's input
# linears, by Megatron's names, are the query's (linear_q_proj, or linear_q_down_proj + linear_q_up_proj when
# q_lora_rank is set) and the key/value latent's (linear_kv_down_proj, linear_kv_up_proj); its output projection is
# linear_proj, as GPT attention's. On an MLA model ``linear_qkv`` (verl's default target, and what 'all-linear'
# folds to) means all of the model's query and key/value linears (``mla_linears``), so the default adapts the whole
# attention as on a GPT model; Megatron's MLA names select a subset.
MLA_QKV_LINEARS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                   "linear_kv_up_proj")
KNOWN_TARGETS = LORA_TARGET_MODULES + MLA_QKV_LINEARS
MODULE_PATHS.update({linear: f"self_attention.{linear}" for linear in MLA_QKV_LINEARS})
# HF (PEFT) names of an MLA model's attention linears -> Megatron's
MLA_HF_TO_MEGATRON = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_b_proj": "linear_q_up_proj",
                      "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_b_proj": "linear_kv_up_proj",
                      "o_proj": "linear_proj"}
_MLA_ONLY_HF = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# verl's defaults of its flat keys: a verl config that carries them with LoRA off says nothing
VERL_FLAT_DEFAULTS = {"lora_rank": 0, "lora_alpha": 16, "target_modules": ALL_LINEAR, "exclude_modules": None,
                      "lora_adapter_path": None}
_WILDCARDS = set("*?[")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _is_pattern(name: str) -> bool:
    return bool(_WILDCARDS & set(name))


# ---------------------------------------------------------------------------- HF names -> Megatron names
def hf_modules_to_megatron(value: Any, key: str) -> list[str]:
    """verl's ``target_modules`` / ``exclude_modules`` (HF names, ``all-linear``, or full HF module names such as
    ``model.layers.3.self_attn.q_proj``) as Megatron names; a fused linear's parts must come together (one
    adapter covers q, k and v; another gate and up). Megatron names pass as they are."""
    value = _plain(value)
    if value is None:
        return []
    if isinstance(value, str):
        if value == ALL_LINEAR:
            return list(LORA_TARGET_MODULES)
        raise ConfigError(f"{key}={value!r}: a string here is PEFT's regular expression, which is not mapped to "
                          f"Megatron's modules; give a list of module names ({', '.join(HF_TO_MEGATRON)}) or "
                          f"'{ALL_LINEAR}', or set the Megatron names in {key.rsplit('.', 1)[0]}.lora."
                          f"{key.rsplit('.', 1)[1]}")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}={value!r} must be '{ALL_LINEAR}' or a list of module names")
    if ALL_LINEAR in value:
        return list(LORA_TARGET_MODULES) + [v for v in value if v != ALL_LINEAR and v not in HF_TO_MEGATRON
                                            and v not in MLA_HF_TO_MEGATRON and v not in KNOWN_TARGETS]
    mapped: list[str] = []
    parts_seen: dict[str, set[str]] = {}
    # an MLA model's names (kv_a_proj_with_mqa, ...) in the list: q_proj is MLA's uncompressed query (linear_q_proj)
    mla = any(v.rsplit(".", 1)[-1] in (*_MLA_ONLY_HF, *MLA_QKV_LINEARS) for v in value)
    for name in value:
        *path, last = name.split(".")
        if last in KNOWN_TARGETS:
            megatron_last = last
        elif mla and last in MLA_HF_TO_MEGATRON:
            megatron_last = MLA_HF_TO_MEGATRON[last]
        elif last in HF_TO_MEGATRON:
            megatron_last = HF_TO_MEGATRON[last]
        elif last in MLA_HF_TO_MEGATRON:
            megatron_last = MLA_HF_TO_MEGATRON[last]
        else:
            raise ConfigError(f"{key}: {name!r} is not a linear an adapter is built for; known: "
                              f"{', '.join(HF_TO_MEGATRON)}, {', '.join(_MLA_ONLY_HF)} (HF names; the last four "
                              f"multi-latent attention's), {', '.join(KNOWN_TARGETS)} (Megatron's) or "
                              f"'{ALL_LINEAR}'")
        full = ".".join([HF_PATH_PARTS.get(p, p) for p in path] + [megatron_last])
        if full not in mapped:
            mapped.append(full)
        if last in HF_TO_MEGATRON and megatron_last in FUSED_PARTS:
            parts_seen.setdefault(full, set()).add(last)
    for full, parts in parts_seen.items():
        fused = FUSED_PARTS[full.rsplit(".", 1)[-1]]
        if set(fused) - parts:
            given = sorted(parts, key=fused.index)
            missing = [p for p in fused if p not in parts]
            raise ConfigError(
                f"{key} names {', '.join(given)} without {', '.join(missing)}: Megatron fuses "
                f"{' / '.join(fused)} into one linear ({full.rsplit('.', 1)[-1]}), and its adapter covers all "
                f"{len(fused)} parts, so a subset is not built; name all of {', '.join(fused)} (or none); on a "
                f"multi-latent attention model name q_proj with kv_a_proj_with_mqa / kv_b_proj")
    return mapped


# ---------------------------------------------------------------------------- folding the flat keys
def _lora_changed(lora: DictConfig, name: str) -> bool:
    default = getattr(LoRAConfig(), name)
    return _plain(lora[name]) != default


def _fold_model(model: DictConfig, prefix: str) -> None:
    lora = model.lora
    flat = {name: _plain(model.get(name)) for name in VERL_FLAT_DEFAULTS}
    if all(v is None for v in flat.values()):
        return
    rank = flat["lora_rank"] if flat["lora_rank"] is not None else lora.rank
    if not rank:  # LoRA stays off: verl's own defaults of the flat keys say nothing
        flat = {k: (None if v == VERL_FLAT_DEFAULTS[k] else v) for k, v in flat.items()}
    targets = {"lora_rank": "rank", "lora_alpha": "alpha", "target_modules": "target_modules",
               "exclude_modules": "exclude_modules", "lora_adapter_path": "adapter_path"}
    values: dict[str, Any] = {}
    for name, field in targets.items():
        if flat[name] is None:
            continue
        if _lora_changed(lora, field):
            raise ConfigError(f"{prefix}.{name}={flat[name]!r} and {prefix}.lora.{field}={_plain(lora[field])!r} "
                              f"are both set: they are two spellings of one setting (verl's older flat key and its "
                              f"Megatron block); keep {prefix}.lora.{field}")
        if field in ("target_modules", "exclude_modules"):
            values[field] = hf_modules_to_megatron(flat[name], f"{prefix}.{name}")
        else:
            values[field] = flat[name]
    with read_write(model):
        for field, value in values.items():
            lora[field] = value
        for name in targets:
            model[name] = None


def fold_lora_aliases(cfg: DictConfig) -> DictConfig:
    """Fold verl's flat LoRA keys of the actor's and the critic's model into their ``lora`` block (in place; a
    second call does nothing), and fill ``lora.alpha`` (16) where LoRA is on and alpha is unset."""
    for prefix in LORA_MODEL_KEYS:
        model = OmegaConf.select(cfg, prefix, default=None)
        if not isinstance(model, DictConfig) or "lora" not in model:
            continue
        _fold_model(model, prefix)
        lora = model.lora
        if isinstance(lora.rank, int) and lora.rank > 0 and lora.alpha is None:
            with read_write(model):
                lora.alpha = DEFAULT_ALPHA
    return cfg


# ---------------------------------------------------------------------------- which modules get an adapter
def lora_enabled(lora: LoRAConfig | None) -> bool:
    """rank > 0 (``lora``: the block as DictConfig or LoRAConfig; None: off)."""
    return lora is not None and (lora.rank or 0) > 0


def module_name(layer: int, linear: str) -> str:
    """A linear's full Megatron name, with the global layer number: ``decoder.layers.3.self_attention.linear_qkv``."""
    return f"decoder.layers.{layer}.{MODULE_PATHS[linear]}"


def _matches(name: str, entry: str) -> bool:
    if _is_pattern(entry):
        return fnmatch.fnmatchcase(name, entry)
    return name == entry or name.rsplit(".", 1)[-1] == entry or name.endswith("." + entry)


def mla_linears(mla: Any) -> tuple[str, ...]:
    """An MLA model's attention linears (``mla``: its MLASpec): the query's, the key/value latent's, linear_proj."""
    q = ("linear_q_proj",) if mla.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    return (*q, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")


def _mla_entries(entries: list[str], mla: Any) -> list[str]:
    """``entries`` with ``linear_qkv`` standing for the MLA model's query and key/value linears."""
    qkv = mla_linears(mla)[:-1]
    out = []
    for entry in entries:
        out += [entry.replace("linear_qkv", linear) for linear in qkv] if "linear_qkv" in entry else [entry]
    return out


def lora_targets(lora: LoRAConfig | None, layer: int, mla: Any = None) -> list[str]:
    """The linears of layer ``layer`` (global number, 0-based) that get an adapter: named by a target_modules entry
    (a plain name matches the module's short name or a suffix of its full name; a pattern, fnmatch on the full
    name) and by no exclude_modules entry. The planner counts with this; the model code should select with it.
    ``mla``: the model's MLASpec (multi-latent attention): its attention linears (``mla_linears``) take the place
    of linear_qkv / linear_proj, ``linear_qkv`` in an entry standing for its query and key/value linears."""
    if not lora_enabled(lora):
        return []
    targets, excludes = list(_plain(lora.target_modules)), list(_plain(lora.exclude_modules) or [])
    linears = LORA_TARGET_MODULES
    if mla is not None:
        targets, excludes = _mla_entries(targets, mla), _mla_entries(excludes, mla)
        linears = (*mla_linears(mla), "linear_fc1", "linear_fc2")
    chosen = []
    for linear in linears:
        name = module_name(layer, linear)
        if any(_matches(name, t) for t in targets) and not any(_matches(name, e) for e in excludes):
            chosen.append(linear)
    return chosen


def lora_on_experts(lora: Any, model: Any) -> bool:
    """Whether any MoE layer of ``model`` (HFModelConfig facts) gets adapters on its experts: a targeted
    linear_fc1 / linear_fc2 of an MoE layer means every routed expert's (and the shared expert's)."""
    moe = getattr(model, "moe", None)
    if moe is None or not lora_enabled(lora):
        return False
    mla = getattr(model, "mla", None)
    return any(moe.is_moe_layer(i) and {"linear_fc1", "linear_fc2"} & set(lora_targets(lora, i, mla))
               for i in range(model.num_layers))


# ---------------------------------------------------------------------------- checks of the block (validate)
def _check_module_list(values: Iterable[str], key: str, targets: bool) -> None:
    for entry in values:
        if not isinstance(entry, str) or not entry:
            raise ConfigError(f"{key}: {entry!r} is not a module name")
        last = entry.rsplit(".", 1)[-1]
        if _is_pattern(entry):
            if targets and not any(linear in entry for linear in KNOWN_TARGETS):
                raise ConfigError(f"{key}: the pattern {entry!r} names none of the linears an adapter is built for "
                                  f"({', '.join(KNOWN_TARGETS)}); a target pattern must contain one, e.g. "
                                  f"'decoder.layers.0.*.linear_qkv'")
            continue
        if last not in KNOWN_TARGETS:
            hf_names = {**MLA_HF_TO_MEGATRON, **HF_TO_MEGATRON}
            hint = f" (HF's name; Megatron's is {hf_names[last]})" if last in hf_names else ""
            raise ConfigError(f"{key}: {entry!r}{hint} is not a linear an adapter is built for; known: "
                              f"{', '.join(KNOWN_TARGETS)} (Megatron's names; {', '.join(MLA_QKV_LINEARS)} "
                              f"multi-latent attention's), or fnmatch patterns on full "
                              f"names such as 'decoder.layers.3.self_attention.linear_qkv'")


def check_lora_section(lora: LoRAConfig, prefix: str) -> None:
    """The block ``<prefix>.lora`` on its own; raises ConfigError naming the key."""
    key = f"{prefix}.lora"
    rank = lora.rank
    if not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"{key}.rank={rank!r} must be an integer >= 0 (0: LoRA off)")
    if rank == 0:
        defaults = LoRAConfig()
        changed = [f"{key}.{name}={_plain(getattr(lora, name))!r}" for name in
                   ("alpha", "type", "dropout", "dropout_position", "target_modules", "exclude_modules",
                    "lora_A_init_method", "lora_B_init_method", "merge", "adapter_path", "dtype")
                   if _plain(getattr(lora, name)) != getattr(defaults, name)]
        if changed:
            raise ConfigError(f"{', '.join(changed)} set, but LoRA is off because {key}.rank=0: set {key}.rank > 0 "
                              f"(e.g. 32) to train adapters, or drop {'them' if len(changed) > 1 else 'it'}")
        return
    if lora.type != "lora":
        why = ("not built: only plain LoRA (type=lora) is" if lora.type in NOT_BUILT_TYPES
               else f"unknown; built: {', '.join(BUILT_TYPES)}")
        raise ConfigError(f"{key}.type={lora.type!r} is {why}")
    if lora.alpha is not None and not lora.alpha > 0:
        raise ConfigError(f"{key}.alpha={lora.alpha} must be > 0 (the adapters' scale is alpha / rank)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"{key}.dropout={lora.dropout} must lie in [0, 1)")
    if lora.dropout_position != "pre":
        raise ConfigError(f"{key}.dropout_position={lora.dropout_position!r} is not built: dropout is applied to the "
                          f"adapter's input (pre); set {key}.dropout_position=pre")
    if lora.lora_A_init_method not in LORA_A_INIT_METHODS:
        raise ConfigError(f"{key}.lora_A_init_method={lora.lora_A_init_method!r} is not built; built: "
                          f"{', '.join(LORA_A_INIT_METHODS)}")
    if lora.lora_B_init_method not in LORA_B_INIT_METHODS:
        raise ConfigError(f"{key}.lora_B_init_method={lora.lora_B_init_method!r} is not built; built: "
                          f"{', '.join(LORA_B_INIT_METHODS)}")
    if not lora.merge:
        raise ConfigError(f"{key}.merge=false (adapters loaded through an engine's LoRA API: SGLang "
                          f"load_lora_adapter, vLLM LoRARequest) is not built: the engines get the merged weights "
                          f"W + alpha/r B A, which every engine runs without LoRA support; set {key}.merge=true")
    if lora.dtype is not None and lora.dtype not in LORA_DTYPES:
        raise ConfigError(f"{key}.dtype={lora.dtype!r} is unknown; known: fp32, bf16 (null: the model's "
                          f"megatron.params_dtype)")
    targets = list(_plain(lora.target_modules) or [])
    if not targets:
        raise ConfigError(f"{key}.target_modules is empty with {key}.rank={rank}: no linear would get an adapter; "
                          f"name some of {', '.join(LORA_TARGET_MODULES)}, or set rank=0")
    _check_module_list(targets, f"{key}.target_modules", targets=True)
    _check_module_list(_plain(lora.exclude_modules) or [], f"{key}.exclude_modules", targets=False)


def check_lora(cfg: PPOTrainerConfig, uses_critic: bool) -> None:
    """Every LoRA refusal that needs only the config (validate() runs it, on the typed tree, whose flat verl keys
    typed_config folded): the actor's block, and the critic's when a critic runs (set without one, it would do
    nothing)."""
    check_lora_section(cfg.actor_rollout_ref.model.lora, "actor_rollout_ref.model")
    critic_lora = cfg.critic.model.lora
    if not uses_critic and lora_enabled(critic_lora):
        raise ConfigError(f"critic.model.lora.rank={critic_lora.rank} but no critic runs (critic.enable / "
                          f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}): it would do nothing; drop it")
    check_lora_section(critic_lora, "critic.model")


# ---------------------------------------------------------------------------- the model (preflight, planner)
def check_lora_model(model: Any, prefix: str, lora: LoRAConfig | None, megatron: Any = None,
                     megatron_key: str = "") -> None:
    """What LoRA needs from the model itself (``model``: HFModelConfig facts from config.json or
    plan.architecture; ``megatron``: the role's megatron section at ``megatron_key``); raises ConfigError naming
    the key."""
    if not lora_enabled(lora):
        return
    overrides = _plain(getattr(megatron, "override_transformer_config", None)) or {}
    if overrides.get("moe_grouped_gemm") is True and lora_on_experts(lora, model):
        raise ConfigError(f"{megatron_key}.override_transformer_config.moe_grouped_gemm=true with LoRA on the "
                          f"experts ({prefix}.lora.target_modules names linear_fc1 / linear_fc2 of an MoE model): "
                          f"the adapters sit on each expert's own linears, which Transformer Engine's grouped layer "
                          f"does not have; drop it (SequentialMLP is chosen), or put linear_fc1 and linear_fc2 in "
                          f"{prefix}.lora.exclude_modules")
    _check_mla_targets(model, prefix, lora)
    mla = getattr(model, "mla", None)
    if mla is None:
        sizes = {"hidden_size": model.hidden_size, "head_dim": model.head_dim}
    else:  # the latents are the narrow sides of the MLA linears
        sizes = {"hidden_size": model.hidden_size, "kv_lora_rank": mla.kv_lora_rank}
        if mla.q_lora_rank is not None:
            sizes["q_lora_rank"] = mla.q_lora_rank
    moe = getattr(model, "moe", None)
    if moe is None or moe.dense_ffn_hidden_size is not None:
        sizes["intermediate_size"] = model.intermediate_size
    if lora_on_experts(lora, model):  # the experts' (and the shared expert's) widths are adapted too
        sizes["moe_intermediate_size"] = moe.ffn_hidden_size
        if moe.shared_expert_size is not None:
            sizes["shared_expert_intermediate_size"] = moe.shared_expert_size
    smallest = min(sizes.values())
    if lora.rank > smallest:
        named = ", ".join(f"{name} {size}" for name, size in sizes.items())
        raise ConfigError(f"{prefix}.lora.rank={lora.rank} is larger than the model's smallest adapted dimension "
                          f"({smallest}: {named}; {model.source}): not low-rank")


def _check_mla_targets(model: Any, prefix: str, lora: LoRAConfig) -> None:
    """Multi-latent attention's linears named for a model that does not have them (GPT attention, or the other
    query form), by name."""
    key = f"{prefix}.lora.target_modules"
    named = {entry.rsplit(".", 1)[-1] for entry in _plain(lora.target_modules) or [] if not _is_pattern(entry)}
    mla = getattr(model, "mla", None)
    if mla is None:
        wrong = sorted(named & set(MLA_QKV_LINEARS))
        if wrong:
            raise ConfigError(f"{key} names {', '.join(wrong)}: multi-latent attention's linears, but "
                              f"{model.source} has GPT attention (one fused linear_qkv); name linear_qkv / "
                              f"linear_proj")
        return
    have = mla_linears(mla)
    wrong = sorted(named & set(MLA_QKV_LINEARS) - set(have))
    if wrong:
        form = "q_lora_rank is null: one linear_q_proj" if mla.q_lora_rank is None else \
            f"q_lora_rank={mla.q_lora_rank}: linear_q_down_proj + linear_q_up_proj"
        raise ConfigError(f"{key} names {', '.join(wrong)}, which {model.source} does not have ({form}); its "
                          f"attention's linears are {', '.join(have)}")


# ---------------------------------------------------------------------------- a PEFT adapter to start from (preflight)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def check_adapter_path(lora: LoRAConfig | None, prefix: str) -> None:
    """``<prefix>.lora.adapter_path``: a PEFT LoRA adapter directory whose adapter_config.json agrees with the block
    (r = rank, lora_alpha = alpha, target_modules mapping to the same Megatron linears); raises ConfigError
    naming the key, the file and the field."""
    if not lora_enabled(lora) or not lora.adapter_path:
        return
    key = f"{prefix}.lora.adapter_path"
    root = Path(str(lora.adapter_path)).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{key}={root}: {'not a directory' if root.exists() else 'does not exist'} (expected a PEFT "
                          f"adapter directory with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config_file, weights = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise ConfigError(f"{key}={root} has no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    if not weights.is_file():
        other = " (adapter_model.bin is there: only safetensors are read)" if (root / "adapter_model.bin").exists() else ""
        raise ConfigError(f"{key}={root} has no {ADAPTER_WEIGHTS}{other}")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {config_file} cannot be read as JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: {config_file} must hold a JSON object")
    where = f"{key}: {config_file}"
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ConfigError(f"{where}: peft_type={peft_type!r} is not a LoRA adapter")
    if raw.get("use_dora"):
        raise ConfigError(f"{where}: use_dora=true: DoRA adapters are not built")
    for field in ("rank_pattern", "alpha_pattern"):
        if raw.get(field):
            raise ConfigError(f"{where}: {field}={raw[field]!r}: a rank or alpha per module is not built (one "
                              f"{prefix}.lora.rank / alpha for every adapter)")
    if raw.get("bias", "none") not in ("none", None):
        raise ConfigError(f"{where}: bias={raw['bias']!r}: adapters with trained biases are not built (bias=none)")
    if raw.get("modules_to_save"):
        raise ConfigError(f"{where}: modules_to_save={raw['modules_to_save']!r}: fully trained modules beside the "
                          f"adapters are not built")
    if raw.get("layers_to_transform") is not None:
        raise ConfigError(f"{where}: layers_to_transform={raw['layers_to_transform']!r} is not read; select layers "
                          f"with {prefix}.lora.target_modules / exclude_modules patterns")
    if raw.get("r") != lora.rank:
        raise ConfigError(f"{where}: r={raw.get('r')!r} differs from {prefix}.lora.rank={lora.rank}; set the rank "
                          f"the adapter was trained with")
    alpha = float(lora.alpha) if lora.alpha is not None else DEFAULT_ALPHA
    if raw.get("lora_alpha") is None or float(raw["lora_alpha"]) != alpha:
        raise ConfigError(f"{where}: lora_alpha={raw.get('lora_alpha')!r} differs from {prefix}.lora.alpha={alpha:g}; "
                          f"set the alpha the adapter was trained with (its scale is alpha / rank)")
    try:
        theirs = {name.rsplit(".", 1)[-1] for name in hf_modules_to_megatron(raw.get("target_modules"),
                                                                             f"{where}: target_modules")}
    except ConfigError as err:
        raise ConfigError(str(err)) from None
    ours = {linear for linear in KNOWN_TARGETS
            if any(_matches(f"x.{MODULE_PATHS[linear]}", t) or linear in t for t in _plain(lora.target_modules))}
    if theirs & set(MLA_QKV_LINEARS) and "linear_qkv" in ours:  # an MLA model's: linear_qkv is its q/kv linears
        ours = (ours - {"linear_qkv"}) | (theirs & set(MLA_QKV_LINEARS))
    if theirs != ours:
        raise ConfigError(f"{where}: target_modules={raw.get('target_modules')!r} are the Megatron linears "
                          f"{sorted(theirs)}, but {prefix}.lora.target_modules gives {sorted(ours)}; set "
                          f"{prefix}.lora.target_modules to the adapter's")
