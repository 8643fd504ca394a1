"""On-policy distillation losses (issue 55 item 2, losses only): verl 0.9.1's distillation losses as the oracle
(values, metrics and gradients w.r.t. the student's logits, every loss mode, both clamps, policy gradient,
task-reward mixing), bad inputs refused, and the vocab-parallel form on 2 gloo ranks equal to one rank."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from algos_data import random_mask

from megatron_rl import algos
from megatron_rl.algos import distillation as dl
from megatron_rl.algos.loss_agg import GlobalBatchInfo
from megatron_rl.config.distillation_schema import DistillationLossSection
from megatron_rl.distributed.model_parallel import destroy_model_parallel, init_model_parallel
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.verl_oracle import verl_module

B, T, V, K = 5, 7, 24, 6
TOL = dict(atol=1e-5, rtol=1e-5)


def import_verl_distillation() -> SimpleNamespace:
    """verl's distillation modules (the test skips without them). verl.utils.dataset's __init__ imports datasets
    and pandas (not in our venv) for classes these losses never touch: while they import, that package is an
    empty shell whose submodules (dataset_utils, which they need) still load from verl's directory."""
    verl_utils = verl_module("verl.utils")
    shell = None
    if "verl.utils.dataset" not in sys.modules:
        shell = types.ModuleType("verl.utils.dataset")
        shell.__path__ = [str(Path(verl_utils.__file__).parent / "dataset")]
        sys.modules["verl.utils.dataset"] = shell
    try:
        return SimpleNamespace(
            losses=verl_module("verl.trainer.distillation.losses"),
            fsdp=verl_module("verl.trainer.distillation.fsdp.losses"),
            megatron=verl_module("verl.trainer.distillation.megatron.losses"),
            config=verl_module("verl.workers.config"),
        )
    finally:
        if shell is not None and sys.modules.get("verl.utils.dataset") is shell:
            del sys.modules["verl.utils.dataset"]


@pytest.fixture(scope="module")
def verl_distill() -> SimpleNamespace:
    return import_verl_distillation()


def problem(seed: int = 0, vocab: int = V):
    """Student logits, the teacher's top-k of its own random logits (distinct ids), sampled tokens, a padded mask."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, vocab, generator=gen) * 2.0
    teacher = torch.log_softmax(torch.randn(B, T, vocab, generator=gen) * 2.5, dim=-1)
    teacher_logps, teacher_ids = torch.topk(teacher, K, dim=-1)
    sampled = torch.randint(0, vocab, (B, T), generator=gen)
    old_logits = logits + 0.3 * torch.randn(B, T, vocab, generator=gen)
    old = torch.log_softmax(old_logits, -1).gather(-1, sampled[..., None])[..., 0]
    return dict(logits=logits, teacher_ids=teacher_ids, teacher_logps=teacher_logps, sampled=sampled,
                teacher_sampled=teacher.gather(-1, sampled[..., None])[..., 0], old=old,
                mask=random_mask(B, T, gen, empty_rows=(2,)), upstream=torch.rand(B, T, generator=gen) + 0.5)


def sampled_log_probs(logits, sampled):
    return torch.log_softmax(logits, dim=-1).gather(-1, sampled[..., None])[..., 0]


def plain(metrics: dict) -> dict:
    """verl's metrics as floats (Metric objects, tensors, floats)."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "aggregate"):
            value = value.aggregate()
        out[key] = float(value.item() if isinstance(value, torch.Tensor) else value)
    return out


# ---------------------------------------------------------------- per-token forward KL over the top-k


@pytest.mark.parametrize("clamp", [None, -3.0])
def test_forward_kl_topk_per_token_matches_verl_fsdp(verl_distill, clamp):
    for seed in range(3):
        p = problem(seed)
        ours_x, verl_x = p["logits"].clone().requires_grad_(), p["logits"].clone().requires_grad_()
        ours = dl.forward_kl_topk(ours_x, p["teacher_ids"], p["teacher_logps"], log_prob_min_clamp=clamp)
        nested = [torch.nested.nested_tensor([t.reshape(B * T, K)], layout=torch.jagged)
                  for t in (p["teacher_logps"], p["teacher_ids"])]
        theirs = verl_distill.fsdp.compute_forward_kl_topk(
            verl_x.reshape(1, B * T, V), *nested, SimpleNamespace(distillation_loss=SimpleNamespace(
                log_prob_min_clamp=clamp, use_chunked_topk=False)), "thd")
        assert set(ours) == set(theirs)
        for key, value in ours.items():
            torch.testing.assert_close(value.to(theirs[key].dtype), theirs[key].reshape(B, T), **TOL)
        (ours["distillation_losses"] * p["upstream"]).sum().backward()
        (theirs["distillation_losses"].reshape(B, T) * p["upstream"]).sum().backward()
        torch.testing.assert_close(ours_x.grad, verl_x.grad, **TOL)
        if clamp is not None:  # the clamp binds on some student entries, which then pass no gradient
            student = torch.log_softmax(p["logits"], -1).gather(-1, p["teacher_ids"])
            assert bool((student < clamp).any()) and bool((p["teacher_logps"] < clamp).any())


