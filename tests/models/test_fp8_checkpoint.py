"""DeepSeek-V3's FP8 block-scaled checkpoints (float8_e4m3fn weights + per-block ``weight_scale_inv``,
config.json's quantization_config) dequantised on load (models/fp8_checkpoint.py): the slices the loader reads
equal a whole-tensor reference dequantisation exactly (TP 1 and TP 2 slices, partial blocks); a Megatron model
built from the FP8 checkpoint gives the logits and the export of one built from the dequantised fp32 checkpoint;
other quantisations, a missing block size and a scale of the wrong shape are refused by name.

The tiny checkpoint's weights are quantised here with a (24, 20) block, so the tiny tensors span several blocks,
most of them partial, and TP 2 shards start in the middle of a block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.config import ConfigError
from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.fp8_checkpoint import FP8BlockDequantizer, check_fp8_quantization
from megatron_rl.models.hf_checkpoint import CheckpointMismatchError, HFCheckpointReader
from megatron_rl.models.hf_config import UnsupportedModelError
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

from fp8_checkpoint_jobs import fp8_checks

BLOCK = (24, 20)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
TOLERANCE = 1e-5


def quantise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block): scale = blockwise amax / 448, as DeepSeek's
    checkpoints are made; the last blocks partial."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = weight.new_zeros(nr * br, nc * bc)
    padded[:rows, :cols] = weight.float()
    amax = padded.abs().view(nr, br, nc, bc).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    expanded = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.float() / expanded).to(torch.float8_e4m3fn), scale.float()


def reference_dequantise(quantised: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The whole tensor at once: fp8 -> fp32 times the scale expanded over each block (the last partial)."""
    rows, cols = quantised.shape
    expanded = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return quantised.to(torch.float32) * expanded


def _is_quantised(name: str, tensor: torch.Tensor) -> bool:
    """DeepSeek-V3's FP8 checkpoints quantise the linear layers only: not the embedding, lm_head, norms, the router
    gate or its correction bias."""
    return (tensor.dim() == 2 and name.endswith(".weight") and not name.endswith("mlp.gate.weight")
            and name not in ("model.embed_tokens.weight", "lm_head.weight"))


def make_fp8_pair(src: Path, fp8_dir: Path, dequantised_dir: Path, block=BLOCK) -> dict[str, torch.Tensor]:
    """From the fp32 checkpoint ``src``: ``fp8_dir`` (quantised linear weights + ``*_scale_inv`` +
    quantization_config) and ``dequantised_dir`` (fp32, the reference dequantisation of every quantised weight).
    Returns the reference dequantised tensors by name."""
    tensors = load_file(src / "model.safetensors")
    fp8, dequantised, reference = {}, {}, {}
    for name, tensor in tensors.items():
        if _is_quantised(name, tensor):
            q, s = quantise(tensor, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            reference[name] = dequantised[name] = reference_dequantise(q, s, block)
        else:
            fp8[name] = dequantised[name] = tensor
    for directory, weights, quantised in ((fp8_dir, fp8, True), (dequantised_dir, dequantised, False)):
        directory.mkdir(parents=True)
        config = json.loads((src / "config.json").read_text())
        if quantised:
            config["quantization_config"] = {**QUANTIZATION, "weight_block_size": list(block)}
        (directory / "config.json").write_text(json.dumps(config))
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny_hf_checkpoint(root / "fp32", "deepseek_v3", with_tokenizer=False, vocab_size=300)
    reference = make_fp8_pair(src, root / "fp8", root / "dequantised")
    return root, reference


# ---------------------------------------------------------------- dequantisation of slices (no Megatron)


def test_quantisation_is_real_and_spans_partial_blocks(checkpoints):
    root, reference = checkpoints
    original = load_file(root / "fp32" / "model.safetensors")
    reader = HFCheckpointReader(root / "fp8")
    names = set(reader.names())
    assert len(reference) > 20
    assert "model.layers.1.mlp.experts.7.gate_proj.weight_scale_inv" in names
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in names and "model.norm.weight_scale_inv" not in names
    partial = [n for n in reference if any(d % b for d, b in zip(reference[n].shape, BLOCK, strict=True))]
    assert len(partial) > 10
    for name, deq in reference.items():
        assert reader.dtype(name) == "F8_E4M3"
        assert not torch.equal(deq, original[name])  # fp8 rounding happened
        assert torch.allclose(deq, original[name], rtol=0.07, atol=1e-6)


def test_whole_tensors_and_tensor_parallel_slices_are_exact(checkpoints):
    root, reference = checkpoints
    fp8 = FP8BlockDequantizer(HFCheckpointReader(root / "fp8"), BLOCK)
    fp8.validate()
    for name, expected in reference.items():
        assert torch.equal(fp8.read(name), expected), name
        rows, cols = expected.shape
        for size in (1, 2):  # TP 1 and the two TP 2 shards, by rows (column-parallel) and columns (row-parallel)
            for rank in range(size):
                r0, r1 = rank * rows // size, (rank + 1) * rows // size
                c0, c1 = rank * cols // size, (rank + 1) * cols // size
                assert torch.equal(fp8.read(name, 0, r0, r1), expected[r0:r1]), (name, size, rank)
                assert torch.equal(fp8.read(name, 1, c0, c1), expected[:, c0:c1]), (name, size, rank)
        for dtype in (torch.bfloat16, torch.float32):  # the parameter's dtype: one cast of the fp32 product
            assert torch.equal(fp8.read(name, 0, 5, rows - 3, dtype=dtype), expected[5 : rows - 3].to(dtype))
    # tensors without a scale are read as stored
    assert fp8.read("model.norm.weight").dtype == torch.float32
    assert fp8.scale_names() == {n + "_scale_inv" for n in reference}


def test_odd_slices_of_an_odd_shape(tmp_path):
    torch.manual_seed(0)
    weight = torch.randn(37, 53) * torch.logspace(-3, 1, 53)
    block = (16, 16)
    q, s = quantise(weight, block)
    assert s.shape == (3, 4)
    save_file({"w": q, "w_scale_inv": s, "norm": torch.ones(3)}, tmp_path / "model.safetensors")
    fp8 = FP8BlockDequantizer(HFCheckpointReader(tmp_path), block)
    fp8.validate()
    expected = reference_dequantise(q, s, block)
    for start, stop in [(0, 1), (15, 17), (16, 32), (31, 37), (0, 37), (20, 21), (5, None)]:
        assert torch.equal(fp8.read("w", 0, start, stop), expected[start:stop]), (start, stop)
    for start, stop in [(0, 53), (15, 49), (32, 53), (47, 48), (3, None)]:
        assert torch.equal(fp8.read("w", 1, start, stop), expected[:, start:stop]), (start, stop)


# ---------------------------------------------------------------- Megatron: FP8 vs dequantised (2 gloo ranks)

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, EP)


