"""A strict CPU stand-in of SGLang 0.5.23 (test infrastructure only; importable as ``sglang`` when
``tests/stand_ins`` is on sys.path / PYTHONPATH).

Modules with SGLang's paths: ``sglang.Engine`` (= ``sglang.srt.entrypoints.engine.Engine``),
``sglang.srt.utils.common.MultiprocessingSerializer``, ``sglang.srt.utils.patch_torch.
monkey_patch_torch_reductions``, ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``,
``sglang.srt.utils.network.get_free_port_below_ephemeral``. The HTTP server is ``tests/stand_ins/
sglang_server.py``.

Environment: SGLANG_STAND_IN_ROOT (required: GPU registry + logs), SGLANG_STAND_IN_NODE (default hostname),
SGLANG_STAND_IN_GPUS_PER_NODE (default 8), CUDA_VISIBLE_DEVICES, MEGATRON_RL_DEVICE_INDEX (current device
index, default 0), SGLANG_MEMORY_SAVER_CUDA_GRAPH, SGLANG_STAND_IN_COPY_DELAY_S (default 0.075),
SGLANG_STAND_IN_TIMEOUT_S (scheduler answers and collectives, default 60), SGLANG_STAND_IN_START_TIMEOUT_S
(default 180), SGLANG_STAND_IN_CRASH_RANK (test hook), SGLANG_STAND_IN_BUILD_DELAY_S (test hook: Engine() takes
that long before its schedulers start, as a cold build does), SGLANG_STAND_IN_COPY_HOLD (test hook: a path;
while that file exists, queued weight copies wait).

Stricter than SGLang (on purpose: what passes here must pass on a GPU cluster):
- every serialized payload carries a ProducerTag (node, physical GPU, pid); a flattened_bucket payload is
  accepted by scheduler i only if it was produced on the same node and on scheduler i's physical GPU
  (colocated sync), and only payload i is deserialized by scheduler i;
- one scheduler per physical GPU per node (a file registry under ``$SGLANG_STAND_IN_ROOT``);
- base_gpu_id + rank must be visible in CUDA_VISIBLE_DEVICES; the process's current device is
  ``visible[MEGATRON_RL_DEVICE_INDEX]`` (default 0: a process that never bound its device is on visible[0]);
- unknown Engine kwargs, sampling params, weight names and shape mismatches are errors (SGLang may skip);
- Engine() takes only the ServerArgs it emulates (SERVER_ARGS_DEFAULTS in srt/entrypoints/engine.py; other real
  fields are refused); ep_size, moe_runner_backend and moe_a2a_backend are checked (ep_size must divide
  tp_size: SGLang fails later, in its schedulers) and recorded (``stand_in_given_args``), not emulated;
- release/resume need enable_memory_saver=True (SGLang silently frees nothing without it); releasing a tag
  twice is an error; a weight update while weights are released is refused; generation is refused while
  weights/kv_cache (or saver-managed cuda_graph memory) are released or any weight is NaN;
- per-GPU memory: a trainer process marked by ``_stand_in.devices.hold_trainer_cache(n)`` holds n bytes reserved
  (torch's caching allocator) on its GPU until it calls ``torch.cuda.empty_cache()``; resuming kv_cache or
  cuda_graph on a GPU where any live trainer process holds some kills the engine with a CUDA OOM (on a GPU it
  fails when the cache does not fit beside it: here any held byte fails);
- generate is refused while a weight-update session is open (weights are finalized by end_weight_update);
- all Engine methods must be called from the creating thread; skip_tokenizer_init=True and
  load_format="dummy" are required; ``selector`` must be "all"; a weight-update group needs rank_offset >= 1.

Faithful to 0.5.23 (and therefore unforgiving the same way):
- a load that fails on one tensor has loaded the tensors before it (SGLang's load loop): a failed update is
  a partial one; update_weights_from_distributed receives the broadcast first and then validates;
- weight copies are asynchronous: ``update_weights_from_tensor`` returns once every scheduler has queued
  its copy; the copy runs SGLANG_STAND_IN_COPY_DELAY_S (default 0.075) later and reads the producer's
  shared memory then, so reusing the buffer too early corrupts the weights; reads wait for copies;
- the weight-update session (begin/end, 0.5.23 messages); updates answer (success, message);
- nccl_port is drawn with the global ``random`` module below the ephemeral range and bound later by the
  scheduler: processes seeded alike collide (EADDRINUSE, engine start fails, it does not hang);
- resume of a tag that is not released kills the engine (every later call: "engine is dead: ...");
  resumed weights are NaN until loaded; cuda_graph memory is freed only with
  SGLANG_MEMORY_SAVER_CUDA_GRAPH=true set at build time;
- Engine() writes 0.5.23's ``_set_envs_and_config`` variables into the caller's environment (NCCL_CUMEM_ENABLE
  and NCCL_NVLS_ENABLE = 0 unless set, CUDA_DEVICE_MAX_CONNECTIONS=8, TRTLLM_ENABLE_PDL, CUTE_DSL_*,
  SGLANG_RUN_ID) and forces ``multiprocessing.set_start_method("spawn")`` in the caller;
- Engine() (main thread) replaces the caller's SIGQUIT handler (kill the process tree, 0.5.23's launch
  phase handler) and SIGTERM handler (log and ignore; 0.5.23's source does this on non-zero node ranks, the
  stand-in always does it: stricter);
- TP sharding like SGLang's Llama/Qwen2/Qwen3 loaders (qkv_proj / gate_up_proj stacked column parallel, kv
  heads replicated when tp > num_kv_heads, o_proj/down_proj row parallel, vocab parallel embed/lm_head
  padded to a multiple of 64, norms replicated).

Different from SGLang (by necessity):
- CPU, computes in fp32; ``dtype`` decides the dtype the engine serves, by 0.5.23's rule (``auto``: the
  checkpoint's torch_dtype, fp16 for an fp32 checkpoint), and a weight arriving in another dtype is refused
  (SGLang casts it silently: stricter); CPU shared memory (sharing strategy file_system)
  stands in for CUDA IPC; gloo stands in for NCCL (backend "nccl" is accepted and run as gloo);
- generation gathers the shards to scheduler 0 and runs the transformers model there (own decode loop, fp32;
  log-probs are temperature-scaled full-vocabulary log_softmax, greedy = log_softmax(logits) at
  temperature 0): no radix cache (flush_cache is a no-op), sampling_seed ignored, no streaming, text is
  always None, rows with equal sampling params (apart from sampling_seed) are batched together;
- load_format=None tensors are serialized by the Engine in the caller (as SGLang does) and are not
  GPU-checked (only node-checked); per-rank payloads (flattened_bucket, and every HTTP payload) are;
  LocalSerializedTensor and load_format="direct" are not supported;
- the GPU registry and port choice are simulated on one machine (nodes are names, GPUs are numbers);
- extra inspection methods ``stand_in_*`` exist on Engine; test hook: SGLANG_STAND_IN_CRASH_RANK=<r> makes
  scheduler r exit (code 3) during start;
- not emulated: ulimit, ZMQ/IPC ports, the tokenizer manager, streaming.
"""

__version__ = "0.5.23"


def __getattr__(name):
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")


__all__ = ["Engine", "__version__"]
