"""One stand-in scheduler process: one TP rank on one (simulated) physical GPU.

It holds only its shard, answers commands from the Engine over a pipe, talks to the other ranks over a
gloo group on 127.0.0.1:nccl_port, and performs weight copies asynchronously on a background "stream".
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

TAGS = ("weights", "kv_cache", "cuda_graph")
KV_CACHE_BYTES_AT_FULL = 8 << 20  # kv_cache bytes = mem_fraction_static * this
CUDA_GRAPH_BYTES = 1 << 20
DEFAULT_COPY_DELAY_S = 0.075


class Fatal(Exception):
    """The scheduler cannot continue (SGLang's scheduler process dies, taking the engine with it)."""


class CopyStream:
    """A CUDA stream stand-in: jobs run in order, each after its delay, on one background thread. While the
    file ``hold`` exists (a test hook) no job runs: a test orders its steps before a copy without a race."""

    def __init__(self, delay_s: float, hold: str | None = None) -> None:
        self.delay_s = delay_s
        self.hold = hold
        self.jobs: queue.Queue = queue.Queue()
        self.error: str | None = None
        threading.Thread(target=self._run, daemon=True, name="copy-stream").start()

    def submit(self, fn) -> None:
        self.jobs.put((time.monotonic() + self.delay_s, fn))

    def _run(self) -> None:
        while True:
            due, fn = self.jobs.get()
            try:
                time.sleep(max(0.0, due - time.monotonic()))
                while self.hold and os.path.exists(self.hold):
                    time.sleep(0.01)
                fn()
            except Exception as exc:  # noqa: BLE001
                self.error = f"asynchronous weight copy failed: {type(exc).__name__}: {exc}"
            finally:
                fn = None  # drop the producer's memory (its shared-memory refcount) before the job is done
                self.jobs.task_done()

    def synchronize(self) -> None:
        self.jobs.join()
        if self.error is not None:
            raise RuntimeError(self.error)


def served_dtype(requested: str, config: Any, torch: Any) -> Any:
    """The dtype SGLang 0.5.23 serves (srt/configs/model_config.py _get_and_verify_dtype): an explicit dtype as
    asked; ``auto``: the checkpoint's ``torch_dtype``, except that an fp32 checkpoint is served in fp16 (bf16
    for Gemma)."""
    names = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}
    if requested != "auto":
        return getattr(torch, names[requested])
    stored = getattr(config, "torch_dtype", None) or torch.float32
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    if stored == torch.float32:
        return torch.bfloat16 if str(getattr(config, "model_type", "")).startswith("gemma") else torch.float16
    return stored


