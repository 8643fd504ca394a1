"""What a run needs from the file system, checked before Ray or any worker starts (and by ``--dry-run``).

``validate(cfg)`` checks the config on its own; ``preflight(cfg)`` checks it against the world: the output
directory (no silent overwrite of a finished run), the data files (exist, are files, readable, and every
``data_source`` has a scorer), the model's ``config.json`` (readable; its heads split over TP; its positions hold
prompt + response), a LoRA adapter's files, the rollout engine (rollout.name=vllm: vLLM installed, and on CPU a
head size its attention runs), the checkpoint a resume takes. Each error is a
``ConfigError`` naming the key, the file and the values seen, so the real start and the dry run fail alike.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from megatron_rl.agent.program import load_agent_program
from megatron_rl.config import ConfigError
from megatron_rl.config.access import is_unset, megatron_section, plain
from megatron_rl.config.loggers import config_problem, logger_backends, package_problem
from megatron_rl.config.loader import checked_typed_config
from megatron_rl.config.lora import ADAPTER_WEIGHTS, check_adapter_path, check_lora_model, lora_enabled
from megatron_rl.config.distillation_schema import served_teacher
from megatron_rl.config.schema import ModelConfig, PPOTrainerConfig
from megatron_rl.data import RLDataset, load_tokenizer
from megatron_rl.models.fp8_checkpoint import check_fp8_quantization
from megatron_rl.models.hf_config import UnsupportedModelError, parse_hf_config
from megatron_rl.models.sizes import check_parallel_fit
from megatron_rl.plan.distillation import teacher_path
from megatron_rl.plan.model_facts import load_model_facts
from megatron_rl.plan.preference import validate_dpo
from megatron_rl.plan.validate import (
    check_context_parallel_model,
    context_parallel_roles,
    cp_comm_type,
    uses_critic,
    validate,
    validate_sft,
)
from megatron_rl.reward.custom import load_custom_scorer
from megatron_rl.reward.model.inputs import RewardModelInputs
from megatron_rl.reward.registry import missing_scorer_reason, registered_data_sources
from megatron_rl.rollout.engines import engine_of
from megatron_rl.trainer.checkpointing import HF_FINAL_DIR, TRAINER_STATE_FILE, TrainerCheckpointer
from megatron_rl.trainer.loop import TrainerState, optimizers
from megatron_rl.trainer.run_identity import check_resume, resume_checkpoint
from megatron_rl.trainer.validation import check_validation_settings

logger = logging.getLogger(__name__)

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def check_start(cfg: DictConfig | PPOTrainerConfig):
    """THE check of a start, run alike by ``--dry-run`` and a real start before anything starts (train.py):
    ``validate`` (the config) and ``preflight`` (the config against the world), both on the typed tree (a
    DictConfig converted here, once). Returns the derived sizes."""
    cfg = checked_typed_config(cfg)
    sizes = validate(cfg)
    preflight(cfg)
    return sizes


def check_sft_start(cfg: DictConfig | PPOTrainerConfig):
    """An SFT start's check (``python -m megatron_rl.sft``, with or without ``--dry-run``): ``validate_sft`` and the
    file-system checks that apply to SFT (output directory, loggers, model, LoRA files, the resumed checkpoint);
    the rows are checked where the datasets are built (trainer/sft.py ``sft_dataset``). Returns the sizes."""
    cfg = checked_typed_config(cfg)
    sizes = validate_sft(cfg)
    check_output_dir(cfg)
    check_loggers(cfg)
    check_model(cfg)
    check_lora_files(cfg)
    check_resume_state(cfg)
    return sizes


def check_dpo_start(cfg: DictConfig | PPOTrainerConfig):
    """A DPO start's check (``python -m megatron_rl.dpo``): ``validate_dpo`` (the SFT keys, counting a pair as two
    rows, and the ``dpo:`` section's) and ``check_sft_start``'s file-system checks; the rows are checked where the
    datasets are built (trainer/dpo.py). The sizes."""
    cfg = checked_typed_config(cfg)
    sizes = validate_dpo(cfg)
    for check in (check_output_dir, check_loggers, check_model, check_lora_files, check_resume_state):
        check(cfg)
    return sizes


def preflight(cfg: PPOTrainerConfig) -> None:
    """Every file-system check of a start; raises ConfigError on the first problem."""
    check_output_dir(cfg)
    check_loggers(cfg)
    check_rollout_engine(cfg)
    rows = check_data(cfg)
    check_model(cfg)
    check_teacher(cfg)
    check_sequence_positions(cfg)
    check_lora_files(cfg)
    check_reward_model_inputs(cfg)
    check_agent_program(cfg)
    usable = check_training_prompts(cfg)
    check_schedule(cfg, rows if usable is None else usable)

    check_resume(cfg, usable)  # the checkpoint a resume takes: the same model, tokenizer and data-loader settings
    check_resume_state(cfg)


def check_loggers(cfg: PPOTrainerConfig) -> None:
    """trainer.logger: known backends (verl's values that do not run here are refused with what to use) whose
    packages import here (else refused only when logging starts), and the validation settings. (The planner CLI,
    which cannot know the launch machine, warns about a missing package instead: plan/cli.py.)"""
    import os

    problem = config_problem(cfg.trainer.logger)
    if problem is not None:
        raise ConfigError(problem)
    check_validation_settings(cfg)
    if "file" in logger_backends(cfg.trainer.logger):
        ignored = [v for v in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT") if os.environ.get(v)]
        if ignored:
            logger.warning("trainer.logger 'file' writes %s/metrics.jsonl here; %s is not read",
                           cfg.trainer.default_local_dir, " and ".join(ignored))
    missing = package_problem(cfg.trainer.logger)
    if missing is not None:
        raise ConfigError(missing)


# ---------------------------------------------------------------------------- the output directory
def _results_in(root: Path) -> list[str]:
    found = []
    metrics = root / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        with metrics.open("rb") as f:
            lines = sum(1 for line in f if line.strip())
        found.append(f"metrics.jsonl ({lines} records)")
    if (root / HF_FINAL_DIR).is_dir():
        found.append(f"{HF_FINAL_DIR}/ (a final HF checkpoint)")
    if any(_has_scalars(p) for p in (root / "tensorboard").glob("events.out.tfevents.*")):
        found.append("tensorboard/ events")
    return found


def _has_scalars(path: Path) -> bool:
    """An event file holding at least one logged value; a file with only TensorBoard's header (what a run that
    failed before its first step leaves) is not a result. Records: u64 length, u32 crc, data, u32 crc."""
    import struct

    from tensorboard.compat.proto.event_pb2 import Event

    try:
        with path.open("rb") as f:
            while len(head := f.read(12)) == 12:
                (length,) = struct.unpack("<Q", head[:8])
                data = f.read(length)
                f.read(4)
                if len(data) < length:
                    return True  # torn: a run wrote here; count it
                event = Event()
                event.ParseFromString(data)
                if event.HasField("summary") and len(event.summary.value):
                    return True
    except Exception:  # noqa: BLE001 - unreadable or not TensorBoard's: count it, as before
        return True
    return False


def check_output_dir(cfg: PPOTrainerConfig) -> None:
    """Refuse to start from step 0 in a directory holding a run's results, unless trainer.overwrite=true.

    Resuming (an intact checkpoint under resume_mode=auto, or resume_mode=resume_path) keeps the results."""
    trainer = cfg.trainer
    root = Path(trainer.default_local_dir)
    if trainer.overwrite or not root.is_dir():
        return
    results = _results_in(root)
    if not results or trainer.resume_mode == "resume_path":
        return
    if trainer.resume_mode == "auto":
        intact, skipped = TrainerCheckpointer(root, max(1, trainer.max_ckpt_to_keep)).newest_intact()
        if intact is not None:
            return
        why = "it has no intact checkpoint to resume from"
        if skipped:
            why += " (" + "; ".join(f"{p.name}: {reason}" for p, reason in skipped) + ")"
    else:
        why = f"trainer.resume_mode={trainer.resume_mode} starts from step 0"
    raise ConfigError(
        f"trainer.default_local_dir={root} already holds the results of a run: {', '.join(results)}; {why}, so "
        f"starting would overwrite them. Choose a new trainer.default_local_dir, or set trainer.overwrite=true "
        f"to replace them")


# ---------------------------------------------------------------------------- data files
def _check_file(key: str, path: Path) -> None:
    if not path.exists():
        raise ConfigError(f"{key}: {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"{key}: {path} is a directory, expected a .parquet or .jsonl file")
    if not path.is_file():
        raise ConfigError(f"{key}: {path} is not a regular file, expected a .parquet or .jsonl file")
    if path.suffix.lower() not in DATA_SUFFIXES:
        raise ConfigError(f"{key}: {path} has suffix {path.suffix!r}; expected .parquet or .jsonl")
    try:
        with path.open("rb"):
            pass
    except OSError as err:
        raise ConfigError(f"{key}: {path} cannot be read: {err.strerror or err}") from err


def _data_sources(key: str, path: Path) -> list[Any]:
    """The data_source of every row (None where a row has none or cannot be parsed: the dataset reports those)."""
    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            names = pq.read_schema(path).names
            if "data_source" not in names:
                return []
            return pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist()
        sources = []
        with path.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    sources.append(None)
                    continue
                sources.append(row.get("data_source") if isinstance(row, dict) else None)
        return sources
    except (OSError, ValueError, UnicodeDecodeError) as err:  # pyarrow's errors are ValueError / OSError
        raise ConfigError(f"{key}: {path} cannot be read as {path.suffix.lstrip('.')}: {err}") from err


def check_data(cfg: PPOTrainerConfig) -> int:
    """Every train and val file exists, is a readable data file, and every data_source has a scorer (unless
    reward.custom_reward_function.path scores them all). Returns the number of training rows."""
    custom = cfg.reward.custom_reward_function.path
    if custom:
        _check_custom_reward(Path(custom), cfg.reward.custom_reward_function.name)

    registered = registered_data_sources()
    train_rows = 0
    for files in ("train_files", "val_files"):
        if is_unset(cfg.data, files) or getattr(cfg.data, files) is None:
            continue
        key = f"data.{files}"
        for name in getattr(cfg.data, files):
            path = Path(name).expanduser()
            _check_file(key, path)
            sources = _data_sources(key, path)
            if key == "data.train_files":
                train_rows += len(sources)
            if custom:
                continue
            unknown = Counter(s for s in sources if isinstance(s, str) and s and missing_scorer_reason(s))
            if unknown:
                counts = ", ".join(f"{s!r}: {c} row{'s' if c > 1 else ''} ({missing_scorer_reason(s)})"
                                   for s, c in unknown.most_common())
                raise ConfigError(
                    f"{key}: {path} has rows whose data_source has no scorer ({counts}); registered: {registered}. "
                    f"Register one with megatron_rl.reward.register_scorer, or score every row with "
                    f"reward.custom_reward_function.path")
    if not is_unset(cfg.data, "train_files") and not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: nothing to train on")
    return train_rows


def _check_custom_reward(path: Path, name: str | None = None) -> None:
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"reward.custom_reward_function.path: {path} {what}, expected a Python file")

    try:  # the file imports and defines the function (what the reward manager does when the run starts)
        load_custom_scorer(str(path), name or "compute_score")
    except (ImportError, AttributeError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None


# ---------------------------------------------------------------------------- the model
def _config_json(key: str, model: ModelConfig) -> dict[str, Any] | None:
    if is_unset(model, "path"):
        return None
    directory = Path(model.path).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"{key}.path: {directory} is not a directory (expected an HF model directory "
                          f"with config.json)")
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"{key}.path: {directory} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); the model cannot be built from it") from err
    except OSError as err:
        raise ConfigError(f"{path} cannot be read: {err.strerror or err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return {**raw, **plain(model.override_config)}


def check_context_parallel_models(cfg: PPOTrainerConfig, model) -> None:
    """CP > 1 against the model (issue 35): an MoE model, a2a's head counts, a sliding window with p2p are
    refused here as the dry run's plan refuses them (the model build would, after Ray started). ``model``:
    the actor's facts, which the reference shares; the critic's own config.json when it has one."""
    for role in context_parallel_roles(cfg, uses_critic(cfg)):
        mcfg = megatron_section(cfg, role)
        if mcfg.context_parallel_size == 1 or role == "reward_model":
            continue
        facts = model
        if role == "critic" and not is_unset(cfg.critic.model, "path") and \
                cfg.critic.model.path != cfg.actor_rollout_ref.model.path:
            if _config_json("critic.model", cfg.critic.model) is None:
                continue
            facts = load_model_facts(cfg, "critic.model")
        check_context_parallel_model(facts, role, mcfg.context_parallel_size, mcfg.tensor_model_parallel_size,
                                     cp_comm_type(mcfg), te_attention=str(cfg.trainer.device) != "cpu")


def check_model_overrides(cfg: PPOTrainerConfig, model: Any) -> None:
    """``<role>.megatron.override_transformer_config`` fields config.json decides (moe_router_enable_expert_bias,
    num_layers, ...) repeat the model's value, as the builder checks them (models/builder.py check_model_fields);
    refused here on a real start, where only the workers' model build saw them (the dry run's plan did)."""
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        overrides = plain(megatron_section(cfg, role).override_transformer_config) or {}
        if not overrides:
            continue
        from megatron_rl.controller.deferred_compile import deferred_compile  # only when overridden: see below

        with deferred_compile():  # the builder imports Megatron-Core, which only a config with overrides pays for
            from megatron_rl.models.builder import check_model_fields, model_fields  # Megatron-Core: as above
        try:
            check_model_fields(model_fields(model), overrides, model.source,
                               f"{role}.megatron.override_transformer_config")
        except ValueError as err:
            raise ConfigError(str(err)) from None


def check_lora_models(cfg: PPOTrainerConfig, model) -> None:
    """LoRA against the model (issue 36), as the dry run's plan checks it. ``model``: the actor's facts; the
    critic's own config.json when it has one."""
    check_lora_model(model, "actor_rollout_ref.model", cfg.actor_rollout_ref.model.lora,
                     cfg.actor_rollout_ref.actor.megatron, "actor_rollout_ref.actor.megatron")
    if not uses_critic(cfg) or not lora_enabled(cfg.critic.model.lora):
        return
    facts = model
    if not is_unset(cfg.critic.model, "path") and cfg.critic.model.path != cfg.actor_rollout_ref.model.path:
        if _config_json("critic.model", cfg.critic.model) is None:
            return
        facts = load_model_facts(cfg, "critic.model")
    check_lora_model(facts, "critic.model", cfg.critic.model.lora, cfg.critic.megatron, "critic.megatron")


