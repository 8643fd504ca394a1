"""LoRA against full fine-tuning on CPU at the ~30M benchmark size (bench_sizes.SIZES["30M"]): one training step
of the actor (old log-probs, reference log-probs for a KL loss, one PPO update of 16 prompts x 8 responses of
32 tokens), each configuration in a fresh process, in the same run. Full fine-tuning builds a reference model;
LoRA (rank 32, alpha 64, the four Megatron linears) answers the reference with its adapters off. Reported:
the best of 3 step times, the process's peak resident memory over the step (VmHWM) and the training state the
engines hold (weights, gradient buffers, Adam state). Run:

    pytest benchmarks/test_lora.py -s
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from bench_sizes import SIZES

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.rl_batches import grouped_rl_batch
from megatron_rl_testing.timing import best_seconds

PROMPTS, N, PROMPT_LEN, RESPONSE_LEN = 16, 8, 16, 32


def _batch():
    gen = torch.Generator().manual_seed(0)
    rows = PROMPTS * N
    response_lens = torch.randint(8, RESPONSE_LEN + 1, (rows,), generator=gen)
    return grouped_rl_batch(PROMPTS, N, PROMPT_LEN, response_lens, RESPONSE_LEN, gen)


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _state_bytes(engines) -> int:
    """Weights + gradient buffers + optimizer state (Adam's moments and fp32 masters) the engines hold."""
    total = 0
    for engine in engines:
        for chunk in engine.model:
            for param in chunk.parameters():
                total += param.numel() * param.element_size()
                grad = getattr(param, "main_grad", None)
                total += 0 if grad is None else grad.numel() * grad.element_size()
        for optimizer in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer] if engine.optimizer else []):
            for state in getattr(optimizer, "optimizer", optimizer).state.values():  # torch's Adam inside Megatron's
                total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total


def lora_bench_job(model_dir: str, rank: int) -> dict[str, float]:
    from megatron_rl.config.schema import ActorConfig, LoRAConfig, MegatronParallelConfig, OptimConfig, RefConfig
    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.workers import ActorRole, MegatronEngine, ReferenceRole

    torch.set_num_threads(2)
    init_model_parallel()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _vm_kib("VmRSS")
    megatron = MegatronParallelConfig(share_prompts=True)
    config = ActorConfig(ppo_mini_batch_size=PROMPTS, ppo_micro_batch_size_per_gpu=PROMPTS * N, use_kl_loss=True,
                         optim=OptimConfig(lr=1e-4, weight_decay=0.0), megatron=megatron)
    lora = LoRAConfig(rank=rank, alpha=2.0 * rank) if rank else None
    engine = MegatronEngine(model_dir, megatron, config.optim, lora=lora)
    actor = ActorRole(engine, config, rollout_n=N)
    ref_config = RefConfig(log_prob_micro_batch_size_per_gpu=PROMPTS * N)
    if rank:
        ref = ReferenceRole(engine, ref_config, adapters_off=True)
    else:
        ref = ReferenceRole(MegatronEngine(model_dir, dataclasses.replace(megatron), None), ref_config)
    data = _batch()

    def step():
        old = actor.compute_log_prob(data)
        data.batch["old_log_probs"] = old.batch["old_log_probs"]
        data.batch["ref_log_prob"] = ref.compute_ref_log_prob(data).batch["ref_log_prob"]
        actor.update_actor(data)

    step()  # warm-up: Adam's state exists from here
    seconds = best_seconds(3, step)
    engines = [engine] if ref.engine is engine else [engine, ref.engine]
    out = {"step_s": seconds, "peak_rss_mib": (_vm_kib("VmHWM") - before) / 1024,
           "state_mib": _state_bytes(engines) / 2**20,
           "trainable": sum(p.numel() for c in engine.model for p in c.parameters() if p.requires_grad),
           "params": sum(p.numel() for c in engine.model for p in c.parameters())}
    destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    shape = SIZES["30M"]["model"]
    return str(make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("lora_bench") / "m", "qwen2", with_tokenizer=False, vocab_size=512,
        hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_layers=shape["num_hidden_layers"], num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"]))


def test_lora_step_time_and_memory_against_full_fine_tuning(model_dir):
    full = run_multiprocess(lora_bench_job, 1, model_dir, 0, timeout_s=900, threads_per_rank=2)[0]
    lora = run_multiprocess(lora_bench_job, 1, model_dir, 32, timeout_s=900, threads_per_rank=2)[0]
    print(f"\n{full['params'] / 1e6:.1f}M parameters; LoRA rank 32 trains {lora['trainable'] / 1e6:.2f}M "
          f"({lora['trainable'] / lora['params']:.1%} of the base)")
    print("| | full fine-tuning (+ reference model) | LoRA r=32 (reference = adapters off) | LoRA / full |\n|---|---|---|---|")
    for key, label in (("step_s", "training step, s"), ("peak_rss_mib", "peak RSS over the step, MiB"),
                       ("state_mib", "weights + grads + Adam state, MiB")):
        print(f"| {label} | {full[key]:.2f} | {lora[key]:.2f} | {lora[key] / full[key]:.2f} |")
    assert lora["state_mib"] < 0.5 * full["state_mib"]
