"""Grouped-GEMM experts (issue 38, part 3) on CPU: which expert layer the builder picks and why (logged once),
and the grouped weight layout (TEGroupedMLP's ``experts.linear_fc1.weight<i>``) through loading, export and
gradients, held by a plain-torch twin of TE's grouped experts (tests/models/moe_grouped_jobs.py).

The CUDA side (the real TEGroupedMLP against SequentialMLP, and their step times) is
tests/gpu/test_moe_grouped_cuda.py, run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import itertools
import logging
import re

import pytest
import torch

from megatron_rl.models import moe_experts
from megatron_rl.models.hf_config import parse_hf_config
from megatron_rl.models.moe_experts import (
    OVERRIDE_KEY,
    ExpertLayer,
    choose_expert_layer,
    expert_state_key,
    expert_weight,
    expert_weight_name,
    log_expert_layer,
)
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint, tiny_hf_config

# ---------------------------------------------------------------- the choice, against a model of the rules


def _expected(override: bool | None, cuda: bool, te: bool) -> bool | str:
    """The rules as the issue states them: grouped where CUDA and TE are there unless the user says false;
    the user's true where grouped cannot run is an error."""
    runnable = cuda and te
    if override is None:
        return runnable
    if override and not runnable:
        return "error"
    return override


@pytest.mark.parametrize("override, cuda, te", list(itertools.product((None, True, False), (True, False),
                                                                      (True, False))))
def test_expert_layer_choice_follows_the_rules(override, cuda, te):
    expected = _expected(override, cuda, te)
    if expected == "error":
        with pytest.raises(ValueError) as error:
            choose_expert_layer(override, cuda=cuda, te=te)
        assert f"{OVERRIDE_KEY}=true" in str(error.value)
        for missing, why in ((cuda, "no CUDA device"), (te, "Transformer Engine does not import")):
            assert (why in str(error.value)) == (not missing)
        return
    choice = choose_expert_layer(override, cuda=cuda, te=te)
    assert choice.grouped is expected
    assert choice.name == ("TEGroupedMLP" if expected else "SequentialMLP")
    if override is not None:
        assert choice.reason == f"{OVERRIDE_KEY}={str(override).lower()}"
    else:
        assert ("no CUDA device" in choice.reason) == (not cuda)
        assert ("Transformer Engine does not import" in choice.reason) == (not te)


@pytest.mark.parametrize("value", ["true", "false", 1, 0, [True]])
def test_a_non_boolean_override_is_refused_by_key(value):
    with pytest.raises(ValueError, match=re.escape(f"{OVERRIDE_KEY}={value!r} must be true or false")):
        choose_expert_layer(value, cuda=True, te=True)


def test_the_choice_is_logged_once_per_process_with_its_reason(monkeypatch, caplog):
    monkeypatch.setattr(moe_experts, "_logged", set())
    caplog.set_level(logging.INFO, logger=moe_experts.__name__)
    for _ in range(3):  # actor, reference, critic of one process
        log_expert_layer(choose_expert_layer(None, cuda=False, te=False))
    log_expert_layer(choose_expert_layer(None, cuda=True, te=True))
    lines = [r.getMessage() for r in caplog.records if r.name == moe_experts.__name__]
    assert lines == [
        "MoE experts: SequentialMLP (no CUDA device; Transformer Engine does not import: one plain-torch MLP "
        "per local expert)",
        "MoE experts: TEGroupedMLP (CUDA device and Transformer Engine: one grouped GEMM over the local "
        "experts)",
    ]


def test_moe_transformer_kwargs_take_the_choice():
    from megatron_rl.models.moe import moe_transformer_kwargs

    moe = parse_hf_config(tiny_hf_config("qwen3_moe").to_dict()).moe
    assert moe_transformer_kwargs(moe, 1, 1, ExpertLayer(True, "test"))["moe_grouped_gemm"] is True
    assert moe_transformer_kwargs(moe, 1, 1, ExpertLayer(False, "test"))["moe_grouped_gemm"] is False
    assert moe_transformer_kwargs(moe, 1, 1)["moe_grouped_gemm"] is False  # the planner: no layer built


class _Built(Exception):
    """Raised by the stand-in make_transformer_config: the choice reached it, nothing else is built."""