class Scheduler:
    def __init__(self, args: dict[str, Any]) -> None:
        if os.environ.get("SGLANG_STAND_IN_CRASH_RANK") == str(args["tp_rank"]):  # test hook: die at start
            os._exit(3)
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.args = args
        self.rank, self.tp = args["tp_rank"], args["tp_size"]
        self.node, self.gpu = args["node"], args["physical_gpu"]
        torch.set_num_threads(1)
        self.log = logging.getLogger(f"sglang_stand_in.scheduler{self.rank}")

        # the rendezvous binds nccl_port now (chosen by the parent earlier, like 0.5.23)
        port = args["nccl_port"]
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=self.rank,
                world_size=self.tp,
                timeout=timedelta(seconds=float(args["collective_timeout_s"])),
            )
        except Exception as exc:  # noqa: BLE001 - any failure to join is fatal, with its reason
            text = str(exc)
            if "EADDRINUSE" in text or "address already in use" in text.lower():
                raise Fatal(
                    f"scheduler TP{self.rank} could not bind nccl_port {port} on 127.0.0.1: "
                    f"EADDRINUSE (address already in use) — another engine picked the same port"
                ) from None
            raise Fatal(
                f"scheduler TP{self.rank} failed to join the TP group on port {port}: {text}"
            ) from None

        from transformers import AutoConfig, AutoModelForCausalLM  # after the bind: a port clash fails fast

        from sglang._stand_in.sharding import ShardLayout

        self.config = AutoConfig.from_pretrained(args["model_path"])
        self.served_dtype = None if args.get("dtype") is None else served_dtype(args["dtype"], self.config, torch)
        torch.manual_seed(int(args["random_seed"]))
        model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        full = {k: v.detach() for k, v in model.state_dict().items()}
        self.layout = ShardLayout(self.config, {k: v.shape for k, v in full.items()}, self.tp, self.rank)
        self.shards: dict[str, Any] | None = self.layout.shard(full)
        del model, full
        self.kv_cache: Any = torch.zeros(
            int(float(args["mem_fraction_static"]) * KV_CACHE_BYTES_AT_FULL), dtype=torch.uint8
        )
        self.cuda_graph: Any = torch.zeros(CUDA_GRAPH_BYTES, dtype=torch.uint8)
        self.released: set[str] = set()
        self.stream = CopyStream(
            float(os.environ.get("SGLANG_STAND_IN_COPY_DELAY_S", DEFAULT_COPY_DELAY_S)),
            os.environ.get("SGLANG_STAND_IN_COPY_HOLD"),
        )
        self.groups: dict[str, Any] = {}
        self.hf_model = None
        self.sample_calls = 0

    # ------------------------------------------------------------------ helpers
    def memory(self) -> dict[str, int]:
        weights = (
            0 if self.shards is None else sum(t.numel() * t.element_size() for t in self.shards.values())
        )
        return {
            "weights": weights,
            "kv_cache": 0 if self.kv_cache is None else self.kv_cache.numel(),
            "cuda_graph": 0 if self.cuda_graph is None else self.cuda_graph.numel(),
        }

    def _serving_problem(self) -> str | None:
        if "weights" in self.released or self.shards is None:
            return "weights are released (release_memory_occupation); resume and load them first"
        if "kv_cache" in self.released:
            return "kv_cache is released (release_memory_occupation); resume it first"
        if "cuda_graph" in self.released and self.cuda_graph is None:
            return "cuda_graph memory is released; resume it first"
        return None

    def _agree(self, problem: str | None) -> None:
        """Every rank learns every rank's problem before a collective (no rank is left waiting)."""
        problems: list[Any] = [None] * self.tp
        self.dist.all_gather_object(problems, problem)
        found = [f"TP{r}: {p}" for r, p in enumerate(problems) if p]
        if found:
            raise RuntimeError("; ".join(found))

    def _gather_full(self, for_serving: bool) -> dict | None:
        """All shards to rank 0 (one flat gather), reassembled into the full HF state dict there."""
        torch = self.torch
        self.stream.synchronize()
        if for_serving:
            problem = self._serving_problem()
        else:
            problem = "weights are released" if self.shards is None else None
        self._agree(problem)
        names = sorted(self.shards)
        flat = torch.cat([self.shards[n].reshape(-1) for n in names])
        bufs = [torch.empty_like(flat) for _ in range(self.tp)] if self.rank == 0 else None
        self.dist.gather(flat, bufs, dst=0)
        if self.rank != 0:
            return None
        per_rank = []
        for buf in bufs:
            shard, offset = {}, 0
            for n in names:
                shape = self.layout.shard_shapes[n]
                size = int(torch.Size(shape).numel())
                shard[n] = buf[offset : offset + size].view(shape)
                offset += size
            per_rank.append(shard)
        return self.layout.reassemble(per_rank)

    # ------------------------------------------------------------------ commands
    def cmd_update_tensor(self, payload: Any, load_format: str | None, check_gpu: bool) -> str:
        from sglang.srt.utils.common import MultiprocessingSerializer

        torch = self.torch
        tag, obj = MultiprocessingSerializer.deserialize_tagged(payload)  # only this rank's entry
        if tag.node != self.node or (check_gpu and tag.physical_gpu != self.gpu):
            raise ValueError(
                f"payload for TP rank {self.rank} was produced on node {tag.node} GPU {tag.physical_gpu} "
                f"(pid {tag.pid}), but scheduler TP{self.rank} runs on node {self.node} GPU {self.gpu}: its "
                "IPC handles cannot be opened here (colocated sync: trainer rank group_start+i must "
                "serialize payload i on its own GPU)"
            )
        if load_format == "flattened_bucket":
            if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
                raise ValueError("flattened_bucket payload must be {'flattened_tensor', 'metadata'}")
            flat = obj["flattened_tensor"]
            if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
                raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
            named = []
            for m in obj["metadata"]:
                nbytes = int(torch.Size(m.shape).numel()) * m.dtype.itemsize
                if m.end_idx - m.start_idx != nbytes or m.end_idx > flat.numel():
                    raise ValueError(f"metadata of {m.name!r} does not match the flattened tensor")
                named.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).view(m.shape)))
        elif load_format is None:
            if not isinstance(obj, (list, tuple)):
                raise ValueError(f"load_format=None needs a list of (name, tensor), got {type(obj).__name__}")
            named = list(obj)
        else:
            raise ValueError(f"Unknown load_format={load_format}")
        return self._load(named)

    def _load(self, named: list) -> str:
        torch = self.torch
        if self.shards is None or "weights" in self.released:
            raise RuntimeError("weights are released; resume_memory_occupation(['weights']) before loading")
        plans = []
        shards = self.shards

        def copy() -> None:  # runs later on the copy stream, reading the producer's memory then
            with torch.no_grad():
                for plan, tensor in plans:
                    shards[plan.target][plan.dst].copy_(tensor[plan.src])

        try:
            for name, tensor in named:
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
                if not tensor.is_floating_point():
                    raise ValueError(f"weight {name!r} has dtype {tensor.dtype}, not floating point")
                if self.served_dtype is not None and tensor.dtype != self.served_dtype:  # SGLang casts silently: what was sent is not served
                    raise ValueError(
                        f"weight {name!r} arrives as {tensor.dtype} but the engine serves {self.served_dtype} "
                        f"(dtype={self.args['dtype']!r}): the weights it serves are not the ones sent"
                    )
                plan = self.layout.plan(name, tensor.shape)
                if plan is not None:
                    plans.append((plan, tensor))
        finally:
            # like SGLang's load_weights loop, the tensors before a bad one are loaded anyway
            self.stream.submit(copy)
        return "Success"

    def cmd_generate(self, rows: list[list[int]], sampling: list[dict], routed: bool = False) -> Any:
        full = self._gather_full(True)
        if self.rank != 0:
            return None
        bad = [n for n, t in full.items() if not bool(self.torch.isfinite(t).all())]
        if bad:
            raise RuntimeError(f"weights are NaN/inf (never loaded after resume?): {bad[:4]}")
        results = self._generate(full, rows, sampling)
        if routed:
            for row, result in zip(rows, results):
                result["meta_info"]["routed_experts"] = self._routed_experts(row + result["output_ids"])
        return results

    def _routed_experts(self, tokens: list[int]) -> str:
        """SGLang's payload: base64 of a C-order int32 array [len(tokens) - 1, layers, top-k], the experts each
        computed token (the prompt's, then every output token fed back; not the last) was routed to."""
        import base64

        torch = self.torch
        routers = [m for m in self.hf_model.modules() if type(m).__name__.endswith("TopKRouter")]
        if not routers:
            raise ValueError("return_routed_experts on a model without MoE routers")
        seen: list = [None] * len(routers)
        handles = [r.register_forward_hook(lambda m, i, o, j=j: seen.__setitem__(j, o[2])) for j, r in enumerate(routers)]
        try:
            with torch.no_grad():
                self.hf_model(input_ids=torch.tensor([tokens[:-1]]))
        finally:
            for handle in handles:
                handle.remove()
        ids = torch.stack([s.reshape(len(tokens) - 1, -1) for s in seen], dim=1).to(torch.int32)
        return base64.b64encode(ids.contiguous().numpy().tobytes()).decode("ascii")

    def _generate(self, full: dict, rows: list[list[int]], sampling: list[dict]) -> list[dict]:
        torch = self.torch
        if self.hf_model is None:
            from transformers import AutoModelForCausalLM

            self.hf_model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32).eval()
        self.hf_model.load_state_dict(full, strict=True)
        eos = self.config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        groups: dict[Any, list[int]] = {}
        for i, sp in enumerate(sampling):
            key = tuple(
                sorted(
                    (k, tuple(v) if isinstance(v, list) else v) for k, v in sp.items() if k != "sampling_seed"
                )
            )
            groups.setdefault(key, []).append(i)
        results: list[Any] = [None] * len(rows)
        for indices in groups.values():
            sp = sampling[indices[0]]
            stop = set(sp.get("stop_token_ids") or []) | (set() if sp.get("ignore_eos") else set(eos))
            tokens, lps = self._decode([rows[i] for i in indices], sp, stop, pad)
            for j, i in enumerate(indices):
                toks, lp = tokens[j], lps[j]
                finish = (
                    {"type": "stop", "matched": toks[-1]}
                    if toks and toks[-1] in stop
                    else {"type": "length", "length": len(toks)}
                )
                results[i] = {
                    "text": None,
                    "output_ids": toks,
                    "meta_info": {
                        "id": str(i),
                        "finish_reason": finish,
                        "output_token_logprobs": [[p, t, None] for p, t in zip(lp, toks)],
                        "completion_tokens": len(toks),
                        "prompt_tokens": len(rows[i]),
                    },
                }
        return results

    def _decode(self, rows: list[list[int]], sp: dict, stop: set[int], pad: int):
        """Left-padded batch decode (full recompute per step; tiny models). Log-probs: temperature-scaled
        full-vocabulary log_softmax of the drawn token; temperature 0 = greedy with log_softmax(logits)."""
        torch = self.torch
        temperature = float(sp.get("temperature", 1.0))
        top_p = float(sp.get("top_p", 1.0))
        top_k = int(sp.get("top_k", -1))
        steps = int(sp.get("max_new_tokens", 128))
        if temperature < 0 or not 0 < top_p <= 1 or top_k == 0 or top_k < -1 or steps < 0:
            raise ValueError(f"invalid sampling params {sp}")
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        self.sample_calls += 1
        gen = torch.Generator().manual_seed(int(self.args["random_seed"]) * 1000003 + self.sample_calls)
        out_tokens: list[list[int]] = [[] for _ in rows]
        out_lps: list[list[float]] = [[] for _ in rows]
        done = [False] * len(rows)
        with torch.no_grad():
            for _ in range(steps):
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = (
                    self.hf_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
                )
                if temperature == 0:
                    lp_all = torch.log_softmax(logits, -1)
                    tok = logits.argmax(-1)
                else:
                    scaled = logits / temperature
                    lp_all = torch.log_softmax(scaled, -1)
                    filt = scaled.clone()
                    if top_k > 0 and top_k < filt.shape[-1]:
                        kth = torch.topk(filt, top_k, dim=-1).values[:, -1:]
                        filt[filt < kth] = float("-inf")
                    if top_p < 1.0:
                        srt, idx = torch.sort(filt, descending=True, dim=-1)
                        probs = torch.softmax(srt, -1)
                        drop = probs.cumsum(-1) - probs >= top_p
                        srt[drop] = float("-inf")
                        filt = torch.full_like(filt, float("-inf")).scatter(-1, idx, srt)
                    tok = torch.multinomial(torch.softmax(filt, -1), 1, generator=gen).squeeze(-1)
                lp = lp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
                for b in range(len(rows)):
                    if not done[b]:
                        out_tokens[b].append(int(tok[b]))
                        out_lps[b].append(float(lp[b]))
                        done[b] = int(tok[b]) in stop
                if all(done):
                    break
                ids = torch.cat([ids, tok.unsqueeze(-1)], -1)
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], -1)
        return out_tokens, out_lps

    def cmd_state_dict(self) -> Any:
        full = self._gather_full(False)
        return None if full is None else {k: v.numpy().copy() for k, v in full.items()}

    def cmd_shards(self) -> Any:
        self.stream.synchronize()
        if self.shards is None:
            return None
        return {k: v.numpy().copy() for k, v in self.shards.items()}

    def cmd_memory(self) -> dict[str, int]:
        return self.memory()

    def cmd_release(self, tags: list[str]) -> None:
        self.stream.synchronize()  # stream order: pending copies finish before memory goes away
        again = [t for t in tags if t in self.released]
        if again:
            raise RuntimeError(f"memory tags {again} are already released")
        for tag in tags:
            self.released.add(tag)
            if tag == "weights":
                self.shards = None  # really freed
            elif tag == "kv_cache":
                self.kv_cache = None
            elif tag == "cuda_graph" and self.args["cuda_graph_saver"]:
                self.cuda_graph = None  # without SGLANG_MEMORY_SAVER_CUDA_GRAPH=true it stays held
        import gc

        gc.collect()

    def cmd_resume(self, tags: list[str]) -> None:
        torch = self.torch
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise Fatal(f"KeyError: resume_memory_occupation of tag {missing[0]!r} that is not released")
        self._check_trainer_cache([t for t in tags if t in ("kv_cache", "cuda_graph")])
        for tag in tags:
            self.released.discard(tag)
            if tag == "weights":
                self.shards = {
                    n: torch.full(s, float("nan"), dtype=torch.float32)
                    for n, s in self.layout.shard_shapes.items()
                }
            elif tag == "kv_cache":
                self.kv_cache = torch.zeros(
                    int(float(self.args["mem_fraction_static"]) * KV_CACHE_BYTES_AT_FULL), dtype=torch.uint8
                )
            elif tag == "cuda_graph" and self.cuda_graph is None:
                self.cuda_graph = torch.zeros(CUDA_GRAPH_BYTES, dtype=torch.uint8)

    def _check_trainer_cache(self, tags: list[str]) -> None:
        """The KV cache and CUDA graphs are allocated into what the trainer processes on this GPU gave back: memory
        a trainer still holds reserved (torch's cache, no empty_cache) makes the allocation fail, which kills
        the scheduler as an OOM would."""
        root = self.args.get("registry_root")
        if not tags or not root:
            return
        from pathlib import Path

        from sglang._stand_in.devices import trainer_cache_on

        held = trainer_cache_on(Path(root), self.node, self.gpu)
        if held:
            raise Fatal(
                f"torch.OutOfMemoryError: CUDA out of memory resuming {tags} on GPU {self.gpu} of node {self.node} "
                f"(scheduler TP{self.rank}): trainer processes hold memory reserved by PyTorch but unallocated "
                f"({', '.join(f'pid {p}: {n} bytes' for p, n in sorted(held.items()))}); every process on this "
                "GPU must call torch.cuda.empty_cache() before the resume"
            )

    def cmd_flush_cache(self) -> bool:
        return True

    # ------------------------------------------------------------------ server-only: update group
    def cmd_init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> str:
        if group_name in self.groups:
            raise ValueError(f"weight-update group {group_name!r} already exists")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r} not supported")
        self.groups[group_name] = _init_custom_process_group(
            master_address,
            master_port,
            rank=rank_offset + self.rank,
            world_size=world_size,
            group_name=group_name,
            backend="gloo",
            timeout=timedelta(seconds=float(self.args["collective_timeout_s"])),
        )
        return "Succeeded to initialize custom process group."

    def cmd_update_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
    ) -> str:
        torch = self.torch
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(
                f"Group {group_name} not in {list(self.groups)}. "
                "Please call `init_weights_update_group` first."
            )
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"Unknown load_format={load_format}")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        if not names:
            raise ValueError("Cannot create empty tensor bucket")
        types = [getattr(torch, d) for d in dtypes]
        sizes = [int(torch.Size(s).numel()) * t.itemsize for s, t in zip(shapes, types)]
        offset = 0
        for name, shape, t, size in zip(names, shapes, types, sizes):
            if any(dim < 0 for dim in shape):
                raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
            if load_format == "flattened_bucket" and offset % t.itemsize:
                raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {t}")
            offset += size
        if load_format == "flattened_bucket":
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            self.dist.broadcast(flat, src=0, group=group)
            named, offset = [], 0
            for name, shape, t, size in zip(names, shapes, types, sizes):
                named.append((name, flat[offset : offset + size].view(t).view(shape)))
                offset += size
        else:
            named = []
            for name, shape, t in zip(names, shapes, types):
                buf = torch.empty(shape, dtype=t)
                self.dist.broadcast(buf, src=0, group=group)
                named.append((name, buf))
        return self._load(named)

    def cmd_destroy_group(self, group_name: str) -> str:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"Group {group_name} not in {list(self.groups)}")
        self.dist.destroy_process_group(group)
        return "Succeeded to destroy custom process group."


