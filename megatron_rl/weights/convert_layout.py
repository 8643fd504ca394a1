"""The converter's parallel layout (``--tp``, ``--pp``, ``--ep``, ``--etp``): checked against the model and the
launched ranks before any process starts, each refusal naming the flag; and the ranks a plain run spawns."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.moe import check_expert_parallel_fit
from megatron_rl.models.sizes import check_parallel_fit


@dataclass(frozen=True)
class ConvertLayout:
    """TP x PP for the dense layers, EP x ETP for the experts (ETP resolved: Megatron's default is TP)."""

    tp: int
    pp: int
    ep: int = 1
    etp: int = 1

    @property
    def world_size(self) -> int:
        """The fewest ranks Megatron accepts: each pipeline stage needs a multiple of TP (dense layers, with
        data-parallel replicas beyond it) and of EP*ETP (experts); the replicas write nothing twice."""
        return self.pp * math.lcm(self.tp, self.ep * self.etp)

    def flags(self) -> str:
        return f"--tp {self.tp} --pp {self.pp} --ep {self.ep} --etp {self.etp}"


def check_convert_layout(
    hf: HFModelConfig, tp: int, pp: int, ep: int = 1, etp: int | None = None, launched_world: int | None = None
) -> ConvertLayout:
    """The layout for ``hf``, or a ``ValueError`` naming the flag (and the model field) that does not fit.

    ``launched_world``: WORLD_SIZE under torchrun/srun; checked with Megatron-Core's rules (TP*PP divides it,
    EP*ETP divides the ranks of a pipeline stage)."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--ep", ep), ("--etp", etp)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if hf.moe is None and (ep != 1 or etp is not None):
        flag = f"--ep {ep}" if ep != 1 else f"--etp {etp}"
        raise ValueError(f"{flag}: {hf.source} is a dense model ({hf.architecture}); --ep / --etp split MoE experts")
    layout = ConvertLayout(tp, pp, ep, tp if etp is None else etp)
    if hf.moe is not None:
        try:  # experts divisible by EP, each expert's FFN by ETP, ETP 1 or TP
            check_expert_parallel_fit(hf.moe, tp, layout.ep, layout.etp, hf.source)
        except ValueError as error:
            raise ValueError(f"--ep {layout.ep} --etp {layout.etp} (--tp {tp}): {error}") from None
    try:
        check_parallel_fit(hf, tp, pp, None, ep=layout.ep, etp=layout.etp)
    except ValueError as error:
        raise ValueError(f"--tp {tp} --pp {pp}: {error}") from None
    if launched_world is not None:
        _check_launched_world(layout, launched_world)
    return layout


def _check_launched_world(layout: ConvertLayout, world: int) -> None:
    if world % (layout.tp * layout.pp):
        raise ValueError(
            f"launched with WORLD_SIZE={world}, which --tp {layout.tp} * --pp {layout.pp} = "
            f"{layout.tp * layout.pp} does not divide (launch {layout.world_size} ranks)"
        )
    per_stage = world // layout.pp
    if per_stage % (layout.ep * layout.etp):
        raise ValueError(
            f"--ep {layout.ep} * --etp {layout.etp} = {layout.ep * layout.etp} does not divide the {per_stage} "
            f"ranks of a pipeline stage (WORLD_SIZE={world} / --pp {layout.pp}); launch {layout.world_size} ranks"
        )
