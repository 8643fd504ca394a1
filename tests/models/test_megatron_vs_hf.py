"""Megatron GPT built from tiny HF checkpoints against transformers, at TP=1, TP=2 and PP=2 (gloo, 2 ranks).

One spawned group runs every Megatron-side check (spawning and importing Megatron costs seconds);
the transformers references and the assertions run here in the test process.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megatron_rl.distributed import run_multiprocess
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint, padded_batch as batch

pytestmark = pytest.mark.distributed

WORLD = 2
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP)
TOLERANCE = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 1e6,
}
# Each family exercises its own features: tied embeddings + llama3 RoPE scaling, q/k/v bias + a sharded
# checkpoint, q/k norm + head_dim != hidden/heads, sliding window shorter than the sequence, and one
# KV head (TP=2 > KV heads).
MODELS = {
    "llama": dict(
        family="llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE, max_position_embeddings=16384
    ),
    "qwen2": dict(family="qwen2", max_shard_size="40KB"),
    "qwen3": dict(family="qwen3", head_dim=16),
    "mistral": dict(family="mistral", sliding_window=4),
    "qwen2_kv1": dict(family="qwen2", num_kv_heads=1),
}


def corrupt(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    if how == "wrong_shape":
        tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    else:
        del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------- Megatron side (runs on each rank)


def _value_model_checks(directory: str, out_dir: str) -> dict:
    """Critic from a causal-LM checkpoint: forward/backward through the pipeline schedule, then saved
    as an HF TokenClassification directory."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.models import build_from_hf, causal_padding_mask, compute_full_logits, position_ids_from_mask
    from megatron_rl.weights import save_hf_checkpoint

    chunks = build_from_hf(directory, value_head=True)
    input_ids, attention_mask = batch()
    collected = []

    def forward_step(data_iterator, model):
        ids, mask = next(data_iterator)
        values = model(ids, position_ids_from_mask(mask), causal_padding_mask(mask))

        def loss_fn(out):
            collected.append(out.detach())
            return (out.squeeze(-1) * mask).sum(), {}

        return values, loss_fn

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([(input_ids, attention_mask)]),
        model=chunks[0],
        num_microbatches=1,
        seq_length=12,
        micro_batch_size=3,
        forward_only=False,
    )
    grads = {name: p.grad for name, p in chunks[0].named_parameters()}
    save_hf_checkpoint(chunks, out_dir)
    # the saved critic loads back with its trained head (score.*) instead of a fresh one
    reloaded = compute_full_logits(build_from_hf(out_dir, value_head=True), input_ids, attention_mask)
    result = {
        "grads_finite": all(g is not None and torch.isfinite(g).all().item() for g in grads.values()),
        "grads_nonzero": all(g.abs().sum().item() > 0 for g in grads.values()),
    }
    if parallel_state.is_pipeline_last_stage():
        head = chunks[0].output_layer
        result.update(
            values=collected[0],
            reloaded_values=reloaded,
            head_weight=head.weight.detach().clone(),
            head_grad=head.weight.grad.clone(),
        )
    return result


def _embedding_rows(model) -> tuple[int, float]:
    """Local embedding rows and the absolute sum of those past the real vocabulary (padding)."""
    from megatron.core import parallel_state

    weight = model.embedding.word_embeddings.weight
    start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    first_pad = max(0, model.hf_config.vocab_size - start)
    return weight.shape[0], weight[first_pad:].abs().sum().item()


def megatron_checks(dirs: dict[str, str], work: str) -> dict:
    from megatron.core import parallel_state

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import CheckpointMismatchError, build_from_hf, compute_full_logits
    from megatron_rl.weights import export_hf_weights, save_hf_checkpoint

    input_ids, attention_mask = batch()
    out: dict = {"logits": {}, "export": {}, "vocab_rows": {}, "value": {}}
    for tp, pp in LAYOUTS:
        init_model_parallel(tp=tp, pp=pp)
        for name, directory in dirs.items():
            if name.startswith("corrupt"):
                continue
            chunks = build_from_hf(directory)
            logits = compute_full_logits(chunks, input_ids, attention_mask)
            if logits is not None:
                out["logits"][name, tp, pp] = logits
            # every rank receives every tensor; keep copies, they may alias parameters
            out["export"][name, tp, pp] = [(n, t.clone()) for n, t in export_hf_weights(chunks)]
            if parallel_state.is_pipeline_first_stage():
                out["vocab_rows"][name, tp, pp] = _embedding_rows(chunks[0])
        value_dir = f"{work}/value_tp{tp}_pp{pp}"
        out["value"][tp, pp] = _value_model_checks(dirs["qwen2"], value_dir)
        if (tp, pp) == (1, 2):
            save_hf_checkpoint(
                build_from_hf(dirs["qwen2"]),
                f"{work}/saved",
                tokenizer_dir=dirs["qwen2"],
                max_shard_bytes=30_000,
            )
    init_model_parallel(tp=2, pp=1)
    out["errors"] = {}
    for name in ("corrupt_shape", "corrupt_missing"):
        try:
            build_from_hf(dirs[name])
        except CheckpointMismatchError as error:
            out["errors"][name] = str(error)
    out["rank"] = dist.get_rank()
    return out


