"""The driver's generation client to rollout servers (SGLang or rollout/hf_server.py), for the async loops.

In server mode the weight updates stay where they are (trainer rank 0's SGLangEngine opens the servers'
sessions and broadcasts); generation for an async loop goes straight from the driver to the servers, so it can
run while the trainer ranks update. Every sample keeps the weight version the server reports for it
(``non_tensor_batch["weight_version"]``, ints): the loop, not the client, decides which versions it accepts.
A server that cannot be reached is named, with the pool's exit code when the pool started it.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from megatron_rl.protocol import DataProto
from megatron_rl.rollout.batch_io import build_rollout_batch, check_prompt_batch, prompt_token_lists
from megatron_rl.rollout.sampling import resolve_sampling_params
from megatron_rl.rollout.server_pool import RolloutServerDied
from megatron_rl.rollout.sglang.adapter import _parse_output, _sampling_dict
from megatron_rl.rollout.sglang.contract import SGLangServerError, checked
from megatron_rl.rollout.sglang.server_transport import _HTTPServer

__all__ = ["ServerRolloutClient"]


class ServerRolloutClient:
    """``config``: the rollout config; ``urls``: the servers; a batch is split across them in order.
    ``pool``: the RolloutServerPool that started them (names a dead server's exit code), if any."""

    def __init__(self, config: Any, urls: Sequence[str], *, response_length: int, eos_token_id: Any,
                 pad_token_id: int | None, timeout_s: float = 600.0, pool: Any = None) -> None:
        if not urls:
            raise ValueError("the async rollout client needs rollout servers (actor_rollout_ref.rollout.server_urls "
                             "or rollout.num_servers)")
        self.config, self.pool = config, pool
        self.response_length = int(config.response_length or response_length)
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self._servers = [_HTTPServer(url, timeout_s) for url in urls]
        self._threads = ThreadPoolExecutor(max_workers=len(self._servers), thread_name_prefix="rollout-client")

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompt_batch(prompts)
        params = resolve_sampling_params(self.config, prompts.meta_info, response_length=self.response_length,
                                         eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        start = time.perf_counter()
        input_ids = prompt_token_lists(prompts)
        sampling = [checked("sampling", None, _sampling_dict(params, row)) for row in range(len(input_ids))]
        bounds = [len(input_ids) * i // len(self._servers) for i in range(len(self._servers) + 1)]
        parts = [(server, lo, hi) for server, (lo, hi) in zip(self._servers, itertools.pairwise(bounds)) if hi > lo]
        futures = [self._threads.submit(self._generate_on, server, input_ids[lo:hi], sampling[lo:hi])
                   for server, lo, hi in parts]
        outputs = [out for f in futures for out in f.result()]
        responses, log_probs, versions = [], [], []
        for row, output in enumerate(outputs):
            tokens, lps = _parse_output(output, row, params)
            responses.append(tokens)
            log_probs.append(lps)
            versions.append(int(output["meta_info"]["weight_version"]))
        out = build_rollout_batch(prompts, responses, log_probs, response_length=params.max_response_length,
                                  pad_token_id=params.pad_token_id, weight_version=min(versions),
                                  seconds=time.perf_counter() - start)
        out.non_tensor_batch["weight_version"] = np.asarray(versions, dtype=np.int64)
        return out

    def _generate_on(self, server: _HTTPServer, input_ids: list, sampling: list) -> list[dict]:
        try:
            outputs = server.request("/generate", {"input_ids": input_ids, "sampling_params": sampling,
                                                   "return_logprob": True})
        except SGLangServerError as exc:
            if self.pool is not None:
                self.pool.check()  # names the server that exited and its code
            raise RolloutServerDied(f"rollout server {server.url} failed a generation: {exc}") from exc
        if not isinstance(outputs, list) or len(outputs) != len(input_ids):
            raise RuntimeError(f"rollout server {server.url} returned {len(outputs) if isinstance(outputs, list) else outputs!r} "
                               f"results for {len(input_ids)} prompts")
        return outputs

    def close(self) -> None:
        self._threads.shutdown(wait=True)