@pytest.fixture(scope="module")
def megatron_results(checkpoints):
    root, _ = checkpoints
    dirs = {"fp8": str(root / "fp8"), "dequantised": str(root / "dequantised")}
    return run_multiprocess(fp8_checks, 2, dirs, LAYOUTS, timeout_s=900)


@pytest.mark.distributed
@pytest.mark.parametrize("tp, ep", LAYOUTS)
def test_fp8_checkpoint_logits_match_the_dequantised_checkpoint(megatron_results, tp, ep):
    for result in megatron_results:
        fp8, dequantised = result["logits"]["fp8", tp, ep], result["logits"]["dequantised", tp, ep]
        diff = (fp8 - dequantised).abs().max().item()
        print(f"TP={tp} EP={ep}: max |logit diff| fp8 vs dequantised {diff:.2e}")
        assert fp8.dtype == torch.float32 and diff <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.parametrize("tp, ep", LAYOUTS)
def test_export_is_unquantised_and_equals_the_reference(checkpoints, megatron_results, tp, ep):
    """The loader's shards, gathered back by the export: exactly the reference dequantisation, in the parameters'
    dtype, with no scale tensors (the engines and HF saves get unquantised weights)."""
    root, reference = checkpoints
    dequantised = load_file(root / "dequantised" / "model.safetensors")
    for result in megatron_results:
        exported = dict(result["export"]["fp8", tp, ep])
        assert set(exported) == set(dequantised)
        assert not any(n.endswith("_scale_inv") for n in exported)
        for name, tensor in dequantised.items():
            assert exported[name].dtype == torch.float32
            assert torch.equal(exported[name], tensor), f"{name} differs at TP={tp} EP={ep}"
        assert all(torch.equal(exported[n], reference[n]) for n in reference)


@pytest.mark.distributed
def test_bf16_parameters_take_the_bf16_cast_of_the_dequantised_weight(checkpoints, megatron_results):
    """Dequantised to the parameters' dtype as transformers does: one cast of the fp32 product (TP 2 shards)."""
    _, reference = checkpoints
    for result in megatron_results:
        exported = dict(result["export"]["fp8", "bf16"])
        for name, expected in reference.items():
            assert exported[name].dtype == torch.bfloat16
            assert torch.equal(exported[name], expected.to(torch.bfloat16)), name


