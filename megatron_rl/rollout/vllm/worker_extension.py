"""Methods megatron-rl adds to every vLLM worker (vLLM's ``worker_extension_cls``), called through
``LLM.collective_rpc`` / the server's ``/collective_rpc`` route with plain-data arguments.

Loading uses the worker's in-place ``reload_weights`` (checkpoint format, HF names), not
``model.load_weights``: on CPU, vLLM repacks every linear weight into a kernel handle after loading and leaves
an empty parameter behind, which a second ``load_weights`` cannot fill; ``reload_weights`` restores the
parameters, loads (fusing q/k/v and gate/up, sharding for TP) and repacks. One call gets whole decoder layers
(``load_units.py``): a module whose parts came in separate calls would be processed with the rest left empty.
The modules a call loads nothing into keep their kernel tensors as they are (``finalize_layerwise_reload``).

On GPUs the weights come over CUDA IPC instead, through vLLM's own weight-transfer engine (``ipc.py``):
``mrl_ipc_update`` rebuilds a bucket's handles and hands it to the worker's ``update_weights``, inside the session
``start_weight_update`` opened; ``mrl_finish_ipc_update`` closes it.

Method names carry the ``mrl_`` prefix: vLLM refuses an extension whose names clash with the worker's own
(``update_weights``, ``reload_weights`` and ``sleep`` exist). Imported inside vLLM's worker processes.
"""

from __future__ import annotations

import itertools
import logging
import re
from typing import Any

import torch

from megatron_rl.models.mimo_config import register_mimo_config
from megatron_rl.rollout.vllm.ipc import handle_args
from megatron_rl.rollout.vllm.load_units import load_unit
from megatron_rl.rollout.vllm.segment_guard import checked_segment_name, checked_segment_path
from megatron_rl.rollout.vllm.shm import ShmSegment, map_layout, staging_dir

__all__ = ["WorkerExtension"]

# Every reload warns "<Layer>: Failed to load weights" for each module it got nothing for (rotary tables are
# computed, never loaded; a reload of some layers loads nothing into the others), and lists the parameters not
# loaded (all but the call's layers).
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
logging.getLogger("vllm.model_executor.model_loader.reload.inplace").setLevel(logging.ERROR)
register_mimo_config()  # the engine's config arrives pickled: MiMo's class must be known here too

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _is_mtp_tensor(name: str, num_hidden_layers: int) -> bool:
    """A multi-token-prediction layer's tensor: MiMo's ``model.mtp_layers.N.``, DeepSeek-V3's / GLM-4.5's layers past
    ``num_hidden_layers`` (models/mtp.py)."""
    if name.startswith("model.mtp_layers."):
        return True
    match = _LAYER_INDEX.match(name)
    return match is not None and int(match.group(1)) >= num_hidden_layers


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _prepack_cpu_experts(model: torch.nn.Module, units: set[str]) -> int:
    """vLLM 0.32's CPU fused-MoE kernel reads its expert weights (w13, w2) prepacked. vLLM prepacks them when
    it first sets up the kernel, but a weight update (reload) leaves the new weights unpacked
    (``_setup_kernel`` sets the kernel up on the first call only), and the kernel then computes with the
    wrong layout: log-probs off by ~1 against the trainer while the weights read back equal. Prepack again
    here, as the kernel's own ``process_weights_after_loading`` does (without its padding: the reloaded
    parameters already have the padded shape). Only the layers of ``units`` (what the reload loaded): the
    others kept their prepacked weights. Returns the layers prepacked."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.utils import replace_parameter

    prepacked = 0
    for module_name, module in model.named_modules():
        isa = _cpu_experts_isa(module)
        if isa is None or load_unit(module_name) not in units:
            continue
        for name in ("w13_weight", "w2_weight"):
            replace_parameter(module, name, cpu_prepack_moe_weight(getattr(module, name), isa))
        prepacked += 1
    return prepacked


def _cpu_experts_isa(module: torch.nn.Module) -> str | None:
    """The ISA vLLM's CPU fused-MoE kernel prepacks ``module``'s expert weights for, or None (not such a layer)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
        return None
    return experts.isa


