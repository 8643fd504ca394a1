"""LoRA on Megatron (fp32, non-zero B so every output depends on the adapters): TP=2, TP=2 with sequence
parallelism, PP=2 and CP=2 on packed sequences equal TP=1 for log-probs, loss, grad norm, every adapter factor's gradient (gathered over
TP) and the step; only the adapters train (no gradient buffer or optimizer state for the base); with the
adapters off the actor is the base model (the reference policy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_jobs import base_job, lora_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed
# (TP, PP, SP, CP); CP runs on packed sequences (THD)
LAYOUTS = {"tp2": (2, 1, False, 1), "tp2_sp": (2, 1, True, 1), "pp2": (1, 2, False, 1), "cp2_packed": (1, 1, False, 2)}
ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("lora") / "qwen2", "qwen2", with_tokenizer=False))


@pytest.fixture(scope="module")
def reference(model_dir):
    return run_multiprocess(lora_job, 1, model_dir, 1, 1, timeout_s=600)[0]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, model_dir):
    tp, pp, sp, cp = LAYOUTS[request.param]
    return request.param, run_multiprocess(lora_job, tp * pp * cp, model_dir, tp, pp, sp, cp, timeout_s=600)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=ATOL, msg=lambda m: f"{what}: {m}")


def test_only_the_adapters_train(reference, model_dir):
    assert reference["trainable"] and all("_lora." in name for name in reference["trainable"]), reference["trainable"]
    assert reference["frozen_with_grad_buffer"] == []
    assert reference["optimizer_params"] == reference["adapter_params"] > 0
    # 2 layers x (q, k, v, o, gate, up, down) adapters of rank 4 on the tiny model (hidden 32, 4 heads of 8,
    # 2 KV heads, ffn 64): A [4, in] + B [out, 4] each
    per_layer = sum(4 * (i + o) for i, o in ((32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64), (64, 32)))
    assert reference["adapter_params"] == 2 * per_layer


def test_adapters_off_is_the_base_model(reference, model_dir):
    base = run_multiprocess(base_job, 1, model_dir, timeout_s=300)[0]
    _close(reference["base_log_probs_adapters_off"], base, "adapters off vs the base model")
    assert (reference["log_probs"] - base).abs().max() > 1e-2  # the adapters do change the policy


def test_layouts_equal_tp1(reference, layout):
    name, ranks = layout
    last = ranks[-1]
    _close(last["log_probs"], reference["log_probs"], f"{name} log-probs")
    _close(last["base_log_probs_adapters_off"], reference["base_log_probs_adapters_off"], f"{name} adapters off")
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert last["metrics"][key] == pytest.approx(reference["metrics"][key], rel=ATOL, abs=ATOL), key
    grads = {k: v for rank in ranks for k, v in rank["grads"].items()}
    after = {k: v for rank in ranks for k, v in rank["adapters_after"].items()}
    assert grads.keys() == reference["grads"].keys()
    for key, grad in reference["grads"].items():
        assert grad.abs().max() > 0, key
        _close(grads[key], grad, f"{name} gradient of {key}")
        _close(after[key], reference["adapters_after"][key], f"{name} {key} after the step")
    _close(last["log_probs_after"], reference["log_probs_after"], f"{name} log-probs after the step")


def _merged_in_hf_layout(model_dir: str, adapters: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The base checkpoint with W + scale B A merged per HF module, computed in HF's layout (not the exporter's)."""
    from safetensors.torch import load_file

    from megatron_rl.models.lora import HF_PARTS, PARTS

    weights = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    for key in {k.rsplit(".", 1)[0] for k in adapters}:
        layer, target = key.split(".")
        for part, module in zip(PARTS[target], HF_PARTS[target]):
            suffix = f"_{part}" if part else ""
            a, b = adapters[f"{key}.A{suffix}"], adapters[f"{key}.B{suffix}"]
            name = f"model.layers.{layer}.{module}.weight"
            weights[name] = weights[name] + scale * (b @ a)
    return weights


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_engines_get_the_merged_weights(model_dir, tp, pp):
    """What every engine receives (the exporter's HF buckets) is W + (alpha / r) B A of the trained adapters,
    merged on the trainer in Megatron's layout: bit-equal to the same merge done in HF's layout."""
    from lora_jobs import lora_config, merged_export_job

    ranks = run_multiprocess(merged_export_job, tp * pp, model_dir, tp, pp, timeout_s=600)
    config = lora_config()
    expected = _merged_in_hf_layout(model_dir, ranks[0]["adapters"], config.alpha / config.rank)
    exported = ranks[0]["exported"]
    assert exported.keys() == expected.keys()
    differing = [name for name in exported if not torch.equal(exported[name], expected[name])]
    assert not differing, f"not bit-equal to the merge in HF's layout: {differing}"
    base = _merged_in_hf_layout(model_dir, {}, 0.0)
    assert not torch.equal(exported["model.layers.1.self_attn.k_proj.weight"], base["model.layers.1.self_attn.k_proj.weight"])


def test_critic_lora_trains_adapters_and_value_head_equal_at_tp2(tmp_path, model_dir):
    from lora_jobs import critic_lora_job
    from megatron_rl_testing.tiny_models import make_tiny_critic_checkpoint

    critic_dir = str(make_tiny_critic_checkpoint(Path(model_dir), tmp_path / "critic"))
    one = run_multiprocess(critic_lora_job, 1, critic_dir, 1, timeout_s=600)[0]
    two = run_multiprocess(critic_lora_job, 2, critic_dir, 2, timeout_s=600)[-1]
    assert {n for n in one["trainable"] if "_lora." not in n} == {"module.output_layer.weight", "module.output_layer.bias"}
    for key in ("values", "values_after"):
        _close(two[key], one[key], f"critic {key}")
    assert (one["values_after"] - one["values"]).abs().max() > 1e-4
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=ATOL, abs=ATOL), key