def test_topk_log_probs_equal_log_softmax_with_gradient():
    p = problem(1)
    x, y = p["logits"].clone().requires_grad_(), p["logits"].clone().requires_grad_()
    ids = torch.cat([p["teacher_ids"], p["teacher_ids"][..., :2]], dim=-1)  # repeated ids accumulate
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    ours = dl.topk_log_probs(x, ids)
    ref = torch.log_softmax(y, -1).gather(-1, ids)
    torch.testing.assert_close(ours, ref, **TOL)
    (ours * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, **TOL)
    # padded vocabulary columns are outside the softmax and get no gradient
    z = p["logits"].clone().requires_grad_()
    padded = dl.topk_log_probs(z, p["teacher_ids"].clamp(max=19), vocab_size=20)
    expected = torch.log_softmax(p["logits"][..., :20], -1).gather(-1, p["teacher_ids"].clamp(max=19))
    torch.testing.assert_close(padded, expected)
    padded.sum().backward()
    assert torch.count_nonzero(z.grad[..., 20:]) == 0


# ---------------------------------------------------------------- the whole loss against verl's distillation_loss


def verl_run(verl_distill, monkeypatch, cfg: dict, p: dict, logits, mode: str, batch_info: dict, weights=None):
    """verl's distillation_loss on padded tensors (its unpadding step, no_padding_2_padding, made the identity)."""
    monkeypatch.setattr(verl_distill.losses, "no_padding_2_padding", lambda t, data: t)
    loss_cfg = verl_distill.config.DistillationLossConfig(**cfg)
    actor = verl_distill.config.ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                                            loss_agg_mode=mode)
    model_output = {"log_probs": sampled_log_probs(logits, p["sampled"])}
    data = {"response_mask": p["mask"], "old_log_probs": p["old"], "teacher_logprobs": p["teacher_sampled"][..., None],
            "dp_size": batch_info["dp_size"], "batch_num_tokens": batch_info["batch_num_tokens"],
            "global_batch_size": batch_info["global_batch_size"]}
    if weights is not None:
        data["rollout_is_weights"] = weights
    if cfg["loss_mode"] == "forward_kl_topk":
        nested = [torch.nested.nested_tensor([t.reshape(B * T, K)], layout=torch.jagged)
                  for t in (p["teacher_logps"], p["teacher_ids"])]
        out = verl_distill.fsdp.compute_forward_kl_topk(logits.reshape(1, B * T, V), *nested,
                                                        SimpleNamespace(distillation_loss=loss_cfg), "thd")
        model_output.update({k: v.reshape(B, T) for k, v in out.items()})
    return verl_distill.losses.distillation_loss(actor, SimpleNamespace(distillation_loss=loss_cfg), model_output, data)


def ours_run(cfg: dict, p: dict, logits, mode: str, batch_info: dict, weights=None):
    global_batch = GlobalBatchInfo(global_num_tokens=batch_info["batch_num_tokens"],
                                   global_batch_size=batch_info["global_batch_size"], dp_size=batch_info["dp_size"])
    return dl.compute_distillation_loss(
        cfg, p["mask"], mode, student_log_probs=sampled_log_probs(logits, p["sampled"]),
        teacher_log_probs=p["teacher_sampled"][..., None], student_logits=logits, teacher_topk_ids=p["teacher_ids"],
        teacher_topk_log_probs=p["teacher_logps"], old_log_probs=p["old"], rollout_is_weights=weights,
        global_batch=global_batch)


