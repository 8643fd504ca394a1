"""LoRA adapters in and out of PEFT's format, and adapter-only checkpoints (gloo, CPU, tiny Qwen2, fp32).

- After one LoRA update at TP=2 and at PP=2, ``save_peft_adapter``'s directory loads with
  ``peft.PeftModel.from_pretrained`` onto the HF base and gives our log-probs (1e-5); ``merge_and_unload()``
  gives the weights our merged export (W + scale B A) gives (1e-6).
- An adapter made with ``peft`` itself (random non-zero B) loads through ``lora.adapter_path`` at TP=2 and
  gives the PEFT model's log-probs (1e-5).
- Bad adapters (missing tensor, wrong r, wrong shape, a pickled .bin) are refused naming the file and the key.
- A LoRA checkpoint saved after one update at TP=2 and resumed in fresh processes gives the uninterrupted
  run's second update exactly (adapters, log-probs, metrics), and is a fraction of a full-model checkpoint.

Three spawns: TP=2 (export, checkpoint, the peft-made adapter), PP=2 (export), TP=2 again (resume, errors).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import workers_jobs as jobs
from lora_peft_jobs import export_job, reshard_job, resume_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed
LOG_PROB_ATOL = 1e-5
WEIGHT_ATOL = 1e-6
HF_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# a LoRA checkpoint (rank-4 adapters + their Adam state) against the full model's (weights + Adam state)
MAX_SIZE_RATIO = 0.2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora_peft")


@pytest.fixture(scope="module")
def model_dir(workdir) -> str:
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    # wider than the default tiny model so that a checkpoint's tensors, not its per-file bookkeeping, set its size
    return str(
        make_tiny_hf_checkpoint(
            workdir / "qwen2", "qwen2", with_tokenizer=False, hidden_size=128, intermediate_size=256
        )
    )


def hf_base(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_log_probs(model, data) -> torch.Tensor:
    """Log-probs of the response tokens under an HF (or PEFT) model, logits divided by the batch's temperature."""
    from megatron_rl_testing.hf_reference import hf_response_log_probs

    return hf_response_log_probs(model, data, data.meta_info["temperature"]) * data.batch["response_mask"]


def masked(log_probs: torch.Tensor, data) -> torch.Tensor:
    return log_probs * data.batch["response_mask"]


@pytest.fixture(scope="module")
def peft_made(workdir, model_dir) -> dict:
    """An adapter made with peft (r=4, alpha=8, all seven projections, random non-zero B), its log-probs,
    and broken copies of it."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)  # lora_A: PEFT's kaiming init
    model = get_peft_model(
        hf_base(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=HF_MODULES, task_type="CAUSAL_LM")
    )
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1, generator=generator)
    model.eval()
    good = workdir / "peft_made"
    model.save_pretrained(str(good))
    data = jobs.training_batch()
    out = {"dir": str(good), "log_probs": hf_log_probs(model, data)}

    tensors = load_file(str(good / "adapter_model.safetensors"))
    key_missing = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    key_shape = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    assert key_missing in tensors and key_shape in tensors, sorted(tensors)[:4]
    bad = {}

    def broken(case: str, weights: dict | None = None, config: dict | None = None) -> None:
        directory = workdir / f"bad_{case}"
        shutil.copytree(good, directory)
        if weights is not None:
            save_file(weights, str(directory / "adapter_model.safetensors"))
        if config is not None:
            original = json.loads((good / "adapter_config.json").read_text())
            (directory / "adapter_config.json").write_text(json.dumps({**original, **config}))
        bad[case] = str(directory)

    broken("missing", weights={k: v for k, v in tensors.items() if k != key_missing})
    broken("rank", config={"r": 8})
    broken("shape", weights={**tensors, key_shape: torch.zeros(4, 16)})  # [4, 128]
    broken("pickle")
    Path(bad["pickle"], "adapter_model.safetensors").rename(Path(bad["pickle"], "adapter_model.bin"))
    out |= {"bad": bad, "key_missing": key_missing, "key_shape": key_shape}
    return out


@pytest.fixture(scope="module")
def tp2(model_dir, workdir, peft_made):
    return run_multiprocess(export_job, 2, model_dir, str(workdir), 2, 1, peft_made["dir"], timeout_s=600)


@pytest.fixture(scope="module")
def pp2(model_dir, workdir):
    return run_multiprocess(export_job, 2, model_dir, str(workdir), 1, 2, None, timeout_s=600)


@pytest.fixture(scope="module")
def resumed(model_dir, workdir, tp2, peft_made):
    return run_multiprocess(resume_job, 2, model_dir, str(workdir), peft_made["bad"], timeout_s=600)


# ------------------------------------------------------------------ export: peft loads ours
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_exported_adapter_loads_with_peft_and_gives_our_log_probs(layout, request, model_dir, workdir):
    from peft import PeftModel

    ranks = request.getfixturevalue(layout)
    name = {"tp2": "tp2_pp1", "pp2": "tp1_pp2"}[layout]
    directory = workdir / f"{name}_adapter"
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, model_dir)
    assert sorted(config["target_modules"]) == sorted(HF_MODULES)

    data = jobs.training_batch()
    model = PeftModel.from_pretrained(hf_base(model_dir), str(directory)).eval()
    ours = masked(ranks[-1]["log_probs"], data)
    torch.testing.assert_close(hf_log_probs(model, data), ours, atol=LOG_PROB_ATOL, rtol=0)
    # the update moved the adapters: the base model's log-probs are far from ours
    assert (hf_log_probs(hf_base(model_dir), data) - ours).abs().max() > 1e-2

    merged = model.merge_and_unload().state_dict()
    exported = ranks[0]["merged"]
    assert exported and exported.keys() <= merged.keys()
    for key, tensor in exported.items():
        torch.testing.assert_close(
            merged[key], tensor, atol=WEIGHT_ATOL, rtol=0, msg=lambda m, k=key: f"{k}: {m}"
        )


# ------------------------------------------------------------------ import: ours loads peft's
def test_adapter_made_with_peft_loads_at_tp2(peft_made, tp2):
    data = jobs.training_batch()
    torch.testing.assert_close(
        masked(tp2[-1]["peft_made/log_probs"], data), peft_made["log_probs"], atol=LOG_PROB_ATOL, rtol=0
    )


def test_bad_adapters_are_refused_naming_file_and_key(peft_made, resumed):
    bad, errors = peft_made["bad"], resumed[0]
    weights = "adapter_model.safetensors"
    assert f"{bad['missing']}/{weights}" in errors["error/missing"], errors["error/missing"]
    assert repr(peft_made["key_missing"]) in errors["error/missing"]
    assert f"{bad['rank']}/adapter_config.json: r=8" in errors["error/rank"], errors["error/rank"]
    assert "rank 4" in errors["error/rank"]
    assert f"{bad['shape']}/{weights}" in errors["error/shape"], errors["error/shape"]
    assert f"{peft_made['key_shape']!r} has shape [4, 16], expected [4, 128]" in errors["error/shape"]
    assert f"{bad['pickle']}/adapter_model.bin" in errors["error/pickle"], errors["error/pickle"]
    for case in bad:  # every rank raises the same error (no rank is left waiting in a collective)
        assert resumed[1][f"error/{case}"] == errors[f"error/{case}"]


# ------------------------------------------------------------------ checkpoints: adapters only
def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _stored_elements(directory: Path) -> int:
    """How many tensor elements a checkpoint stores (model and optimizer state), from its index."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return sum(item.size.numel() for item in index.values() if isinstance(item, TensorStorageMetadata))


