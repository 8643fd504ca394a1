"""The closed choices of the config: each choice field of the schema (config/schema.py) is one of these enums."""
from __future__ import annotations

import enum

# Choice fields are enums (OmegaConf has no Literal): a value outside them fails at compose time with the
# key and the options named, and validate() and error messages take the options from here. StrEnum
# members are their strings: `cfg.trainer.launcher == "ray"` and f-strings work unchanged.
class Truncation(enum.StrEnum):
    error = "error"
    left = "left"
    right = "right"
    middle = "middle"  # verl's: the first half and the last half of the budget


class MalformedRowPolicy(enum.StrEnum):
    skip = "skip"
    error = "error"


class LRScheduler(enum.StrEnum):
    constant = "constant"
    cosine = "cosine"


class RolloutEngineName(enum.StrEnum):
    hf = "hf"
    sglang = "sglang"
    vllm = "vllm"


class RolloutMode(enum.StrEnum):
    colocated = "colocated"
    server = "server"


class AsyncMode(enum.StrEnum):
    sync = "sync"
    one_step_off = "one_step_off"
    fully_async = "fully_async"


class StaleSamples(enum.StrEnum):
    """fully_async: what happens to samples above async_training.max_staleness (trainer/fully_async.py)."""

    drop = "drop"  # the batch is not trained (groups stay whole)
    mask = "mask"  # the too-old tokens leave response_mask (slime's mask-offpolicy-in-partial-rollout)


class ValueHeadInit(enum.StrEnum):
    zero = "zero"
    normal = "normal"


class RewardManagerName(enum.StrEnum):
    naive = "naive"
    batch = "batch"
    dapo = "dapo"  # naive + DAPO's soft overlong penalty (reward.reward_kwargs.overlong_buffer_cfg)
    prime = "prime"  # verl's PRIME: per-sample scoring in worker processes with a time limit each


class KLControlType(enum.StrEnum):
    fixed = "fixed"
    adaptive = "adaptive"


class Launcher(enum.StrEnum):
    ray = "ray"
    torchrun = "torchrun"


class Device(enum.StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ActorStrategy(enum.StrEnum):
    megatron = "megatron"  # verl's actor.strategy; its fsdp strategies are not run here


class ResumeMode(enum.StrEnum):
    auto = "auto"
    disable = "disable"
    resume_path = "resume_path"


def _spelled(name: str, values: tuple[str, ...]) -> type[enum.StrEnum]:
    """A StrEnum whose members are named as their values: OmegaConf takes an enum field's value by member name,
    and verl's spellings (``token-mean``, ``low_var_kl+``) are no Python identifiers."""
    return enum.StrEnum(name, [(v, v) for v in values], module=__name__, qualname=name)


# megatron.params_dtype (workers/engine.py PARAMS_DTYPES): auto = bf16 on CUDA, fp32 on CPU
ParamsDType = _spelled("ParamsDType", ("auto", "fp32", "float32", "bf16", "bfloat16"))
# rollout.dtype and reward_model.judge.dtype (rollout/hf_engine.py resolve_dtype): auto = bf16 on CUDA, fp32 on CPU
EngineDType = _spelled("EngineDType", ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"))
# actor/critic.loss_agg_mode (algos/loss_agg.py LOSS_AGG_MODES)
LossAggMode = _spelled("LossAggMode", ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                       "seq-mean-token-sum-norm"))
# algorithm.kl_penalty and actor.kl_loss_type (algos/kl.py KL_PENALTIES): "<name>+" takes the gradient of k2
_KL_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KLPenalty = _spelled("KLPenalty", _KL_BASE + tuple(f"{name}+" for name in _KL_BASE))


class WeightTransport(enum.StrEnum):
    distributed = "distributed"  # an NCCL update group with the servers
    tensor = "tensor"  # HTTP payloads


class UpdateGroupBackend(enum.StrEnum):
    nccl = "nccl"
    gloo = "gloo"


class TruncateSide(enum.StrEnum):
    left = "left"
    right = "right"
    middle = "middle"


class ToolCallFormat(enum.StrEnum):
    hermes = "hermes"  # <tool_call>{json}</tool_call> (Qwen's), the only format parsed


class RolloutIS(enum.StrEnum):
    token = "token"
    sequence = "sequence"


class RolloutCorrectionLoss(enum.StrEnum):
    ppo_clip = "ppo_clip"
    reinforce = "reinforce"


class CombineMode(enum.StrEnum):
    rm = "rm"
    sum = "sum"
    gate = "gate"
