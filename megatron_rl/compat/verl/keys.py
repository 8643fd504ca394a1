"""The fate of every verl key on megatron-rl: one table (``RULES``) that both the compat entry
(``trainer/main_ppo.py``) and the documentation (``key_table.py`` -> docs/configuration.md) read, so they cannot
drift apart.

A key of verl's ``ppo_megatron_trainer`` config (``verl_ppo_megatron_trainer.yaml``, pinned) or of its example
scripts is, in this order:

- ``mapped``: a rule rewrites it onto megatron-rl's key(s) that do the same (the entry logs each rewrite);
- ``dropped``: accepted and without effect, because verl does nothing with it on this path either, or megatron-rl
  always does what it asks (logged, with the reason);
- ``default``: megatron-rl has no such setting and behaves as verl does at the key's default: verl's default
  value (and the rule's extra ``accepts``) pass (logged), any other value is refused, naming what to use instead;
- ``refused``: never accepted, with the reason;
- ``same``: no rule, and megatron-rl's schema has the key under verl's name: honoured as it is.

A key neither verl nor megatron-rl has is left to megatron-rl's own checks, which name the nearest keys.
"""

from __future__ import annotations

import enum
import fnmatch
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.schema import DataConfig

VERL_CONFIG = Path(__file__).with_name("verl_ppo_megatron_trainer.yaml")
_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
_NCCL_TIMEOUT_KEYS = ("actor_rollout_ref.nccl_timeout", "critic.nccl_timeout")


class Fate(enum.StrEnum):
    same = "same"
    mapped = "mapped"
    dropped = "dropped"
    default = "default"
    refused = "refused"


# A rewrite sees the key, its value and every key=value of the command line (bare keys), for the settings that
# depend on another key (grad_offload on param_offload, prompt_length on data.max_prompt_length, ...).
Rewrite = Callable[[str, str, Mapping[str, str]], list[str]]


@dataclass(frozen=True)
class Rule:
    pattern: str  # a dotted key, or an fnmatch pattern ('*' spans dots)
    fate: Fate
    why: str  # the log line, the refusal and the table say this
    rewrite: Rewrite | None = None  # mapped
    accepts: tuple[str, ...] = ()  # default: values accepted besides verl's default


# bare, truthy, is_null, refuse and ABSENT are shared with the async entries' table (experimental/async_keys.py)
# and compat/verl/defaults.py.
def bare(value: str) -> str:
    return value.strip().strip("'\"")


def truthy(value: str) -> bool:
    return bare(value).lower() in ("true", "1", "yes")


def is_null(value: str) -> bool:
    return bare(value).lower() in ("null", "none", "~", "")


def _dist_checkpointing_path(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl's path of a Megatron checkpoint to start from: nothing when use_dist_checkpointing is off (verl's
    scripts set the path either way), refused when it is on."""
    switch = key.rsplit(".", 1)[0] + ".use_dist_checkpointing"
    if truthy(seen.get(switch, "False")):
        raise ValueError(f"with {switch}=True verl starts from that Megatron checkpoint; megatron-rl starts from the "
                         "HF checkpoint in model.path and resumes its own torch_dist checkpoints (docs/trainer.md)")
    return []


def _trust_remote_code(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    return ["data.trust_remote_code=true"] if truthy(value) else []


def _lr_warmup_steps(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if not is_null(value) and int(bare(value)) >= 0:
        return [f"{key}={bare(value)}"]
    ratio = float(bare(seen.get(key + "_ratio", "0.0")))
    if ratio:
        raise ValueError(f"verl would warm up for {key}_ratio={ratio} of the steps; give {key} as a number of steps")
    return [f"{key}=0"]


def _min_lr(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl's absolute floor of the decayed learning rate as ours, a ratio of optim.lr (the given lr, else verl's)."""
    prefix = key.rsplit(".", 1)[0]
    lr = float(bare(seen.get(f"{prefix}.lr", str(verl_default(f"{prefix}.lr")))))
    floor = float(bare(value))
    if not 0.0 <= floor <= lr:
        raise ValueError(f"min_lr={floor:g} must lie in [0, {prefix}.lr={lr:g}]")
    if f"{prefix}.min_lr_ratio" in seen:
        raise ValueError(f"set one of {prefix}.min_lr and {prefix}.min_lr_ratio (megatron-rl keeps the ratio)")
    return [f"{prefix}.min_lr_ratio={floor / lr if lr else 0.0!r}"]