# ---------------------------------------------------------------- refusals


def test_config_without_quantization_is_not_fp8():
    assert check_fp8_quantization({"model_type": "deepseek_v3"}) is None
    assert check_fp8_quantization({"quantization_config": dict(QUANTIZATION)}) == BLOCK


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quant_method": "awq"}, "quantization_config.quant_method='awq'"),
        ({"quant_method": "compressed-tensors"}, "quantization_config.quant_method='compressed-tensors'"),
        ({"weight_block_size": None}, "quantization_config.weight_block_size is missing"),
        ({"weight_block_size": [128]}, r"quantization_config.weight_block_size=\[128\]"),
        ({"weight_block_size": [128, 0]}, r"quantization_config.weight_block_size=\[128, 0\]"),
        ({"fmt": "e5m2"}, "quantization_config.fmt='e5m2'"),
        ({"activation_scheme": "static"}, "quantization_config.activation_scheme='static'"),
    ],
)
def test_other_quantisations_are_refused_by_name(change, message):
    qc = {k: v for k, v in {**QUANTIZATION, **change}.items() if v is not None}
    with pytest.raises(UnsupportedModelError, match=message) as err:
        check_fp8_quantization({"quantization_config": qc}, source="m/config.json")
    assert "m/config.json" in str(err.value)


def test_preflight_refuses_before_launch(tmp_path):
    from megatron_rl.trainer.preflight import check_quantization

    check_quantization({"quantization_config": dict(QUANTIZATION)}, tmp_path / "config.json")
    with pytest.raises(ConfigError, match="quantization_config.quant_method='bitsandbytes'"):
        check_quantization({"quantization_config": {"quant_method": "bitsandbytes"}}, tmp_path / "config.json")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engines_that_build_fp8_layers_are_refused_for_an_fp8_checkpoint(engine, tmp_path):
    """vLLM and SGLang build FP8 layers from config.json's quantization_config; the trainer syncs the dequantised
    weights. The HF engine builds plain linears (test below) and serves them."""
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.trainer.preflight import check_quantization

    raw = {"quantization_config": dict(QUANTIZATION)}
    check_quantization(raw, tmp_path / "config.json", RolloutConfig(name="hf"))
    check_quantization({}, tmp_path / "config.json", RolloutConfig(name=engine))
    with pytest.raises(ConfigError, match=rf"rollout.name={engine} with an FP8 checkpoint .*builds FP8 layers"):
        check_quantization(raw, tmp_path / "config.json", RolloutConfig(name=engine))


def test_scale_of_the_wrong_shape_is_refused_with_tensor_and_file(checkpoints, tmp_path):
    root, _ = checkpoints
    bad = tmp_path / "bad"
    shutil.copytree(root / "fp8", bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    fp8 = FP8BlockDequantizer(HFCheckpointReader(bad), BLOCK)
    with pytest.raises(CheckpointMismatchError, match=rf"{name}' in model.safetensors .* has shape \(3, 4\);") as err:
        fp8.validate()
    assert "needs (3, 5)" in str(err.value)
    # the same checkpoint read with another block size: every scale is refused
    with pytest.raises(CheckpointMismatchError, match="128x128 blocks"):
        FP8BlockDequantizer(HFCheckpointReader(root / "fp8"), (128, 128)).validate()


def test_fp8_weight_without_a_scale_is_refused(checkpoints, tmp_path):
    root, _ = checkpoints
    bad = tmp_path / "bad"
    shutil.copytree(root / "fp8", bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.2.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match="o_proj.weight' in model.safetensors .* has no"):
        FP8BlockDequantizer(HFCheckpointReader(bad), BLOCK).validate()


def test_hf_save_drops_the_quantization_config(checkpoints):
    """A save from a model loaded off an FP8 checkpoint holds unquantised weights: its config.json says so."""
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.weights.export import _config_for_export

    root, _ = checkpoints
    hf = load_hf_config(root / "fp8")
    assert "quantization_config" in hf.raw
    config = _config_for_export(hf, False, torch.bfloat16)
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"


def test_hf_engine_builds_unquantised_layers_from_the_fp8_config(checkpoints):
    """The HF rollout engine builds its model with ``from_config`` (rollout/hf_engine.py): transformers applies no
    quantizer there, so the FP8 config.json gives plain fp32/bf16 linears that take the synced weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    root, _ = checkpoints
    config = AutoConfig.from_pretrained(root / "fp8")
    assert config.quantization_config["weight_block_size"] == list(BLOCK)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert not any("scale" in name for name in model.state_dict())
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
