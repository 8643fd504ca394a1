"""HFEngine: a transformers causal LM as the rollout engine, on CPU or one CUDA device.

It is the engine wherever SGLang is not available (every CPU machine) and the engine of the tests. It
decodes with its own loop over the model's KV cache so it can report, for every sampled token, its
log-prob under the sampling distribution (convention in ``sampling``), with seeds drawn from a
``torch.Generator`` (``meta_info['seed']`` gives a call its own generator; otherwise the engine's
generator, seeded with ``rollout.seed``, advances across calls).

Weights: built from the actor's HF config. Without ``weights_path`` (an HF checkpoint directory) the
weights are random and the engine refuses to generate until the first complete weight update, so a
missing initial sync fails loudly instead of sampling noise. Weights arrive by name through the
weight-update session of ``RolloutEngine``. Loading is strict: an unknown name, a shape mismatch or (at the end of a session) a
parameter that was never sent is an error naming the tensor. A sealed bucket (the Megatron export's: written once,
never again by its producer) is adopted rather than copied: the parameters it holds, same dtype, shape and device,
become views of it (``bucket.adopt``), which saves one full copy of the weights per sync in this process; the
memory of the weights it replaces goes back when the last of them is replaced. Any other bucket is copied.

Sleep/wake: on CUDA ``sleep()`` moves the weights to host memory and empties the CUDA cache;
``wake_up()`` (and the next weight update) moves them back. On CPU there is no device memory to give back, so both only flip the
state that makes ``generate_sequences`` refuse to run while asleep — the weights stay in RAM.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DynamicCache,
    PretrainedConfig,
)
from transformers.initialization import no_init_weights

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.models.moe_fused import expert_slice, slices_per_fused
from megatron_rl.models.vision import vision_spec_of
from megatron_rl.models.vision_inputs import MULTI_MODAL_INPUTS, collate_visual_inputs, vision_model_inputs
from megatron_rl.ops import log_probs_from_logits
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.base import RolloutEngine, WeightUpdateError
from megatron_rl.rollout.batch_io import build_rollout_batch, check_prompt_batch, repeated_prompt_rows
from megatron_rl.bucket import WeightBucket
from megatron_rl.rollout.checksum import TensorChecksum, tensor_checksum
from megatron_rl.rollout.routed_experts import RouterCapture, check_can_report
from megatron_rl.rollout.sampling import SamplingParams, resolve_sampling_params, sample_next_token

__all__ = ["HFEngine", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``rollout.dtype``: auto = bf16 on CUDA, fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"rollout.dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


class HFEngine(RolloutEngine):
    def __init__(
        self,
        config: RolloutConfig,
        model_config: PretrainedConfig | str | os.PathLike,
        *,
        response_length: int | None = None,
        weights_path: str | os.PathLike | None = None,
        device: str | torch.device | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        """``config``: the rollout config (RolloutConfig or its DictConfig). ``model_config``: the actor's
        HF config or a directory holding config.json. ``response_length`` is used when
        ``config.response_length`` is None (the trainer passes data.max_response_length)."""
        self.config = config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(str(config.dtype), self.device)
        length = config.response_length if config.response_length is not None else response_length
        if length is None or int(length) < 1:
            raise ValueError(
                f"rollout.response_length must be >= 1 (or pass response_length), got {length!r}"
            )
        self.response_length = int(length)

        if not isinstance(model_config, PretrainedConfig):
            model_config = AutoConfig.from_pretrained(model_config)
        # a vision-language checkpoint (Qwen2.5-VL): images and videos enter with the prompts, positions are mRoPE's
        self._vision = (vision_spec_of(model_config.to_dict(), f"{type(model_config).__name__}")
                        if getattr(model_config, "vision_config", None) is not None else None)
        auto = AutoModelForImageTextToText if self._vision is not None else AutoModelForCausalLM
        if weights_path is not None:
            model = auto.from_pretrained(weights_path, config=model_config, dtype=self.dtype)
        else:
            # Random weights are never served (generation is refused until a complete sync), so they are not
            # drawn: 0.6 CPU-s of start-up at 30M parameters. Buffers (rotary frequencies) are still computed.
            with no_init_weights():
                model = auto.from_config(model_config, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        # a vision-language config keeps them in its text_config
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.eos_token_id = eos_token_id if eos_token_id is not None else text_config.eos_token_id
        self.pad_token_id = pad_token_id if pad_token_id is not None else text_config.pad_token_id

        # transformers 5 renamed the forward argument past_key_values to cache
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        self._generator = torch.Generator(self.device).manual_seed(int(config.seed))
        self._targets = _checkpoint_names(self.model.state_dict(keep_vars=True))  # tied weights under both names
        self._unique_params = {id(p): name for name, p in self.model.named_parameters()}
        self._session_loaded: set[int] | None = None  # ids of parameters loaded in the open session
        # MoE: per-expert names written into transformers 5's fused expert tensors (models/moe_fused.py);
        # a fused tensor counts as loaded once every expert slice of it was
        self._session_slices: dict[int, set[str]] = {}
        self._session_version = 0
        # why the served weights cannot be trusted (None: they can)
        self._broken: str | None = (
            None if weights_path is not None else "random initial weights, never synced"
        )
        self._asleep = False
        self.weight_version = 0
        # rollout.enable_rollout_routing_replay: report each token's top-k experts (rollout/routed_experts.py)
        self._capture = (RouterCapture(self.model) if check_can_report(
            bool(config.enable_rollout_routing_replay), "the HF engine", model_config) else None)
        self._probe_capture: RouterCapture | None = None  # expert_choices' hooks when routing replay is off

    @property
    def reports_routing(self) -> bool:
        """Built with ``enable_rollout_routing_replay``: every output has ``batch['routed_experts']``."""
        return self._capture is not None

    # ------------------------------------------------------------------ generation
    def sampling_params(self, meta_info: dict[str, Any]) -> SamplingParams:
        return resolve_sampling_params(
            self.config,
            meta_info,
            response_length=self.response_length,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self._check_servable()
        check_prompt_batch(prompts)
        params = self.sampling_params(prompts.meta_info)
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        start = time.perf_counter()
        ids, mask, pos = (
            prompts.batch[k].to(self.device) for k in ("input_ids", "attention_mask", "position_ids")
        )
        self._routing: list[torch.Tensor] = []
        tokens, log_probs = self._decode(ids, mask, pos, params, generator, self._row_images(prompts))
        responses, response_lps = _cut_at_finish(tokens, log_probs, params.finish_token_ids)
        out = build_rollout_batch(
            prompts,
            responses,
            response_lps,
            response_length=params.max_response_length,
            pad_token_id=params.pad_token_id,
            weight_version=self.weight_version,
            seconds=time.perf_counter() - start,
        )
        if self._capture is not None:  # [prompt | each fed response token], -1 on padding and unfed tokens
            routed = torch.cat(self._routing, dim=1)
            full = routed.new_full((*out.batch["input_ids"].shape, *routed.shape[2:]), -1)
            full[:, : routed.shape[1]] = routed
            out.batch["routed_experts"] = full.masked_fill(~out.batch["attention_mask"].bool()[..., None, None], -1)
        return out

    def _decode(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
        images: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample up to max_response_length tokens for every row; returns tokens and log-probs [B, steps]
        (rows that finished early keep sampling into slots ``_cut_at_finish`` discards). ``images``: each row's
        processor outputs (``multi_modal_inputs``) for a vision-language model."""
        finish_ids = torch.tensor(params.finish_token_ids, dtype=ids.dtype, device=self.device)
        cache = {self._cache_kwarg: DynamicCache(config=self.model.config)}  # filled in place by each forward
        # rollout.n identical prompt rows: prefill each prompt once, then copy its cache rows and logits
        shared = repeated_prompt_rows(ids, mask, pos)
        if shared is not None and images is not None and not _same_images(images, shared):
            shared = None
        firsts, rows = shared if shared is not None else (slice(None), slice(None))
        prefill_pos, inputs = pos[firsts], {"input_ids": ids[firsts]}
        if self._vision is not None:
            first_rows = images if shared is None else [images[int(i)] for i in firsts]
            prefill_pos, inputs = self._vision_inputs(ids[firsts], mask[firsts], first_rows)
        out = self._forward(
            inputs, attention_mask=mask[firsts], position_ids=prefill_pos, **cache, use_cache=True, logits_to_keep=1,
        )
        logits = out.logits[rows, -1]
        if self._capture is not None:
            self._routing.append(self._capture.take(ids[firsts].shape)[rows])
        if shared is not None:
            cache[self._cache_kwarg].reorder_cache(rows)
        next_pos = pos[:, -1:] + 1
        if self._vision is not None:  # mRoPE: the text after the prompt continues from its largest position
            next_pos = (prefill_pos.masked_fill(~mask[firsts].bool(), 0).amax(-1, keepdim=True) + 1)[:, rows]
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
        tokens, log_probs = [], []
        for step in range(params.max_response_length):
            token, log_prob = sample_next_token(logits, params, generator)
            tokens.append(token)
            log_probs.append(log_prob)
            finished |= torch.isin(token, finish_ids)
            if bool(finished.all()) or step == params.max_response_length - 1:
                break
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            out = self.model(
                input_ids=token.unsqueeze(-1),
                attention_mask=mask,
                position_ids=next_pos,
                **cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1]
            if self._capture is not None:
                self._routing.append(self._capture.take(token.unsqueeze(-1).shape))
            next_pos = next_pos + 1
        return torch.stack(tokens, dim=-1), torch.stack(log_probs, dim=-1)

    @torch.no_grad()
    def compute_log_probs(self, data: DataProto) -> torch.Tensor:
        self._check_servable()
        data.require("input_ids", "attention_mask", "position_ids", "responses", where="compute_log_probs")
        temperature = float(data.meta_info.get("temperature", 1.0))
        parts = []
        for chunk in data.split(max(1, int(self.config.log_prob_micro_batch_size_per_gpu))):
            ids, mask, pos, responses = (
                chunk.batch[k].to(self.device)
                for k in ("input_ids", "attention_mask", "position_ids", "responses")
            )
            inputs = {"input_ids": ids}
            if self._vision is not None:
                pos, inputs = self._vision_inputs(ids, mask, self._row_images(chunk))
            width = responses.shape[-1]
            logits = self._forward(inputs, attention_mask=mask, position_ids=pos).logits[:, -width - 1 : -1]
            lp = log_probs_from_logits(logits, responses, temperature=temperature)
            response_mask = chunk.batch.get("response_mask", mask[:, -width:]).to(self.device)
            parts.append(lp * response_mask)
        return torch.cat(parts, dim=0)

    def _row_images(self, data: DataProto) -> list | None:
        """Each row's processor outputs (verl's ``multi_modal_inputs``); a text model refuses a batch with images."""
        column = data.non_tensor_batch.get(MULTI_MODAL_INPUTS)
        if column is None:
            return None
        rows = list(column)
        if self._vision is None and collate_visual_inputs(rows):
            raise ValueError(f"the HF engine's model ({type(self.model).__name__}) is a text model; the prompt batch "
                             f"has images ({MULTI_MODAL_INPUTS})")
        return rows

    def _forward(self, inputs: dict[str, Any], **kwargs: Any) -> Any:
        """The model's forward on ``inputs`` (token ids, or ``_vision_inputs``' embeddings). With Qwen3-VL's DeepStack
        features the language model and head are called directly: transformers' forward only takes them from
        pixels it places itself (models/vision.py)."""
        if "deepstack_visual_embeds" not in inputs:
            return self.model(**inputs, **kwargs)
        keep = kwargs.pop("logits_to_keep", 0)
        hidden = self.model.model.language_model(**inputs, **kwargs).last_hidden_state
        return _Logits(self.model.lm_head(hidden[:, -keep:] if keep else hidden))

    def _vision_inputs(self, ids: torch.Tensor, mask: torch.Tensor, rows: list | None) -> tuple[torch.Tensor,
                                                                                                  dict[str, Any]]:
        """(mRoPE positions [3, B, T], the forward's inputs: the embeddings [B, T, H] with the image and video features
        at the rows' placeholders, and Qwen3-VL's DeepStack features with their positions) for a vision-language
        model. The features are placed here, not by transformers, which would also take an image token the policy
        generated in a response for a placeholder."""
        positions, visual = vision_model_inputs(ids, mask, rows, self._vision)
        visual = {k: v.to(self.device) for k, v in visual.items()}
        embeds = self.model.get_input_embeddings()(ids)
        inputs: dict[str, Any] = {"inputs_embeds": embeds}
        deepstack, deepstack_mask = None, torch.zeros_like(visual["image_mask"])
        for kind, features_of in (("image", self.model.model.get_image_features),
                                  ("video", self.model.model.get_video_features)):
            pixels_key = "pixel_values" if kind == "image" else "pixel_values_videos"
            if pixels_key not in visual:
                continue
            where = visual[f"{kind}_mask"]
            output = features_of(visual[pixels_key].to(self.dtype), visual[f"{kind}_grid_thw"])
            features = torch.cat(output.pooler_output).to(embeds.dtype)
            inputs["inputs_embeds"] = inputs["inputs_embeds"].masked_scatter(where[..., None].expand_as(embeds),
                                                                             features)
            layers = getattr(output, "deepstack_features", None)
            if layers:  # per vision layer, its features of each item, placed at every visual token in sequence order
                placed = [_at_tokens(torch.cat(layer).to(embeds.dtype), where) for layer in layers]
                deepstack = placed if deepstack is None else [a + b for a, b in zip(deepstack, placed)]
                deepstack_mask |= where
        if deepstack is not None:
            inputs.update(visual_pos_masks=deepstack_mask,
                          deepstack_visual_embeds=[layer[deepstack_mask] for layer in deepstack])
        return positions.to(self.device), inputs

    @torch.no_grad()
    def expert_choices(self, data: DataProto) -> dict[int, dict[int, torch.Tensor]] | None:
        """MoE models: per layer and row of ``data``, the top-k experts ([tokens, experts] bool) transformers'
        routers pick for the row's real tokens (``attention_mask``), for the routing agreement with the trainer
        (models/moe_routing.py); None for a dense model. One row per forward, so no padding enters the routing."""
        if getattr(self.model.config, "num_experts_per_tok", None) is None:
            return None
        self._check_servable()
        data.require("input_ids", "attention_mask", where="expert_choices")
        # the routers' own choices, by decoder layer (a router's top-k of its logits is not DeepSeek-V3's choice,
        # and its logits come only for the MoE layers, which the first dense layers would shift)
        capture = self._capture or self._choices_capture()
        out: dict[int, dict[int, torch.Tensor]] = {}
        for row, (ids, mask) in enumerate(zip(data.batch["input_ids"], data.batch["attention_mask"].bool())):
            tokens = ids[mask].unsqueeze(0).to(self.device)
            self.model(input_ids=tokens)
            chosen = capture.take(tokens.shape)[0].long()  # [tokens, L, k]
            for layer in capture.layers:
                choice = torch.zeros(tokens.shape[1], capture.num_experts, dtype=torch.bool)
                out.setdefault(layer, {})[row] = choice.scatter_(1, chosen[:, layer], True)
        return out

    def _choices_capture(self) -> RouterCapture:
        """The routers' hooks for expert_choices when routing replay did not install them (once: hooks stay)."""
        if self._probe_capture is None:
            self._probe_capture = RouterCapture(self.model)
        return self._probe_capture

    def _check_servable(self) -> None:
        if self._asleep:
            raise RuntimeError("HFEngine is asleep; call wake_up() before generating or scoring")
        if self._session_loaded is not None:
            raise RuntimeError("HFEngine has an open weight-update session; call end_weight_update() first")
        if self._broken is not None:
            raise RuntimeError(
                f"HFEngine cannot serve its weights ({self._broken}); run a complete weight update"
            )

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self, version: int) -> None:
        if self._session_loaded is not None:
            raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
        self.wake_up()  # an engine released for training comes back through its next weight update
        self._session_loaded = set()
        self._session_slices = {}
        self._session_version = int(version)

    @torch.no_grad()
    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._session_loaded is None:
            raise WeightUpdateError("load outside a weight-update session; call begin_weight_update() first")
        for name, tensor in named_tensors:
            target, fused = self._targets.get(name), None
            if target is None and (found := expert_slice(self._targets, name)) is not None:
                target, fused = found
            if target is None:
                raise WeightUpdateError(
                    f"weight {name!r} is not a parameter of the rollout model "
                    f"({type(self.model).__name__}); its names look like {sorted(self._targets)[:4]}"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightUpdateError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the rollout model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            if fused is None:
                self._session_loaded.add(id(target))
                continue
            filled = self._session_slices.setdefault(id(fused), set())
            filled.add(name)
            if len(filled) == slices_per_fused(fused, self._unique_params[id(fused)]):
                self._session_loaded.add(id(fused))

    @torch.no_grad()
    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        if self._session_loaded is None or not bucket.adopt():
            self.load_named_tensors(bucket.named_tensors())
            return
        copied = []
        for index, entry in enumerate(bucket.entries):
            target = self._targets.get(entry.name)
            adoptable = (
                isinstance(target, torch.nn.Parameter) and id(target) in self._unique_params
                and target.dtype == entry.dtype and tuple(target.shape) == entry.shape
                and target.device == bucket.buffer.device
            )
            if not adoptable:  # an expert slice of a fused tensor, another dtype: copied (and checked) below
                copied.append((entry.name, bucket.tensor(index)))
                continue
            target.data = bucket.tensor(index)
            self._session_loaded.add(id(target))
        self.load_named_tensors(copied)

    def end_weight_update(self) -> None:
        if self._session_loaded is None:
            raise WeightUpdateError("no weight-update session is open; call begin_weight_update() first")
        missing = [name for pid, name in self._unique_params.items() if pid not in self._session_loaded]
        self._session_loaded = None
        if missing:
            self._broken = f"{len(missing)} parameters never sent, e.g. {missing[:3]}"
            raise WeightUpdateError(
                f"weight update incomplete: {len(missing)} parameters were not sent: {missing[:8]}"
            )
        self._broken = None
        self.weight_version = self._session_version

    def abort_weight_update(self, reason: str) -> None:
        self._session_loaded = None
        self._broken = reason

    def weight_checksums(self) -> dict[str, TensorChecksum]:
        return {name: tensor_checksum(t) for name, t in self._targets.items()}

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        if self.device.type == "cuda" and not self._asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake_up(self) -> None:
        if self.device.type == "cuda" and self._asleep:
            self.model.to(self.device)
        self._asleep = False


class _Logits(NamedTuple):
    logits: torch.Tensor


def _checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors by the names checkpoints (and the trainer's export) give them. transformers 5 nests a
    vision-language model's parts (``model.language_model.*``, ``model.visual.*``) where the released Qwen2.5-VL
    checkpoints, which our export writes, name them ``model.*`` and ``visual.*``; both names are accepted."""
    names = dict(state)
    for name, tensor in state.items():
        for nested, released in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(nested):
                names.setdefault(released + name.removeprefix(nested), tensor)
    return names


def _at_tokens(features: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """[B, T, H]: ``features`` [where.sum(), H] at the tokens ``where`` [B, T] marks, in order; zero elsewhere."""
    out = features.new_zeros(*where.shape, features.shape[-1])
    out[where] = features
    return out


def _same_images(rows: list, shared: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether the rows ``repeated_prompt_rows`` found identical also carry the same images and videos (every
    processor output) as their first row."""
    firsts, runs = shared
    for row, run in enumerate(runs.tolist()):
        first, mine = rows[int(firsts[run])] or {}, rows[row] or {}
        if first is mine:
            continue
        if set(first) != set(mine) or not all(torch.equal(torch.as_tensor(first[k]), torch.as_tensor(mine[k]))
                                              for k in first):
            return False
    return True


def _cut_at_finish(
    tokens: torch.Tensor, log_probs: torch.Tensor, finish_ids: tuple[int, ...]
) -> tuple[list[list[int]], list[list[float]]]:
    """Per row: the tokens up to and including the first finishing token (all of them if none)."""
    hit = torch.isin(tokens, torch.tensor(finish_ids, dtype=tokens.dtype, device=tokens.device))
    steps = tokens.shape[-1]
    first = torch.where(
        hit.any(-1), hit.float().argmax(-1) + 1, torch.full_like(hit[:, 0], steps, dtype=torch.long)
    )
    tokens, log_probs, first = tokens.cpu(), log_probs.cpu(), first.cpu().tolist()
    return (
        [row[:n].tolist() for row, n in zip(tokens, first)],
        [row[:n].tolist() for row, n in zip(log_probs, first)],
    )
