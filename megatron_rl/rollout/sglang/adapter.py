"""SGLangEngine: SGLang as a rollout engine — session, weight version, memory state and sampling — over one of
two transports (``engine_transport.InProcessTransport``: colocated ``sglang.Engine``;
``server_transport.ServerTransport``: HTTP servers elsewhere).

Memory (colocated): SGLang's release/resume is a state machine — resuming a tag that was never released raises
in its scheduler, which then kills the trainer — so the adapter tracks the released tags and only resumes what
it released. Order (as verl's rollout mode and slime do): ``sleep()`` releases weights, KV cache and CUDA graphs
after generation; the next weight update resumes the weights, loads them, empties the trainer's CUDA cache and
only then resumes the KV cache and CUDA graphs, so the cache is allocated into memory the trainer gave back.
Released weights are gone: after ``sleep()`` the engine refuses to generate until a complete weight update.

Log-probs are SGLang's ``output_token_logprobs``: the temperature-scaled full-vocabulary log-prob of each
sampled token (log_softmax(logits) when greedy), the HF engine's convention. ``meta_info['seed']`` becomes a
per-row ``sampling_seed``, which SGLang honours only when started with ``enable_deterministic_inference``.

Images (a vision-language model, ``image_token_id``): a row's ``multi_modal_data`` images go in the request's
``image_data`` (one list per request, each image a base64 PNG data URL), its ``input_ids`` with one
``<|image_pad|>`` per image (verl's raw_prompt_ids): SGLang decodes the ids, matches each image token with one image
and expands it from the image (an expanded prompt would not match). SGLang reports the prompt it served as
``meta_info.prompt_tokens``: it must be the trainer's expanded length. SGLang processes images only with its
tokenizer loaded (a vision-language engine starts without skip_tokenizer_init).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from packaging.version import Version

from megatron_rl.distributed.device import release_cached_memory
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.base import RolloutEngine, WeightUpdateError
from megatron_rl.rollout.batch_io import build_rollout_batch, check_prompt_batch, cut_at_finish, prompt_token_lists
from megatron_rl.bucket import WeightBucket
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.hf_engine import resolve_dtype
from megatron_rl.rollout.routed_experts import decode_sglang_routing, empty_routing, place_request_routing
from megatron_rl.rollout.sampling import SamplingParams, resolve_sampling_params
from megatron_rl.rollout.sglang.contract import MEMORY_TAGS, WEIGHT_UPDATE_SESSION_SINCE, checked
from megatron_rl.rollout.sglang.payload import serialize_bucket
from megatron_rl.rollout.vllm.vision import engine_prompts, image_data_url, row_images

__all__ = ["SGLangEngine"]

WEIGHTS = "weights"


class SGLangEngine(RolloutEngine):
    #: calls must come from the thread that built the engine (SGLang's Engine owns an event loop)
    thread_affine = True

    def __init__(
        self,
        config: RolloutConfig,
        transport: Any,
        *,
        response_length: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        needs_sync: str = "the engine starts with random weights (load_format=dummy)",
        compute_device: str = "cuda",
        routing_shape: tuple[int, int] | None = None,
        image_token_id: int | None = None,
    ) -> None:
        """``image_token_id``: the model's ``<|image_pad|>`` (a vision-language model), None for a text model.
        ``config``: the rollout config; ``transport``: an InProcessTransport or a ServerTransport (see
        ``megatron_rl.rollout.sglang.build_sglang_engine``). ``compute_device``: where the engines compute,
        which decides ``rollout.dtype=auto`` (cpu for the HF-engine servers, servers/hf_server.py)."""
        length = config.response_length if config.response_length is not None else response_length
        if length is None or int(length) < 1:
            raise ValueError(f"rollout.response_length must be >= 1 (or pass response_length), got {length!r}")
        self.config = config
        self.transport = transport
        self.response_length = int(length)
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.dtype = resolve_dtype(str(config.dtype), torch.device(compute_device))
        self.tp_size = transport.tp_size
        self.async_loads = transport.async_loads
        self.sglang_version = str(transport.version)
        self.uses_session = Version(self.sglang_version) >= WEIGHT_UPDATE_SESSION_SINCE
        self.is_server = not transport.colocated
        self.weight_version = 0
        self.released: set[str] = set()  # memory tags released and not resumed (SGLang refuses a blind resume)
        self._in_session = False
        self._session_version = 0
        self._needs_sync: str | None = needs_sync
        # (MoE layers, top-k): every result carries meta_info.routed_experts (routing replay R3); None: not asked
        self.routing_shape = routing_shape
        self.image_token = image_token_id
        if routing_shape is not None and not getattr(transport, "routed_experts", False):
            # the engine builds its transport with the flag whenever it asks for routing; the config side is
            # refused before launch (config/router_replay.py)
            raise RuntimeError("routing replay R3 asked of an SGLang transport started without "
                               "enable_return_routed_experts")

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if self._in_session:
            raise RuntimeError("SGLangEngine has an open weight-update session; call end_weight_update() first")
        if self._needs_sync is not None:
            raise RuntimeError(f"SGLangEngine cannot generate yet: {self._needs_sync}; run a complete weight sync")
        if self.released:
            raise RuntimeError(f"SGLangEngine memory {sorted(self.released)} is released; a weight sync resumes it")
        check_prompt_batch(prompts)
        params = resolve_sampling_params(
            self.config,
            prompts.meta_info,
            response_length=self.response_length,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        start = time.perf_counter()
        input_ids = prompt_token_lists(prompts)
        sampling = [checked("sampling", None, sampling_dict(params, row)) for row in range(len(input_ids))]
        images = row_images(prompts, "SGLangEngine")
        if images is None:
            outputs = self.transport.generate(input_ids, sampling)
        else:  # one image token per image in input_ids (SGLang expands it), the images as data URLs
            requests = engine_prompts(input_ids, images, self.image_token, "SGLangEngine")
            outputs = self.transport.generate([r["prompt_token_ids"] for r in requests], sampling,
                                              image_data=[[image_data_url(i) for i in r] or None for r in images])
        responses, log_probs = [], []
        for row, output in enumerate(outputs):
            if images is not None and images[row]:
                check_prompt_tokens(output, len(input_ids[row]), row)
            tokens, lps = parse_output(output, row, params)
            if self.is_server:
                self._check_served_version(output, row)
            responses.append(tokens)
            log_probs.append(lps)
        out = build_rollout_batch(
            prompts,
            responses,
            log_probs,
            response_length=params.max_response_length,
            pad_token_id=params.pad_token_id,
            weight_version=self.weight_version,
            seconds=time.perf_counter() - start,
        )
        if self.routing_shape is not None:
            out.batch["routed_experts"] = self._routed_experts(outputs, responses, prompts, out)
        return out

    def _routed_experts(self, outputs: list[dict], responses: list[list[int]], prompts: DataProto,
                        out: DataProto) -> torch.Tensor:
        """Each result's ``meta_info.routed_experts`` (base64 int32 [prompt + output - 1, L, k]) at its row."""
        routed = empty_routing(*out.batch["input_ids"].shape, *self.routing_shape)
        for row, (output, tokens) in enumerate(zip(outputs, responses)):
            payload = output["meta_info"].get("routed_experts")
            if payload is None:
                raise RuntimeError(f"SGLang result {row} has no meta_info.routed_experts (keys: "
                                   f"{sorted(output['meta_info'])}); was the engine started with "
                                   "enable_return_routed_experts?")
            array = decode_sglang_routing(payload, *self.routing_shape, f"SGLang result {row}")
            place_request_routing(routed, row, array, prompts.batch["attention_mask"][row], len(tokens),
                                  "SGLang's meta_info.routed_experts")
        return routed

    def _check_served_version(self, output: dict, row: int) -> None:
        """Server mode tags updates with our version; a sample from other weights must not slip through."""
        served = output["meta_info"].get("weight_version")
        if served != str(self.weight_version):
            raise RuntimeError(
                f"sample {row} was generated with weight version {served!r}, expected {self.weight_version}: "
                "a server missed a weight sync"
            )

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self, version: int) -> None:
        if self._in_session:
            raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
        if WEIGHTS in self.released:  # weights first: the load needs their memory, the KV cache comes after
            self._resume([WEIGHTS])
        if self.uses_session:
            self.transport.session("begin_weight_update")
        self._in_session = True
        self._session_version = int(version)
        if self.is_server:
            self.transport.set_version(version)

    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """SGLang always receives flattened buckets: pack these tensors into one (in the engine dtype)."""
        items = list(named_tensors)
        if not items:
            return
        cast = [(n, t, self.dtype if t.is_floating_point() else t.dtype) for n, t in items]
        bucket = WeightBucket(sum(t.numel() * d.itemsize + d.itemsize for _, t, d in cast), items[0][1].device)
        for name, tensor, dtype in cast:
            bucket.add(name, tensor, dtype)
        self.load_weight_bucket(bucket)

    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """A bucket from this process only: an engine of TP 1 (colocated) or a server transport."""
        self._require_session()
        if self.is_server:
            self.transport.load_bucket(bucket)
        else:
            self.load_payloads([serialize_bucket(bucket)])

    def load_payloads(self, payloads: list) -> None:
        """Colocated: one serialized bucket per engine TP rank, each made on that rank's GPU (replica.py
        gathers them from the replica's ranks)."""
        self._require_session()
        self.transport.load_payloads(payloads, version=self._session_version)

    def _require_session(self) -> None:
        if not self._in_session:
            raise WeightUpdateError("load outside a weight-update session; call begin_weight_update() first")

    def end_weight_update(self) -> None:
        if not self._in_session:
            raise WeightUpdateError("no weight-update session is open; call begin_weight_update() first")
        self._close_session()
        self.transport.flush_cache()  # cached prefixes hold KV computed with the old weights
        self.weight_version = self._session_version
        self._needs_sync = None
        if self.released:  # KV cache and CUDA graphs last, into the memory the trainer just gave back
            release_cached_memory()  # this rank's; the replica's other ranks gave theirs back before (replica.py)
            self._resume(sorted(self.released))

    def abort_weight_update(self, reason: str) -> None:
        self._needs_sync = reason
        if self._in_session:
            self._close_session()

    def _close_session(self) -> None:
        self._in_session = False
        if self.uses_session:
            self.transport.session("end_weight_update")

    def replace_servers(self, server_urls: list[str]) -> list[str]:
        """Server mode: dead servers were replaced at new URLs; nothing is generated before a complete sync.
        Returns the URLs of servers stuck in a broken broadcast, to be replaced too (ServerTransport)."""
        if not self.is_server:
            raise RuntimeError("replace_servers is for rollout.mode=server; a colocated engine has no servers")
        stuck = self.transport.replace_servers(server_urls)
        self._needs_sync = f"rollout servers were replaced ({server_urls}) and have not received the weights yet"
        return stuck

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Release every tag still held (nothing is released twice); the weights are gone until the next sync."""
        tags = [tag for tag in MEMORY_TAGS if tag not in self.released]
        if tags:
            self.transport.memory("release_memory_occupation", tags)
            self.released.update(tags)
        if WEIGHTS in tags:
            self._needs_sync = "its weights were released by sleep()"

    def wake_up(self) -> None:
        """The next weight update resumes what ``sleep`` released, in SGLang's order; nothing to do here."""

    def _resume(self, tags: list[str]) -> None:
        unknown = [tag for tag in tags if tag not in self.released]
        if unknown:  # SGLang would raise in its scheduler and take the trainer down
            raise WeightUpdateError(f"resume of memory {unknown} that was never released (released: {sorted(self.released)})")
        self.transport.memory("resume_memory_occupation", tags)
        self.released.difference_update(tags)

    def shutdown(self) -> None:
        self.transport.shutdown()


