"""Multi-rank jobs of test_context_parallel_weights.py: weight export and checkpoints under context parallelism.

Every engine is the actor's MegatronEngine (fp32, AdamW) on a tiny Qwen2, built directly after
``init_model_parallel`` (not through the validated config path). Training steps use synthetic gradients: each
parameter's ``main_grad`` is set from a seed of (step, name, TP rank), i.e. the same on every DP and CP rank of a
TP rank, as after the DP x CP gradient reduction; so two layouts of the same TP size take the same steps, and
what is compared is the checkpoint and export machinery, not the forward path.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel

BUCKET_BYTES = 24 << 10  # several export buckets for the tiny model


# ------------------------------------------------------------------------------------------------ helpers
def make_engine(model_dir: str, tp: int, cp: int):
    from megatron_rl.config.schema import MegatronParallelConfig, OptimConfig
    from megatron_rl.workers import MegatronEngine

    parallel = MegatronParallelConfig(
        tensor_model_parallel_size=tp, context_parallel_size=cp, packed_sequences=True
    )
    return MegatronEngine(model_dir, parallel, OptimConfig(lr=1e-2, weight_decay=0.0))


def _named_params(engine) -> dict[str, torch.nn.Parameter]:
    from megatron_rl.models.layout import unwrap

    return {f"{i}.{name}": p for i, chunk in enumerate(engine.model) for name, p in unwrap(chunk).named_parameters()}


def synthetic_step(engine, step: int) -> float:
    """One optimizer step on gradients that depend only on (step, parameter name, TP rank; parameters that TP
    does not split get the same gradient on every TP rank, as in training); the grad norm."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    engine.zero_grad()
    for name, param in _named_params(engine).items():
        shard = tp_rank if getattr(param, "tensor_model_parallel", False) else "replicated"
        gen = torch.Generator().manual_seed(zlib.crc32(f"{step}/{name}/{shard}".encode()))
        param.main_grad.copy_(torch.randn(param.shape, generator=gen))
    grad_norm = engine.optimizer_step()
    engine.scheduler_step()
    return grad_norm


def _adam_states(engine) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): name for name, p in _named_params(engine).items()}
    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    out: dict[str, dict[str, torch.Tensor]] = {}
    for opt in optimizers:
        torch_opt = opt.optimizer
        for group in torch_opt.param_groups:
            for p in group["params"]:
                state = torch_opt.state.get(p, {})
                out[names[id(p)]] = {k: torch.as_tensor(v).detach().clone() for k, v in state.items()}
    return out


def local_state(engine) -> dict[str, Any]:
    """This rank's weights (its TP shards), Adam moments and steps, LR and scheduler position."""
    return {
        "weights": {name: p.detach().clone() for name, p in _named_params(engine).items()},
        "adam": _adam_states(engine),
        "lr": engine.lr,
        "scheduler_steps": engine.scheduler.state_dict().get("num_steps"),
    }


def _layout_key() -> tuple[int, int, int]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_context_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )


def exports(engine, tp: int) -> dict[str, Any]:
    """The colocated export (every rank materialises) and the server-mode one (only global rank 0 does), with
    the tensors each rank received, the buckets it yielded, and its traffic. ``count_traffic`` with a "node"
    per TP group: ``inter_*`` is traffic that leaves the rank's TP group, i.e. goes to another CP (or DP)
    rank's copy of the model."""
    from megatron_rl.weights.export import ExportPlan, export_hf_buckets
    from megatron_rl_testing.traffic_counter import count_traffic

    out: dict[str, Any] = {}
    for mode, consumers in (("colocated", None), ("server", frozenset({0}))):
        dist.barrier()
        tensors: dict[str, torch.Tensor] = {}
        buckets = 0
        with count_traffic(gpus_per_node=tp) as counts:
            for bucket in export_hf_buckets(engine.model, ExportPlan(consumers, BUCKET_BYTES)):
                buckets += 1
                for name, tensor in bucket.named_tensors():
                    assert name not in tensors, f"{name} exported twice"
                    tensors[name] = tensor.clone()
        out[mode] = {"tensors": tensors, "buckets": buckets, "traffic": dict(counts)}
    return out


def save_hf(engine, path: str) -> None:
    from megatron_rl.weights.export import save_hf_checkpoint

    save_hf_checkpoint(engine.model, path)


def rng_round_trip(engine, path: str) -> bool:
    """Save with a different RNG state on every rank, scramble it, load at the same layout: each rank gets its
    own state back."""
    from megatron_rl.workers.checkpoint import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    synthetic_step(engine, 1)  # Adam state to save and load
    torch.manual_seed(1000 + rank)
    random.seed(1000 + rank)
    np.random.seed(1000 + rank)
    expected = (torch.get_rng_state(), random.getstate())
    save_checkpoint(engine, path)
    torch.manual_seed(0)
    random.seed(0)
    load_checkpoint(engine, path)
    return bool(torch.equal(torch.get_rng_state(), expected[0]) and random.getstate() == expected[1])


def save(engine, path: str) -> None:
    from megatron_rl.workers.checkpoint import save_checkpoint

    save_checkpoint(engine, path, extra={"step": 1})