def check_agent_program(cfg: PPOTrainerConfig) -> None:
    """``rollout.multi_turn.agent_program`` imports and names a function, under ``multi_turn.enable``."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.agent_program:
        return
    if not multi_turn.enable:
        raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.agent_program={multi_turn.agent_program} runs only "
                          "with actor_rollout_ref.rollout.multi_turn.enable=true")
    try:
        load_agent_program(multi_turn.agent_program)
    except ValueError as err:
        raise ConfigError(f"actor_rollout_ref.{err}") from None


def check_vision_rollout(cfg: PPOTrainerConfig, model) -> None:
    """A vision-language model's images reach the colocated engines and the trainer; the paths that do not carry
    them yet are refused by key before anything starts (docs/rollout.md, "Images")."""
    if model.vision is None:
        return
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.multi_turn.enable:
        raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.enable=true: the agent loop does not carry the images "
                          f"of a vision-language model ({model.architecture}) yet")
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref"):  # the engine's own rule, before launch
        if megatron_section(cfg, role).share_prompts:
            raise ConfigError(f"{role}.megatron.share_prompts: a vision-language model ({model.architecture}) runs "
                              "padded micro-batches: shared prompts do not carry its mRoPE positions and images")
    if rollout.mode == "server" and not engine_of(rollout).servers_take_images:
        raise ConfigError(f"actor_rollout_ref.rollout.mode=server with rollout.name={rollout.name}: its servers do not "
                          f"take images; a vision-language model ({model.architecture}) runs colocated")


def check_teacher(cfg: PPOTrainerConfig) -> None:
    """On-policy distillation's teacher (plan/distillation.py): its config.json, the student's vocabulary (the loss
    compares the two distributions token by token: a teacher with another tokenizer is refused, its tokenizer's
    vocabulary compared when it ships one), heads the actor's TP splits (the teacher runs at that layout)."""
    if not cfg.distillation.enabled or is_unset(cfg.actor_rollout_ref.model, "path"):
        return
    path = teacher_path(cfg)
    key = next(f"distillation.teacher_models.{name}.model_path"
               for name, t in cfg.distillation.teacher_models.items() if t.model_path)
    teacher = _config_json(key.removesuffix(".model_path"), ModelConfig(path=path))
    student = _config_json("actor_rollout_ref.model", cfg.actor_rollout_ref.model)
    try:
        facts = parse_hf_config(teacher, source=str(Path(path) / "config.json"))
    except (UnsupportedModelError, ValueError) as err:
        raise ConfigError(f"{key}: {err}") from None
    if facts.vocab_size != student["vocab_size"]:
        raise ConfigError(f"{key}={path}: the teacher's vocabulary ({facts.vocab_size} tokens) is not the student's "
                          f"({student['vocab_size']}, actor_rollout_ref.model.path): distillation needs one tokenizer")
    if any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        ours = load_tokenizer(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path).get_vocab()
        if load_tokenizer(path).get_vocab() != ours:
            raise ConfigError(f"{key}={path}: the teacher's tokenizer is not the student's (data.tokenizer or "
                              "actor_rollout_ref.model.path): distillation needs one tokenizer")
    tp = cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size
    if served_teacher(cfg.distillation) is None and (facts.num_attention_heads % tp or facts.num_key_value_heads % tp):
        raise ConfigError(f"{key}={path}: the teacher runs at actor_rollout_ref.actor.megatron."
                          f"tensor_model_parallel_size={tp}, which does not divide its num_attention_heads="
                          f"{facts.num_attention_heads} and num_key_value_heads={facts.num_key_value_heads}")


