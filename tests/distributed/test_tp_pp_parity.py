"""Same weights, same data: TP=2, PP=2 and interleaved PP=2xVPP=2 reproduce the TP=1=PP logits, losses and
gradients through Megatron's get_forward_backward_func with several micro-batches (gloo, 2 CPU ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed import run_multiprocess
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

pytestmark = pytest.mark.distributed

WORLD = 2
MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ = 4, 2, 10
LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (1, 2, 2)]  # (TP, PP, VPP)
STEP_LAYOUTS = [(1, 1, False), (2, 1, True), (1, 2, False)]  # (TP, PP, distributed optimizer)


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    batches = []
    for i in range(MICRO_BATCHES):
        ids = torch.randint(0, 300, (MICRO_BATCH_SIZE, SEQ), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, : i + 1] = 0  # left padding of varying length
        mask[1, SEQ - i - 1 :] = 0  # right padding
        batches.append((ids, mask))
    return batches


def next_token_loss(ids: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_log_probs = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = (mask[:, 1:] * mask[:, :-1]).float()
    return -(token_log_probs * valid).sum() / valid.sum()


def forward_step_fn(vocab: int):
    from megatron_rl.models import causal_padding_mask, position_ids_from_mask

    def forward_step(data_iterator, model):
        ids, mask = next(data_iterator)
        logits = model(
            ids, position_ids_from_mask(mask), causal_padding_mask(mask), runtime_gather_output=True
        )

        def loss_fn(output):
            output = output[..., :vocab]
            loss = next_token_loss(ids, mask, output)
            return loss, {"loss": loss.detach(), "logits": output.detach()}

        return logits, loss_fn

    return forward_step


def forward_backward(chunks: list, vpp, vocab: int) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = micro_batches()
    return get_forward_backward_func()(
        forward_step_func=forward_step_fn(vocab),
        data_iterator=[iter(data) for _ in chunks] if vpp else iter(data),
        model=chunks,
        num_microbatches=MICRO_BATCHES,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH_SIZE,
        forward_only=False,
    )


def run_layout(directory: str, tp: int, pp: int, vpp) -> dict:
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf
    from megatron_rl.weights import export_hf_weights

    init_model_parallel(tp=tp, pp=pp, vpp=vpp)
    chunks = build_from_hf(directory)
    outputs = forward_backward(chunks, vpp, chunks[0].hf_config.vocab_size)
    # Export the gradients under HF names: swap them into the parameters, reuse the weight export.
    for chunk in chunks:
        for param in chunk.parameters():
            param.data = param.grad
    grads = {name: tensor.clone() for name, tensor in export_hf_weights(chunks)}
    return {"outputs": outputs, "grads": grads}


def optimizer_step(directory: str, tp: int, pp: int, distributed_optimizer: bool) -> dict:
    """Megatron's training path on CPU: DDP-wrapped chunks, finalize_model_grads, clipped Adam. A large
    epsilon keeps Adam from amplifying rounding noise of near-zero gradients into weight differences."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf
    from megatron_rl.weights import export_hf_weights
    from megatron_rl.workers.optimizer_device import optimizer_device_scope

    init_model_parallel(tp=tp, pp=pp)
    chunks = build_from_hf(directory)
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    model = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    with optimizer_device_scope():  # as the engine builds and steps it (CUDA type names on CPU)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=0.1,
                adam_eps=1.0,
                clip_grad=1.0,
                use_distributed_optimizer=distributed_optimizer,
            ),
            model,
        )
    forward_backward(model, None, chunks[0].hf_config.vocab_size)
    with optimizer_device_scope():
        updated, grad_norm, _ = optimizer.step()
    return {
        "updated": updated,
        "grad_norm": grad_norm,
        "weights": {n: t.clone() for n, t in export_hf_weights(model)},
    }


def parity_checks(directory: str) -> dict:
    from megatron_rl.distributed import init_model_parallel

    results = {layout: run_layout(directory, *layout) for layout in LAYOUTS}
    steps = {layout: optimizer_step(directory, *layout) for layout in STEP_LAYOUTS}
    errors = {}
    for kwargs in (dict(tp=3), dict(tp=1, pp=1, vpp=2)):
        try:
            init_model_parallel(**kwargs)
        except ValueError as error:
            errors[tuple(kwargs.items())] = str(error)
    return {"rank": dist.get_rank(), "results": results, "steps": steps, "errors": errors}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    directory = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("parity") / "qwen2", "qwen2", num_layers=4)
    return run_multiprocess(parity_checks, WORLD, str(directory), timeout_s=600)