def compare(verl_distill, monkeypatch, cfg, mode, seed=0, batch_info=None, weights=None):
    p = problem(seed)
    if batch_info is None:
        batch_info = {"dp_size": 1, "batch_num_tokens": p["mask"].sum().item(),
                      "global_batch_size": (p["mask"].sum(-1) > 0).sum().item()}
    ours_x, verl_x = p["logits"].clone().requires_grad_(), p["logits"].clone().requires_grad_()
    ours, ours_metrics = ours_run(cfg, p, ours_x, mode, batch_info, weights)
    theirs, verl_metrics = verl_run(verl_distill, monkeypatch, cfg, p, verl_x, mode, batch_info, weights)
    torch.testing.assert_close(ours, theirs, **TOL)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_x.grad, verl_x.grad, **TOL)
    assert torch.count_nonzero(ours_x.grad) > 0
    verl_metrics = plain(verl_metrics)
    assert set(ours_metrics) == set(verl_metrics)
    assert ours_metrics == pytest.approx(verl_metrics, abs=1e-5)
    return ours_metrics


MODES = [("forward_kl_topk", False), ("forward_kl_topk", True), ("k1", True)] + [
    (m, pg) for m in ("kl", "abs", "mse", "k2", "low_var_kl", "k3") for pg in (False, True)]


@pytest.mark.parametrize("agg", algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode,pg", MODES)
def test_every_mode_matches_verl(verl_distill, monkeypatch, loss_mode, pg, agg):
    cfg = dict(loss_mode=loss_mode, topk=K, use_policy_gradient=pg, loss_max_clamp=None, log_prob_min_clamp=None,
               clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28)
    for seed in range(2):
        compare(verl_distill, monkeypatch, cfg, agg, seed)


@pytest.mark.parametrize("loss_mode,pg", [("forward_kl_topk", False), ("k3", False), ("k1", True), ("mse", True)])
def test_clamps_match_verl(verl_distill, monkeypatch, loss_mode, pg):
    """loss_max_clamp binds on some tokens (half the largest |loss|; k1's negative ones are clamped at -c) and
    log_prob_min_clamp binds on some top-k entries; each changes the loss."""
    p, info = problem(0), {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None}
    loose = dict(loss_mode=loss_mode, topk=K, use_policy_gradient=pg, loss_max_clamp=None, log_prob_min_clamp=None)
    loose_loss, raw = ours_run(loose, p, p["logits"], "token-mean", info)
    clamp = 0.5 * max(abs(raw["distillation/loss_min"]), raw["distillation/loss_max"])
    for cfg in (dict(loose, loss_max_clamp=clamp), dict(loose, log_prob_min_clamp=-3.0),
                dict(loose, loss_max_clamp=clamp, log_prob_min_clamp=-3.0)):
        compare(verl_distill, monkeypatch, cfg, "token-mean")
        clamped_loss = ours_run(cfg, p, p["logits"], "token-mean", info)[0]
        if cfg["loss_max_clamp"] is not None or loss_mode == "forward_kl_topk":
            assert clamped_loss.item() != pytest.approx(loose_loss.item())


@pytest.mark.parametrize("loss_mode,pg", [("forward_kl_topk", False), ("k3", True)])
def test_global_batch_and_is_weights_match_verl(verl_distill, monkeypatch, loss_mode, pg):
    cfg = dict(loss_mode=loss_mode, topk=K, use_policy_gradient=pg, loss_max_clamp=10.0, log_prob_min_clamp=-10.0)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(5)) * 2
    info = {"dp_size": 2, "batch_num_tokens": 50, "global_batch_size": 9}
    for agg in ("token-mean", "seq-mean-token-mean"):
        compare(verl_distill, monkeypatch, cfg, agg, batch_info=info, weights=weights if pg else None)


@pytest.mark.parametrize("use_task_rewards,pg", [(True, False), (True, True), (False, True), (False, False)])
def test_task_reward_mixing_matches_verl(verl_distill, monkeypatch, use_task_rewards, pg):
    cfg = dict(loss_mode="k3", use_policy_gradient=pg, use_task_rewards=use_task_rewards, distillation_loss_coef=0.3)
    distill_loss, distill_metrics = torch.tensor(0.7), {"distillation/loss_min": 0.1}
    task_loss, task_metrics = torch.tensor(2.0), {"actor/pg_loss": 2.0}
    monkeypatch.setattr(verl_distill.losses, "distillation_loss",
                        lambda *a, **k: (distill_loss, dict(distill_metrics)))
    # a copy: verl adds the distillation loss to the task loss in place
    monkeypatch.setattr(verl_distill.losses, "ppo_loss", lambda *a, **k: (task_loss.clone(), dict(task_metrics)))
    theirs, verl_metrics = verl_distill.losses.distillation_ppo_loss(
        SimpleNamespace(), SimpleNamespace(distillation_loss=verl_distill.config.DistillationLossConfig(**cfg)))
    ours, metrics = dl.combine_with_task_loss(cfg, distill_loss, distill_metrics, task_loss, task_metrics)
    expected = 2.0 + 0.3 * 0.7 if use_task_rewards else 0.7
    assert float(ours) == pytest.approx(expected) == pytest.approx(float(theirs))
    verl_metrics = plain(verl_metrics)
    if not (use_task_rewards or pg):  # verl runs no task loss then; ours reports the metrics it is handed
        verl_metrics.update(task_metrics)
    assert metrics == pytest.approx(verl_metrics)
    if use_task_rewards:
        with pytest.raises(ValueError, match="use_task_rewards"):
            dl.combine_with_task_loss(cfg, distill_loss, distill_metrics)