def scheduler_main(conn, args: dict[str, Any]) -> None:
    """Process entry point (multiprocessing spawn)."""
    log_dir = args.get("log_dir")
    if log_dir:
        logging.basicConfig(
            filename=os.path.join(log_dir, f"{args['engine_id']}-tp{args['tp_rank']}.log"),
            level=logging.INFO,
            format="%(asctime)s %(name)s %(message)s",
        )
    try:
        scheduler = Scheduler(args)
    except BaseException as exc:  # noqa: BLE001 - reported to the Engine, which fails its start
        conn.send(("error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, Fatal) else str(exc), True))
        logging.getLogger("sglang_stand_in").error(traceback.format_exc())
        return
    conn.send(("ready", scheduler.memory(), False))
    while True:
        try:
            name, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        if name == "shutdown":
            with contextlib.suppress(Exception):
                scheduler.stream.synchronize()  # release mappings of producer memory before exiting
            conn.send(("ok", None, False))
            break
        try:
            result = getattr(scheduler, f"cmd_{name}")(**kwargs)
        except Fatal as exc:
            conn.send(("error", str(exc), True))
            logging.getLogger("sglang_stand_in").error("fatal: %s", exc)
            os._exit(1)
        except Exception as exc:  # noqa: BLE001
            logging.getLogger("sglang_stand_in").error(traceback.format_exc())
            conn.send(("error", f"{type(exc).__name__}: {exc}", False))
        else:
            conn.send(("ok", result, False))
    with contextlib.suppress(Exception):
        scheduler.dist.destroy_process_group()
    os._exit(0)


def _init_custom_process_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout: timedelta,
):
    """Join a named group beside the default one, the way SGLang's init_custom_process_group does:
    tcp:// rendezvous (rank 0, the trainer, hosts the store), a PrefixStore named after the group, and
    torch's _new_process_group_helper."""
    from torch.distributed import distributed_c10d as c10d

    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
