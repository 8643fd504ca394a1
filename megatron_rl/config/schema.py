"""Structured config schema (Hydra/OmegaConf) with verl's names.

The dataclasses hold every default; ``configs/ppo_trainer.yaml`` builds on them and experiment presets
override them. OmegaConf type-checks every override against these fields, so a typo in a key
(``actor_rollout_ref.rollout.nn=4``) fails at start-up with the key named.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from megatron_rl.config.choices import (
    ActorStrategy,
    AsyncMode,
    CombineMode,
    Device,
    EngineDType,
    KLControlType,
    KLPenalty,
    LRScheduler,
    Launcher,
    LossAggMode,
    MalformedRowPolicy,
    ParamsDType,
    ResumeMode,
    RewardManagerName,
    RolloutCorrectionLoss,
    RolloutEngineName,
    RolloutIS,
    StaleSamples,
    Truncation,
    ValueHeadInit,
)
from megatron_rl.config.rollout_schema import (  # noqa: F401 - re-exported: the schema is one tree
    WeightSyncConfig,
    ValKwargsConfig,
    SGLangConfig,
    EngineKwargsConfig,
    VLLMConfig,
    MultiTurnConfig,
    RolloutConfig,
)
from megatron_rl.config.distillation_schema import DistillationConfig
from megatron_rl.config.preference_schema import DPOConfig  # the dpo: section (python -m megatron_rl.dpo)


def choices_of(cls: type, name: str) -> list[str] | None:
    """The options of the choice field ``cls.name`` (None when it is not a choice field); an Optional choice
    field's options are its enum's (null stays allowed)."""
    import typing

    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is typing.Union:  # Optional[SomeEnum]
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = inner[0] if len(inner) == 1 else hint
    return [m.value for m in hint] if isinstance(hint, type) and issubclass(hint, enum.Enum) else None


@dataclass
class DataConfig:
    tokenizer: Optional[str] = None  # defaults to actor_rollout_ref.model.path
    # verl's key: the user's explicit trust in their own tokenizer directory. True lets AutoTokenizer run the
    # Python code that directory ships (custom tokenizers, e.g. Moonlight's); logged as a warning. The model itself
    # is still built from config.json by megatron-rl's builders (model.trust_remote_code stays refused).
    trust_remote_code: bool = False
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per step; responses per step = train_batch_size * rollout.n
    val_batch_size: Optional[int] = None  # None: the whole validation set at once
    shuffle: bool = True
    seed: int = 1
    filter_overlong_prompts: bool = True
    truncation: Truncation = Truncation.error  # used when filter_overlong_prompts is false
    on_malformed_row: MalformedRowPolicy = MalformedRowPolicy.skip
    dataloader_num_workers: int = 0
    # verl's multimodal keys (megatron_rl/data/multimodal.py): the rows' image column, with one <image> in the
    # prompt per image, and video column (megatron_rl/data/video.py), one <video> per video; the patch size images
    # and video frames are pre-resized to multiples of (null: the processor's); kwargs of every processor call
    # (min_pixels / max_pixels bound an image's pixels, hence its tokens)
    image_key: str = "images"
    video_key: str = "videos"
    image_patch_size: Optional[int] = None
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    # SFT rows (data/sft.py, docs/sft.md; verl's SFT keys): the conversation column (a list of {role, content}),
    # else the prompt_key / response_key pair; the rows' tools for the chat template; the longest row in tokens
    # (longer ones: data.truncation error | left | right)
    messages_key: str = "messages"
    response_key: str = "response"
    tools_key: str = "tools"
    max_length: int = 1024


# LoRA (issue 36): the Megatron linears an adapter can sit on, by Megatron's module names
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoRAConfig:
    """``<actor_rollout_ref|critic>.model.lora``: LoRA adapters on the Megatron model (verl's Megatron block; its
    older flat keys ``model.lora_rank`` ... are folded into it at load time, config/lora.py). rank 0: off.
    Checked before launch by config/lora.py (via plan/validate.py) and trainer/preflight.py; docs/configuration.md."""

    type: str = "lora"  # only lora is built (verl's canonical_lora and dora are refused)
    rank: int = 0  # 0: LoRA off
    alpha: Optional[float] = None  # null: 16 (verl's) when rank > 0; scaling = alpha / rank
    dropout: float = 0.0  # on the adapter's input, 0 <= p < 1
    dropout_position: str = "pre"  # only pre is built
    # Megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2), or fnmatch patterns on the module's full
    # name with the global layer number ("decoder.layers.0.*.linear_qkv") that contain one of them
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    exclude_modules: list[str] = field(default_factory=list)  # names or patterns as target_modules; these get none
    lora_A_init_method: str = "xavier"  # xavier | kaiming | normal
    lora_B_init_method: str = "zero"  # zero | xavier | kaiming | normal (not zero: step 0 is not the base model)
    # true: engines get merged weights W + alpha/r B A (every engine, no LoRA support needed); false (adapters
    # loaded through an engine's LoRA API) is not built and refused
    merge: bool = True
    adapter_path: Optional[str] = None  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from
    dtype: Optional[str] = None  # the adapters' dtype (fp32 | bf16); null: the model's megatron.params_dtype

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def resolved_alpha(self) -> float:
        """alpha, or verl's default 16 when unset."""
        return float(self.alpha) if self.alpha is not None else 16.0

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor of B A in W + (alpha / r) B A (0 when off)."""
        return self.resolved_alpha / self.rank if self.rank > 0 else 0.0


@dataclass
class MTPConfig:
    """``actor_rollout_ref.model.mtp``: the checkpoint's multi-token-prediction layers (verl's keys; models/mtp.py,
    docs/models.md "Multi-token prediction"). Checked before launch (config/mtp.py)."""

    enable: bool = False  # build and load the MTP layers, carry them through checkpoints and the HF export
    enable_train: bool = False  # add their loss (Megatron-Core's MTP loss) to the actor's; false: frozen
    enable_rollout: bool = False  # colocated vLLM drafts with them (speculative decoding); every sync carries them
    detach_encoder: bool = False  # their loss reaches the MTP layers only (the main model's output detached)
    mtp_loss_scaling_factor: float = 0.1  # the loss weight, split over the layers as Megatron does
    # the engines' speculative-decoding settings (verl's; with enable_rollout vLLM reads method and
    # num_speculative_tokens, the speculative_* keys are SGLang's)
    speculative_algorithm: str = "EAGLE"
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    method: str = "mtp"
    num_speculative_tokens: int = 1


@dataclass
class ModelConfig:
    path: str = "???"
    # verl's key. Models are built by megatron-rl's own Megatron builders from config.json and tokenizers load
    # without remote code, so code shipped in a checkpoint never runs: true is refused (config/checks.py).
    trust_remote_code: bool = False
    override_config: dict[str, Any] = field(default_factory=dict)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    # verl's older flat LoRA keys (its FSDP spelling), folded into ``lora`` at load time and then null
    # (config/lora.py fold_lora_aliases): HF module names (q_proj, ..., all-linear) map to Megatron's. Setting a
    # key in both spellings is refused. Read ``lora``, never these.
    lora_rank: Optional[int] = None  # -> lora.rank
    lora_alpha: Optional[float] = None  # -> lora.alpha
    target_modules: Any = None  # -> lora.target_modules: "all-linear" or a list of HF names
    exclude_modules: Any = None  # -> lora.exclude_modules
    lora_adapter_path: Optional[str] = None  # -> lora.adapter_path


@dataclass
class RouterReplayConfig:
    # MoE routing replay (verl's megatron.router_replay; docs/models.md "Routing replay"): disabled | R2 (the
    # old-log-prob pass records the trainer's routing, the update passes replay it) | R3 (the rollout engine's
    # routing, rollout.enable_rollout_routing_replay, replayed in every trainer pass)
    mode: str = "disabled"
    record_file: Optional[str] = None  # verl's: routing to a file; not built (refused when set)
    replay_file: Optional[str] = None  # verl's: routing from a file; not built (refused when set)


@dataclass
class MegatronParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    # MoE models (docs/models.md): experts split over EP ranks, each expert over ETP ranks (null: = TP)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    # MoE: the routers' weights are not trained (rollout and trainer route alike for longer; docs/models.md)
    freeze_router: bool = False
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    sequence_parallel: bool = False
    # Shards Adam's state over DP; needs TE or Apex (refused, not dropped, without them). Off by default
    # so CPU runs need nothing; the GPU presets turn it on.
    use_distributed_optimizer: bool = False
    param_offload: bool = False
    optimizer_offload: bool = False
    params_dtype: ParamsDType = ParamsDType.auto  # auto: bf16 on CUDA, fp32 on CPU
    seed: int = 42
    # Megatron-Core TransformerConfig fields, as verl (recompute_granularity/method/num_layers, ...);
    # unknown fields and those set from the HF config or the keys above are refused (docs/models.md).
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    # Micro-batches as packed sequences (THD, Megatron's PackedSeqParams): the rows' real tokens end to end,
    # block-diagonal causal attention; false keeps the padded [rows, longest] rectangles (docs/workers.md).
    packed_sequences: bool = False
    # Rows of a micro-batch with the same prompt as one sequence [prompt | response 1 | ... | response n]
    # under a tree attention mask: each prompt computed once for its n responses (docs/workers.md)
    share_prompts: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = 0
    lr_scheduler: LRScheduler = LRScheduler.constant
    total_training_steps: int = -1  # filled from trainer.total_training_steps when -1
    clip_grad: float = 1.0
    # Megatron-Core OptimizerConfig fields, set on it as verl does (verl's CPU Adam: optimizer_cpu_offload,
    # optimizer_offload_fraction, overlap_cpu_optimizer_d2h_h2d, use_precision_aware_optimizer); unknown fields,
    # those set from the keys above or megatron.*, and those that cannot run here are refused
    # (config/optimizer_overrides.py; docs/workers.md, "CPU Adam")
    override_optimizer_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActorConfig:
    strategy: ActorStrategy = ActorStrategy.megatron  # verl's key; megatron is the only one
    ppo_mini_batch_size: int = 256  # in prompts; multiplied by rollout.n like verl
    ppo_micro_batch_size_per_gpu: int = 4  # in responses
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    # registry name (algos/policy_loss.py, docs/algorithms.md): vanilla | gspo | decoupled_ppo (AReaL, for async
    # training) | verl 0.9.1's cispo | geo_mean (GMPO) | gpg | dro | clip_cov | kl_cov | sapo | dppo_tv | dppo_kl
    policy_loss: str = "vanilla"
    # parameters of some of those losses (null: verl's default; verl nests the last six under policy_loss.*)
    tau_pos: Optional[float] = None  # sapo
    tau_neg: Optional[float] = None  # sapo
    clip_cov_ratio: Optional[float] = None  # clip_cov
    clip_cov_lb: Optional[float] = None  # clip_cov
    clip_cov_ub: Optional[float] = None  # clip_cov
    kl_cov_ratio: Optional[float] = None  # kl_cov
    ppo_kl_coef: Optional[float] = None  # kl_cov
    dro_beta: Optional[float] = None  # dro (required there)
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # None: clip_ratio
    clip_ratio_high: Optional[float] = None  # None: clip_ratio
    clip_ratio_c: float = 3.0
    tis_imp_ratio_cap: Optional[float] = None  # truncated IS vs rollout_log_probs; None = off
    behav_imp_weight_cap: Optional[float] = None  # decoupled_ppo: tokens above this behaviour weight get 0
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLPenalty = KLPenalty.low_var_kl
    # verl's key: a vision-language model's vision tower kept out of training (requires_grad=False before the
    # optimizer is built: no grads, no Adam state, no activations kept for its backward); refused for a text model
    freeze_vision_tower: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    megatron: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: on exactly when adv_estimator needs values (gae)
    model: ModelConfig = field(default_factory=ModelConfig)  # ppo_trainer.yaml: the actor's path
    ppo_mini_batch_size: Optional[int] = None  # None: the actor's
    ppo_micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    ppo_epochs: Optional[int] = None  # None: the actor's
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]
    value_head_init: ValueHeadInit = ValueHeadInit.zero
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class RewardOverlapConfig:
    """``reward.overlap``: score finished chunks of the rollout while the next chunk generates (reward/overlap.py)."""

    enable: bool = False
    num_chunks: int = 4  # engine calls per rollout, each of whole prompt groups; the last chunk's scoring stays exposed


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (reward/overlong.py), read by reward_manager=dapo only: responses longer
    than ``max_resp_len - len`` tokens lose ``penalty_factor`` per ``len`` tokens beyond (verl's keys)."""

    enable: bool = False
    len: int = 0  # the buffer: the last `len` tokens before max_resp_len
    penalty_factor: float = 1.0  # the penalty at max_resp_len
    log: bool = False  # per-sample extras overlong_reward, overlong (and their reward/<extra>/mean metrics)