def check_lora_files(cfg: PPOTrainerConfig) -> None:
    """``<model>.lora.adapter_path``: a PEFT adapter directory whose adapter_config.json agrees with the LoRA block
    (config/lora.py check_adapter_path) and whose weights parse and are finite (check_adapter_weights), for the actor
    and a running critic."""
    models = {"actor_rollout_ref.model": cfg.actor_rollout_ref.model}
    if uses_critic(cfg):
        models["critic.model"] = cfg.critic.model
    for prefix, model in models.items():
        lora = model.lora
        check_adapter_path(lora, prefix)
        if lora_enabled(lora) and lora.adapter_path:
            check_adapter_weights(f"{prefix}.lora.adapter_path", Path(str(lora.adapter_path)).expanduser())


def check_adapter_weights(key: str, directory: Path) -> None:
    """adapter_model.safetensors parses (header and data: a corrupt or truncated file) and holds only finite
    values; refused naming the file and the tensor, where the workers would fail later with safetensors' own error
    (no file named) or train from NaN factors. Adapters are small (MBs): reading every tensor here is cheap."""
    from safetensors import SafetensorError, safe_open

    weights = directory / ADAPTER_WEIGHTS
    non_finite: list[tuple[str, int, int]] = []
    try:
        with safe_open(str(weights), framework="pt") as file:
            for name in file.keys():
                tensor = file.get_tensor(name)
                if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
                    non_finite.append((name, int((~tensor.isfinite()).sum()), tensor.numel()))
    except (SafetensorError, OSError, ValueError) as err:  # safetensors: SafetensorError, or ValueError on bad data
        raise ConfigError(f"{key}: {weights} cannot be read as safetensors (corrupt or truncated?): "
                          f"{type(err).__name__}: {err}") from None
    if non_finite:
        name, bad, total = non_finite[0]
        raise ConfigError(f"{key}: {weights}: tensor {name!r} holds {bad} non-finite values (NaN or inf) of {total}"
                          f"{f' ({len(non_finite)} tensors in all)' if len(non_finite) > 1 else ''}: the adapter "
                          f"would train from them")


