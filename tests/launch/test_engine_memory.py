"""Each rollout engine's own meaning of rollout.gpu_memory_utilization, in the planner, the presets and the launch
check (issue 49, item 4): SGLang's is a fraction of the memory free at engine start, vLLM's a fraction of the GPU's
total that vLLM refuses to start with when less than that is free. Nothing is started."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron_rl.config import load_config
from megatron_rl.plan import PlanError, build_plan, check_launch
from megatron_rl.plan.model_facts import load_model_facts

GIB = 2**30
ROLLOUT = "actor_rollout_ref.rollout"
GPU_PRESETS = ("grpo_7b", "grpo_32b", "grpo_70b", "grpo_qwen3_30b_a3b", "grpo_8b_long_context")
# preset, engine -> (gpu_memory_utilization, KV cache GiB per GPU, generate peak GiB, update GiB) with enforce_eager
# (no CUDA graphs): python -m megatron_rl.plan +experiment=<preset> actor_rollout_ref.rollout.name=<engine>.
# Before issue 49 every vLLM row read as SGLang's; grpo_qwen3_30b_a3b and grpo_8b_long_context were refused by vLLM.
EXPECTED = {
    ("grpo_7b", "sglang"): (0.5, 21.8, 57.8, 36.5),
    ("grpo_7b", "vllm"): (0.5, 31.1, 68.6, 36.5),
    ("grpo_32b", "sglang"): (0.45, 10.2, 56.1, 41.3),
    ("grpo_32b", "vllm"): (0.45, 19.0, 66.5, 41.3),
    ("grpo_70b", "sglang"): (0.45, 8.1, 58.1, 41.5),
    ("grpo_70b", "vllm"): (0.45, 18.0, 69.4, 41.5),
    ("grpo_qwen3_30b_a3b", "sglang"): (0.45, 9.0, 74.2, 69.5),
    ("grpo_qwen3_30b_a3b", "vllm"): (0.22, 9.1, 75.6, 69.5),
    ("grpo_8b_long_context", "sglang"): (0.6, 22.6, 65.8, 60.9),
    ("grpo_8b_long_context", "vllm"): (0.45, 30.8, 75.3, 60.9),
}


def preset_plan(preset: str, engine: str, *overrides: str):
    return build_plan(load_config(overrides=[f"+experiment={preset}", f"{ROLLOUT}.name={engine}",
                                             f"{ROLLOUT}.enforce_eager=true", *overrides]))


def trainer_at_generate(plan) -> float:
    return sum(r.per_phase["generate"] for r in plan.rows if not r.label.startswith("rollout engine"))


@pytest.mark.parametrize("preset", GPU_PRESETS)
@pytest.mark.parametrize("engine", ("sglang", "vllm"))
def test_each_preset_plans_each_engines_own_meaning_of_the_knob(preset, engine):
    fraction, kv_gib, peak_gib, update_gib = EXPECTED[preset, engine]
    plan = preset_plan(preset, engine)
    rollout = plan.rollout
    assert rollout.fraction == fraction
    if engine == "sglang":  # mem_fraction_static x the memory free when the engine starts
        assert rollout.reserved == pytest.approx(fraction * rollout.free_at_start)
        assert rollout.kv_cache == pytest.approx(rollout.reserved - rollout.weights)
    else:  # vLLM: ceil(total x fraction) (vllm/v1/worker/utils.py:724), which must be free at start (:761)
        assert rollout.reserved == math.ceil(plan.gpu_memory * fraction)
        assert rollout.free_at_start >= rollout.reserved
        assert rollout.kv_cache < rollout.reserved - rollout.weights  # activations come out of vLLM's budget
    # the generate phase holds the trainer and the engine's whole share; the plan fits the GPU
    assert plan.total("generate") == pytest.approx(trainer_at_generate(plan) + rollout.reserved)
    assert (round(rollout.kv_cache / GIB, 1), round(plan.total("generate") / GIB, 1),
            round(plan.total("actor update") / GIB, 1)) == (kv_gib, peak_gib, update_gib)
    assert plan.fits and rollout.memory.engine == engine


def test_vllm_presets_start_in_vllms_own_memory_check():
    """vLLM's real start-up check (vllm/v1/worker/utils.py request_memory, called by gpu_worker.py init_device at
    :535) run on each preset's plan: the free memory the plan has at engine start does not make vLLM refuse, and
    what vLLM asks for is what the plan reserves. A config vLLM refuses, the planner refuses too."""
    from vllm.v1.worker.utils import request_memory

    def vllm_requests(plan, fraction: float) -> int:
        snapshot = SimpleNamespace(total_memory=int(plan.gpu_memory), free_memory=int(plan.rollout.free_at_start),
                                   device_="cuda:0")
        return request_memory(snapshot, SimpleNamespace(gpu_memory_utilization=fraction))

    for preset in GPU_PRESETS:
        plan = preset_plan(preset, "vllm")
        assert vllm_requests(plan, plan.rollout.fraction) == pytest.approx(plan.rollout.reserved, abs=1), preset
    sglang = preset_plan("grpo_qwen3_30b_a3b", "sglang")  # the old preset value read as vLLM's
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        vllm_requests(sglang, 0.45)
    with pytest.raises(PlanError, match="gpu_memory_utilization=0.45 with rollout.name=vllm"):
        preset_plan("grpo_qwen3_30b_a3b", "vllm", f"{ROLLOUT}.gpu_memory_utilization=0.45")


def test_a_vllm_share_larger_than_the_free_memory_is_refused_before_any_worker_starts():
    # 70B preset: 54.4 GiB free when the engine starts (after actor, reference and plan.reserved_gib: 25.2 GiB);
    # 0.7 x 79.6 = 55.7 GiB: vLLM would refuse at start (vllm/v1/worker/utils.py:761)
    overrides = ["+experiment=grpo_70b", f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.gpu_memory_utilization=0.7"]
    message = (r"actor_rollout_ref.rollout.gpu_memory_utilization=0.7 with rollout.name=vllm asks for 0.7 x the "
               r"GPU's 79.6 GiB total = 55.7 GiB, but only 54.4 GiB will be free when the engine starts .* set "
               r"actor_rollout_ref.rollout.gpu_memory_utilization <= 0.68")
    with pytest.raises(PlanError, match=message):
        build_plan(load_config(overrides=overrides))
    # a real start on GPUs: check_launch (train.py, before Ray and the workers); the distributed optimizer is off
    # so that this machine's lack of Transformer Engine is not what is refused
    # (unsharded fp32 master weights: 50.2 GiB free at engine start)
    launch = [*overrides, "trainer.device=cuda", "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false"]
    with pytest.raises(PlanError, match=r"gpu_memory_utilization=0.7 .* only 50.2 GiB will be free .* <= 0.63"):
        check_launch(load_config(overrides=launch))
    # the preset's 0.45 passes vLLM's check; the unsharded Adam state then puts generation over the GPU by more than
    # the plan's error (all counts), which a real start refuses too since issue 51
    with pytest.raises(PlanError, match=r"generate, 82.1 of 79.6 GiB per GPU: DOES NOT FIT, over by 2.5 GiB"):
        check_launch(load_config(overrides=[*launch[:2], *launch[3:]]))
    # SGLang reads the same 0.7 as of the free memory: it starts
    assert preset_plan("grpo_70b", "sglang", f"{ROLLOUT}.gpu_memory_utilization=0.7").rollout.memory.refusal is None


def test_a_sleeping_vllm_engine_keeps_its_cuda_graphs_in_every_phase():
    """vLLM's sleep level 2 releases the cuMem pool (weights, KV cache; vllm/device_allocator/sleep_mode_backend.py
    :127-137); CUDA graphs are captured outside it unless sleep_mode_offload_cudagraph (config/vllm.py:688,
    compilation/cudagraph_pool.py:38), which the engine does not set: they stay through the update."""
    from megatron_rl.rollout.memory import VLLM_CUDA_GRAPH_BYTES

    eager = preset_plan("grpo_7b", "vllm")
    graphs = preset_plan("grpo_7b", "vllm", f"{ROLLOUT}.enforce_eager=false")
    (row,) = [r for r in graphs.rows if r.label == "rollout engine kept asleep (CUDA graphs)"]
    assert row.per_phase == {"generate": VLLM_CUDA_GRAPH_BYTES, "actor update": VLLM_CUDA_GRAPH_BYTES}
    assert graphs.total("actor update") == eager.total("actor update") + VLLM_CUDA_GRAPH_BYTES
    # inside vLLM's budget: the generate peak is the same, the KV cache 1 GiB smaller
    assert graphs.total("generate") == pytest.approx(eager.total("generate"))
    assert graphs.rollout.kv_cache == pytest.approx(eager.rollout.kv_cache - VLLM_CUDA_GRAPH_BYTES)
    # SGLang's release_memory_occupation gives back weights, KV cache and CUDA graphs: nothing is kept
    sglang = preset_plan("grpo_7b", "sglang", f"{ROLLOUT}.enforce_eager=false")
    assert not [r for r in sglang.rows if "asleep" in r.label]
    assert sglang.total("actor update") == eager.total("actor update")


def test_vllm_knob_read_as_a_fraction_of_the_total_and_sglang_as_of_the_free_memory():
    from megatron_rl.rollout.engines import ENGINES
    from megatron_rl.rollout.memory import EngineStart

    model = load_model_facts(load_config(overrides=["+experiment=grpo_7b"]))
    start = EngineStart(total=80 * GIB, held=40 * GIB, weights=10 * GIB, fraction=0.45, model=model, tp=2,
                        max_num_seqs=1024, max_num_batched_tokens=8192, enforce_eager=True)
    assert ENGINES["sglang"].memory(start).budget == 0.45 * 40 * GIB
    vllm = ENGINES["vllm"].memory(start)
    assert vllm.budget == 36 * GIB and vllm.refusal is None
    refused = ENGINES["vllm"].memory(EngineStart(**{**start.__dict__, "fraction": 0.55}))
    assert refused.refusal is not None and "only 40.0 GiB will be free" in refused.refusal
    assert "<= 0.50" in refused.refusal


@pytest.mark.parametrize("preset, overrides", [
    ("grpo_70b", ()),
    ("grpo_qwen3_30b_a3b", ()),
    ("grpo_70b", (f"{ROLLOUT}.gpu_memory_utilization=0.7",)),  # refused by the planner and by the double alike
])
def test_the_plans_per_gpu_numbers_are_what_the_vllm_double_sees(monkeypatch, preset, overrides):
    """On the fake 8-GPU node (megatron_rl_testing.fake_gpu_node, whose vllm.LLM double keeps vLLM's start-up
    check, vllm/v1/worker/utils.py:761), each GPU holding what the plan says the trainer holds when the engine
    starts: the engines built from our engine_args reserve on each GPU the plan's share, hold its weights, and
    give it back when they sleep; where the plan refuses, vLLM's double refuses with the same free memory."""
    import torch
    import vllm

    from megatron_rl.rollout.vllm.engine import engine_args
    from megatron_rl_testing.fake_gpu_node import FakeGpuNode
    from megatron_rl_testing.vllm_support import skip_without_vllm

    skip_without_vllm()
    cfg = load_config(overrides=[f"+experiment={preset}", f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.enforce_eager=true",
                                 *overrides])
    refused = bool(overrides)
    if refused:
        with pytest.raises(PlanError, match="only 54.4 GiB will be free") as err:
            build_plan(cfg)
        plan = build_plan(load_config(overrides=[f"+experiment={preset}", f"{ROLLOUT}.name=vllm"]))  # same trainer
    else:
        plan = build_plan(cfg)
    rollout, total = plan.rollout, int(plan.gpu_memory)
    node = FakeGpuNode(monkeypatch, gpus=8, total_bytes=total, model_bytes=int(rollout.weights) * rollout.tp)
    held = total - int(rollout.free_at_start)
    for gpu in range(8):
        node._allocate(gpu, f"rank{gpu}", "trainer", held, "the trainer's state at engine start")
    args = engine_args(cfg.actor_rollout_ref.rollout, "/unused", max_model_len=plan.sequence_length,
                       dtype=torch.bfloat16, on_cpu=False)
    engines_per_node, llms = 8 // rollout.tp, []
    for engine in range(engines_per_node):
        gpus = ",".join(str(g) for g in range(engine * rollout.tp, (engine + 1) * rollout.tp))
        with node.process(f"engine{engine}", {"CUDA_VISIBLE_DEVICES": gpus}):
            if refused:
                with pytest.raises(ValueError, match=r"Free memory on device cuda:0 \(54.4\d/79.6\d GiB\) on startup"):
                    vllm.LLM(**args)
                continue
            llms.append(vllm.LLM(**args))
    if refused:
        assert "54.4 GiB" in str(err.value) and not node.engines
        return
    assert len(node.engines) == engines_per_node
    for record in node.engines:
        for gpu in record.gpus:
            sizes = record.bytes_on[gpu]
            assert sizes["weights"] == pytest.approx(rollout.weights, abs=rollout.tp)
            assert sizes["weights"] + sizes["kv_cache"] == rollout.reserved  # ceil(total x fraction)
            assert node.free_bytes(gpu) == int(rollout.free_at_start) - rollout.reserved
    for llm in llms:  # sleep level 2: back to what was free at start (no CUDA graphs: enforce_eager)
        llm.sleep(level=2)
    assert all(node.free_bytes(gpu) == int(rollout.free_at_start) for gpu in range(8))
