"""Multi-token prediction (MTP): DeepSeek-V3's (also GLM-4.5's) and MiMo's extra prediction layers, their HF
tensors, and how they map to Megatron-Core 0.16.1's ``MultiTokenPredictionBlock``.

No Megatron import: hf_config, the planner and validation read this module before any worker starts.

Layer k (1-based depth) at position i, as the engines' MTP drafters compute it (vLLM's deepseek_mtp / mimo_mtp) and
Megatron's ``MultiTokenPredictionLayer`` does:
  e = enorm(embed(t[i + k]))                       (the token k ahead; Megatron rolls the input ids by k)
  h = hnorm(h_{k-1}[i])                            (h_0: the main model's output after its final norm)
  x = eh_proj(cat(e, h))                           (MiMo's input_proj takes cat(h, e): its columns are swapped)
  h_k = final_norm(decoder_layer(x))               -> lm_head -> logits of t[i + k + 1]
HF names of layer k (0-based index ``k - 1``):
* DeepSeek-V3 / GLM-4.5: ``model.layers.{num_hidden_layers + k - 1}.``: enorm, hnorm, eh_proj, shared_head.norm,
  and a whole decoder layer (MoE when the model's last layer is); the checkpoint also stores copies of the
  embedding (``embed_tokens``) and of lm_head (``shared_head.head``), which Megatron shares with the main model:
  read nowhere, written back as copies on export.
* MiMo (MiMoForCausalLM, Qwen2's block): ``model.mtp_layers.{k - 1}.``: token_layernorm, hidden_layernorm,
  input_proj, final_layernorm, and a dense decoder layer.
The MTP layers are built only when ``model.mtp.enable`` asks (verl's key); otherwise their tensors are skipped on
load as transformers skips them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_rl.models.hf_config import HFModelConfig

# model_type -> how its checkpoint names the MTP layers
_DEEPSEEK_NAMING = ("deepseek_v3", "glm4_moe")
_MIMO_NAMING = ("mimo",)


@dataclass(frozen=True)
class MTPSpec:
    """The multi-token-prediction layers of a checkpoint."""

    num_layers: int  # num_nextn_predict_layers
    first_index: int  # DeepSeek naming: the HF layer index of MTP layer 0 (num_hidden_layers); MiMo: 0
    mimo_naming: bool  # model.mtp_layers.{k}.* with [hidden | embedding] inputs, else DeepSeek's
    moe_layer: bool  # the MTP decoder layer is an MoE layer (DeepSeek-V3 / GLM-4.5: as the model's last layer)

    def prefix(self, k: int) -> str:
        """HF prefix of MTP layer ``k`` (0-based)."""
        if self.mimo_naming:
            return f"model.mtp_layers.{k}."
        return f"model.layers.{self.first_index + k}."

    def hf_index(self, k: int) -> int:
        """The layer index MTP layer ``k``'s decoder-layer tensors are named with (MoE names take an index)."""
        return self.first_index + k

    def tensor_names(self, k: int) -> dict[str, str]:
        """HF names of MTP layer ``k``'s own tensors by role: enorm, hnorm, eh_proj, final_norm."""
        p = self.prefix(k)
        if self.mimo_naming:
            names = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
        else:
            names = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
        return {role: f"{p}{name}.weight" for role, name in zip(("enorm", "hnorm", "eh_proj", "final_norm"), names)}

    def shared_copies(self, k: int, tied: bool) -> dict[str, str]:
        """HF names of the checkpoint's copies of the embedding and lm_head in MTP layer ``k`` (DeepSeek naming)."""
        if self.mimo_naming:
            return {}
        copies = {"embedding": f"{self.prefix(k)}embed_tokens.weight"}
        if not tied:
            copies["head"] = f"{self.prefix(k)}shared_head.head.weight"
        return copies

    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return tuple(self.prefix(k) for k in range(self.num_layers))