@dataclass
class RewardKwargsConfig:
    """verl's ``reward_model.reward_kwargs``: the dapo manager's arguments."""

    overlong_buffer_cfg: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # null: the response budget (actor_rollout_ref.rollout.response_length, null: data.max_response_length)
    max_resp_len: Optional[int] = None


@dataclass
class SandboxFusionConfig:
    """``reward.sandbox_fusion``: where the code sources' reward runs their tests (reward/code_execution.py;
    docs/data_and_rewards.md, "Code execution"). verl's keys, then ours."""

    # a SandboxFusion /run_code service (ours: agent/sandbox_service.py); null: this machine's sandbox
    url: Optional[str] = None
    max_concurrent: int = 64  # cases of one scoring worker at once (one client per worker process)
    memory_limit_mb: int = 1024
    continuous: bool = True  # verl's flag: true, fraction of the first max_tests cases passed; false, all or nothing
    run_timeout_s: float = 5.0  # one case's wall clock (raise reward.timeout_s, the whole sample's, with it)
    max_tests: int = 10  # cases a continuous score counts (verl's 10)


@dataclass
class RewardConfig:
    reward_manager: RewardManagerName = RewardManagerName.naive
    num_workers: int = 4
    timeout_s: float = 10.0  # per scoring call; inline (num_workers=0) a call past it stops the run
    # Stop the run after this many steps in a row in which every sample's reward errored or timed out
    # (each such step is warned about); 0: never stop.
    max_failed_steps: int = 3
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    overlap: RewardOverlapConfig = field(default_factory=RewardOverlapConfig)
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None  # an HF <Family>ForSequenceClassification directory (one label)
    # verl's meaning: the policy's tokenizer. Set it when the RM's tokenizer or chat template differs: responses
    # are decoded with it and re-tokenized with the RM's (raw_prompt + the response as the assistant turn).
    # null (default here, verl defaults to the actor's path): the RM reads the policy's tokens as they are.
    input_tokenizer: Optional[str] = None
    override_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardCombineConfig:
    """How the RM score and the rule score of a sample make its score (reward/model/combine.py)."""

    mode: CombineMode = CombineMode.rm  # rm: the RM score alone (verl) | sum: rule + weight * rm | gate: weight * rm where rule > gate_threshold, else rule
    weight: float = 1.0
    gate_threshold: float = 0.0
    per_data_source: dict[str, Any] = field(default_factory=dict)  # data_source -> {mode, weight, gate_threshold}