# ---------------------------------------------------------------- checks here


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dirs = {name: str(make_tiny_hf_checkpoint(root / name, **kwargs)) for name, kwargs in MODELS.items()}
    plain = make_tiny_hf_checkpoint(root / "plain", "qwen2")
    dirs["corrupt_shape"] = str(corrupt(plain, root / "corrupt_shape", "wrong_shape"))
    dirs["corrupt_missing"] = str(corrupt(plain, root / "corrupt_missing", "missing"))
    results = run_multiprocess(megatron_checks, WORLD, dirs, str(root), timeout_s=600)
    return dirs, root, results


@functools.cache
def hf_logits(directory: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.api import position_ids_from_mask

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    input_ids, attention_mask = batch()
    with torch.no_grad():
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
        ).logits


def checkpoint_tensors(directory: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in Path(directory).glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_logits_match_transformers(setup, name, tp, pp):
    dirs, _, results = setup
    last_stage = [r for r in results if (name, tp, pp) in r["logits"]]
    assert len(last_stage) == WORLD // pp  # every TP rank of the last stage has the gathered logits
    expected = hf_logits(dirs[name])
    valid = batch()[1].bool()
    for result in last_stage:
        logits = result["logits"][name, tp, pp]
        assert logits.shape == expected.shape  # vocabulary padding removed
        diff = (logits - expected)[valid].abs().max().item()
        assert diff <= TOLERANCE, f"{name} TP={tp} PP={pp}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_export_round_trip_is_exact_on_every_rank(setup, name, tp, pp):
    dirs, _, results = setup
    original = checkpoint_tensors(dirs[name])
    for result in results:
        names = [n for n, _ in result["export"][name, tp, pp]]
        assert len(names) == len(set(names))  # each tensor yielded once
        exported = dict(result["export"][name, tp, pp])
        assert set(exported) == set(original), set(exported) ^ set(original)
        for tensor_name, tensor in original.items():
            assert torch.equal(exported[tensor_name], tensor), f"{tensor_name} differs at TP={tp} PP={pp}"


def test_vocab_is_padded_per_tp_rank_with_zero_rows(setup):
    _, _, results = setup
    for result in results:  # vocab 300: padded to 384 at TP=1, to 2 x 256 at TP=2
        assert result["vocab_rows"]["qwen2", 1, 1] == (384, 0.0)
        assert result["vocab_rows"]["qwen2", 2, 1] == (256, 0.0)


def test_saved_hf_directory_is_complete_and_exact(setup):
    dirs, root, _ = setup
    saved = root / "saved"
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # max_shard_bytes forced several shards
    assert checkpoint_tensors(str(saved)).keys() == checkpoint_tensors(dirs["qwen2"]).keys()
    for name, tensor in checkpoint_tensors(dirs["qwen2"]).items():
        assert torch.equal(checkpoint_tensors(str(saved))[name], tensor), name
    assert (saved / "tokenizer.json").is_file() and (saved / "tokenizer_config.json").is_file()
    assert (hf_logits(str(saved)) - hf_logits(dirs["qwen2"])).abs().max().item() == 0.0


@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_value_model_forward_backward_matches_token_classification(setup, tp, pp):
    from transformers import AutoModelForTokenClassification

    from megatron_rl.models.api import position_ids_from_mask

    _, root, results = setup
    last = [r["value"][tp, pp] for r in results if "values" in r["value"][tp, pp]]
    assert len(last) == WORLD // pp
    for result in (r["value"][tp, pp] for r in results):
        assert result["grads_finite"] and result["grads_nonzero"]
    values = last[0]["values"]
    assert values.shape == (3, 12, 1)
    assert torch.equal(last[0]["reloaded_values"], values)
    for other in last[1:]:  # TP ranks agree on the replicated head and its gradient
        assert torch.equal(other["head_weight"], last[0]["head_weight"])
        assert torch.equal(other["head_grad"], last[0]["head_grad"])
    critic = AutoModelForTokenClassification.from_pretrained(
        str(root / f"value_tp{tp}_pp{pp}"), dtype=torch.float32
    )
    input_ids, attention_mask = batch()
    with torch.no_grad():
        expected = critic.eval()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
        ).logits
    valid = attention_mask.bool()
    assert (values - expected)[valid].abs().max().item() <= TOLERANCE


def test_corrupted_checkpoints_are_rejected_naming_the_tensor(setup):
    _, _, results = setup
    for result in results:
        shape_error = result["errors"]["corrupt_shape"]
        assert "model.layers.1.mlp.up_proj.weight" in shape_error
        assert "expected shape (64, 32), found (63, 32)" in shape_error
        missing_error = result["errors"]["corrupt_missing"]
        assert (
            "missing tensor 'model.layers.0.self_attn.k_proj.weight' (expected shape (16, 32))"
            in missing_error
        )
