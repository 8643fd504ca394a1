"""Multi-token prediction (models/mtp.py, models/mtp_model.py): DeepSeek-V3's and MiMo's MTP layers read from
config.json, built on Megatron-Core at TP 1 and 2 (sequence parallel), their loss and gradients against the same
computation built from transformers' modules (megatron_rl_testing/mtp_models.py), the export round trip, and the
refusals before launch.

One spawned group (2 gloo ranks) runs the Megatron side; the references and assertions run here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config.errors import ConfigError
from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import UnsupportedModelError, parse_hf_config
from megatron_rl.models.mtp import with_mtp
from megatron_rl_testing.mtp_models import MTP_FAMILIES, make_mtp_checkpoint, own_names, reference_mtp
from megatron_rl_testing.tiny_models import padded_batch as batch
from mtp_jobs import mtp_checks, mtp_targets

TOLERANCE = 1e-5
TPS = [1, 2]


# ---------------------------------------------------------------- config (no Megatron)


def test_mtp_layers_are_read_from_config_json(tmp_path):
    deepseek = parse_hf_config(json.loads((make_mtp_checkpoint(tmp_path / "d", "deepseek_v3") / "config.json")
                                          .read_text()))
    spec = deepseek.checkpoint_mtp
    assert (spec.num_layers, spec.mimo_naming, spec.moe_layer, spec.prefix(0)) == (1, False, True, "model.layers.2.")
    assert spec.tensor_names(0)["final_norm"] == "model.layers.2.shared_head.norm.weight"
    assert deepseek.mtp is None  # read, not built, until model.mtp.enable asks
    mimo = parse_hf_config(json.loads((make_mtp_checkpoint(tmp_path / "m", "mimo") / "config.json").read_text()))
    assert (mimo.architecture, mimo.qkv_bias, mimo.moe) == ("MiMoForCausalLM", True, None)
    assert mimo.checkpoint_mtp.tensor_names(0)["eh_proj"] == "model.mtp_layers.0.input_proj.weight"
    assert with_mtp(mimo, True).mtp == mimo.checkpoint_mtp


def test_enable_without_mtp_layers_is_refused(tmp_path):
    from megatron_rl_testing.tiny_models import tiny_hf_config

    hf = parse_hf_config(tiny_hf_config("qwen2").to_dict(), source="q/config.json")
    with pytest.raises(UnsupportedModelError, match=r"mtp.enable=true but q/config.json: it declares no multi-token"):
        with_mtp(hf, True)


@pytest.mark.parametrize("overrides, message", [
    ({"enable_train": True}, r"mtp.enable_train=true needs actor_rollout_ref.model.mtp.enable=true"),
    ({"enable": True, "enable_rollout": True, "tis_imp_ratio_cap": 2.0},
     r"enable_rollout=true with actor_rollout_ref.actor.tis_imp_ratio_cap set: it reads the rollout engine's"),
    ({"enable": True, "mtp_loss_scaling_factor": -0.1}, r"mtp_loss_scaling_factor=-0.1 must be >= 0"),
    ({"enable": True, "enable_train": True, "context_parallel_size": 2},
     r"enable_train=true with actor_rollout_ref.actor.megatron.context_parallel_size=2"),
    ({"enable": True, "rank": 8}, r"mtp.enable=true with actor_rollout_ref.model.lora.rank=8"),
    ({"critic": True}, r"critic.model.mtp.enable=true: a critic builds no multi-token-prediction layers"),
])
def test_mtp_settings_are_refused_by_name(overrides, message):
    from megatron_rl.config.loader import load_config, typed_config
    from megatron_rl.config.mtp import check_mtp_settings

    keys = {"context_parallel_size": "actor_rollout_ref.actor.megatron", "rank": "actor_rollout_ref.model.lora",
            "critic": None, "tis_imp_ratio_cap": "actor_rollout_ref.actor"}
    args = [f"{keys.get(k, 'actor_rollout_ref.model.mtp')}.{k}={v}" for k, v in overrides.items() if k != "critic"]
    args += ["critic.model.mtp.enable=true"] if "critic" in overrides else []
    args += ["actor_rollout_ref.model.path=/nonexistent", "data.train_files=[/nonexistent.parquet]"]
    cfg = typed_config(load_config(overrides=args))
    with pytest.raises(ConfigError, match=message):
        check_mtp_settings(cfg)


def test_drafting_is_refused_on_engines_that_do_not_draft_and_checked_against_the_model(tmp_path):
    """enable_rollout: refused by name on the HF engine (validation), and vLLM's MiMo drafter takes one token per step
    (the planner's model facts)."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.plan.model_facts import load_model_facts
    from megatron_rl.plan.validate import validate

    model = make_mtp_checkpoint(tmp_path / "mimo", "mimo")
    base = [f"actor_rollout_ref.model.path={model}", "data.train_files=[/nonexistent.parquet]",
            "actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_rollout=true"]
    with pytest.raises(ConfigError, match=r"mtp.enable_rollout=true: speculative decoding .* colocated engines that "
                                          r"draft with them \(vllm; here hf"):
        validate(load_config(overrides=base + ["actor_rollout_ref.rollout.name=hf"]))
    cfg = load_config(overrides=base + ["actor_rollout_ref.rollout.name=vllm",
                                        "actor_rollout_ref.model.mtp.num_speculative_tokens=2"])
    with pytest.raises(ConfigError, match=r"num_speculative_tokens=2: vLLM's MiMo drafter predicts one token"):
        load_model_facts(cfg)


# ---------------------------------------------------------------- Megatron vs transformers (2 gloo ranks)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    dirs = {family: str(make_mtp_checkpoint(root / family, family, seed=i, vocab_size=300))
            for i, family in enumerate(MTP_FAMILIES)}
    input_ids, attention_mask = batch()
    from megatron_rl.models import position_ids_from_mask

    labels, mask = mtp_targets(input_ids, attention_mask)
    references = {}
    for family, directory in dirs.items():
        main, mtp, leaves = reference_mtp(directory, input_ids, attention_mask, position_ids_from_mask(attention_mask),
                                          root / f"reference_{family}")
        ce = torch.nn.functional.cross_entropy(mtp.reshape(-1, mtp.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce.view(labels.shape) * mask).sum() / mask.sum()
        loss.backward()
        references[family] = dict(main=main.detach(), loss=loss.item(),
                                   grads={n: leaf.grad.clone() for n, leaf in leaves.items()})
    return dirs, references, run_multiprocess(mtp_checks, 2, dirs, TPS, timeout_s=900)


@pytest.mark.distributed
@pytest.mark.parametrize("family", MTP_FAMILIES)
@pytest.mark.parametrize("tp", TPS)
def test_main_logits_unchanged_by_the_mtp_layer(setup, family, tp):
    _, references, results = setup
    valid = batch()[1].bool()
    for result in results:
        diff = (result[family, tp, "logits"] - references[family]["main"])[valid].abs().max().item()
        assert diff <= TOLERANCE, f"{family} TP={tp}: max |logit diff| {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("family", MTP_FAMILIES)
@pytest.mark.parametrize("tp", TPS)
def test_export_round_trip_is_exact_with_the_mtp_layer(setup, family, tp):
    """Every checkpoint tensor comes back bit-exact, the MTP layer's (MiMo's swapped input_proj halves, DeepSeek's
    embedding / lm_head copies) included."""
    dirs, _, results = setup
    stored = load_file(Path(dirs[family]) / "model.safetensors")
    exported = results[0][family, tp, "export"]
    assert set(exported) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.distributed
@pytest.mark.parametrize("family", MTP_FAMILIES)
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("detach", [False, True], ids=["joint", "detach_encoder"])
def test_mtp_loss_and_gradients_match_the_reference(setup, family, tp, detach):
    """The MTP loss equals the reference's cross-entropy of token i + 2 (fp32 level), the MTP layer's own tensors
    and its decoder layer's attention get the reference's gradients (non-zero), and ``detach_encoder`` keeps the
    main model's gradient at exactly 0 (it is non-zero without it)."""
    dirs, references, results = setup
    reference = references[family]
    names = own_names(dirs[family])
    for result in results:
        out = result[family, tp, detach]
        assert abs(out["loss"] - reference["loss"]) <= TOLERANCE * max(1.0, reference["loss"])
        assert out["tokens"] == float(mtp_targets(*batch())[1].sum())
        compared = 0
        for name, expected in reference["grads"].items():
            assert name in out["grads"], f"{name} has no Megatron gradient"
            assert expected.abs().max() > 0, name
            diff = (out["grads"][name] - expected).abs().max().item()
            assert diff <= TOLERANCE, f"{family} TP={tp} {name}: max |grad diff| {diff:.2e}"
            compared += 1
        assert compared >= 6 and set(names.values()) <= set(reference["grads"])
        assert (out["main_grad"] == 0.0) if detach else (out["main_grad"] > 0.0)