def _check_actor_split(cfg: PPOTrainerConfig, model: Any) -> None:
    """The actor's TP/PP/VPP/EP/ETP and its pipeline stages' layers (an uneven split's too) against config.json, as
    the model builder checks them (models/sizes.py check_parallel_fit): a real start on CPU refused them only in the
    workers' init_model (the dry run's plan refused them)."""
    mcfg = cfg.actor_rollout_ref.actor.megatron
    overrides = mcfg.override_transformer_config or {}
    try:
        check_parallel_fit(model, mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size,
                           mcfg.virtual_pipeline_model_parallel_size, ep=mcfg.expert_model_parallel_size,
                           etp=mcfg.expert_tensor_parallel_size,
                           first=overrides.get("num_layers_in_first_pipeline_stage"),
                           last=overrides.get("num_layers_in_last_pipeline_stage"))
    except ValueError as err:
        raise ConfigError(f"actor_rollout_ref.actor.megatron (TP={mcfg.tensor_model_parallel_size}, "
                          f"PP={mcfg.pipeline_model_parallel_size}, EP={mcfg.expert_model_parallel_size}) does not "
                          f"factor this model: {err}") from None


def check_model(cfg: PPOTrainerConfig) -> None:
    """config.json is readable, and the actor's and the rollout's TP split its heads and KV heads."""
    raw = _config_json("actor_rollout_ref.model", cfg.actor_rollout_ref.model)
    if raw is None:
        return
    source = Path(cfg.actor_rollout_ref.model.path) / "config.json"

    model = load_model_facts(cfg)  # an architecture the model builders do not know: refused here, as the dry run's plan does
    check_quantization(raw, source, cfg.actor_rollout_ref.rollout)
    check_context_parallel_models(cfg, model)
    check_lora_models(cfg, model)
    check_vision_rollout(cfg, model)
    check_model_overrides(cfg, model)
    # the language model's (a vision-language config.json holds them in text_config)
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    if not isinstance(heads, int) or heads < 1:
        raise ConfigError(f"{source}: num_attention_heads={heads!r} must be a positive integer")
    actor_tp = cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size
    for key, tp in (("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", actor_tp),):
        if heads % tp or kv_heads % tp:
            raise ConfigError(f"{key}={tp} does not divide the model's num_attention_heads={heads} and "
                              f"num_key_value_heads={kv_heads} ({source}); Megatron splits both over TP")
    _check_actor_split(cfg, model)
    rollout_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if heads % rollout_tp or (kv_heads % rollout_tp and rollout_tp % kv_heads):
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} does not factor the "
                          f"model: num_attention_heads={heads} must split over it and num_key_value_heads="
                          f"{kv_heads} must split over it or be replicated ({source})")