def parse_mtp_config(hf_config: dict[str, Any], model_type: str, moe_last_layer: bool) -> MTPSpec | None:
    """The MTP layers a config.json declares (``num_nextn_predict_layers``), None when it declares none."""
    count = int(hf_config.get("num_nextn_predict_layers") or 0)
    if count <= 0 or model_type not in _DEEPSEEK_NAMING + _MIMO_NAMING:
        return None
    mimo = model_type in _MIMO_NAMING
    return MTPSpec(
        num_layers=count,
        first_index=0 if mimo else int(hf_config["num_hidden_layers"]),
        mimo_naming=mimo,
        moe_layer=moe_last_layer and not mimo,
    )


def checkpoint_mtp_tensors(hf: HFModelConfig, names: set[str]) -> set[str]:
    """The checkpoint's MTP tensors among ``names`` (all of them, built or not); of a family whose MTP layers are not
    mapped here (Hy3), the layers past ``num_hidden_layers`` that ``num_nextn_predict_layers`` declares."""
    if hf.checkpoint_mtp is not None:
        prefixes = hf.checkpoint_mtp.checkpoint_prefixes()
    else:
        count = int(hf.raw.get("num_nextn_predict_layers") or 0)
        prefixes = tuple(f"model.layers.{hf.num_layers + k}." for k in range(count))
    return {name for name in names if prefixes and name.startswith(prefixes)}


def shared_copy_names(hf: HFModelConfig) -> set[str]:
    """Names of the embedding / lm_head copies in the MTP layers the model builds (loaded from nowhere)."""
    if hf.mtp is None:
        return set()
    return {name for k in range(hf.mtp.num_layers) for name in hf.mtp.shared_copies(k, hf.tie_word_embeddings).values()}


def with_mtp(hf: HFModelConfig, enable: bool, key: str = "actor_rollout_ref.model.mtp.enable") -> HFModelConfig:
    """``hf`` with its MTP layers built (``hf.mtp`` set) when ``enable``; refused when the checkpoint has none."""
    from megatron_rl.models.hf_config import UnsupportedModelError  # import cycle: hf_config imports this module

    if not enable:
        return replace(hf, mtp=None)
    if hf.checkpoint_mtp is None:
        declared = hf.raw.get("num_nextn_predict_layers")
        why = (f"its {declared} multi-token-prediction layer(s) are not mapped for {hf.architecture} (they are skipped "
               "on load)" if declared else f"it declares no multi-token-prediction layer (num_nextn_predict_layers is "
               f"{declared!r})")
        raise UnsupportedModelError(
            f"{key}=true but {hf.source}: {why}; MTP layers are built for DeepSeek-V3, GLM-4.5 and MiMo checkpoints; "
            "set it false")
    return replace(hf, mtp=hf.checkpoint_mtp)


def check_drafting(hf: HFModelConfig, speculative_tokens: int, key: str) -> None:
    """vLLM's MTP drafter for ``hf`` can draft ``speculative_tokens`` per step: MiMo's predicts one
    (vllm/model_executor/models/mimo_mtp.py asserts spec_step_idx == 0), DeepSeek-V3's a multiple of its MTP layers
    beyond them (vllm/config/speculative.py: num_speculative_tokens divisible by n_predict)."""
    from megatron_rl.models.hf_config import UnsupportedModelError  # import cycle: hf_config imports this module

    layers = hf.mtp.num_layers
    if hf.mtp.mimo_naming and speculative_tokens != 1:
        raise UnsupportedModelError(f"{key}={speculative_tokens}: vLLM's MiMo drafter predicts one token per step; "
                                    "set it to 1")
    if speculative_tokens > layers and speculative_tokens % layers:
        raise UnsupportedModelError(f"{key}={speculative_tokens}: vLLM needs a multiple of the model's "
                                    f"{layers} MTP layers (num_nextn_predict_layers) beyond them")


def mtp_transformer_kwargs(mtp: MTPSpec, loss_scaling_factor: float) -> dict[str, Any]:
    """TransformerConfig fields of the MTP layers."""
    return dict(mtp_num_layers=mtp.num_layers, mtp_loss_scaling_factor=loss_scaling_factor)


# TransformerConfig fields mtp_transformer_kwargs sets (model.mtp's keys; not overridable).
MTP_DERIVED_FIELDS = ("mtp_num_layers", "mtp_loss_scaling_factor")
