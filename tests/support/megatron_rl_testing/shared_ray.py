"""One embedded Ray for the tests whose runs use Ray, started at the first of them and kept while they follow
one another (a run leaves a Ray it found running up: trainer/runner.py). Starting and stopping Ray costs
~10-20 s on a loaded 2-core machine, as much as a tiny training run itself.

A test that does not ask for it gets no Ray of ours (one that checks a run starts without Ray, or that starts a
Ray of other resources, sees none): tests/conftest.py stops it before that test's first fixture. A test that
leaves an actor or a placement group behind gets the next test a fresh Ray, so nothing of one test's run reaches
the next. It knows its Ray by the GCS address: a Ray a test module started after shutting ours down is never
taken for ours, neither shared nor stopped.
"""
from __future__ import annotations

import time

# Enough logical CPUs for the largest run that shares it (two ranks, two rollout servers, a judge); a run
# reserves what it needs, so more than it asks for changes nothing it does.
NUM_CPUS = 4


class SharedRay:
    def __init__(self) -> None:
        self.gcs_address: str | None = None  # of the Ray this started, while it may still be up

    def _up(self, ray) -> bool:
        """Whether the Ray this process is connected to is the one this started."""
        if self.gcs_address is not None and ray.is_initialized():
            if ray.get_runtime_context().gcs_address == self.gcs_address:
                return True
        self.gcs_address = None  # stopped, or replaced by another: never ours again
        return False

    def start(self) -> None:
        import ray

        from megatron_rl.controller import init_ray

        if self._up(ray):
            return
        if ray.is_initialized():  # someone else's Ray (a module's own): not ours to share or stop
            raise RuntimeError("a test module's own Ray is still up; the shared Ray cannot start")
        init_ray(num_cpus=NUM_CPUS)
        self.gcs_address = ray.get_runtime_context().gcs_address

    def stop(self) -> None:
        if self.gcs_address is None:
            return
        import ray

        from megatron_rl.controller import shutdown_ray

        if self._up(ray):
            shutdown_ray()
        self.gcs_address = None

    def check_clean(self, wait_s: float = 10.0) -> None:
        """Stop it when the last test left something in it: resources still held (an actor, a placement
        group) or a named actor alive. Killed actors give their resources back a moment later: wait a little."""
        import ray

        if not self._up(ray):
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self._clean(ray):
                return
            time.sleep(0.2)
        self.stop()

    @staticmethod
    def _clean(ray) -> bool:
        from ray.util import list_named_actors

        total, free = ray.cluster_resources(), ray.available_resources()
        held = any(free.get(k, 0.0) < v - 1e-6 for k, v in total.items() if not k.startswith(("node:", "memory",
                                                                                                "object_store")))
        return not held and not list_named_actors(all_namespaces=True)
