"""rollout/vllm/contract.py against the installed vLLM: the engine-argument names we check
``engine_kwargs.vllm`` with, the worker and LLM methods we call, the CPU attention's head sizes."""

from __future__ import annotations

import dataclasses

from megatron_rl.rollout.vllm import contract
from megatron_rl_testing.vllm_support import skip_without_vllm

skip_without_vllm()


def test_the_pinned_version_is_installed():
    assert contract.vllm_missing() is None


def test_engine_argument_names_are_vllms():
    from vllm.engine.arg_utils import EngineArgs

    installed = {f.name for f in dataclasses.fields(EngineArgs)}
    assert contract.ENGINE_ARG_NAMES == installed, (
        f"missing here: {sorted(installed - contract.ENGINE_ARG_NAMES)}, "
        f"gone from vLLM: {sorted(contract.ENGINE_ARG_NAMES - installed)}")
    assert set(contract.OWNED_ENGINE_ARGS) <= installed


def test_methods_we_call_exist():
    from vllm import LLM
    from vllm.v1.worker.cpu_worker import CPUWorker

    assert [m for m in contract.WORKER_METHODS if not hasattr(CPUWorker, m)] == []
    assert [m for m in contract.LLM_METHODS if not hasattr(LLM, m)] == []
    from megatron_rl.rollout.vllm.worker_extension import WorkerExtension

    ours = [m for m in vars(WorkerExtension) if not m.startswith("_")]
    assert ours and not [m for m in ours if hasattr(CPUWorker, m)], "an extension method shadows a worker's own"


def test_cpu_head_sizes_are_the_cpu_attentions():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == contract.CPU_HEAD_SIZES


def test_cpu_mla_latent_sizes_are_the_cpu_mla_backends():
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    assert tuple(CPUMLABackend.get_supported_head_sizes()) == contract.CPU_MLA_HEAD_SIZES


def test_server_routes_and_completion_fields_exist():
    import pathlib

    import vllm
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from megatron_rl.rollout.vllm.server import completion_request

    routers = "".join(p.read_text() for p in pathlib.Path(vllm.__file__).parent.joinpath("entrypoints").rglob("*.py"))
    assert [r for r in contract.SERVER_ROUTES if f'"{r}"' not in routers] == []
    assert [f for f in contract.COMPLETION_FIELDS if f not in CompletionRequest.model_fields] == []
    sent = completion_request("m", [1, 2], max_tokens=3, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=[2])
    assert set(sent) == set(contract.COMPLETION_FIELDS), "the request sends a field the contract does not name"
