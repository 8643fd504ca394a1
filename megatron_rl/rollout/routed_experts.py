"""The rollout engines' routing report for MoE routing replay R3 (models/router_replay.py).

With ``rollout.enable_rollout_routing_replay`` every engine returns ``batch['routed_experts']``: [B, P + R, L, k]
int16, aligned with the output's ``input_ids``: for each token and MoE layer, the top-k experts the engine's
router chose when it computed the token; -1 where no choice exists (prompt and response padding, and the last
sampled token, which no forward ever took as input).

- HF engine: forward hooks on transformers' top-k routers (``RouterCapture``), prefill and each decode step.
- SGLang and vLLM report, per request, a [prompt tokens + output tokens - 1, L, k] array of the tokens their
  forwards computed (prompt first); ``place_request_routing`` puts it at the request's row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers only for the hint: the engines hand in their model's config
    from transformers import PretrainedConfig

__all__ = ["ROLLOUT_KEY", "RouterCapture", "check_can_report", "decode_sglang_routing", "empty_routing",
           "place_request_routing"]

ROLLOUT_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def check_can_report(enabled: bool, engine: str, model_config: PretrainedConfig) -> bool:
    """``enable_rollout_routing_replay`` for an engine: refused, naming the key, for a dense model."""
    if not enabled:
        return False
    if getattr(model_config, "num_experts_per_tok", None) is None:
        raise ValueError(f"{ROLLOUT_KEY}=true needs an MoE model; {engine}'s model "
                         f"({getattr(model_config, 'model_type', '?')}) has no router")
    return True


def empty_routing(rows: int, width: int, layers: int, topk: int) -> torch.Tensor:
    return torch.full((rows, width, layers, topk), -1, dtype=torch.int16)


def place_request_routing(out: torch.Tensor, row: int, routing: Any, prompt_mask: torch.Tensor,
                          response_tokens: int, where: str) -> None:
    """Write one request's routing ([prompt tokens + output tokens - 1, L, k], the tokens its forwards
    computed) into ``out[row]`` ([P + R, L, k]; the prompt left-padded to P); shapes checked, naming ``where``."""
    routing = torch.as_tensor(routing)
    prompt_cols = prompt_mask.bool().nonzero()[:, 0]
    width = out.shape[1] - prompt_mask.shape[0]
    expected = len(prompt_cols) + max(response_tokens - 1, 0)
    layers, topk = out.shape[2], out.shape[3]
    if routing.dim() != 3 or tuple(routing.shape[1:]) != (layers, topk) or routing.shape[0] < expected:
        raise ValueError(f"{where}: routed experts of row {row} have shape {tuple(routing.shape)}, expected "
                         f"({expected} or more, {layers}, {topk}) for {len(prompt_cols)} prompt and "
                         f"{response_tokens} response tokens")
    routing = routing[:expected].to(out.dtype)
    out[row, prompt_cols] = routing[: len(prompt_cols)]
    generated = min(response_tokens - 1, width)
    if generated > 0:
        start = prompt_mask.shape[0]
        out[row, start : start + generated] = routing[len(prompt_cols) : len(prompt_cols) + generated]


def decode_sglang_routing(payload: str, layers: int, topk: int, where: str) -> Any:
    """SGLang's ``meta_info['routed_experts']``: base64 of a C-order int32 array [tokens, layers, top-k]."""
    import base64

    import numpy as np

    raw = base64.b64decode(payload)
    width = 4 * layers * topk
    if len(raw) % width:
        raise ValueError(f"{where}: meta_info.routed_experts holds {len(raw)} bytes, not a multiple of "
                         f"4 x {layers} layers x top-{topk}")
    return np.frombuffer(raw, dtype="<i4").reshape(-1, layers, topk).copy()


class RouterCapture:
    """The top-k expert ids transformers' MoE routers (``TopKRouter``: returns logits, scores, indices) chose in
    each forward of ``model``, per decoder layer (-1 for a dense layer: L is always num_hidden_layers, as the
    trainer's layer numbering and SGLang's and vLLM's reports)."""

    def __init__(self, model: torch.nn.Module) -> None:
        # decoder layer of each router (model.layers.<i>....): dense layers between MoE layers report -1
        # Qwen/Mixtral name theirs ...TopKRouter, DeepSeek-V3 and GLM-4.5 ...TopkRouter; each returns (logits,
        # weights, indices) with the indices its own rule chose (DeepSeek-V3's: sigmoid + bias + groups)
        found = [(name, m) for name, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]
        if not found:
            raise ValueError(f"{ROLLOUT_KEY}=true: {type(model).__name__} has no top-k router to report")
        self.num_layers = int(model.config.num_hidden_layers)
        self.layers = [int(name.split("layers.")[1].split(".")[0]) for name, _ in found]
        self.routers = [m for _, m in found]
        self._seen: list[torch.Tensor | None] = [None] * len(self.routers)
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    def _hook(self, layer: int):
        def hook(module, inputs, output) -> None:
            self._seen[layer] = output[2].detach()
        return hook

    @property
    def num_experts(self) -> int:
        return int(self.routers[0].weight.shape[0])

    def take(self, shape: Sequence[int]) -> torch.Tensor:
        """The last forward's choices as [*shape, L, k] (``shape``: the forward's [rows, tokens])."""
        if any(seen is None for seen in self._seen):
            raise RuntimeError("RouterCapture: a router did not run in the last forward")
        topk = self._seen[0].shape[-1]
        out = torch.full((*shape, self.num_layers, topk), -1, dtype=torch.int16)
        for layer, seen in zip(self.layers, self._seen):
            out[..., layer, :] = seen.reshape(*shape, -1).to(torch.int16).cpu()
        self._seen = [None] * len(self.routers)
        return out
