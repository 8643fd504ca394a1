"""Tiny checkpoints with one multi-token-prediction layer (DeepSeek-V3's naming, and MiMo's on Qwen2's block) and
the reference MTP computation built from transformers' modules (models/mtp.py states the formula).

The MTP decoder layer is a real decoder layer: the last layer of a random (L + 1)-layer model, relabelled as the
MTP layer of an L-layer checkpoint, with its own norms (1 + noise) and projection (random)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

MTP_FAMILIES = ("deepseek_v3", "mimo")


def make_mtp_checkpoint(path: str | Path, family: str, seed: int = 0, num_layers: int = 2, **config_kwargs) -> Path:
    """An L-layer ``family`` checkpoint with one MTP layer at ``path`` (``mimo``: Qwen2's block, MiMo's names)."""
    path = Path(path)
    source = "qwen2" if family == "mimo" else family
    make_tiny_hf_checkpoint(path, source, seed=seed, num_layers=num_layers + 1, **config_kwargs)
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    h = config["hidden_size"]
    gen = torch.Generator().manual_seed(1000 + seed)
    last = f"model.layers.{num_layers}."
    if family == "mimo":
        prefix = "model.mtp_layers.0."
        tensors = {(prefix + n[len(last):] if n.startswith(last) else n): t for n, t in tensors.items()}
        own = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
        config.update(architectures=["MiMoForCausalLM"], model_type="mimo")
    else:
        prefix = last
        own = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
        tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        if not config.get("tie_word_embeddings"):
            tensors[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for name in own:
        if name in ("eh_proj", "input_proj"):
            tensors[f"{prefix}{name}.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
        else:
            tensors[f"{prefix}{name}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    config.update(num_hidden_layers=num_layers, num_nextn_predict_layers=1)
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:num_layers]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _transformers_model(config: dict, tensors: dict[str, torch.Tensor], directory: Path, **changes):
    """transformers' causal LM of ``config`` (MiMo as Qwen2) with ``changes``, loaded from ``tensors`` written to
    ``directory`` (from_pretrained converts the checkpoint's per-expert names to transformers 5's fused experts)."""
    from transformers import AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "num_nextn_predict_layers"} | changes
    if fields.get("layer_types"):
        fields["layer_types"] = fields["layer_types"][: fields["num_hidden_layers"]]
    if config["model_type"] == "mimo":
        fields.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    save_file({n: t.contiguous() for n, t in tensors.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def own_names(path: str | Path) -> dict[str, str]:
    """HF names of the MTP layer's own tensors by role (enorm, hnorm, eh_proj, final_norm)."""
    config = json.loads((Path(path) / "config.json").read_text())
    if config["model_type"] == "mimo":
        prefix, names = "model.mtp_layers.0.", ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
    else:
        prefix, names = f"model.layers.{config['num_hidden_layers']}.", ("enorm", "hnorm", "eh_proj", "shared_head.norm")
    return {role: f"{prefix}{n}.weight" for role, n in zip(("enorm", "hnorm", "eh_proj", "final_norm"), names)}


def reference_mtp(path: str | Path, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  scratch: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(main logits, MTP depth-1 logits [b, s, vocab], leaves by HF name whose ``.grad`` a backward fills: the MTP
    layer's own tensors, and its decoder layer's attention and norms) of the checkpoint at ``path``, computed with
    transformers' modules. Position i of the MTP logits predicts token i + 2 from the main model's normed output
    at i and the embedding of token i + 1 (token 0 past the end, as Megatron rolls the ids)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    mimo = config["model_type"] == "mimo"
    roles = own_names(path)
    prefix = roles["enorm"].rsplit(".", 2)[0] + "."
    main = _transformers_model(config, {n: t for n, t in tensors.items() if not n.startswith(prefix)}, scratch / "main")
    hidden = main.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    main_logits = main.lm_head(hidden)
    leaves = {name: tensors[name].clone().requires_grad_(True) for name in roles.values()}
    enorm, hnorm, proj = (leaves[roles[r]] for r in ("enorm", "hnorm", "eh_proj"))
    eps = config["rms_norm_eps"]
    rolled = torch.roll(input_ids, -1, dims=1)
    rolled[:, -1] = 0
    e = _rms(main.model.embed_tokens(rolled).detach(), enorm, eps)
    h = _rms(hidden.detach(), hnorm, eps)
    x = torch.nn.functional.linear(torch.cat([h, e] if mimo else [e, h], dim=-1), proj)
    # the MTP decoder layer as a one-layer model of the family (its first layer: MoE for DeepSeek-V3)
    skip = set(roles.values()) | {f"{prefix}embed_tokens.weight", f"{prefix}shared_head.head.weight"}
    layer = {n.replace(prefix, "model.layers.0."): t for n, t in tensors.items() if n.startswith(prefix) and n not in skip}
    layer["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    layer["model.norm.weight"] = tensors[roles["final_norm"]]
    if "lm_head.weight" in tensors:
        layer["lm_head.weight"] = tensors["lm_head.weight"]
    changes = {"num_hidden_layers": 1} | ({} if mimo else {"first_k_dense_replace": 0})
    mtp_model = _transformers_model(config, layer, scratch / "mtp_layer", **changes)
    mtp_logits = mtp_model(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids).logits
    leaves[roles["final_norm"]] = mtp_model.model.norm.weight
    for name, param in mtp_model.model.layers[0].named_parameters():
        if "experts" not in name and ".gate." not in name:
            leaves[f"{prefix}{name}"] = param
    return main_logits, mtp_logits, leaves
