"""What vLLM must receive in one reload: a load unit.

vLLM's in-place reload (``vllm/model_executor/model_loader/reload/layerwise.py``) materialises a module's
parameters empty (``torch.empty_strided``, ``meta.py``) and processes the module (fuses q/k/v and gate/up,
repacks CPU kernels, builds a layer's fused experts) once the weights loaded into it reach its size, or at the
end of the reload call. A module whose weights came in two reload calls is processed twice, each time with the
other part left as garbage. So every reload call gets whole units: a decoder layer (everything under
``...layers.N.`` or MiMo's ``...mtp_layers.N.``: its fused attention and MLP projections, biases, norms and all of its
experts), a vision tower's block (``visual.blocks.N.``: vLLM fuses its q/k/v and gate/up too, and may
shard them by TP), or outside these one module (``model.embed_tokens``, ``model.norm``, ``lm_head``,
``visual.patch_embed.proj``, ``visual.merger.mlp.0``).

Imported inside vLLM's workers too: the standard library only.
"""

from __future__ import annotations

import re

__all__ = ["load_unit"]

# MiMo's MTP layers (mtp_layers.N) are units too, and the blocks of a vision tower (Qwen2.5-VL's visual.blocks.N)
_LAYER = re.compile(r"^(.*?\b(?:(?:mtp_)?layers|blocks)\.\d+)\.")


def load_unit(name: str) -> str:
    """The unit of an HF tensor name or of a vLLM module name: its decoder layer's prefix, else its module."""
    match = _LAYER.match(name)
    return match.group(1) if match else name.rpartition(".")[0]
