"""Every GPU preset x colocated engine (vLLM, SGLang) started by the real rollout build on a fake node of 8 GPUs
(megatron_rl_testing.fake_gpu_node, whose vllm.LLM and sglang.Engine doubles keep those engines' device and
memory rules): node 0 of the preset's run, each rank in its own simulated process, holding on its GPU what the
plan says the trainer holds when the engine starts. No two engines share a GPU, each runs on exactly its
replica's GPUs, none is refused, and the plan's per-GPU rollout figures are what the doubles hold, through the
memory schedule (sleep for the update, weights back for the sync, KV cache after it). Where the plan refuses a
configuration, the engine's double refuses it too. Only the rollout side is built (no Megatron, no weights).

SGLang's rule that matters most here (sglang 0.5.23, python/sglang/srt/entrypoints/engine.py:935-939): TP
worker i runs on device ``base_gpu_id + i`` of what the leader's process sees; vLLM's: TP worker i on
``cuda:i`` of the environment its processes inherit (vllm/v1/worker/gpu_worker.py:498-501).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_rl.config import load_config
from megatron_rl.config.loader import typed_config
from megatron_rl.distributed.device import RankPlace, bind_device, rank_place
from megatron_rl.plan import PlanError, build_plan
from megatron_rl.plan.memory import total_params
from megatron_rl_testing.fake_gpu_node import FakeGpuNode
from megatron_rl_testing.rollout_ranks import TOKEN_IDS, StubActor

ROLLOUT = "actor_rollout_ref.rollout"
PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs" / "experiment"
BF16 = 2
GPUS_PER_NODE = 8


def gpu_presets() -> list[str]:
    """The presets that run on GPUs (trainer.device is not cpu)."""
    return [p.stem for p in sorted(PRESETS_DIR.glob("*.yaml"))
            if load_config(overrides=[f"+experiment={p.stem}"]).trainer.device != "cpu"]


GPU_PRESETS = gpu_presets()


def skip_without(engine: str) -> None:
    """vLLM's double stands in for vllm.LLM, whose module must import; SGLang's is a module of its own."""
    if engine == "vllm":
        from megatron_rl_testing.vllm_support import skip_without_vllm

        skip_without_vllm()


def preset_config(preset: str, engine: str, *overrides: str):
    # enforce_eager: no vLLM CUDA graphs, which the double does not hold (the plan's allowance would be kept asleep)
    return load_config(overrides=[f"+experiment={preset}", f"{ROLLOUT}.name={engine}", f"{ROLLOUT}.mode=colocated",
                                  f"{ROLLOUT}.enforce_eager=true", "actor_rollout_ref.model.path=/unused",
                                  f"{ROLLOUT}.weight_sync.verify_freq=0", *overrides])


class Node0:
    """Node 0 of a run of ``trainer.nnodes`` x ``n_gpus_per_node`` ranks under torchrun (no CUDA_VISIBLE_DEVICES):
    every rank's place is known (the rollout mesh spans the world), node 0's ranks are simulated."""

    def __init__(self, node: FakeGpuNode, monkeypatch, cfg) -> None:
        self.node, self.cfg = node, cfg
        per_node, nnodes = int(cfg.trainer.n_gpus_per_node), int(cfg.trainer.nnodes)
        assert per_node == GPUS_PER_NODE, f"trainer.n_gpus_per_node={per_node}: the fake node has {GPUS_PER_NODE}"
        world = per_node * nnodes
        envs = [{"RANK": str(r), "LOCAL_RANK": str(r % per_node), "WORLD_SIZE": str(world),
                 "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(r // per_node)} for r in range(world)]
        places = [rank_place(r, r % per_node, env) for r, env in enumerate(envs)]
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
        monkeypatch.setattr(dist, "all_gather_object",
                            lambda out, obj, group=None: out.__setitem__(slice(None), places))
        self.ranks = list(zip(envs[:per_node], places[:per_node]))

    @contextlib.contextmanager
    def rank(self, env: dict[str, str], place: RankPlace) -> Iterator[None]:
        """One rank's process (entered again: the same process, its memory kept), its device bound."""
        with self.node.process(f"rank{place.rank}", env):
            bind_device(place)
            yield

    def hold_trainer(self, nbytes: int) -> None:
        """Every rank's trainer state is on its GPU before any engine starts (init_model builds it first)."""
        for env, place in self.ranks:
            with self.rank(env, place):
                self.node.hold_tensors(nbytes)

    def build_rollout(self) -> list:
        """``ActorRolloutRefWorker._build_rollout`` of every rank of the node, in rank order."""
        from megatron_rl.workers.hybrid import ActorRolloutRefWorker

        replicas = []
        for env, place in self.ranks:
            with self.rank(env, place):
                worker = ActorRolloutRefWorker(typed_config(self.cfg))
                worker.actor = StubActor()
                replicas.append(worker._build_rollout(None, dict(TOKEN_IDS)))
        return replicas

    def on_leaders(self, replicas: list, step) -> None:
        for (env, place), replica in zip(self.ranks, replicas):
            if replica.is_leader:
                with self.rank(env, place):
                    step(replica)


def plan_with_trainer_bytes(monkeypatch, cfg):
    """The plan, and what its trainer rows hold on a GPU when the engine starts: the ``held`` the planner hands
    the engine's memory model (planner._rollout_share), taken before that model reads it, so the fake ranks hold
    the trainer's bytes and the engine's start is measured, not copied from the plan's rollout figures."""
    from megatron_rl.plan import planner

    share, seen = planner._rollout_share, []

    def recording(cfg, model, world, gpu_memory, held):
        seen.append((share(cfg, model, world, gpu_memory, held), held))
        return seen[-1][0]

    with monkeypatch.context() as patch:
        patch.setattr(planner, "_rollout_share", recording)
        plan = build_plan(cfg)
    (held,) = [held for rollout, held in seen if rollout is plan.rollout]
    return plan, int(held)