def check_quantization(raw: dict[str, Any], source: Path, rollout: Any = None) -> None:
    """config.json's quantization_config: absent, or FP8 block-scaled (dequantised on load); else refused by
    ``quantization_config.<field>`` (models/fp8_checkpoint.py). With it, an engine that builds quantised layers
    from config.json (``rollout``'s; EngineSpec.builds_quantized_layers) is refused: it would take the trainer's
    dequantised weights into FP8 layers."""
    try:
        block = check_fp8_quantization(raw, str(source))
    except UnsupportedModelError as err:
        raise ConfigError(str(err)) from err
    if block is not None and rollout is not None and engine_of(rollout).builds_quantized_layers:
        raise ConfigError(f"actor_rollout_ref.rollout.name={engine_of(rollout).name} with an FP8 checkpoint "
                          f"({source}: quantization_config): the engine builds FP8 layers from it, while the trainer "
                          "dequantises the weights on load and syncs them unquantised; not built here. Use the HF "
                          "engine (rollout.name=hf), or a dequantised copy of the checkpoint without "
                          "quantization_config (megatron-rl's HF exports are such copies)")


def _model_positions(raw: dict[str, Any], source: str) -> tuple[int, str] | None:
    """(positions the model encodes, how they follow from config.json), as vLLM derives its max_model_len:
    max_position_embeddings, times the factor of a linear RoPE scaling; llama3 (and YaRN) configs hold the
    extended length already (vllm/config/model.py _get_and_verify_max_len, lines 2579-2616). None: no such key
    (check_model names a broken config)."""
    if not isinstance(raw.get("max_position_embeddings"), int):
        return None
    try:
        facts = parse_hf_config(raw, source)
    except (UnsupportedModelError, KeyError, TypeError, ValueError):
        return None
    base = facts.max_position_embeddings
    scaling = facts.rope_scaling
    if scaling is not None and scaling.kind == "linear":
        return int(base * scaling.factor), f"max_position_embeddings={base} x linear rope factor {scaling.factor:g}"
    return base, f"max_position_embeddings={base}"