def last_stage_outputs(per_rank, layout):
    found = [r["results"][layout]["outputs"] for r in per_rank if r["results"][layout]["outputs"]]
    assert found, f"no rank returned outputs for {layout}"
    return found[0]


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=["tp2", "pp2", "pp2_vpp2"])
def test_logits_and_losses_match_single_rank(per_rank, layout):
    reference = last_stage_outputs(per_rank, LAYOUTS[0])
    outputs = last_stage_outputs(per_rank, layout)
    assert len(outputs) == MICRO_BATCHES
    for ref, out in zip(reference, outputs):
        torch.testing.assert_close(out["logits"], ref["logits"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["loss"], ref["loss"], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=["tp2", "pp2", "pp2_vpp2"])
def test_gradients_match_single_rank(per_rank, layout):
    reference = per_rank[0]["results"][LAYOUTS[0]]["grads"]
    for result in per_rank:  # every rank receives every gathered gradient
        grads = result["results"][layout]["grads"]
        assert grads.keys() == reference.keys()
        for name, ref in reference.items():
            assert ref.abs().sum() > 0, f"{name} has no gradient in the reference"
            torch.testing.assert_close(
                grads[name], ref, atol=1e-6, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
            )


def test_parallel_sizes_that_do_not_factor_are_refused(per_rank):
    errors = per_rank[0]["errors"]
    assert errors[(("tp", 3),)] == "world size 2 is not divisible by TP*PP*CP = 3*1*1 = 3"
    assert errors[(("tp", 1), ("pp", 1), ("vpp", 2))] == "virtual pipeline size 2 needs PP >= 2, got PP=1"


@pytest.mark.parametrize("layout", STEP_LAYOUTS[1:], ids=["tp2_distopt", "pp2"])
def test_optimizer_step_with_ddp_matches_single_rank(per_rank, layout):
    reference = per_rank[0]["steps"][STEP_LAYOUTS[0]]
    for result in per_rank:
        step = result["steps"][layout]
        assert step["updated"] and reference["updated"]
        assert step["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        for name, weight in reference["weights"].items():
            torch.testing.assert_close(
                step["weights"][name], weight, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )


# --- Critic (value head) gradients under sequence parallelism (issue 32, item 10) --------------------------
# The head is initialised NON-ZERO (a zero head gives the trunk no gradient at all, which hid a doubled trunk
# gradient under SP). Each layout runs Megatron's training path (DDP, finalize_model_grads, clipped Adam) and
# returns the finalised gradients under HF names, the grad norm the optimizer clips with, and the values.
CRITIC_LAYOUTS = [(1, False), (2, False), (2, True)]  # (TP, sequence parallel)


def value_loss(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    target = torch.linspace(-1.0, 1.0, mask.shape[-1])
    valid = mask.float()
    return (((values.squeeze(-1).float() - target) ** 2) * valid).sum() / valid.sum()


def critic_step(directory: str, tp: int, sequence_parallel: bool) -> dict:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, causal_padding_mask, position_ids_from_mask
    from megatron_rl.weights import export_hf_weights
    from megatron_rl.workers.optimizer_device import optimizer_device_scope

    init_model_parallel(tp=tp)
    chunks = build_from_hf(directory, value_head=True, sequence_parallel=sequence_parallel)
    head = chunks[-1].output_layer
    with torch.no_grad():  # the same non-zero head in every layout, whatever each rank's RNG consumed
        gen = torch.Generator().manual_seed(7)
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.5)
        head.bias.fill_(0.25)
    config = chunks[0].config
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(), chunk) for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    with optimizer_device_scope():
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=0.1, adam_eps=1.0, clip_grad=1e9), model
        )

    def forward_step(data_iterator, model_chunk):
        ids, mask = next(data_iterator)
        values = model_chunk(ids, position_ids_from_mask(mask), causal_padding_mask(mask))

        def loss_fn(output):
            loss = value_loss(mask, output)
            return loss, {"loss": loss.detach(), "values": output.detach()}

        return values, loss_fn

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches()), model=model,
        num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH_SIZE, forward_only=False,
    )
    params = [p for m in model for p in m.parameters()]
    kept = [p.data for p in params]
    for param in params:  # export the finalised gradients under HF names
        param.data = param.main_grad.view_as(param)
    grads = {name: tensor.clone() for name, tensor in export_hf_weights(model)}
    for param, data in zip(params, kept):
        param.data = data
    with optimizer_device_scope():
        _, grad_norm, _ = optimizer.step()
    return {"outputs": outputs, "grads": grads, "grad_norm": grad_norm}


def critic_checks(directory: str) -> dict:
    return {layout: critic_step(directory, *layout) for layout in CRITIC_LAYOUTS}


@pytest.fixture(scope="module")
def critic_per_rank(tmp_path_factory):
    directory = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("critic") / "qwen2", "qwen2", num_layers=2)
    return run_multiprocess(critic_checks, WORLD, str(directory), timeout_s=600)


@pytest.mark.parametrize("layout", CRITIC_LAYOUTS[1:], ids=["tp2", "tp2_sp"])
def test_critic_values_and_gradients_match_single_rank(critic_per_rank, layout):
    reference = critic_per_rank[0][CRITIC_LAYOUTS[0]]
    assert reference["grads"]["score.weight"].abs().sum() > 0
    for rank, result in enumerate(critic_per_rank):
        step = result[layout]
        for ref, out in zip(reference["outputs"], step["outputs"], strict=True):
            torch.testing.assert_close(out["values"], ref["values"], atol=1e-5, rtol=1e-5)
        assert step["grads"].keys() == reference["grads"].keys()
        for name, ref in reference["grads"].items():
            assert ref.abs().sum() > 0, f"{name} has no gradient in the reference"
            torch.testing.assert_close(
                step["grads"][name], ref, atol=1e-6, rtol=1e-4, msg=lambda m, name=name: f"rank {rank} {name}: {m}"
            )
        assert step["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), f"rank {rank} grad norm"
