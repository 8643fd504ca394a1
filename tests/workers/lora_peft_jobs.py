"""Rank jobs of test_lora_peft.py: LoRA actors (lora_jobs.py) that export PEFT adapters, load one made by
``peft``, and save / resume adapter-only checkpoints."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lora_jobs import _actor, adapter_tensors, lora_config
from workers_jobs import actor_config, make_actor, training_batch, update

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel


def _log_probs(actor) -> Any:
    return actor.compute_log_prob(training_batch()).batch["old_log_probs"]


def _merged_export(engine) -> dict[str, Any]:
    """Our merged HF weights (W + scale B A on the LoRA layers), on global rank 0."""
    from megatron_rl.weights import export_hf_weights

    return {name: tensor.clone() for name, tensor in export_hf_weights(engine.model, consumers={0})}


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, FileNotFoundError) as err:
        return str(err)
    return "no error raised"


def export_job(model_dir: str, workdir: str, tp: int, pp: int, peft_made: str | None) -> dict[str, Any]:
    """One LoRA update, then: the PEFT export, our log-probs and merged weights. At TP=2 also the checkpoint
    half of the resume test (save, then the uninterrupted second update), a full-model checkpoint of the
    same model for size, and the adapter made with peft loaded through lora.adapter_path (the engine)."""
    from megatron_rl.models.peft_adapter import save_peft_adapter

    init_model_parallel(tp=tp, pp=pp)
    name = f"tp{tp}_pp{pp}"
    actor = _actor(model_dir, tp, pp, False, lora_config())
    out: dict[str, Any] = {"metrics1": update(actor, training_batch())}
    save_peft_adapter(actor.engine.model, f"{workdir}/{name}_adapter", model_dir)
    out["log_probs"] = _log_probs(actor)
    out["merged"] = _merged_export(actor.engine)
    out["adapters1"] = adapter_tensors(actor.engine, grads=False)
    if peft_made is None:
        destroy_model_parallel()
        return out

    actor.save_checkpoint(f"{workdir}/lora_ckpt", extra={"data_position": 3})
    out["metrics2"] = update(actor, training_batch(seed=5))
    out["adapters2"] = adapter_tensors(actor.engine, grads=False)
    out["log_probs2"] = _log_probs(actor)

    full = make_actor(model_dir, actor_config(tp=tp, pp=pp))  # the same model, full fine-tuning
    update(full, training_batch())
    full.save_checkpoint(f"{workdir}/full_ckpt")

    loaded = _actor(model_dir, tp, pp, False, lora_config(adapter_path=peft_made))  # lora.adapter_path
    out["peft_made/log_probs"] = _log_probs(loaded)
    destroy_model_parallel()
    return out


def resume_job(model_dir: str, workdir: str, bad: dict[str, str]) -> dict[str, Any]:
    """A fresh pair of ranks (TP=2): resume the LoRA checkpoint and take the second update; a LoRA
    checkpoint refused by a full-model engine; the bad PEFT adapters' errors."""
    from megatron_rl.models.peft_adapter import load_peft_adapter

    init_model_parallel(tp=2)
    actor = _actor(model_dir, 2, 1, False, lora_config())
    out: dict[str, Any] = {"extra": actor.load_checkpoint(f"{workdir}/lora_ckpt")}
    out["metrics2"] = update(actor, training_batch(seed=5))
    out["adapters2"] = adapter_tensors(actor.engine, grads=False)
    out["log_probs2"] = _log_probs(actor)

    full = make_actor(model_dir, actor_config(tp=2))
    out["error/full_engine"] = _error(lambda: full.load_checkpoint(f"{workdir}/lora_ckpt"))
    other_rank = _actor(model_dir, 2, 1, False, lora_config(rank=2, alpha=4.0))
    out["error/other_rank"] = _error(lambda: other_rank.load_checkpoint(f"{workdir}/lora_ckpt"))
    for case, directory in bad.items():
        out[f"error/{case}"] = _error(lambda d=directory: load_peft_adapter(actor.engine.model, d))
    dist.barrier()
    destroy_model_parallel()
    return out


def reshard_job(model_dir: str, workdir: str) -> dict[str, Any]:
    """The TP=2 LoRA checkpoint loaded at PP=2 (adapters and their optimizer state resharded)."""
    init_model_parallel(pp=2)
    actor = _actor(model_dir, 1, 2, False, lora_config())
    actor.load_checkpoint(f"{workdir}/lora_ckpt")
    out = {"log_probs": _log_probs(actor), "adapters": adapter_tensors(actor.engine, grads=False)}
    destroy_model_parallel()
    return out