@dataclass
class JudgeModelConfig:
    path: Optional[str] = None  # an HF causal LM with a chat template


@dataclass
class RewardJudgeConfig:
    """``reward_model.judge``: a generative judge on a rollout engine (``engine``: hf, vllm, or sglang on GPUs) in the
    driver, or with ``reward_model.enable_resource_pool`` in a Ray actor of its own (reward/model/judge.py,
    judge_actor.py)."""

    enable: bool = False
    engine: RolloutEngineName = RolloutEngineName.hf  # the rollout engine that serves the judge, loaded from model.path
    model: JudgeModelConfig = field(default_factory=JudgeModelConfig)
    template: str = "Question: {prompt}\nAnswer: {response}\nReference: {ground_truth}\nRate the answer 0-10. Score:"
    verdict_pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"  # group 1: the number
    verdict_scale: float = 0.1  # score = verdict * scale
    response_length: int = 16  # tokens of the judge's answer
    dtype: EngineDType = EngineDType.float32
    timeout_s: float = 60.0  # per engine call; a call past it scores its samples 0 (reward/timeouts)
    retries: int = 1  # failed samples (parse failure, timeout, engine error) are asked again this many times


@dataclass
class RewardModelConfig:
    """``reward_model``: a sequence-classification RM on Megatron (verl's key names where verl has them)."""

    enable: bool = False
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = 4
    max_length: Optional[int] = None  # RM rows longer than this keep their last max_length tokens
    use_dynamic_bsz: bool = False
    forward_max_token_len_per_gpu: int = 32768
    # verl's name. false: the RM shares the hybrid engine's processes (Ray) as the critic does, so its megatron
    # TP/PP/CP must be the actor's; true: its own Ray pool of n_gpus_per_node x nnodes ranks (0: the trainer's).
    # Under torchrun it always shares the trainer's processes.
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 0
    nnodes: int = 0
    megatron: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)
    combine: RewardCombineConfig = field(default_factory=RewardCombineConfig)
    judge: RewardJudgeConfig = field(default_factory=RewardJudgeConfig)  # enable: the judge scores instead of model.path