def test_config_reads_verl_keys_and_defaults_follow_verls_yaml(verl_distill):
    verl_cfg = verl_distill.config.DistillationLossConfig(loss_mode="forward_kl_topk", topk=64, loss_max_clamp=5.0,
                                                          use_policy_gradient=False)
    ours = dl.DistillationLossConfig.from_config(verl_cfg)
    assert (ours.loss_mode, ours.topk, ours.loss_max_clamp, ours.log_prob_min_clamp) == (
        "forward_kl_topk", 64, 5.0, -10.0)
    assert set(dl.DISTILLATION_LOSS_MODES) == set(verl_distill.losses.DISTILLATION_LOSS_REGISTRY)
    yaml_text = (Path(verl_distill.losses.__file__).parents[1] / "config/distillation/distillation.yaml").read_text()
    defaults = dl.DistillationLossConfig()
    for line in ("loss_mode: k3", "topk: 32", "use_task_rewards: true", "loss_max_clamp: null",
                 "log_prob_min_clamp: null", "use_policy_gradient: false"):
        assert line in yaml_text
    assert (defaults.loss_mode, defaults.topk, defaults.use_task_rewards, defaults.loss_max_clamp,
            defaults.log_prob_min_clamp, defaults.use_policy_gradient) == ("k3", 32, True, None, None, False)


def test_schema_section_has_the_loss_configs_fields_and_defaults():
    """config/ imports no domain package (docs/architecture.md), so the schema's section restates
    DistillationLossConfig's fields: the same names, types and defaults, in the same order."""
    def shape(cls: type) -> list[tuple[str, object, object]]:
        return [(f.name, f.type, f.default) for f in dataclasses.fields(cls)]

    assert shape(DistillationLossSection) == shape(dl.DistillationLossConfig)


# ---------------------------------------------------------------- bad inputs (no oracle needed)


def test_bad_configs_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"distillation\.distillation_loss\.loss_mode 'reverse_kl'.*known"):
        dl.DistillationLossConfig(loss_mode="reverse_kl")
    with pytest.raises(ValueError, match=r"loss_mode='k1' needs use_policy_gradient"):
        dl.DistillationLossConfig(loss_mode="k1")
    with pytest.raises(ValueError, match="policy_loss_mode"):
        dl.DistillationLossConfig(use_policy_gradient=True, policy_loss_mode="gspo")
    with pytest.raises(ValueError, match="topk must be a positive int"):
        dl.DistillationLossConfig(loss_mode="forward_kl_topk", topk=0)
    with pytest.raises(ValueError, match="loss_max_clamp must be > 0"):
        dl.DistillationLossConfig(loss_max_clamp=-1.0)
    with pytest.raises(ValueError, match="unknown"):
        dl.compute_distillation_loss({"loss_mode": "jsd"}, torch.ones(2, 3))


def topk_call(p, cfg=None, mask=None, **tensors):
    args = dict(student_logits=p["logits"], teacher_topk_ids=p["teacher_ids"], teacher_topk_log_probs=p["teacher_logps"])
    args.update(tensors)
    cfg = {"loss_mode": "forward_kl_topk", "topk": K} if cfg is None else cfg
    return dl.compute_distillation_loss(cfg, p["mask"] if mask is None else mask, **args)