def _unpack_cpu_experts(packed: torch.Tensor, isa: str) -> torch.Tensor:
    """The checkpoint layout [experts, rows, cols] of prepacked expert weights, exactly. Prepacking moves
    elements within each expert's matrix, the same way for every expert: prepack the element indices (as
    base-256 digits, exact in any float dtype) to learn where each one went, and move them back."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    experts, rows, cols = packed.shape
    index = torch.arange(rows * cols)
    where = torch.zeros(rows * cols, dtype=torch.long)
    for digit in range(3):  # rows * cols < 256**3
        value = ((index // 256**digit) % 256).to(packed.dtype).view(1, rows, cols)
        where += cpu_prepack_moe_weight(value, isa).flatten().long() * 256**digit
    out = torch.empty(experts, rows * cols, dtype=packed.dtype)
    out[:, where] = packed.reshape(experts, rows * cols)
    return out.view(experts, rows, cols)


def _restore_image_norm(model_runner: Any) -> int:
    """A vision tower's on-device pixel normalisation (vLLM's ``FusedMMInputNorm``, with mm_device_do_normalize)
    keeps the processor's mean / std in buffers named ``weight`` and ``bias`` that no checkpoint holds: vLLM computes
    them when it builds the model, load_format=dummy then fills them with noise, and no weight update sets them.
    Computed again here from the processor config, as vLLM computes them. Returns the modules restored."""
    from vllm.model_executor.layers.fusion.mm_input_norm import FusedMMInputNorm, _load_norm_params

    restored = 0
    for module in model_runner.model.modules():
        if isinstance(module, FusedMMInputNorm):
            params = _load_norm_params(model_runner.model_config)
            mean, std = (torch.tensor(v, dtype=torch.float32) for v in (params.image_mean, params.image_std))
            with torch.no_grad():
                module.weight.copy_(params.rescale_factor / std)
                module.bias.copy_(-mean / std)
            restored += 1
    return restored


class WorkerExtension:
    def mrl_load_weights(self, layouts_by_rank: list[list[dict[str, Any]]]) -> int:
        """Load the segments meant for this worker's TP rank (``layouts_by_rank[rank]``) in one reload; returns
        the number of tensors read. Every segment is checked before any is mapped (segment_guard.py)."""
        layouts = layouts_by_rank[_tp_rank()]
        for layout in layouts:
            checked_segment_path(layout["path"], layout["size"])
        units: set[str] = set()
        counted = [0]
        # only an engine that drafts (speculative decoding with the MTP layers) gets MTP tensors to split off
        drafts = getattr(self.model_runner, "drafter", None) is not None
        layers = int(self.model_runner.model_config.hf_config.num_hidden_layers) if drafts else 0

        def is_mtp(name: str) -> bool:
            return drafts and _is_mtp_tensor(name, layers)

        def tensors(mtp: bool):
            for name, tensor in itertools.chain.from_iterable(map_layout(layout) for layout in layouts):
                if is_mtp(name) == mtp:
                    counted[0] += 1
                    units.add(load_unit(name))
                    yield name, tensor

        names = [entry[0] for layout in layouts for entry in layout["tensors"]]
        if not all(is_mtp(name) for name in names):
            self.reload_weights(weights_iterator=tensors(mtp=False), is_checkpoint_format=True)
            _prepack_cpu_experts(self.model_runner.model, units)
            _restore_image_norm(self.model_runner)
        if any(is_mtp(name) for name in names):
            self._reload_drafter(tensors(mtp=True))
        return counted[0]

    def mrl_ipc_update(self, updates: list[dict[str, Any]]) -> None:
        """GPU: one bucket over CUDA IPC (an update per run of back-to-back tensors) into the session vLLM's
        weight-transfer engine holds open (ipc.py): the plain handles rebuilt as torch's arguments here, in the
        worker (msgpack would not carry them)."""
        for update in updates:
            self.update_weights({**update, "ipc_handles": {uuid: handle_args(plain)
                                                           for uuid, plain in update["ipc_handles"].items()}})

    def mrl_finish_ipc_update(self) -> None:
        """GPU: vLLM finalises the session's layerwise reload (the post-load processing, once), then the buffers no
        checkpoint holds are computed again, as after a reload on CPU."""
        self.finish_weight_update()
        _restore_image_norm(self.model_runner)

    def _reload_drafter(self, weights) -> None:
        """The MTP drafter's layers (speculative decoding with model.mtp.enable_rollout): vLLM's drafter shares the
        target's embedding and lm_head, so only its MTP layers are loaded, in place as the target's are."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(self.vllm_config, self.model_runner.drafter.model, weights_iterator=weights, weights_path=None,
                       is_checkpoint_format=True)

    def mrl_read_weights(self, name: str, drafter: bool = False) -> dict[str, Any]:
        """Every parameter of this rank as the kernels use it, written to a new /dev/shm segment (``name`` +
        the TP rank; ``name`` must be a bare segment name, segment_guard.py; the caller unlinks it); returns its
        layout. On CPU a linear layer keeps its weight only inside a packed kernel handle: it is recovered exactly
        by running that kernel on an identity matrix; prepacked MoE experts are unpacked (``_unpack_cpu_experts``).
        ``drafter``: the MTP drafter's parameters instead (speculative decoding)."""
        checked_segment_name(name)
        model = self.model_runner.drafter.model if drafter else self.model_runner.model
        tensors = []
        with torch.inference_mode():
            for module_name, module in model.named_modules():
                isa = _cpu_experts_isa(module)
                for param_name, param in module.named_parameters(recurse=False):
                    full = f"{module_name}.{param_name}" if module_name else param_name
                    if isa is not None and param_name in ("w13_weight", "w2_weight"):
                        tensors.append((full, _unpack_cpu_experts(param.detach().cpu(), isa)))
                    elif param_name == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear"):
                        # a replicated linear (e.g. the MoE router's GateLinear) has no per-partition size
                        width = getattr(module, "input_size_per_partition", None) or module.input_size
                        eye = torch.eye(width, dtype=param.dtype)
                        tensors.append((full, module.cpu_linear(eye, param, None).t().contiguous()))
                    else:
                        tensors.append((full, param.detach().cpu().clone()))
        return ShmSegment(staging_dir(), f"{name}_tp{_tp_rank()}", tensors).layout