@dataclass
class KLControlConfig:
    type: KLControlType = KLControlType.fixed
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose scores have zero variance, regenerate until full."""

    enable: bool = False
    metric: str = "score"
    max_num_gen_batches: int = 4


@dataclass
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction (algos/rollout_corr.py): IS weights and rejection against the
    rollout engine's log-probs; all off by default. Thresholds take a number or a "lower_upper" string."""

    rollout_is: Optional[RolloutIS] = None  # null | token | sequence
    rollout_is_threshold: Any = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None  # comma-separated: token_k1, seq_mean_k3, ...
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False  # old_log_probs := rollout_log_probs (no old-log-prob pass)
    loss_type: RolloutCorrectionLoss = RolloutCorrectionLoss.ppo_clip  # bypass mode's loss; only ppo_clip runs in the trainer


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLPenalty = KLPenalty.kl
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class TrainerConfig:
    project_name: str = "megatron_rl"
    experiment_name: str = "run"
    # verl's values (file = jsonl); checked before start-up, the planner too (trainer/tracking.py, docs/trainer.md)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    launcher: Launcher = Launcher.ray
    device: Device = Device.auto
    nnodes: int = 1
    n_gpus_per_node: int = 8  # processes per node on CPU
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # None: epochs * batches per epoch
    # A checkpoint every save_freq steps and at the last step (-1: never; a late failure then loses the run).
    save_freq: int = 20
    test_freq: int = -1
    val_before_train: bool = False
    # Samples (input, output, score) each validation logs to the loggers (verl's key; 0: none).
    log_val_generations: int = 0
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: ResumeMode = ResumeMode.auto  # resume_path: trainer.resume_from_path
    resume_from_path: Optional[str] = None
    max_ckpt_to_keep: int = 2
    # sha256 of every tensor shard (*.distcp) in each checkpoint's manifest, checked at resume: one read of the
    # checkpoint per save and per resume (about 35 min each for 1 TB at 0.5 GB/s; docs/trainer.md). Off: the
    # shards are size-checked, every other file is hashed.
    checkpoint_hash_shards: bool = False
    save_hf_at_end: bool = True
    # Starting from step 0 in a directory that holds a run's results (metrics.jsonl, hf_final/, events)
    # is refused unless this is true; resuming from an intact checkpoint keeps them.
    overwrite: bool = False
    # Reorder each step's batch so every actor DP rank gets a nearly equal sum of tokens (Karmarkar-Karp,
    # verl's _balance_batch; metrics global_seqlen/*). verl's default is true; false here keeps the row order.
    balance_batch: bool = False