def fake_node(monkeypatch, engine: str, plan) -> FakeGpuNode:
    """GPUs of the plan's size; every engine serves the plan's model in bf16 (its bytes from the model config)."""
    return FakeGpuNode(monkeypatch, gpus=GPUS_PER_NODE, total_bytes=int(plan.gpu_memory),
                       model_bytes=total_params(plan.model) * BF16, with_vllm=engine == "vllm",
                       with_sglang=engine == "sglang")


def engine_row(plan, phase: str) -> float:
    (row,) = [r for r in plan.rows if r.label == "rollout engine (weights + KV)"]
    return row.per_phase.get(phase, 0.0)


def resident(node: FakeGpuNode, gpu: int) -> int:
    return sum(sum(record.bytes_on[gpu].values()) for record in node.engines if gpu in record.bytes_on)


@pytest.mark.parametrize("engine", ("vllm", "sglang"))
@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_each_gpu_preset_starts_each_engine_on_its_replicas_gpus_with_the_plans_bytes(monkeypatch, preset, engine):
    skip_without(engine)
    cfg = preset_config(preset, engine)
    plan, held = plan_with_trainer_bytes(monkeypatch, cfg)
    rollout, tp = plan.rollout, plan.rollout.tp
    node = fake_node(monkeypatch, engine, plan)
    run = Node0(node, monkeypatch, cfg)
    run.hold_trainer(held)
    replicas = run.build_rollout()

    # placement: one engine per replica led from this node, on exactly its replica's GPUs, no GPU shared
    leaders = [r for r in replicas if r.is_leader]
    assert len(node.engines) == len(leaders) == GPUS_PER_NODE // tp
    assert [e.engine for e in node.engines] == [engine] * len(leaders)
    assert [e.gpus for e in node.engines] == [r.replica.gpus for r in leaders], (
        f"engines on {[e.gpus for e in node.engines]}, replicas {[r.replica.gpus for r in leaders]}")
    used = [g for e in node.engines for g in e.gpus]
    assert sorted(used) == list(range(GPUS_PER_NODE)), f"engines share GPUs: {[e.gpus for e in node.engines]}"

    # what each engine measured and holds on each of its GPUs is the plan's per-GPU figure
    for record in node.engines:
        for gpu in record.gpus:
            sizes = record.bytes_on[gpu]
            assert record.free_at_start[gpu] == pytest.approx(rollout.free_at_start, abs=1)
            assert sizes["weights"] == pytest.approx(rollout.weights, abs=tp)
            assert sizes["weights"] + sizes["kv_cache"] == pytest.approx(rollout.reserved, abs=2)
            if engine == "sglang":  # vLLM's KV cache is its budget less a profiled peak the double does not run
                assert sizes["kv_cache"] == pytest.approx(rollout.kv_cache, abs=2)
    for gpu in range(GPUS_PER_NODE):
        assert resident(node, gpu) == pytest.approx(engine_row(plan, "generate"), abs=2)

    # the memory schedule: asleep through the update, weights back for the sync, then the KV cache
    run.on_leaders(replicas, lambda replica: replica.release())
    for gpu in range(GPUS_PER_NODE):
        assert resident(node, gpu) == pytest.approx(engine_row(plan, "actor update"), abs=2)
        assert node.free_bytes(gpu) == node.total_bytes - held
    run.on_leaders(replicas, lambda replica: replica.engine.begin_weight_update(1))
    for gpu in range(GPUS_PER_NODE):
        assert resident(node, gpu) == pytest.approx(rollout.weights, abs=tp)
    run.on_leaders(replicas, lambda replica: replica.engine.end_weight_update())
    for gpu in range(GPUS_PER_NODE):
        assert resident(node, gpu) == pytest.approx(rollout.reserved, abs=2)
    run.on_leaders(replicas, lambda replica: replica.engine.shutdown())
    assert all(node.free_bytes(gpu) == node.total_bytes - held for gpu in range(GPUS_PER_NODE))


# preset, engine, override -> the planner's refusal; the engine's double refuses the same start
REFUSED = [
    ("grpo_qwen3_30b_a3b", "vllm", f"{ROLLOUT}.gpu_memory_utilization=0.45",
     r"gpu_memory_utilization=0.45 with rollout.name=vllm", r"Free memory on device cuda:0 .* on startup is less"),
    ("grpo_70b", "sglang", f"{ROLLOUT}.gpu_memory_utilization=0.2",
     r"leaving KV cache for 0 tokens", r"Loaded weights leave no GPU memory for the KV cache"),
]


@pytest.mark.parametrize("preset,engine,override,plan_says,engine_says", REFUSED)
def test_what_the_plan_refuses_the_engine_refuses(monkeypatch, preset, engine, override, plan_says, engine_says):
    skip_without(engine)
    cfg = preset_config(preset, engine, override)
    with pytest.raises(PlanError, match=plan_says):
        build_plan(cfg)
    plan, held = plan_with_trainer_bytes(monkeypatch, preset_config(preset, engine))  # the same trainer
    node = fake_node(monkeypatch, engine, plan)
    run = Node0(node, monkeypatch, cfg)
    run.hold_trainer(held)
    with pytest.raises(ValueError, match=engine_says):
        run.build_rollout()
    assert all(not record.bytes_on.get(g) for record in node.engines for g in record.gpus)