def test_lora_checkpoint_resumes_exactly(tp2, resumed):
    assert resumed[0]["extra"] == {"data_position": 3}
    for before, after in zip(tp2, resumed):
        for name, value in before["metrics2"].items():
            assert after["metrics2"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
        assert after["adapters2"].keys() == before["adapters2"].keys()
        for key, tensor in before["adapters2"].items():
            torch.testing.assert_close(after["adapters2"][key], tensor, atol=0, rtol=0, msg=key)
        torch.testing.assert_close(after["log_probs2"], before["log_probs2"], atol=0, rtol=0)
    # the second update moved the adapters from the checkpoint's, so the load mattered
    assert (tp2[-1]["log_probs2"] - tp2[-1]["log_probs"]).abs().max() > 1e-3


def test_lora_checkpoint_is_a_fraction_of_the_full_one(workdir, tp2):
    lora, full = workdir / "lora_ckpt", workdir / "full_ckpt"
    print(
        f"\nLoRA checkpoint {_bytes(lora)} bytes ({_stored_elements(lora)} tensor elements), full-model "
        f"checkpoint {_bytes(full)} bytes ({_stored_elements(full)}): {_bytes(lora) / _bytes(full):.3f}"
    )
    # the adapters and their Adam moments (fp32: no master copy), nothing of the base
    adapter_elements = sum(t.numel() for t in tp2[0]["adapters2"].values())
    assert _stored_elements(lora) == 3 * adapter_elements
    assert _bytes(lora) < MAX_SIZE_RATIO * _bytes(full), (_bytes(lora), _bytes(full))
    assert json.loads((lora / "megatron_rl_checkpoint.json").read_text())["lora"]["rank"] == 4


def test_lora_checkpoint_saved_at_tp2_loads_at_pp2(model_dir, workdir, tp2):
    ranks = run_multiprocess(reshard_job, 2, model_dir, str(workdir), timeout_s=600)
    # the state the checkpoint was saved in: after the first update (the second came after the save)
    torch.testing.assert_close(ranks[-1]["log_probs"], tp2[-1]["log_probs"], atol=LOG_PROB_ATOL, rtol=0)
    adapters = {key: tensor for rank in ranks for key, tensor in rank["adapters"].items()}
    assert adapters.keys() == tp2[0]["adapters1"].keys()
    for key, tensor in tp2[0]["adapters1"].items():
        torch.testing.assert_close(adapters[key], tensor, atol=0, rtol=0, msg=key)


def test_lora_checkpoint_is_refused_by_other_engines(workdir, resumed):
    assert "holds LoRA adapters only (rank 4" in resumed[0]["error/full_engine"], resumed[0][
        "error/full_engine"
    ]
    assert "but the actor engine builds" in resumed[0]["error/other_rank"], resumed[0]["error/other_rank"]