# ---------------------------------------------------------------------------------------------- helpers
def sampling_dict(params: SamplingParams, row: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_new_tokens": params.max_response_length,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": list(params.finish_token_ids),
        "ignore_eos": False,
    }
    if params.seed is not None:
        out["sampling_seed"] = params.seed + row
    return out


def check_prompt_tokens(output: dict, expected: int, row: int) -> None:
    """SGLang's ``meta_info.prompt_tokens`` (the prompt it served, images expanded) is the trainer's prompt length."""
    served = (output.get("meta_info") or {}).get("prompt_tokens")
    if served != expected:
        raise RuntimeError(f"SGLang served prompt row {row} as {served!r} tokens, the trainer's prompt has {expected}: "
                           "SGLang expanded its images otherwise than the trainer's processor; the response would not "
                           "follow the prompt the trainer scores")


def parse_output(output: dict, row: int, params: SamplingParams) -> tuple[list[int], list[float]]:
    """Response tokens and log-probs from ``meta_info.output_token_logprobs`` ([logprob, token_id, text]),
    cut after the first finishing token."""
    try:
        entries = output["meta_info"]["output_token_logprobs"]
    except (KeyError, TypeError) as exc:
        raise RuntimeError(
            f"SGLang result {row} has no meta_info.output_token_logprobs (keys: "
            f"{sorted(output) if isinstance(output, dict) else type(output).__name__})"
        ) from exc
    return cut_at_finish([int(e[1]) for e in entries], [float(e[0]) for e in entries], params.finish_token_ids,
                         params.max_response_length, f"SGLang result {row}")