def test_bad_tensors_are_refused_naming_tensor_and_shapes():
    p = problem(0)
    with pytest.raises(ValueError, match=r"teacher_topk_log_probs must be \[batch, response_length, topk\].*\(5, 6, 6\)"):
        topk_call(p, teacher_topk_log_probs=p["teacher_logps"][:, :6])
    with pytest.raises(ValueError, match=r"teacher_topk_ids \(5, 7, 5\) and teacher_topk_log_probs \(5, 7, 6\)"):
        topk_call(p, teacher_topk_ids=p["teacher_ids"][..., :5], cfg={"loss_mode": "forward_kl_topk", "topk": 5})
    with pytest.raises(ValueError, match=r"topk=5 but teacher_topk_ids has shape \(5, 7, 6\)"):
        topk_call(p, cfg={"loss_mode": "forward_kl_topk", "topk": 5})
    with pytest.raises(ValueError, match=r"topk=30 is larger than the vocabulary \(24 tokens\)"):
        ids = torch.zeros(B, T, 30, dtype=torch.long)
        topk_call(p, teacher_topk_ids=ids, teacher_topk_log_probs=ids.float(),
                  cfg={"loss_mode": "forward_kl_topk", "topk": 30})
    with pytest.raises(ValueError, match=r"topk=30 columns, more than the vocabulary's 24"):
        ids = torch.zeros(B, T, 30, dtype=torch.long)
        dl.forward_kl_topk(p["logits"], ids, ids.float())
    with pytest.raises(ValueError, match=r"student_logits \(5, 7, 24\).*response_mask's \(5, 6\)"):
        topk_call(p, mask=p["mask"][:, :6])
    with pytest.raises(ValueError, match=r"teacher_topk_ids holds ids outside \[0, 24\)"):
        topk_call(p, teacher_topk_ids=p["teacher_ids"] + 24)
    with pytest.raises(TypeError, match="teacher_topk_ids must hold integer token ids"):
        topk_call(p, teacher_topk_ids=p["teacher_ids"].float())
    with pytest.raises(ValueError, match=r"needs \['student_logits'\]"):
        topk_call(p, student_logits=None)
    lp = sampled_log_probs(p["logits"], p["sampled"])
    with pytest.raises(ValueError, match=r"student_log_probs \(5, 7\), teacher_log_probs \(5, 6\)"):
        dl.compute_distillation_loss({}, p["mask"], student_log_probs=lp, teacher_log_probs=lp[:, :6])
    with pytest.raises(ValueError, match="needs student_log_probs and teacher_log_probs"):
        dl.compute_distillation_loss({}, p["mask"], student_log_probs=lp)
    with pytest.raises(ValueError, match="use_policy_gradient=true needs student_log_probs and old_log_probs"):
        dl.compute_distillation_loss({"use_policy_gradient": True}, p["mask"], student_log_probs=lp, teacher_log_probs=lp)
    with pytest.raises(ValueError, match=r"vocab_size=30 must be in \[1, 24\]"):
        dl.topk_log_probs(p["logits"], p["teacher_ids"], vocab_size=30)


def test_all_padding_micro_batch_is_a_zero_loss():
    p = problem(0)
    x = p["logits"].clone().requires_grad_()
    loss, metrics = dl.compute_distillation_loss({"loss_mode": "forward_kl_topk", "topk": K}, torch.zeros(B, T),
                                                 student_logits=x, teacher_topk_ids=p["teacher_ids"],
                                                 teacher_topk_log_probs=p["teacher_logps"])
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0
    assert metrics == {"distillation/overlap_token_advantage": 0.0}


def test_minimising_forward_kl_topk_moves_the_student_to_the_teacher():
    p = problem(2)
    x = p["logits"].clone().requires_grad_()
    opt = torch.optim.SGD([x], lr=1.0)
    cfg = {"loss_mode": "forward_kl_topk", "topk": K}
    history = []
    for _ in range(40):
        loss, metrics = dl.compute_distillation_loss(cfg, p["mask"], "token-sum", student_logits=x,
                                                     teacher_topk_ids=p["teacher_ids"],
                                                     teacher_topk_log_probs=p["teacher_logps"])
        history.append((loss.item(), metrics))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert history[-1][0] < 0.05 * history[0][0]
    assert history[-1][1]["distillation/overlap_ratio"] > history[0][1]["distillation/overlap_ratio"]
    assert history[-1][1]["distillation/student_mass"] > history[0][1]["distillation/student_mass"]


# ---------------------------------------------------------------- vocab-parallel form: 2 gloo ranks == 1 rank

TP_CASES = [  # (log_prob_min_clamp, vocab_size, use_policy_gradient)
    (None, None, False),
    (-3.0, None, False),
    (-3.0, 20, False),  # Megatron's vocabulary padding: the last 4 columns are outside the softmax
    (None, None, True),
]


