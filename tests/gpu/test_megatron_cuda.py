"""Megatron actor on a lent GPU (skipped without CUDA), issue 14: the TE spec when TE imports, packed
sequences (THD) against the padded path and against transformers in fp32, one update each, offload
freeing real device memory and bringing the same numbers back, peak memory recorded next to the state
the planner counts. bf16 tolerance: mean |log-prob difference| <= 2e-2 against fp32 transformers, packed
vs padded <= 1e-2 (the same bf16 kernels over the same tokens; only the attention calls differ)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_cuda_jobs import megatron_cuda_job

    from megatron_rl.distributed import run_multiprocess
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("cuda") / "qwen2", "qwen2", with_tokenizer=False)
    return str(model), run_multiprocess(megatron_cuda_job, 1, str(model), timeout_s=300)[0]


def _hf_log_probs(model_dir: str, data) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = data.batch
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits / data.meta_info["temperature"]
    response = batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, -response - 1:-1].float(), -1)
    picked = logp.gather(-1, batch["responses"][..., None]).squeeze(-1)
    return picked * batch["attention_mask"][:, -response:]


def test_packed_and_padded_match_transformers_in_bf16(results, record_property):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
    from workers_jobs import training_batch

    model_dir, out = results
    record_property("te_spec", out["te_spec"])
    expected = _hf_log_probs(model_dir, training_batch())
    mask = training_batch().batch["attention_mask"][:, -expected.shape[1]:].bool()
    for name in ("padded", "packed"):
        diff = (out[f"{name}/log_probs"].float() - expected)[mask].abs()
        record_property(f"{name}_mean_abs_diff_vs_fp32_hf", float(diff.mean()))
        assert float(diff.mean()) <= 2e-2, name
    # bf16 packs on CUDA take the fused flash-varlen kernel, not the per-sequence twin
    assert "flash_varlen" in out["packed/attention_kernels"], out["packed/attention_kernels"]
    packed_vs_padded = (out["packed/log_probs"] - out["padded/log_probs"])[mask].abs()
    record_property("packed_vs_padded_max", float(packed_vs_padded.max()))
    assert float(packed_vs_padded.mean()) <= 1e-2
    for name in ("padded", "packed"):
        assert all(torch.isfinite(torch.tensor(v)) for v in out[f"{name}/metrics"].values())


def test_offload_frees_device_memory_and_restores_the_numbers(results, record_property):
    _, out = results
    held = sum(out["offload/host_bytes"].values())
    record_property("offload_freed_bytes", out["offload/freed_bytes"])
    record_property("offload_host_bytes", held)
    assert out["offload/freed_bytes"] >= 0.9 * held > 0
    assert out["offload/log_probs_equal"]


def test_peak_memory_next_to_the_planned_state(results, record_property):
    from megatron_rl.plan.memory import state_bytes_per_param

    _, out = results
    per_param = state_bytes_per_param("bf16", False, 1)
    planned = out["padded/params"] * (per_param.params + per_param.grads + per_param.optimizer)
    for name in ("padded", "packed"):
        record_property(f"{name}_peak_bytes", out[f"{name}/peak_bytes"])
    record_property("planned_state_bytes", planned)
    assert out["padded/peak_bytes"] >= planned  # the state is resident in the update, activations on top
