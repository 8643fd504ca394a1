"""Worker classes the controller tests start under Ray (importable by the workers via PYTHONPATH)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from megatron_rl.controller import Dispatch, Execute, Worker, register
from megatron_rl.protocol import DataProto


def fake_megatron_mesh(rank: int, world_size: int, tp: int, pp: int) -> dict[str, int]:
    """Megatron's default rank order: tensor-parallel fastest, then data-parallel, pipeline slowest."""
    dp = world_size // (tp * pp)
    return {"tp_rank": rank % tp, "dp_rank": (rank // tp) % dp, "pp_rank": rank // (tp * dp), "dp_size": dp, "pp_size": pp}


def tag_rows(data: DataProto, rank: int) -> DataProto:
    """The rows this rank received, tagged with the rank, so the driver can check split and collect order."""
    ids = data.batch["ids"]
    return DataProto.from_dict({"ids": ids, "rank": torch.full_like(ids, rank)}, {"uid": data.non_tensor_batch["uid"]},
                               data.meta_info)


class ProbeWorker(Worker):
    """Reports what each rank received. FAKE_TP / FAKE_PP in the environment give it a Megatron-like mesh."""

    def __init__(self, tag: str = "probe") -> None:
        super().__init__()
        self.tag = tag
        self.seen: list[int] = []
        self.rank_zero_calls = 0
        tp, pp = int(os.environ.get("FAKE_TP", "1")), int(os.environ.get("FAKE_PP", "1"))
        if tp * pp > 1:
            self.set_mesh(**fake_megatron_mesh(self.rank, self.world_size, tp, pp))

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, suffix: str = "") -> dict:
        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        return {"rank": self.rank, "pid": os.getpid(), "tag": self.tag + suffix, "env": env}

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, value: int, factor: int) -> int:
        return value * factor

    @register(Dispatch.RANK_ZERO)
    def rank_value(self) -> int:
        return 100 + self.rank

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def count_rank_zero_call(self) -> int:
        self.rank_zero_calls += 1
        return self.rank

    def rank_zero_call_count(self) -> int:
        return self.rank_zero_calls

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag_dp(self, data: DataProto) -> DataProto:
        self.seen = data.batch["ids"].tolist()
        return tag_rows(data, self.rank)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def count_rows(self, data: DataProto, extra: int) -> int:
        return len(data) + extra

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def tag_megatron(self, data: DataProto) -> DataProto:
        self.seen = data.batch["ids"].tolist()
        if not self.mesh_info().is_collect:  # a non-collecting rank's output must never reach the driver
            return DataProto.from_dict({"ids": -data.batch["ids"], "rank": torch.full_like(data.batch["ids"], -1)},
                                       {"uid": data.non_tensor_batch["uid"]})
        return tag_rows(data, self.rank)

    def last_seen(self) -> list[int]:
        return self.seen

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def delayed_echo(self, value: str, delay_s: float) -> str:
        time.sleep(delay_s)
        return f"{value}@{self.rank}"

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_ranks(self) -> float:
        """A gloo group through the MASTER_ADDR/PORT the worker group wired (env://)."""
        dist.init_process_group("gloo", init_method="env://")
        try:
            total = torch.tensor([float(self.rank)])
            dist.all_reduce(total)
            return total.item()
        finally:
            dist.destroy_process_group()


class ActorRole(Worker):
    """Stands in for actor+rollout: reports a TP=world mesh (one DP group collected from rank 0)."""

    def __init__(self, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.set_mesh(dp_rank=0, dp_size=1, tp_rank=self.rank)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        ids = data.batch["ids"]
        return DataProto.from_dict({"old_log_probs": ids.float() * self.scale})

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class CriticRole(Worker):
    """Stands in for the critic: pure data parallel, never calls set_mesh."""

    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        self.offset = offset

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"values": data.batch["ids"].float() + self.offset})

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_values_megatron(self, data: DataProto) -> DataProto:
        return self.compute_values(data)

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class FaultyWorker(Worker):
    """Fails on purpose: raises, exits its process, hangs, or raises in its constructor."""

    def __init__(self, fail_init_on_rank: int = -1) -> None:
        super().__init__()
        if self.rank == fail_init_on_rank:
            raise ValueError(f"constructor failing on purpose on rank {self.rank}")

    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def raise_on(self, rank: int) -> int:
        if self.rank == rank:
            self._inner_failure()
        return self.rank

    def _inner_failure(self) -> None:
        raise ValueError("bad value on purpose")

    @register(Dispatch.ONE_TO_ALL)
    def exit_on(self, rank: int) -> int:
        """The chosen rank's process vanishes; the others wait as if stuck in a collective with it."""
        if self.rank == rank:
            os._exit(3)
        time.sleep(300)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def raise_then_peer_exits(self, raising: int, exiting: int) -> int:
        """A collective with a rank that dies: ``raising`` fails at once (as gloo's "Connection reset by peer"
        would), ``exiting``'s process vanishes a moment later."""
        if self.rank == raising:
            raise RuntimeError("Connection reset by peer (on purpose)")
        if self.rank == exiting:
            time.sleep(0.5)
            os._exit(3)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def hang(self) -> None:
        time.sleep(300)


class ConfigReceiver(Worker):
    """Reports what the trainer config became after travelling as an init argument (pickled by Ray)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    @register(Dispatch.ONE_TO_ALL)
    def config_facts(self) -> dict:
        cfg = self.config
        return {"type": f"{type(cfg).__module__}.{type(cfg).__qualname__}",
                "kl_penalty": (type(cfg.algorithm.kl_penalty).__name__, str(cfg.algorithm.kl_penalty)),
                "loss_agg_mode": cfg.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum",
                "override_config": type(cfg.actor_rollout_ref.model.override_config).__name__,
                "default_local_dir": cfg.trainer.default_local_dir}