def _tp_losses(logits: torch.Tensor, p: dict, clamp, vocab_size, pg, tp_group, real_vocab: int) -> tuple:
    """The loss, metrics and logits gradient of one case; token ids are kept inside the real vocabulary."""
    x = logits.clone().requires_grad_()
    ids = p["teacher_ids"].clamp(max=real_vocab - 1)
    cfg = {"loss_mode": "forward_kl_topk", "topk": K, "log_prob_min_clamp": clamp, "use_policy_gradient": pg,
           "loss_max_clamp": 2.0}
    lp = sampled_log_probs(p["logits"][..., :real_vocab], p["sampled"].clamp(max=real_vocab - 1))
    loss, metrics = dl.compute_distillation_loss(
        cfg, p["mask"], "seq-mean-token-mean", student_logits=x, teacher_topk_ids=ids,
        teacher_topk_log_probs=p["teacher_logps"], student_log_probs=lp, old_log_probs=p["old"],
        tp_group=tp_group, vocab_size=vocab_size)
    if not pg:  # the PG form's gradient flows through the sampled tokens' log-probs, not these logits
        loss.backward()
    return loss.detach(), metrics, None if pg else x.grad


def tp_rank_results() -> list:
    rank, width = dist.get_rank(), V // 2
    p = problem(4)
    shard = p["logits"][..., rank * width:(rank + 1) * width]
    return [_tp_losses(shard, p, *case, dist.group.WORLD, case[1] or V) for case in TP_CASES]


def test_vocab_parallel_two_gloo_ranks_equal_one_rank():
    ranks = run_multiprocess(tp_rank_results, 2, timeout_s=300)
    p = problem(4)
    for i, case in enumerate(TP_CASES):
        width = case[1] or V
        single = _tp_losses(p["logits"], p, *case, None, width)
        unpadded = _tp_losses(p["logits"][..., :width], p, case[0], None, case[2], None, width)
        for loss, metrics, grad in ranks[0][i], ranks[1][i]:
            for ref in (single, unpadded):
                torch.testing.assert_close(loss, ref[0], **TOL)
                assert metrics == pytest.approx(ref[1], abs=1e-5)
        if not case[2]:
            grads = torch.cat([ranks[0][i][2], ranks[1][i][2]], dim=-1)
            torch.testing.assert_close(grads, single[2], **TOL)
            torch.testing.assert_close(grads[..., :width], unpadded[2], **TOL)
            assert torch.count_nonzero(grads[..., width:]) == 0


def verl_megatron_rank_results() -> list:
    """Runs on each rank: verl's Megatron vocab-parallel KL (_VocabParallelKLDivergence) and ours, per token."""
    verl = import_verl_distillation()
    init_model_parallel(tp=2)
    try:
        rank, width = dist.get_rank(), V // 2
        out = []
        for clamp in (None, -3.0):
            p = problem(5)
            shard = p["logits"][..., rank * width:(rank + 1) * width]
            ours_x, verl_x = shard.clone().requires_grad_(), shard.clone().requires_grad_()
            ours = dl.forward_kl_topk(ours_x, p["teacher_ids"], p["teacher_logps"], log_prob_min_clamp=clamp,
                                      tp_group=dist.group.WORLD)
            theirs = verl.megatron._VocabParallelKLDivergence.apply(
                verl_x, p["teacher_logps"], p["teacher_ids"], clamp)
            (ours["distillation_losses"] * p["upstream"]).sum().backward()
            (theirs[0] * p["upstream"]).sum().backward()
            ours = {k: v.detach() for k, v in ours.items()}
            out.append((ours, [t.detach() for t in theirs], ours_x.grad, verl_x.grad))
        return out
    finally:
        destroy_model_parallel()


def test_vocab_parallel_matches_verl_megatron_on_two_gloo_ranks(verl_distill):
    """Values and gradients equal verl's Megatron form. Its student and teacher masses are taken after
    log_prob_min_clamp (verl's FSDP form, and ours, before it): they are compared without the clamp."""
    for rank in run_multiprocess(verl_megatron_rank_results, 2, timeout_s=300):
        for (ours, theirs, ours_grad, verl_grad), clamp in zip(rank, (None, -3.0)):
            names = ["distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"]
            for name, value in zip(names, theirs):
                if clamp is not None and name.endswith("_mass"):
                    assert not torch.allclose(ours[name], value)  # the documented difference
                    continue
                torch.testing.assert_close(ours[name].to(value.dtype), value, **TOL)
            torch.testing.assert_close(ours_grad, verl_grad, **TOL)