@dataclass
class RayInitConfig:
    address: Optional[str] = None  # None: start an embedded local Ray
    num_cpus: Optional[int] = None
    num_gpus: Optional[int] = None  # GPUs an embedded Ray declares (None: what it detects)
    # A remote call taking longer fails with the role, rank and key named. Log-prob, value and weight-sync calls
    # get at least what controller/deadlines.py derives from the response length, batch and model size.
    timeout_s: float = 600.0
    # Per call kind (controller/deadlines.py). A 70B init_model loads 140 GB and builds the engines.
    init_timeout_s: Optional[float] = 3600.0  # init_model, load_checkpoint; null: timeout_s
    generate_timeout_s: Optional[float] = None  # generate_sequences; null: derived (response length, model size)
    update_timeout_s: Optional[float] = None  # update_actor, update_critic; null: derived (batch, model size)
    save_timeout_s: Optional[float] = 1800.0  # save_checkpoint, save_hf
    # the workers' process groups (NCCL's watchdog, gloo): a collective waiting longer fails its rank (verl's
    # nccl_timeout); null: the longest of the call deadlines above, as a collective may wait as long as its call
    collective_timeout_s: Optional[float] = None


@dataclass
class PlanConfig:
    """Facts for the dry-run planner (megatron_rl/plan, docs/launching.md)."""

    gpu_memory_gib: float = 79.6  # H100-80GB as nvidia-smi reports it (81559 MiB)
    reserved_gib: float = 4.0  # CUDA context, NCCL buffers, fragmentation
    architecture: dict[str, Any] = field(default_factory=dict)  # config.json fields; used when model.path has none


@dataclass
class AsyncTrainingConfig:
    """``async_training``: rollouts generated ahead of the update on rollout servers (docs/trainer.md, "Async").
    verl's recipe names: one_step_off (recipe/one_step_off_policy), fully_async (recipe/fully_async_policy)."""

    mode: AsyncMode = AsyncMode.sync
    # versions a sample (its oldest token) may lag the policy it trains; one_step_off: 1; 0: on-policy (= sync)
    max_staleness: int = 1
    # fully_async: batches generated ahead and not yet trained (the bounded buffer; 0 when max_staleness=0)
    buffer_batches: int = 2
    # fully_async: a weight sync pauses in-flight requests and they resume on the new weights (verl's name);
    # false: the sync waits for the batch in flight
    partial_rollout: bool = True
    stale_samples: StaleSamples = StaleSamples.drop


@dataclass
class PPOTrainerConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)  # preference training only (docs/dpo.md)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)  # on-policy distillation


SCHEMA_NAME = "ppo_trainer_schema"


def register_configs() -> None:
    """Make the schema available to Hydra as a defaults-list entry (``- ppo_trainer_schema``)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=PPOTrainerConfig)