def check_sequence_positions(cfg: PPOTrainerConfig) -> None:
    """The longest sequence a rollout makes (data.max_prompt_length + the response length) fits the positions of
    the actor's (and a critic's own) model, for every engine: vLLM refuses a longer max_model_len only once it
    starts, the HF engine and Megatron run past the trained positions without a word."""
    rollout = cfg.actor_rollout_ref.rollout
    response_key = ("actor_rollout_ref.rollout.response_length" if rollout.response_length is not None
                    else "data.max_response_length")
    response = rollout.response_length if rollout.response_length is not None else cfg.data.max_response_length
    longest = cfg.data.max_prompt_length + response
    models = [("actor_rollout_ref.model", cfg.actor_rollout_ref.model)]
    if uses_critic(cfg) and not is_unset(cfg.critic.model, "path") and \
            cfg.critic.model.path != cfg.actor_rollout_ref.model.path:
        models.append(("critic.model", cfg.critic.model))
    for key, model in models:
        raw = _config_json(key, model)
        if raw is None:
            continue
        source = Path(model.path) / "config.json"
        positions = _model_positions(raw, str(source))
        if positions is None or longest <= positions[0]:
            continue
        limit, how = positions
        raise ConfigError(
            f"data.max_prompt_length={cfg.data.max_prompt_length} + {response_key}={response} = {longest} tokens is "
            f"longer than the {limit} positions of {key}.path={model.path} ({how}; {source}, with "
            f"{key}.override_config applied; rollout.name={rollout.name}): positions past it were never trained. "
            f"Lower data.max_prompt_length or {response_key}, or set {key}.override_config.max_position_embeddings "
            f"if the model extrapolates")


