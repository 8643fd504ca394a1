"""MegatronEngine: one role's model chunks, DDP wrapper, optimizer and LR schedule, and the pipeline run.

Constructed on every rank after ``torch.distributed`` and Megatron's parallel state are initialised
(``megatron_rl.distributed.init_model_parallel``); the model comes from an HF directory through
``megatron_rl.models``. A trainable engine (``optim`` given) wraps each chunk in Megatron's
``DistributedDataParallel`` and builds Megatron's optimizer; a frozen one (the reference) keeps
bare chunks without gradients.

Loss normalisation: each micro-batch's loss is already its share of the mini-batch objective
(divided by the mini-batch's global token/sequence count, see ``algos.GlobalBatchInfo``). So the
engine turns off every Megatron rescaling: ``calculate_per_token_loss`` keeps the schedule from
dividing by the number of micro-batches and makes DDP *sum* gradients over data-parallel ranks, and
``finalize_model_grads`` runs without a token count. The gradient is then that of the global
mini-batch loss, however the mini-batch was split over micro-batches and ranks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.config.optimizer_overrides import optimizer_overrides
from megatron_rl.config.schema import LoRAConfig, MegatronParallelConfig, MTPConfig, OptimConfig
from megatron_rl.config.worker_rules import check_share_prompts_packing
from megatron_rl.models import capabilities
from megatron_rl.models.builder import build_gpt_model, transformer_overrides
from megatron_rl.models.hf_config import load_hf_config
from megatron_rl.models.layout import unwrap
from megatron_rl.models.loading import load_hf_weights
from megatron_rl.models.lora import LoRAAdapter, LoRASpec
from megatron_rl.models.moe_training import ExpertLoad, freeze_routers, moe_metrics, moe_padding, router_loss_scaling
from megatron_rl.models.mtp import with_mtp
from megatron_rl.models.peft_adapter import load_peft_adapter
from megatron_rl.models.rope_positions import check_rope_positions, rope_at_positions
from megatron_rl.models.router_replay import build_routing_replay
from megatron_rl.models.value_head import ValueHead
from megatron_rl.workers.lr_schedule import build_lr_scheduler
from megatron_rl.workers.mtp_loss import MTPTraining
from megatron_rl.workers.offload import EngineOffload
from megatron_rl.workers.optimizer_device import optimizer_device_scope
from megatron_rl.workers.packing import PackedMicroBatch

logger = logging.getLogger(__name__)

# (model output on the last stage, micro-batch) -> (loss, data kept for the caller)
StepFn = Callable[[torch.Tensor, PackedMicroBatch], tuple[torch.Tensor, Any]]

PARAMS_DTYPES = {
    "auto": None,
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def resolve_params_dtype(name: str, prefix: str) -> torch.dtype:
    """``auto``: bf16 with CUDA (fp32 master weights in the optimizer), fp32 on CPU."""
    if name not in PARAMS_DTYPES:
        raise ValueError(f"{prefix}.params_dtype={name!r} is unknown; known: {sorted(PARAMS_DTYPES)}")
    dtype = PARAMS_DTYPES[name]
    if dtype is None:
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return dtype


def check_parallel_state(parallel: MegatronParallelConfig, prefix: str) -> None:
    """The role's TP/PP/VPP/CP settings must be the ones Megatron's parallel state was set up with."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron's parallel state is not initialised: call megatron_rl.distributed.init_model_parallel("
            f"tp={parallel.tensor_model_parallel_size}, pp={parallel.pipeline_model_parallel_size}) "
            f"before building the {prefix} engine"
        )
    ps = parallel_state
    actual = {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
    }
    # MoE sizes: EP 1 and ETP = TP (Megatron's default) when a config does not set them
    defaults = {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": parallel.tensor_model_parallel_size}
    for key, value in actual.items():
        wanted = getattr(parallel, key, None)
        wanted = defaults[key] if wanted is None and key in defaults else wanted
        if wanted != value:
            raise ValueError(
                f"{prefix}.{key}={wanted} but Megatron's parallel state was initialised with {value}"
            )


def check_share_prompts(chunks: Sequence[torch.nn.Module], packed_sequences: bool, prefix: str) -> None:
    """``megatron.share_prompts`` needs padded micro-batches (its tree mask is a dense mask; the rule validation
    calls too: config/worker_rules.py) and RoPE."""
    check_share_prompts_packing(True, packed_sequences, prefix)
    for chunk in chunks:
        try:
            check_rope_positions(chunk)
        except ValueError as err:
            raise ValueError(f"{prefix}.share_prompts: {err}") from None


def freeze_all_but_adapters(chunks: Sequence[torch.nn.Module]) -> None:
    """LoRA: only the adapters (and a critic's value head) train; the base weights get no gradient buffer,
    no optimizer state and no distributed-optimizer shard (DDP and the optimizer skip frozen parameters)."""
    for chunk in chunks:
        chunk.requires_grad_(False)
        for module in chunk.modules():
            if isinstance(module, (LoRAAdapter, ValueHead)):
                module.requires_grad_(True)


def _finalize_grads_unscaled(model, num_tokens, pg_collection=None, force_all_reduce=False):
    """Megatron's grad finalisation (DP reduction, tied embeddings) without dividing by a token count."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def freeze_vision_tower(chunks: list[torch.nn.Module], hf_config: Any, key: str) -> int:
    """requires_grad=False on the vision tower of a vision-language model's chunks (``model.vision``, on the first
    pipeline stage only; other stages hold none); returns the parameters frozen here. ``key`` names the setting in
    the refusal of a model without a vision tower (plan/planner.py refuses it before launch too)."""
    if getattr(hf_config, "vision", None) is None:
        raise ValueError(f"{key}=true, but {getattr(hf_config, 'architecture', 'the model')} has no vision tower "
                         "(a vision-language model's, e.g. Qwen2_5_VLForConditionalGeneration); drop the key")
    frozen = 0
    for chunk in chunks:
        tower = getattr(unwrap(chunk), "vision", None)
        if tower is not None:
            tower.requires_grad_(False)
            frozen += sum(p.numel() for p in tower.parameters())
    return frozen


class MegatronEngine:
    """Model chunks (one per virtual pipeline stage) with optional DDP + optimizer + LR schedule.

    Args:
        model_dir: HF checkpoint directory (config.json + safetensors).
        parallel: ``MegatronParallelConfig`` (must match the initialised parallel state).
        optim: ``OptimConfig`` for a trainable role; None builds a frozen model (no grads, no optimizer).
        value_head: build the critic (a scalar head instead of the vocabulary projection).
        value_head_init: ``zero`` | ``normal`` (used when the checkpoint has no value head).
        name: config prefix used in error messages, e.g. ``actor_rollout_ref.actor``.
        override_config: ``<role>.model.override_config``, HF config.json fields applied on top of the
            checkpoint's config before the model is built (the rollout engine gets the same).
        mtp: ``actor_rollout_ref.model.mtp`` (the actor's): with ``enable`` the checkpoint's multi-token-prediction
            layers are built and loaded, trained with their loss under ``enable_train`` (workers/mtp_loss.py),
            else frozen.
        freeze_vision_tower: ``actor_rollout_ref.actor.freeze_vision_tower``: a vision-language model's vision
            tower (``model.vision`` of the first stage's chunk) gets requires_grad=False before the optimizer is
            built; refused for a model without one.
    """

    def __init__(
        self,
        model_dir: str,
        parallel: MegatronParallelConfig,
        optim: OptimConfig | None = None,
        *,
        value_head: bool = False,
        value_head_init: str = "normal",
        name: str = "actor",
        override_config: Mapping[str, Any] | None = None,
        lora: LoRAConfig | None = None,
        mtp: MTPConfig | None = None,
        freeze_vision_tower: bool = False,
    ) -> None:
        self.name = name
        self.freeze_vision_tower = freeze_vision_tower
        self.mtp = mtp if mtp is not None and mtp.enable else None
        check_parallel_state(parallel, f"{name}.megatron")
        self.params_dtype = resolve_params_dtype(parallel.params_dtype, f"{name}.megatron")
        # <role>.model.lora (rank > 0): adapters on the targeted linears, everything else frozen
        self.lora = LoRASpec.from_config(lora, self.params_dtype, seed=int(getattr(parallel, "seed", 0)))
        chunks = self._build_model(model_dir, parallel, value_head, value_head_init, override_config,
                                   getattr(lora, "adapter_path", None))
        self.hf_config = chunks[0].hf_config
        self.config = chunks[0].config
        self._set_batch_layout(chunks, parallel)
        self.value_head = value_head
        # MoE router losses and expert load of the last training run (models/moe_training.py); {} for dense models
        self.router_metrics: dict[str, float] = {}
        # the MTP loss of the last training run (workers/mtp_loss.py); {} without it
        self.mtp_metrics: dict[str, float] = {}
        self.mtp_training = None
        if self.mtp is not None and optim is not None and self.mtp.enable_train:
            self.mtp_training = MTPTraining(self.mtp, self.hf_config.mtp.num_layers)
        self.expert_load: ExpertLoad | None = None
        # set while a probe's routing is recorded (models/moe_routing.py: routing agreement with the rollout engine)
        self.routing_recorder = None
        # megatron.router_replay.mode R2/R3: the routers replay batch['routed_experts'] (models/router_replay.py)
        self.routing_replay = build_routing_replay(chunks, parallel, self.hf_config, f"{name}.megatron")
        self.optimizer = None
        self.scheduler = None
        self.use_distributed_optimizer = False
        if optim is None:
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()
            self.model: list[torch.nn.Module] = chunks
        else:
            self._set_up_training(chunks, parallel, optim)
        # megatron.param_offload / optimizer_offload: the roles and the hybrid worker move the state
        # between phases through this (workers/offload.py).
        self.offload = EngineOffload(self, getattr(parallel, "param_offload", False),
                                     getattr(parallel, "optimizer_offload", False))

    # ------------------------------------------------------------------ construction
    def _build_model(
        self,
        model_dir: str,
        parallel: MegatronParallelConfig,
        value_head: bool,
        value_head_init: str,
        override_config: Mapping[str, Any] | None,
        adapter_path: str | None,
    ) -> list[torch.nn.Module]:
        """The model chunks from the HF directory, with the LoRA adapters (loaded from ``adapter_path`` if set)."""
        # init_weights=True although the weights are loaded next: Megatron marks tensor-parallel
        # parameters (``tensor_model_parallel``, read by the grad-norm and clipping) only while it
        # initialises them; without it the gradient norm under TP>1 misses half the shards.
        # sequence_parallel and override_transformer_config reach the TransformerConfig here (checked:
        # an unknown field is refused by name); the planner builds its config from the same function.
        chunks = build_gpt_model(
            with_mtp(load_hf_config(model_dir, override_config), self.mtp is not None),
            value_head=value_head,
            value_head_init=value_head_init,
            params_dtype=self.params_dtype,
            init_weights=True,
            lora=self.lora,
            mtp_loss_scaling_factor=self.mtp.mtp_loss_scaling_factor if self.mtp is not None else 0.1,
            **transformer_overrides(parallel, f"{self.name}.megatron"),
        )
        load_hf_weights(chunks, model_dir)
        if self.mtp is not None and not self.mtp.enable_train:  # loaded, synced and exported, never trained
            for chunk in chunks:
                if getattr(chunk, "mtp_process", False):
                    chunk.mtp.requires_grad_(False)
        if self.lora is not None:
            if adapter_path:  # a PEFT adapter to start from (checked before launch: trainer/preflight.py)
                load_peft_adapter(chunks, adapter_path)
            freeze_all_but_adapters(chunks)
        return chunks

    def _set_batch_layout(self, chunks: list[torch.nn.Module], parallel: MegatronParallelConfig) -> None:
        """How micro-batches reach the model: packed (THD) or padded rows, prompts shared or not."""
        prefix = f"{self.name}.megatron"
        # megatron.packed_sequences: micro-batches as THD packs (PackedSeqParams), else padded rows.
        self.packed_sequences = bool(getattr(parallel, "packed_sequences", False))
        # megatron.share_prompts: rows with the same prompt as one [prompt | responses...] sequence (shared_prompts.py)
        self.share_prompts = bool(getattr(parallel, "share_prompts", False))
        if self.share_prompts:
            check_share_prompts(chunks, self.packed_sequences, prefix)
        cp = parallel_state.get_context_parallel_world_size()
        if self.hf_config.vision is not None:  # mRoPE positions and images ride with padded rows only
            for key, on in (("packed_sequences", self.packed_sequences), ("share_prompts", self.share_prompts),
                            ("context_parallel_size", cp > 1)):
                if on:
                    raise ValueError(f"{prefix}.{key}: a vision-language model ({self.hf_config.architecture}) runs "
                                     "padded micro-batches: THD packs, shared prompts and context parallelism do not "
                                     "carry its mRoPE positions and images")
        if cp > 1 and not self.packed_sequences:  # (plan/validate.py refuses it before launch)
            raise ValueError(f"{prefix}.context_parallel_size={cp} needs {prefix}.packed_sequences=true: "
                             "padded micro-batches are not split over CP ranks")

    def _set_up_training(
        self, chunks: list[torch.nn.Module], parallel: MegatronParallelConfig, optim: OptimConfig
    ) -> None:
        """A trainable engine: routers frozen if asked, expert load counted (MoE), DDP, optimizer, LR schedule."""
        if getattr(parallel, "freeze_router", False):
            freeze_routers(chunks, f"{self.name}.megatron.freeze_router")
        if self.freeze_vision_tower:
            freeze_vision_tower(chunks, self.hf_config, f"{self.name}.freeze_vision_tower")
        if self.hf_config.moe is not None:
            self.expert_load = ExpertLoad(chunks, self.config.num_layers, self.hf_config.moe.num_experts)
        self.model = self._wrap_ddp(chunks, parallel)
        self.optimizer = self._build_optimizer(optim)
        self.scheduler = build_lr_scheduler(self.optimizer, optim, f"{self.name}.optim")

    def _use_distributed_optimizer(self, parallel: MegatronParallelConfig) -> bool:
        """Asked for and unavailable is an error, never a quiet fallback: the plan counted it (the
        planner refuses the same config before launch, with the plan it would get without it)."""
        blocker = capabilities.distributed_optimizer_blocker() if parallel.use_distributed_optimizer else None
        if blocker is not None:
            raise RuntimeError(
                f"{self.name}.megatron.use_distributed_optimizer=true {blocker}. Install "
                "megatron-rl[gpu] (Transformer Engine) or set use_distributed_optimizer=false "
                "(Adam state unsharded: python -m megatron_rl.plan shows what that costs)"
            )
        return bool(parallel.use_distributed_optimizer)

    def _wrap_ddp(self, chunks: list[torch.nn.Module], parallel: MegatronParallelConfig) -> list[torch.nn.Module]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.use_distributed_optimizer = self._use_distributed_optimizer(parallel)
        # Set before DDP reads it: sum (not average) gradients over DP; see the module docstring.
        self.config.calculate_per_token_loss = True
        self.config.finalize_model_grads_func = _finalize_grads_unscaled
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=self.use_distributed_optimizer,
            check_for_nan_in_grad=True,  # fail loudly before a NaN reaches the weights
        )
        model = [
            DistributedDataParallel(self.config, ddp_config, chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)
        ]
        no_sync = [chunk.no_sync for chunk in model]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        return model

    def _build_optimizer(self, optim: OptimConfig) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if len(optim.betas) != 2:
            raise ValueError(f"{self.name}.optim.betas must have two values, got {list(optim.betas)}")
        # optim.override_optimizer_config: Megatron's own OptimizerConfig fields (verl's CPU Adam), checked as the
        # validation before launch checks them (a CPU engine refuses HybridDeviceOptimizer: it takes CUDA streams)
        overrides = optimizer_overrides(optim, f"{self.name}.optim", on_cpu=not torch.cuda.is_available(),
                                        distributed_optimizer=self.use_distributed_optimizer)
        config = OptimizerConfig(
            optimizer="adam",  # decoupled weight decay: AdamW
            lr=optim.lr,
            min_lr=optim.lr * optim.min_lr_ratio,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0],
            adam_beta2=optim.betas[1],
            clip_grad=optim.clip_grad,
            bf16=self.params_dtype == torch.bfloat16,
            params_dtype=self.params_dtype,
            use_distributed_optimizer=self.use_distributed_optimizer,
            **overrides,
        )
        with optimizer_device_scope():
            return get_megatron_optimizer(config, self.model)

    # ------------------------------------------------------------------ facts
    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    @property
    def uniform_micro_batch_shape(self) -> bool:
        """Megatron-core 0.16.1's interleaved (VPP) training schedule fails on micro-batches of
        different shapes (measured: activations of mismatched widths, broken p2p with different
        row counts), so with VPP every micro-batch is padded to one rectangle."""
        return len(self.model) > 1

    @property
    def sequence_multiple(self) -> int:
        """Packed widths must be a multiple of this: TP under sequence parallelism (Megatron splits the
        sequence dimension over the TP ranks), else 1."""
        return self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1

    @property
    def context_parallel(self) -> tuple[dist.ProcessGroup, int, int] | None:
        """(CP group, CP size, CP rank) under context parallelism (packed sequences only), else None."""
        size = parallel_state.get_context_parallel_world_size()
        if size == 1:
            return None
        return parallel_state.get_context_parallel_group(), size, parallel_state.get_context_parallel_rank()

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return parallel_state.get_tensor_model_parallel_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return parallel_state.get_data_parallel_group()

    @property
    def is_last_stage(self) -> bool:
        return parallel_state.is_pipeline_last_stage()

    def mesh_kwargs(self) -> dict[str, int]:
        """This rank's coordinates, as ``controller.Worker.set_mesh(**engine.mesh_kwargs())`` takes them."""
        return {
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "dp_size": parallel_state.get_data_parallel_world_size(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "cp_rank": parallel_state.get_context_parallel_rank(),
        }

    # ------------------------------------------------------------------ running
    def run(
        self, micro_batches: Sequence[PackedMicroBatch], step_fn: StepFn, *, forward_only: bool
    ) -> list[Any]:
        """Run the micro-batches through the pipeline schedule (any PP/VPP, PP=1 included).

        ``step_fn(output, micro_batch)`` runs on the last stage and returns (loss, data); with
        ``forward_only=False`` the loss is back-propagated and gradients accumulate in the DDP
        buffers (call ``zero_grad`` before and ``optimizer_step`` after). Returns the ``data`` of
        every micro-batch, in order, on the last pipeline stage and [] elsewhere.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not forward_only and not self.trainable:
            raise RuntimeError(f"{self.name}: a frozen engine (no optim config) cannot run a backward pass")

        def loss_func(micro_batch: PackedMicroBatch, output: torch.Tensor):
            loss, data = step_fn(output, micro_batch)
            # Three values + calculate_per_token_loss: Megatron back-propagates the loss as is.
            return loss, torch.ones((), dtype=torch.int, device=loss.device), data

        count_valid = self.expert_load is not None and self.config.recompute_granularity != "full"

        def forward_step(data_iterator, model):
            micro_batch = next(data_iterator)
            padding = micro_batch.padding if self.hf_config.moe is not None else None
            if count_valid:  # the expert load leaves this micro-batch's pad tokens out (moe_training.ExpertLoad)
                self.expert_load.valid = None if padding is None else ~padding.t()
            if self.routing_recorder is not None:
                self.routing_recorder.expect(micro_batch)
            if self.routing_replay is not None:
                self.routing_replay.expect(micro_batch)
            self._set_mtp_targets(unwrap(model), micro_batch, len(micro_batches), forward_only)
            if micro_batch.is_thd:
                output = model(
                    micro_batch.input_ids,
                    micro_batch.position_ids,
                    None,
                    packed_seq_params=micro_batch.packed_seq_params(),
                    **moe_padding(model, padding),
                )
            else:
                # shared prompts: responses continue their prompt's RoPE positions (models/rope_positions.py)
                positions = (rope_at_positions(model, micro_batch.position_ids) if micro_batch.is_shared
                             else contextlib.nullcontext())
                with positions:
                    output = model(micro_batch.input_ids, micro_batch.position_ids, micro_batch.attention_blocked(),
                                   **moe_padding(model, padding), **micro_batch.images)
            return output, functools.partial(loss_func, micro_batch)

        for chunk in self.model:
            chunk.train(not forward_only)
        iterators = [iter(micro_batches) for _ in self.model]
        scaling = contextlib.nullcontext() if forward_only else router_loss_scaling(
            self.config, len(micro_batches), parallel_state.get_data_parallel_world_size()
        )
        replay = self.routing_replay
        if replay is not None:
            replay.begin(training=not forward_only)
        with torch.set_grad_enabled(not forward_only), scaling:
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.model if len(self.model) > 1 else self.model[0],
                num_microbatches=len(micro_batches),
                seq_length=max(mb.input_ids.shape[1] for mb in micro_batches),
                micro_batch_size=max(mb.input_ids.shape[0] for mb in micro_batches),
                forward_only=forward_only,
            )
        if replay is not None:
            replay.end()
        if self.mtp_training is not None and not forward_only:
            self.mtp_metrics = self.mtp_training.metrics([unwrap(c) for c in self.model], self.dp_group, self.device)
        if not forward_only and self.hf_config.moe is not None:
            losses = moe_metrics(self.config.num_layers, len(micro_batches))
            self.router_metrics = losses | self.expert_load.metrics()
            if replay is not None:
                self.router_metrics |= replay.metrics()
        return outputs

    def _set_mtp_targets(self, chunk: torch.nn.Module, micro_batch: PackedMicroBatch, micro_batches: int,
                         forward_only: bool) -> None:
        """The MTP loss's targets on the chunk that holds the MTP layers, in training micro-batches only."""
        if not getattr(chunk, "mtp_process", False):
            return
        chunk.mtp_targets = None
        if self.mtp_training is not None and not forward_only:
            self.mtp_training.set_targets(chunk, micro_batch, micro_batches,
                                          parallel_state.get_data_parallel_world_size())

    def zero_grad(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        """Clip, step; returns the gradient norm (over all parameters, before clipping)."""
        with optimizer_device_scope():
            success, grad_norm, _ = self.optimizer.step()
        if not success:
            raise RuntimeError(f"{self.name}: the optimizer skipped the step (inf/NaN gradients)")
        return float(grad_norm)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def scheduler_step(self) -> None:
        self.scheduler.step(1)

    # ------------------------------------------------------------------ pipeline communication
    def broadcast_from_last_stage(
        self, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """The last stage's ``tensor`` on every rank of this pipeline (others pass None)."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return tensor
        tensor = (
            torch.empty(shape, dtype=dtype, device=self.device) if tensor is None else tensor.contiguous()
        )
        dist.broadcast(
            tensor,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return tensor

    def broadcast_object_from_last_stage(self, obj: Any) -> Any:
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(
            holder,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return holder[0]

    @property
    def device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