def _lora_key(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """<model>.lora.*: as given while LoRA is on, but fully_sharded_loras; nothing when it is off (rank 0)."""
    prefix, leaf = key.rsplit(".", 1)
    if leaf == "fully_sharded_loras" or int(bare(seen.get(f"{prefix}.rank", "0")) or 0) == 0:
        return []
    return [f"{key}={value}"]


_RM_ON_MEGATRON = ("the reward model runs on Megatron here, in the trainer's processes (reward_model.megatron.*), "
                   "not in a rollout engine")
_RM_ROLLOUT = "reward.reward_model.rollout"


def _rm_layout(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    return [f"reward_model.megatron.{name}=${{actor_rollout_ref.actor.megatron.{name}}}"
            for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                         "packed_sequences")]


def _rm_max_length(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl's RM engine lengths -> the rows the Megatron RM reads: prompt + response (verl's defaults fill the other)."""
    lengths = [int(bare(seen.get(f"{_RM_ROLLOUT}.{name}", str(verl_default(f"{_RM_ROLLOUT}.{name}")))))
               for name in ("prompt_length", "response_length")]
    return [f"reward_model.max_length={sum(lengths)}"]


_NO_PROFILER = "no built-in profiler hooks here; run the workers under nsys or torch.profiler"


def _profiler(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl's profiler settings: nothing while no role's profiler is enabled (verl's test scripts set ranks, tool
    and steps with enable=False); refused when one is."""
    enabled = sorted(k for k, v in seen.items() if k.endswith(".profiler.enable") and truthy(v))
    if enabled:
        raise ValueError(f"{_NO_PROFILER} ({', '.join(f'{k}=True' for k in enabled)})")
    return []


_SAVE_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def _save_contents(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl's list of what a checkpoint holds: ours holds model, optimizer and extra whatever the list says (a
    resume needs them); hf_model asks for HF weights, which the run exports once, at the end."""
    items = [bare(item) for item in bare(value).strip("[]").split(",") if bare(item)]
    unknown = [item for item in items if item not in _SAVE_CONTENTS]
    if unknown:
        raise ValueError(f"{', '.join(unknown)} unknown; verl's are {', '.join(_SAVE_CONTENTS)}")
    return ["trainer.save_hf_at_end=true"] if "hf_model" in items else []


def _to(target: str) -> Rewrite:
    return lambda key, value, seen: [f"{target}={value}"]


def _under(prefix: str, target: str) -> Rewrite:
    """``prefix.<rest>`` -> ``++target.<rest>`` (set or add: the target is a section whose entries verl adds with +)."""
    return lambda key, value, seen: [f"++{target}{key[len(prefix):]}={value}"]


# verl's teacher served by its own inference engine on a GPU pool of its own: ours is a frozen Megatron engine on the
# actor's ranks at the reference's layout, so these settings have nothing to set
_TEACHER_COLOCATED = ("the teacher runs as a frozen Megatron engine on the actor's ranks at the reference's layout "
                      "(docs/distillation.md), not served on a pool of its own")
_SANDBOX_WHY = ("-> reward.sandbox_fusion.*: the code sources' tests run on that SandboxFusion service (ours: "
                "python -m megatron_rl.agent.sandbox_service; docs/data_and_rewards.md, Code execution)")


def _sandbox_fusion(prefix: str) -> Rewrite:
    """verl's ``<prefix>.url|max_concurrent|memory_limit_mb`` -> ``reward.sandbox_fusion.*``; a null limit keeps ours."""
    def rewrite(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
        leaf = key[len(prefix) + 1:]
        if leaf not in ("url", "max_concurrent", "memory_limit_mb"):
            raise ValueError(f"verl's sandbox_fusion has url, max_concurrent and memory_limit_mb, not {leaf}")
        if is_null(value) and leaf != "url":
            return []
        return [f"reward.sandbox_fusion.{leaf}={value}"]

    return rewrite


def refuse(message: str) -> None:
    raise ConfigError(message)


# ---------------------------------------------------------------------------------------------- rewrites

def _rollout_mode(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    v = bare(value)
    return [f"{key}={'colocated' if v in ('async', 'sync') else v}"]


def _load_format(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    v = bare(value)
    return [f"{key}={'dummy' if v in ('dummy_dtensor', 'dummy_megatron', 'dummy_hf') else v}"]


_PACKED_UNDER_CP = ("; with context_parallel_size > 1 it stays true: CP is built on packed sequences here, which give "
                    "the same log-probs and loss as verl's padded (bshd) CP layout")


def _context_parallel(role: str, seen: Mapping[str, str]) -> int:
    """A role's CP on the command line (the ref's follows the actor's unless given)."""
    actor = seen.get("actor_rollout_ref.actor.megatron.context_parallel_size", "1")
    default = actor if role == "actor_rollout_ref.ref" else "1"
    return int(bare(seen.get(f"{role}.megatron.context_parallel_size", default)))


def _packed(*roles: str) -> Rewrite:
    def packed(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
        return [f"{role}.megatron.packed_sequences="
                f"{'true' if truthy(value) or _context_parallel(role, seen) > 1 else 'false'}" for role in roles]

    return packed


def _model_engine(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if bare(value) != "megatron":
        refuse(f"{key}={value}: megatron-rl trains with Megatron-Core only; set {key}=megatron or drop the key")
    return []


def _nccl_timeout(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl's collective timeout of a role's process groups (seconds): ray_init.collective_timeout_s, the timeout
    of every worker's process groups here (controller/deadlines.py). The actor's and the critic's keys share it:
    the longer one wins."""
    if "ray_init.collective_timeout_s" in seen:
        refuse(f"{key}={value} and ray_init.collective_timeout_s={seen['ray_init.collective_timeout_s']} both set "
                "the workers' collective timeout; keep ray_init.collective_timeout_s and drop the verl key")
    seconds = [_seconds(k, seen[k]) for k in _NCCL_TIMEOUT_KEYS if k in seen] or [_seconds(key, value)]
    return [f"ray_init.collective_timeout_s={max(seconds)}"]


def _seconds(key: str, value: str) -> float:
    try:
        seconds = float(bare(value))
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        refuse(f"{key}={value}: a timeout is a positive number of seconds")
    return seconds


def _py_executable(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if not is_null(value):
        refuse(f"{key}={value}: megatron-rl's Ray workers run the driver's Python; launch the command inside that "
                "environment (e.g. `uv run ... python3 -m megatron_rl.compat.verl.trainer.main_ppo ...`) and drop the "
                "key, or set it to null")
    return []


def _policy_loss(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    name = key[len("actor_rollout_ref.actor.policy_loss."):]
    return [f"actor_rollout_ref.actor.{'policy_loss' if name == 'loss_mode' else name}={value}"]


def _files(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl takes one path or a list; megatron-rl's data.*_files is always a list."""
    v = value.strip()
    return [f"{key}={v}" if v.startswith("[") else f"{key}=['{bare(v)}']"]


def _logger(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """verl's scripts also write one sink bare (trainer.logger=console); megatron-rl's key is a list."""
    v = value.strip()
    return [f"{key}={v}" if v.startswith("[") else f"{key}=[{bare(v)}]"]


def _grad_offload(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """Here ``param_offload`` moves a role's weights and its gradient buffers together (workers/offload.py)."""
    role = key[: -len(".megatron.grad_offload")]
    if truthy(value) and not truthy(seen.get(f"{role}.megatron.param_offload", "false")):
        refuse(f"{key}=True without {role}.megatron.param_offload=True: megatron-rl offloads the gradient buffers "
                f"together with the weights; set {role}.megatron.param_offload=True (or grad_offload=False)")
    return []


def _rollout_expert_parallel(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    """As verl's servers: vLLM's ``enable_expert_parallel`` (its EP then spans the engine's TP x DP ranks), SGLang's
    ``ep_size`` (verl/workers/rollout/sglang_rollout/async_sglang_server.py; validation checks it divides the
    engine's TP, rollout/sglang/server_args.py). The HF engine has none."""
    ep = int(bare(value))
    if ep < 1:
        refuse(f"{key}={value} must be >= 1")
    engine = bare(seen.get("actor_rollout_ref.rollout.name", "hf"))
    if engine == "vllm":
        return [f"++actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel={'true' if ep > 1 else 'false'}"]
    if engine == "sglang" and ep > 1:
        return [f"++actor_rollout_ref.rollout.engine_kwargs.sglang.ep_size={ep}"]
    if ep > 1:
        refuse(f"{key}={value}: rollout.name={engine} has no expert parallelism here; use "
                "actor_rollout_ref.rollout.name=vllm or sglang, or expert_parallel_size=1")
    return []


def _setting(seen: Mapping[str, str], key: str, default: Any) -> str:
    return seen.get(key, str(default))


def _prompt_length(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    prompt = _setting(seen, "data.max_prompt_length", DataConfig.max_prompt_length)
    if int(bare(value)) != int(bare(prompt)):
        refuse(f"{key}={value} differs from data.max_prompt_length={prompt}: the rollout engines here take prompts "
                "of data.max_prompt_length; set that key (and drop this one)")
    return []


def _max_model_len(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if is_null(value):
        return []
    prompt = int(bare(_setting(seen, "data.max_prompt_length", DataConfig.max_prompt_length)))
    response = int(bare(seen.get("actor_rollout_ref.rollout.response_length")
                         or _setting(seen, "data.max_response_length", DataConfig.max_response_length)))
    if int(bare(value)) < prompt + response:
        refuse(f"{key}={value} is shorter than a prompt and its response ({prompt} + {response}): the engine would "
                "cut responses; megatron-rl sizes the engine's context as data.max_prompt_length + the response "
                "length, so drop the key or lower those")
    return []


def _reward_manager_source(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if bare(value) != "register":
        refuse(f"{key}={value}: megatron-rl's reward managers are its registered ones (reward.reward_manager: naive, "
                "batch, dapo, prime); a custom scorer is reward.custom_reward_function.path/name")
    return []


# ---------------------------------------------------------------------------------------------- the table

_NO_RECOMPUTE_HERE = ("verl's Megatron engine does not read it (its FSDP engine does); activation recompute is "
                      "<role>.megatron.override_transformer_config.recompute_granularity/method/num_layers, "
                      "as in verl")

RULES: tuple[Rule, ...] = (
    # --- launch and placement
    # verl's scripts name the engine at the top level and on the actor: one rule for both
    *(Rule(key, Fate.mapped, "megatron is the only engine here; others are refused", _model_engine)
      for key in ("model_engine", "actor_rollout_ref.actor.model_engine")),
    *(Rule(key, Fate.mapped, "the collective timeout (s) -> ray_init.collective_timeout_s, the timeout of the "
           "workers' process groups (the longer of the actor's and the critic's)", _nccl_timeout)
      for key in _NCCL_TIMEOUT_KEYS),
    Rule("ray_kwargs.ray_init.runtime_env.py_executable", Fate.mapped,
         "Ray workers run the driver's Python; only null fits", _py_executable),
    Rule("ray_kwargs.ray_init.num_cpus", Fate.mapped, "-> ray_init.num_cpus", _to("ray_init.num_cpus")),
    Rule("ray_kwargs.ray_init.*", Fate.default, "megatron-rl's Ray settings are ray_init.* (docs/controller.md)"),
    Rule("ray_kwargs.*", Fate.default, "megatron-rl's Ray settings are ray_init.* (docs/controller.md)"),
    Rule("trainer.critic_warmup", Fate.default, "no critic warm-up steps here: actor updates start at step 1",
         accepts=("0",)),
    # --- data
    Rule("data.train_files", Fate.mapped, "a single path becomes a one-element list", _files),
    Rule("data.val_files", Fate.mapped, "a single path becomes a one-element list", _files),
    Rule("trainer.logger", Fate.mapped, "a single sink becomes a one-element list", _logger),
    Rule("data.return_raw_chat", Fate.dropped,
         "raw prompts always travel in non_tensor_batch['raw_prompt'] here"),
    # --- model and packing
    Rule("actor_rollout_ref.model.use_remove_padding", Fate.mapped,
         f"verl's packed (THD) layout: -> <actor, ref>.megatron.packed_sequences{_PACKED_UNDER_CP}; a "
         "vision-language model (Qwen2.5-VL) runs padded micro-batches whatever it says, logged: its mRoPE positions "
         "and images ride with padded rows only",
         _packed("actor_rollout_ref.actor", "actor_rollout_ref.ref")),
    Rule("critic.model.use_remove_padding", Fate.mapped, f"-> critic.megatron.packed_sequences{_PACKED_UNDER_CP}",
         _packed("critic")),
    *(Rule(f"{role}.megatron.use_remove_padding", Fate.mapped,
           f"-> {role}.megatron.packed_sequences{_PACKED_UNDER_CP}", _packed(role)) for role in _ROLES),
    Rule("actor_rollout_ref.model.use_fused_kernels", Fate.dropped,
         "log-probs and entropies always come from megatron-rl's fused vocab-parallel kernel, the same numbers as "
         "verl's unfused path (its default, false) and its fused one"),
    Rule("*.optim.lr_decay_steps", Fate.dropped,
         "a decay schedule's length; the learning rate here follows optim.lr_scheduler over the run's steps, and "
         "verl's only style accepted here, lr_decay_style=constant, does not decay"),
    # verl sets each entry on Megatron-Core's OptimizerConfig (verl/utils/megatron/optimizer.py); so does megatron-rl
    *(Rule(f"{role}.optim.override_optimizer_config.*", Fate.mapped,
           "Megatron-Core OptimizerConfig fields, set on it as in verl (its CPU Adam: optimizer_cpu_offload, "
           "optimizer_offload_fraction, overlap_cpu_optimizer_d2h_h2d, use_precision_aware_optimizer; GPU runs) -> "
           f"++{role}.optim.override_optimizer_config.* (set or add), checked against Megatron's fields "
           "(docs/workers.md, 'CPU Adam')",
           _under(f"{role}.optim.override_optimizer_config", f"{role}.optim.override_optimizer_config"))
      for role in ("actor_rollout_ref.actor", "critic")),
    Rule("*.model.enable_gradient_checkpointing", Fate.dropped, _NO_RECOMPUTE_HERE),
    Rule("*.megatron.use_mbridge", Fate.dropped,
         "megatron-rl converts HF <-> Megatron weights with its own layout (models/layout.py); either value loads "
         "the same weights"),
    Rule("*.megatron.vanilla_mbridge", Fate.dropped, "as use_mbridge"),
    Rule("*.megatron.grad_offload", Fate.mapped,
         "gradient buffers leave the GPU with <role>.megatron.param_offload here; True needs param_offload=True",
         _grad_offload),
    *(Rule(f"{role}.model.trust_remote_code", Fate.mapped,
           "verl runs the tokenizer's shipped code with it (workers/config/model.py hf_tokenizer) -> "
           "data.trust_remote_code (logged as a warning); the model is built from config.json by megatron-rl's "
           "builders either way, so no model code runs", _trust_remote_code)
      for role in ("actor_rollout_ref", "critic")),
    Rule("*.model.lora.rank", Fate.same, ""),
    Rule("*.model.lora.*", Fate.mapped,
         "verl's LoRA block, as given while LoRA is on (fully_sharded_loras, vLLM's LoRA sharding, does nothing with "
         "merged adapters); with lora.rank=0 verl ignores its other keys: accepted without effect", _lora_key),
    # verl keeps a second router_replay block on the role itself; its engine reads the megatron one
    Rule("actor_rollout_ref.*.router_replay.*", Fate.default,
         "routing replay here is <role>.megatron.router_replay.* (docs/models.md, 'Routing replay')"),
    Rule("*.megatron.qat.*", Fate.default, "quantization-aware training is not built here"),
    Rule("*.qat.*", Fate.default, "quantization-aware training is not built here"),
    Rule("*.megatron.dist_checkpointing_path", Fate.mapped,
         "read by verl only with <role>.megatron.use_dist_checkpointing=True (a Megatron checkpoint to start from); "
         "megatron-rl loads HF checkpoints", _dist_checkpointing_path),
    Rule("*.megatron.*checkpointing*", Fate.default,
         "megatron-rl loads HF checkpoints and writes its own torch_dist checkpoints (docs/trainer.md)"),
    Rule("*.megatron.dist_ckpt_*", Fate.default, "megatron-rl writes its own torch_dist checkpoints (docs/trainer.md)"),
    Rule("*.megatron.distrib_optim_*", Fate.default,
         "megatron-rl writes its own torch_dist checkpoints (docs/trainer.md)"),
    Rule("*.checkpoint.save_contents", Fate.mapped,
         "a checkpoint here always holds the model, the optimizer and the rest of the run's state; verl's hf_model "
         "(an HF copy at every save) becomes one HF export at the end, trainer.save_hf_at_end", _save_contents),
    Rule("*.checkpoint.*", Fate.default,
         "a checkpoint here always holds the model, the optimizer and the rest of the run's state, so that a resume "
         "continues exactly; the HF export is trainer.save_hf_at_end (docs/trainer.md)"),
    Rule("*.optim.lr_warmup_steps", Fate.mapped,
         "verl's null or -1 means lr_warmup_steps_ratio x the steps; with that ratio at its default 0.0 no warm-up",
         _lr_warmup_steps),
    Rule("*.optim.min_lr", Fate.mapped, "verl's floor of the decayed learning rate -> optim.min_lr_ratio = min_lr / "
         "optim.lr", _min_lr),
    Rule("*.optim.*", Fate.default,
         "the optimizer here is Adam(W) with optim.lr, min_lr_ratio, lr_warmup_steps, lr_scheduler, weight_decay, "
         "betas and clip_grad (docs/configuration.md)"),
    Rule("*.profiler.*", Fate.mapped, f"{_NO_PROFILER}; settings of a role whose profiler.enable is false do "
         "nothing", _profiler),
    Rule("global_profiler.*", Fate.mapped, f"{_NO_PROFILER}; verl profiles only roles with profiler.enable=True",
         _profiler),
    Rule("critic.model.mtp.*", Fate.dropped, "a critic builds no multi-token-prediction layers (verl's value model "
         "does not either); the actor's are actor_rollout_ref.model.mtp"),
    # --- the policy loss: verl nests it, megatron-rl keeps its name and parameters on the actor
    Rule("actor_rollout_ref.actor.policy_loss.*", Fate.mapped,
         "loss_mode -> actor.policy_loss; <param> -> actor.<param>", _policy_loss),
    # --- rollout
    Rule("actor_rollout_ref.rollout.mode", Fate.mapped,
         "async|sync -> colocated (verl's hybrid engine places rollout the same way)", _rollout_mode),
    Rule("actor_rollout_ref.rollout.load_format", Fate.mapped,
         "verl's dummy_dtensor|dummy_megatron|dummy_hf -> dummy (random weights until the first sync)", _load_format),
    Rule("actor_rollout_ref.rollout.engine_kwargs.*", Fate.mapped,
         "-> ++actor_rollout_ref.rollout.engine_kwargs.* (set or add), checked against the engine's arguments",
         _under("actor_rollout_ref.rollout.engine_kwargs", "actor_rollout_ref.rollout.engine_kwargs")),
    Rule("actor_rollout_ref.rollout.calculate_log_probs", Fate.dropped,
         "the engine's log-probs of its sampled tokens are always returned here (rollout_log_probs)"),
    Rule("actor_rollout_ref.rollout.prompt_length", Fate.mapped,
         "must equal data.max_prompt_length (the engines take prompts of that length)", _prompt_length),
    Rule("actor_rollout_ref.rollout.max_model_len", Fate.mapped,
         "checked >= prompt + response; the engine's context here is data.max_prompt_length + the response length",
         _max_model_len),
    Rule("actor_rollout_ref.rollout.expert_parallel_size", Fate.mapped,
         "as verl: vLLM enable_expert_parallel (EP over the engine's TP x DP); SGLang ep_size; > 1 refused for hf",
         _rollout_expert_parallel),
    Rule("actor_rollout_ref.rollout.moe_tensor_parallel_size", Fate.dropped,
         "read by verl's TensorRT-LLM rollout only; vLLM and SGLang split experts by TP / EP"),
    # verl's current spelling (checkpoint_engine.) and its older one
    Rule("actor_rollout_ref.rollout.*update_weights_bucket_megabytes", Fate.mapped,
         "-> actor_rollout_ref.rollout.weight_sync.bucket_size_mb",
         _to("actor_rollout_ref.rollout.weight_sync.bucket_size_mb")),
    Rule("actor_rollout_ref.rollout.checkpoint_engine.*", Fate.default,
         "weights reach the engines through megatron-rl's own bucketed sync (docs/rollout.md)"),
    Rule("actor_rollout_ref.rollout.disable_log_stats", Fate.default,
         "a vLLM engine argument: +actor_rollout_ref.rollout.engine_kwargs.vllm.disable_log_stats=<value>"),
    Rule("actor_rollout_ref.rollout.cudagraph_capture_sizes", Fate.default,
         "a vLLM engine argument: +actor_rollout_ref.rollout.engine_kwargs.vllm.cudagraph_capture_sizes=[...] "
         "(with actor_rollout_ref.rollout.enforce_eager=false)"),
    Rule("actor_rollout_ref.rollout.agent.*", Fate.default,
         "agent loops here are actor_rollout_ref.rollout.multi_turn.* (docs/rollout.md)"),
    Rule("actor_rollout_ref.rollout.disaggregation.*", Fate.default,
         "prefill/decode disaggregation is not built here"),
    Rule("actor_rollout_ref.rollout.quantization*", Fate.default, "quantized rollout is not built here"),
    Rule("actor_rollout_ref.rollout.trace.*", Fate.default, "rollout tracing is not built here"),
    Rule("actor_rollout_ref.rollout.prometheus.*", Fate.default, "engine Prometheus export is not built here"),
    # --- reward
    Rule("custom_reward_function.*", Fate.mapped, "-> reward.custom_reward_function.*",
         _under("custom_reward_function", "reward.custom_reward_function")),
    Rule("reward_model.reward_manager", Fate.mapped, "-> reward.reward_manager", _to("reward.reward_manager")),
    Rule("reward.reward_manager.name", Fate.mapped, "-> reward.reward_manager", _to("reward.reward_manager")),
    Rule("reward.reward_manager.source", Fate.mapped, "register only (the managers megatron-rl has)",
         _reward_manager_source),
    Rule("reward.reward_manager.module.*", Fate.default,
         "a custom scorer is reward.custom_reward_function.path/name here"),
    Rule("reward_model.reward_kwargs.*", Fate.mapped, "-> reward.reward_kwargs.* (DAPO's overlong buffer)",
         _under("reward_model.reward_kwargs", "reward.reward_kwargs")),
    Rule("reward.reward_kwargs.*", Fate.mapped, "set or add", _under("reward.reward_kwargs", "reward.reward_kwargs")),
    Rule("reward_model.num_workers", Fate.mapped, "-> reward.num_workers", _to("reward.num_workers")),
    # verl's newer layout of the reward model (reward.reward_model.*), which serves it in a rollout engine; here it
    # runs on Megatron (reward_model.*, docs/data_and_rewards.md)
    Rule("reward.reward_model.enable", Fate.mapped, "-> reward_model.enable", _to("reward_model.enable")),
    Rule("reward.reward_model.model_path", Fate.mapped, "-> reward_model.model.path", _to("reward_model.model.path")),
    Rule("reward.reward_model.rollout.tensor_model_parallel_size", Fate.mapped,
         f"{_RM_ON_MEGATRON}, at the actor's TP / PP / CP and packing (the processes it shares); verl's engine TP "
         "does not apply",
         _rm_layout),
    Rule("reward.reward_model.rollout.prompt_length", Fate.mapped,
         "with rollout.response_length -> reward_model.max_length (their sum: the RM reads prompt and response)",
         _rm_max_length),
    Rule("reward.reward_model.rollout.response_length", Fate.mapped, "as rollout.prompt_length", _rm_max_length),
    Rule("reward.reward_model.rollout.name", Fate.dropped, _RM_ON_MEGATRON),
    Rule("reward.reward_model.rollout.gpu_memory_utilization", Fate.dropped, _RM_ON_MEGATRON),
    Rule("reward.reward_model.*", Fate.default,
         "a reward model here is configured under reward_model.* (docs/data_and_rewards.md)"),
    Rule("reward_model.rollout.*", Fate.default,
         "a generative judge here is reward_model.judge.* (docs/data_and_rewards.md)"),
    # verl's sandbox-fusion settings of the code sources' reward: reward.sandbox_fusion.* (verl's newer layout) is
    # ours as it is; verl's older top-level and reward_model.* layouts are moved there
    Rule("sandbox_fusion.*", Fate.mapped, _SANDBOX_WHY, _sandbox_fusion("sandbox_fusion")),
    Rule("reward_model.sandbox_fusion.*", Fate.mapped, _SANDBOX_WHY, _sandbox_fusion("reward_model.sandbox_fusion")),
    # --- sections megatron-rl does not have
    # on-policy distillation (docs/distillation.md): the section is ours; verl's served teacher is not
    Rule("distillation.n_gpus_per_node", Fate.dropped, _TEACHER_COLOCATED),
    Rule("distillation.nnodes", Fate.dropped, _TEACHER_COLOCATED),
    Rule("distillation.teacher_models.*.inference.*", Fate.dropped, _TEACHER_COLOCATED),
    Rule("distillation.teacher_models.*.num_replicas", Fate.dropped, _TEACHER_COLOCATED),
    Rule("transfer_queue.*", Fate.default,
         "verl's TransferQueue data plane; batches move through Ray's object store here (docs/controller.md)"),
    Rule("trainer.v1.*", Fate.default, "verl's experimental trainer switches; megatron-rl has one trainer"),
    Rule("skip.*", Fate.default, "verl's rollout dump/skip debugging switches are not built here"),
)

GENERIC_DEFAULT = "megatron-rl has no such setting and behaves as verl does at this default"


@functools.lru_cache(maxsize=1)
def verl_config() -> DictConfig:
    return OmegaConf.load(VERL_CONFIG)


@functools.lru_cache(maxsize=1)
def _our_config() -> DictConfig:
    return load_config(overrides=[])


ABSENT = object()


def verl_default(key: str) -> Any:
    """verl's default for ``key``, its interpolations resolved within verl's config (``ABSENT`` when verl has no
    such key; None for a required ``???`` one)."""
    return default_in(verl_config(), key)


def default_in(cfg: DictConfig, key: str) -> Any:
    """``key``'s value in ``cfg`` (verl's config, or its SFT config), interpolations resolved within it (``ABSENT``
    when ``cfg`` has no such key; None for a required ``???`` one)."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, throw_on_resolution_failure=False) if parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent.keys():  # keys(): `in` misses '???' values
        return ABSENT
    return OmegaConf.select(cfg, key, throw_on_missing=False, throw_on_resolution_failure=False)


def ours_has(key: str) -> bool:
    """megatron-rl's schema has ``key`` (or it lies inside one of its free-form dicts, e.g.
    override_transformer_config)."""
    cfg: Any = _our_config()
    for part in key.split("."):
        if not isinstance(cfg, DictConfig):
            return False
        if part not in cfg.keys():  # keys(), not `in`: a MISSING ('???') value is "not in" a DictConfig
            return OmegaConf.get_type(cfg) is dict
        cfg = cfg._get_node(part)
    return True


def rule_for(key: str, rules: tuple[Rule, ...] = RULES) -> Rule | None:
    return next((rule for rule in rules if fnmatch.fnmatchcase(key, rule.pattern)), None)


def fate_of(key: str, rules: tuple[Rule, ...] = RULES) -> tuple[Fate, str]:
    """What happens to ``key`` and why: the table's row (``rules``: an entry's own table, e.g. the async entries')."""
    rule = rule_for(key, rules)
    if rule is not None and not (rule.fate is Fate.default and ours_has(key)):
        return rule.fate, rule.why
    if ours_has(key):
        return Fate.same, ""
    return Fate.default, GENERIC_DEFAULT


def _same_value(value: str, default: Any) -> bool:
    if default is ABSENT or isinstance(default, (DictConfig, ListConfig)):
        return isinstance(default, (DictConfig, ListConfig)) and bare(value) in ("{}", "[]") and not len(default)
    if isinstance(default, str) and default.startswith("${"):
        return False
    if default is None:
        return is_null(value)
    if isinstance(default, bool):
        return bare(value).lower() in (("true", "1") if default else ("false", "0"))
    if isinstance(default, (int, float)):
        try:
            return float(bare(value)) == float(default)
        except ValueError:
            return False
    return bare(value) == str(default)


@dataclass(frozen=True)
class Translation:
    overrides: list[str]  # megatron_rl.train's arguments
    notes: list[str]  # one line per verl key rewritten, dropped or accepted at its default


def translate_key(key: str, value: str, seen: Mapping[str, str],
                  rules: tuple[Rule, ...] = RULES) -> tuple[list[str] | None, str | None]:
    """(megatron-rl overrides, log note) for one verl ``key=value``; None overrides: pass it on as it is. A refusal
    is a ConfigError naming the key (a rewrite's own ValueError included). ``rules``: the table to read (an entry's
    own, e.g. compat/verl/experimental's async entries')."""
    try:
        return _translate_key(key, value, seen, rules)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{key}={value}: {err}") from None


def _translate_key(key: str, value: str, seen: Mapping[str, str],
                   rules: tuple[Rule, ...]) -> tuple[list[str] | None, str | None]:
    fate, why = fate_of(key, rules)
    return apply_fate(key, value, seen, fate, why, rule_for(key, rules))


def apply_fate(key: str, value: str, seen: Mapping[str, str], fate: Fate, why: str, rule: Rule | None,
               default_of: Callable[[str], Any] = verl_default) -> tuple[list[str] | None, str | None]:
    """``key=value`` meeting ``fate`` (``rule``'s, or the one the table gives it): (overrides, note) as
    ``translate_key``, or a refusal. ``default_of``: verl's default of a key (the SFT entry's: verl's SFT config)."""
    if fate is Fate.same:
        return None, None
    if fate is Fate.mapped:
        out = rule.rewrite(key, value, seen)
        return out, f"{key}={value} -> {' '.join(out) or '(nothing)'}: {why}"
    if fate is Fate.dropped:
        return [], f"{key}={value} accepted, no effect: {why}"
    if fate is Fate.refused:
        refuse(f"{key}={value}: {why}")
    default = default_of(key)
    if default is ABSENT and rule is None:
        return None, None  # neither verl's key nor ours: megatron-rl's checks name it and the nearest keys
    accepts = rule.accepts if rule is not None else ()
    if _same_value(value, default) or any(_same_value(value, a) for a in accepts):
        return [], f"{key}={value} accepted (verl's default): {why}"
    shown = "none" if default is ABSENT else OmegaConf.to_yaml(default).strip() if isinstance(
        default, (DictConfig, ListConfig)) else repr(default)
    refuse(f"{key}={value}: {why}; only verl's default ({shown}) is accepted here")
    return None, None  # unreachable


def command_line_settings(argv: list[str]) -> dict[str, str]:
    """bare key -> value of every key=value argument (the last one wins, as in Hydra)."""
    return {arg.partition("=")[0].lstrip("+~"): arg.partition("=")[2] for arg in argv if "=" in arg}