# ---------------------------------------------------------------------------- the rollout engine
def check_rollout_engine(cfg: PPOTrainerConfig) -> None:
    """What the engine of rollout.name needs of the machine that starts the run (EngineSpec.check_here; vLLM: its
    pinned version installed, servers given by URL on this host, a head size its CPU attention runs), refused here
    rather than when the engine is built, after Ray and the trainer's model are up."""
    engine_of(cfg.actor_rollout_ref.rollout).check_here(
        cfg, lambda: _config_json("actor_rollout_ref.model", cfg.actor_rollout_ref.model))


# ---------------------------------------------------------------------------- the prompts the run trains on
def check_reward_model_inputs(cfg: PPOTrainerConfig) -> None:
    """A reward model that re-tokenizes (``reward_model.model.input_tokenizer``) reads its own tokenizer's chat
    template: the runner's rule (reward/model/inputs.py ``RewardModelInputs``), here before Ray starts, with the
    tokenizers it loads."""
    rm = cfg.reward_model
    if not rm.enable or rm.judge.enable or not rm.model.input_tokenizer or is_unset(rm.model, "path"):
        return
    try:
        RewardModelInputs(load_tokenizer(rm.model.path), load_tokenizer(rm.model.input_tokenizer), rm.max_length)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    except OSError as err:  # a tokenizer that does not load
        raise ConfigError(f"reward_model.model: a tokenizer cannot be loaded ({err})") from None