def resume(model_dir: str, tp: int, cp: int, path: str) -> dict[str, Any]:
    """A fresh engine at (tp, cp) loads ``path``: its state, then the state and grad norm after step 2."""
    from megatron_rl.workers.checkpoint import load_checkpoint

    engine = make_engine(model_dir, tp, cp)
    extra = load_checkpoint(engine, path)
    out = {"extra": extra, "loaded": local_state(engine)}
    out["grad_norm2"] = synthetic_step(engine, 2)
    out["after_step2"] = local_state(engine)
    return out


def train_and_save(model_dir: str, tp: int, cp: int, path: str) -> dict[str, Any]:
    """A fresh engine at (tp, cp): step 1, save to ``path``, step 2; the state at each point."""
    engine = make_engine(model_dir, tp, cp)
    out = {"grad_norm1": synthetic_step(engine, 1)}
    out["saved"] = local_state(engine)
    out["rng_at_save"] = torch.get_rng_state()
    save(engine, path)
    out["grad_norm2"] = synthetic_step(engine, 2)
    out["after_step2"] = local_state(engine)
    return out


# ------------------------------------------------------------------------------------------------ jobs
def reference_job(model_dir: str, workdir: str) -> dict[str, Any]:
    """World 1, TP = CP = 1: the reference export and run, and the CP=1 checkpoint the CP=2 layouts resume."""
    init_model_parallel(tp=1, cp=1)
    engine = make_engine(model_dir, 1, 1)
    out: dict[str, Any] = {"export": exports(engine, 1)}
    out["run"] = train_and_save(model_dir, 1, 1, f"{workdir}/ckpt_tp1cp1")
    destroy_model_parallel()
    return out


def cp2_job(model_dir: str, workdir: str) -> dict[str, Any]:
    """World 2: TP=1 x CP=2 against TP=1 x DP=2 (the same ranks without CP)."""
    out: dict[str, Any] = {"rank": dist.get_rank()}
    init_model_parallel(tp=1, cp=1)  # DP = 2: every rank a copy of the model, as under CP = 2
    out["dp2/export"] = exports(make_engine(model_dir, 1, 1), 1)

    init_model_parallel(tp=1, cp=2)
    out["layout"] = _layout_key()
    engine = make_engine(model_dir, 1, 2)
    out["cp2/export"] = exports(engine, 1)
    save_hf(engine, f"{workdir}/hf_cp2")
    out["cp2/resume_cp1"] = resume(model_dir, 1, 2, f"{workdir}/ckpt_tp1cp1")  # saved at CP=1, world 1
    out["cp2/run"] = train_and_save(model_dir, 1, 2, f"{workdir}/ckpt_tp1cp2")
    out["cp2/rng_round_trip"] = rng_round_trip(make_engine(model_dir, 1, 2), f"{workdir}/rng_cp2")
    destroy_model_parallel()
    return out


def resume_cp1_job(model_dir: str, workdir: str) -> dict[str, Any]:
    """World 1, CP = 1: resume the checkpoint saved at TP=1 x CP=2; and load the CP=1 checkpoint with its
    metadata as written before CP was recorded (no ``cp`` in its layout): its RNG state is restored."""
    import json
    import shutil

    from megatron_rl.workers.checkpoint import METADATA_FILE, load_checkpoint

    init_model_parallel(tp=1, cp=1)
    out = resume(model_dir, 1, 1, f"{workdir}/ckpt_tp1cp2")
    legacy = f"{workdir}/ckpt_tp1cp1_legacy"
    shutil.copytree(f"{workdir}/ckpt_tp1cp1", legacy)
    metadata = json.loads(open(f"{legacy}/{METADATA_FILE}").read())
    del metadata["layout"]["cp"]
    open(f"{legacy}/{METADATA_FILE}", "w").write(json.dumps(metadata))
    torch.manual_seed(7)
    load_checkpoint(make_engine(model_dir, 1, 1), legacy)
    out["legacy_rng"] = torch.get_rng_state()
    destroy_model_parallel()
    return out


def tp2_cp2_job(model_dir: str, workdir: str) -> dict[str, Any]:
    """World 4: TP=2 x CP=2 against TP=2 x DP=2, checkpoints both ways between them."""
    out: dict[str, Any] = {"rank": dist.get_rank()}
    init_model_parallel(tp=2, cp=1)  # DP = 2
    out["dp2/layout"] = _layout_key()
    out["dp2/export"] = exports(make_engine(model_dir, 2, 1), 2)
    out["dp2/run"] = train_and_save(model_dir, 2, 1, f"{workdir}/ckpt_tp2cp1")

    init_model_parallel(tp=2, cp=2)
    out["cp2/layout"] = _layout_key()
    out["cp2/export"] = exports(make_engine(model_dir, 2, 2), 2)
    out["cp2/resume_cp1"] = resume(model_dir, 2, 2, f"{workdir}/ckpt_tp2cp1")
    out["cp2/run"] = train_and_save(model_dir, 2, 2, f"{workdir}/ckpt_tp2cp2")

    init_model_parallel(tp=2, cp=1)
    out["dp2/resume_cp2"] = resume(model_dir, 2, 1, f"{workdir}/ckpt_tp2cp2")
    destroy_model_parallel()
    return out