def _choice_reaching_the_config(monkeypatch, hf, *, cuda: bool, use_te: bool, **overrides) -> tuple:
    from megatron_rl.models import builder

    seen = {}

    def make_transformer_config(hf, **kwargs):
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr(builder, "make_transformer_config", make_transformer_config)
    monkeypatch.setattr(builder.torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(_Built):
        builder.build_gpt_model(hf, use_te=use_te, **overrides)
    return seen["experts"], seen


@pytest.mark.parametrize("cuda, use_te, override, grouped", [
    (False, False, None, False), (True, True, None, True), (True, False, None, False),
    (True, True, False, False), (True, True, True, True), (False, False, False, False),
])
def test_the_builder_decides_once_and_passes_the_choice(monkeypatch, caplog, cuda, use_te, override, grouped):
    monkeypatch.setattr(moe_experts, "_logged", set())
    caplog.set_level(logging.INFO, logger=moe_experts.__name__)
    hf = parse_hf_config(tiny_hf_config("qwen3_moe").to_dict())
    overrides = {} if override is None else {"moe_grouped_gemm": override}
    experts, kwargs = _choice_reaching_the_config(monkeypatch, hf, cuda=cuda, use_te=use_te, **overrides)
    assert experts.grouped is grouped
    assert "moe_grouped_gemm" not in kwargs  # the choice carries it, not a second copy of the override
    with pytest.raises(_Built):
        from megatron_rl.models import builder

        builder.build_gpt_model(hf, use_te=use_te, **overrides)
    assert len([r for r in caplog.records if r.name == moe_experts.__name__]) == 1


def test_a_dense_model_makes_no_expert_choice(monkeypatch):
    hf = parse_hf_config(tiny_hf_config("qwen3").to_dict())
    experts, _ = _choice_reaching_the_config(monkeypatch, hf, cuda=False, use_te=False)
    assert experts is None


def test_grouped_experts_asked_for_on_cpu_are_refused_before_anything_is_built(monkeypatch):
    from megatron_rl.models import builder

    hf = parse_hf_config(tiny_hf_config("qwen3_moe").to_dict())
    monkeypatch.setattr(builder, "make_transformer_config", lambda *a, **k: pytest.fail("built"))
    refusal = re.escape(f"{OVERRIDE_KEY}=true: TE's grouped experts cannot run here")
    with pytest.raises(ValueError, match=refusal):
        builder.build_gpt_model(hf, use_te=False, moe_grouped_gemm=True)


def test_the_planner_refuses_a_non_boolean_override_by_key():
    from megatron_rl.models.builder import make_transformer_config

    hf = parse_hf_config(tiny_hf_config("qwen3_moe").to_dict())
    with pytest.raises(ValueError, match=re.escape(f"{OVERRIDE_KEY}='false' must be true or false")):
        make_transformer_config(hf, layout=(1, 1, None, 1), init_weights=False, moe_grouped_gemm="false")


def test_the_local_spec_has_no_grouped_experts():
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_rl.models.builder import gpt_layer_spec

    hf = parse_hf_config(tiny_hf_config("qwen3_moe").to_dict())
    assert gpt_layer_spec(hf, use_te=False).submodules.mlp.submodules.experts.module is SequentialMLP
    with pytest.raises(ValueError, match="need Transformer Engine's layer spec"):
        gpt_layer_spec(hf, use_te=False, grouped_experts=True)


# ---------------------------------------------------------------- the names of either layout


SEQUENTIAL = "decoder.layers.3.mlp.experts.local_experts.{i}.{linear}.weight"
GROUPED = "decoder.layers.3.mlp.experts.{linear}.weight{i}"


@pytest.mark.parametrize("i, linear", [(0, "linear_fc1"), (7, "linear_fc2"), (12, "linear_fc1")])
def test_expert_state_keys_convert_both_ways(i, linear):
    sequential, grouped = SEQUENTIAL.format(i=i, linear=linear), GROUPED.format(i=i, linear=linear)
    assert expert_state_key(sequential, grouped=True) == grouped
    assert expert_state_key(grouped, grouped=False) == sequential
    assert expert_state_key(grouped, grouped=True) == grouped
    assert expert_state_key(sequential, grouped=False) == sequential


@pytest.mark.parametrize("key", [
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",  # a shared expert is a dense MLP, never grouped
    "decoder.layers.0.mlp.router.weight",
    "decoder.layers.0.mlp.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.linear_fc1._extra_state",
])
def test_other_keys_are_left_alone(key):
    assert expert_state_key(key, grouped=True) == key == expert_state_key(key, grouped=False)


def test_a_bad_expert_linear_is_refused_by_name():
    with pytest.raises(ValueError, match="expert linear 'linear_qkv' is not one of"):
        expert_weight_name(0, "linear_qkv", grouped=True)


def test_expert_weight_finds_the_same_parameter_in_either_layout():
    from moe_grouped_jobs import GroupedExpertsTwin

    sequential = torch.nn.Module()
    sequential.num_local_experts = 2
    sequential.local_experts = torch.nn.ModuleList()
    for _ in range(2):
        expert = torch.nn.Module()
        expert.linear_fc1 = torch.nn.Linear(4, 6, bias=False)
        expert.linear_fc2 = torch.nn.Linear(3, 4, bias=False)
        sequential.local_experts.append(expert)
    grouped = GroupedExpertsTwin(2, hidden=4, ffn=3)
    grouped.load_state_dict({expert_state_key(k, grouped=True): v
                             for k, v in sequential.state_dict().items()}, strict=True)
    for i, linear in itertools.product(range(2), ("linear_fc1", "linear_fc2")):
        assert expert_weight(sequential, i, linear) is getattr(sequential.local_experts[i], linear).weight
        assert expert_weight(grouped, i, linear) is getattr(getattr(grouped, linear), f"weight{i}")
        assert torch.equal(expert_weight(grouped, i, linear), expert_weight(sequential, i, linear))


# ---------------------------------------------------------------- a model in each layout (2 spawned ranks)

# qwen3_moe: every layer MoE; qwen2_moe: a dense layer first, a gated shared expert
FAMILIES = ("qwen3_moe", "qwen2_moe")
TOLERANCE = 1e-6  # fp32, the same per-expert matmuls: the twin differs from SequentialMLP only in op order


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    from moe_grouped_jobs import grouped_layout_job

    from megatron_rl.distributed import run_multiprocess

    root = tmp_path_factory.mktemp("grouped")
    dirs = {f: str(make_tiny_hf_checkpoint(root / f, f, with_tokenizer=False)) for f in FAMILIES}
    return run_multiprocess(grouped_layout_job, 2, dirs, timeout_s=600)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ep", (1, 2))
def test_export_is_bit_identical_from_either_layout(layouts, family, ep):
    from moe_grouped_jobs import EXPERT_LAYOUTS

    assert ep in EXPERT_LAYOUTS
    reference = layouts[0][family, 1]["export"]["sequential"]  # EP=1, SequentialMLP
    assert reference and any(".experts.3." in name for name, _ in reference)
    for rank in layouts:
        result = rank[family, ep]
        assert result["replaced"] == (2 if family == "qwen3_moe" else 1) and result["grouped_layout"]
        for layout in ("sequential", "grouped"):
            got = result["export"][layout]
            assert [n for n, _ in got] == [n for n, _ in reference], (family, ep, layout)
            for (name, tensor), (_, expected) in zip(got, reference, strict=True):
                assert torch.equal(tensor, expected), f"{family} EP={ep} {layout}: {name} differs"


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ep", (1, 2))
def test_loading_hf_fills_the_grouped_layout_at_the_owned_offsets(layouts, family, ep):
    for rank in layouts:
        result = rank[family, ep]
        sequential, grouped = result["sequential_params"], result["from_hf_params"]
        assert sequential.keys() == grouped.keys()
        experts = {int(re.search(r"\.experts\.(\d+)\.", k)[1]) for k in grouped if ".experts." in k}
        assert experts == set(result["owned"]) and len(experts) == 4 // ep
        for key, value in sequential.items():
            assert torch.equal(grouped[key], value), f"{family} EP={ep}: {key}"


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ep", (1, 2))
def test_the_grouped_twin_matches_sequential_logits_and_gradients(layouts, family, ep):
    for rank in layouts:
        result = rank[family, ep]
        torch.testing.assert_close(result["logits"]["grouped"], result["logits"]["sequential"],
                                   atol=TOLERANCE, rtol=TOLERANCE)
        seq, grp = result["grads"]["sequential"], result["grads"]["grouped"]
        assert seq.keys() == grp.keys() and any(".experts." in k for k in seq)
        for key in seq:
            torch.testing.assert_close(grp[key], seq[key], atol=TOLERANCE, rtol=TOLERANCE, msg=key)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ep", (1, 2))
def test_one_moe_layer_forward_and_backward_match(layouts, family, ep):
    for rank in layouts:
        seq, grp = (rank[family, ep]["layer"][name] for name in ("sequential", "grouped"))
        assert seq["output"].abs().max() > 1e-3  # the experts did something
        for what in ("output", "input_grad"):
            torch.testing.assert_close(grp[what], seq[what], atol=TOLERANCE, rtol=TOLERANCE, msg=what)
        assert seq["expert_grads"].keys() == grp["expert_grads"].keys()
        assert len(seq["expert_grads"]) == 2 * 4 // ep  # gate_up and down of each local expert
        for key, grad in seq["expert_grads"].items():
            assert grad.abs().max() > 0, key
            torch.testing.assert_close(grp["expert_grads"][key], grad, atol=TOLERANCE, rtol=TOLERANCE,
                                       msg=key)


def test_the_converter_counts_grouped_expert_weights_as_experts():
    from megatron_rl.weights.convert_report import expert_load

    weight = torch.zeros(2, 3)
    named = [(SEQUENTIAL.format(i=0, linear="linear_fc1"), weight),
             (GROUPED.format(i=1, linear="linear_fc2"), weight),
             ("decoder.layers.3.mlp.shared_experts.linear_fc1.weight", weight)]
    assert expert_load(named) == (2, 2 * weight.numel() * weight.element_size())


def test_a_grouped_layer_without_per_expert_weights_is_refused_by_name():
    stacked = torch.nn.Module()  # TE's opt-in single_grouped_parameter: one [E, out, in] weight
    stacked.num_local_experts = 2
    stacked.linear_fc1 = torch.nn.Module()
    stacked.linear_fc1.weight = torch.nn.Parameter(torch.zeros(2, 6, 4))
    with pytest.raises(ValueError, match=r"Module has no parameter 'linear_fc1.weight1' \(one weight per local "
                                         r"expert\); it holds \['linear_fc1.weight'\]"):
        expert_weight(stacked, 1, "linear_fc1")