def check_training_prompts(cfg: PPOTrainerConfig) -> int | None:
    """Build the training dataset as the run does (tokenizer, chat template, overlong and malformed rows) and
    refuse data that gives no batch, and the validation set as the runner builds it; returns the usable training
    prompts (None when there is nothing to build them from)."""
    data = cfg.data
    model = cfg.actor_rollout_ref.model
    if is_unset(data, "train_files") or not data.train_files:
        return None
    tokenizer_path = data.tokenizer or (None if is_unset(model, "path") else model.path)
    if not tokenizer_path:
        return None

    try:
        tokenizer = load_tokenizer(tokenizer_path, data.trust_remote_code)
    except Exception as err:  # noqa: BLE001 - transformers raises OSError / ValueError / others
        key = "data.tokenizer" if data.tokenizer else "actor_rollout_ref.model.path"
        raise ConfigError(f"{key}={tokenizer_path}: the tokenizer cannot be loaded ({type(err).__name__}: "
                          f"{err})") from None
    try:
        dataset = RLDataset.from_config(list(data.train_files), tokenizer, data)
    except ValueError as err:  # no usable prompts, a malformed row under on_malformed_row=error, an overlong one
        raise ConfigError(f"data.train_files: {err}") from None
    check_video_engine(cfg, dataset, "data.train_files")
    if len(dataset) < data.train_batch_size:
        raise ConfigError(f"data.train_files give {len(dataset)} usable prompts (after data.max_prompt_length="
                          f"{data.max_prompt_length} and data.on_malformed_row), fewer than data.train_batch_size="
                          f"{data.train_batch_size}: not one training batch (the loader drops an incomplete one). "
                          f"Lower data.train_batch_size or add prompts")
    if data.val_files:  # as the runner builds the validation set (trainer/runner.py _val_batches), after Ray
        try:
            val = RLDataset.from_config(list(data.val_files), tokenizer, data)
        except ValueError as err:  # an overlong prompt under truncation=error, a malformed row, no usable prompt
            raise ConfigError(f"data.val_files: {err}") from None
        check_video_engine(cfg, val, "data.val_files")
    return len(dataset)


def check_video_engine(cfg: PPOTrainerConfig, dataset: RLDataset, files_key: str) -> None:
    """Prompts with videos need an engine that takes them (the HF engine); refused naming the data and the engine."""
    rollout = cfg.actor_rollout_ref.rollout
    if dataset.has_videos and not engine_of(rollout).takes_videos:
        raise ConfigError(f"{files_key} have videos (column data.video_key={cfg.data.video_key}) but "
                          f"actor_rollout_ref.rollout.name={rollout.name} does not take videos here; only the HF "
                          "engine does (rollout.name=hf; docs/rollout.md, Videos)")


# ---------------------------------------------------------------------------- the checkpoint a resume takes
def check_resume_state(cfg: PPOTrainerConfig) -> None:
    """The trainer_state.json of the checkpoint this start resumes has the keys the loop reads (TrainerState
    .from_saved, which the resume itself calls), refused here naming the file and key rather than after start-up."""
    path = resume_checkpoint(cfg)
    if path is None or not (path / TRAINER_STATE_FILE).is_file():
        return  # the loop refuses a checkpoint without one, naming it
    source = path / TRAINER_STATE_FILE
    try:
        saved = json.loads(source.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"resuming {path}: {source} cannot be read as JSON ({err})") from None
    try:
        TrainerState.from_saved(saved, source)
    except ValueError as err:
        raise ConfigError(f"resuming {path}: {err}") from None


# ---------------------------------------------------------------------------- the schedule
def check_schedule(cfg: PPOTrainerConfig, train_rows: int) -> None:
    """Warm-up against the training length when that comes from the data (validate checks the explicit one)."""
    if cfg.trainer.total_training_steps is not None or train_rows == 0:
        return
    steps = train_rows // cfg.data.train_batch_size * cfg.trainer.total_epochs  # before overlong-prompt filtering
    if steps == 0:
        raise ConfigError(f"data.train_files hold {train_rows} rows, fewer than data.train_batch_size="
                          f"{cfg.data.train_batch_size}: not one training step")
    for role, optim in optimizers(cfg).items():
        warmup = optim.lr_warmup_steps
        if warmup > steps and (role != "critic" or uses_critic(cfg)):
            raise ConfigError(f"{role}.optim.lr_warmup_steps={warmup} is longer than the at most {steps} training "
                              f"steps the data gives ({train_rows} rows / data.train_batch_size x "
                              f"trainer.total_epochs)")
