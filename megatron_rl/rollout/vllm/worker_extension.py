"""Methods megatron-rl adds to every vLLM worker (vLLM's ``worker_extension_cls``), called through
``LLM.collective_rpc`` / the server's ``/collective_rpc`` route with plain-data arguments.

Loading uses the worker's in-place ``reload_weights`` (checkpoint format, HF names), not
``model.load_weights``: on CPU, vLLM repacks every linear weight into a kernel handle after loading and leaves
an empty parameter behind, which a second ``load_weights`` cannot fill; ``reload_weights`` restores the
parameters, loads (fusing q/k/v and gate/up, sharding for TP) and repacks. All of one update is loaded in one
call: a fused layer whose parts came in separate calls would be repacked half old.

Method names carry the ``mrl_`` prefix: vLLM refuses an extension whose names clash with the worker's own
(``update_weights``, ``reload_weights`` and ``sleep`` exist). Imported inside vLLM's worker processes.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from megatron_rl.rollout.vllm.shm import ShmSegment, map_layout

__all__ = ["WorkerExtension"]

# Every reload warns "RotaryEmbedding: Failed to load weights": rotary tables are computed, never loaded.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class WorkerExtension:
    def mrl_load_weights(self, layouts_by_rank: list[list[dict[str, Any]]]) -> int:
        """Load the segments meant for this worker's TP rank (``layouts_by_rank[rank]``) in one reload; returns
        the number of tensors read."""
        layouts = layouts_by_rank[_tp_rank()]
        counted = [0]

        def tensors():
            for name, tensor in itertools.chain.from_iterable(map_layout(layout) for layout in layouts):
                counted[0] += 1
                yield name, tensor

        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        return counted[0]

    def mrl_read_weights(self, name: str) -> dict[str, Any]:
        """Every parameter of this rank as the kernels use it, written to a new /dev/shm segment (``name`` +
        the TP rank; the caller unlinks it); returns its layout. On CPU a linear layer keeps its weight only
        inside a packed kernel handle: it is recovered exactly by running that kernel on an identity matrix."""
        model = self.model_runner.model
        tensors = []
        with torch.inference_mode():
            for module_name, module in model.named_modules():
                for param_name, param in module.named_parameters(recurse=False):
                    full = f"{module_name}.{param_name}" if module_name else param_name
                    if param_name == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear"):
                        eye = torch.eye(module.input_size_per_partition, dtype=param.dtype)
                        tensors.append((full, module.cpu_linear(eye, param, None).t().contiguous()))
                    else:
                        tensors.append((full, param.detach().cpu().clone()))
        return ShmSegment(f"{name}_tp{_tp_rank()}", tensors).layout
