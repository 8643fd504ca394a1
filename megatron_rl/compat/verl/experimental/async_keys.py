"""The keys of verl's async entries (``verl.experimental.one_step_off_policy.main_ppo``,
``verl.experimental.fully_async_policy.fully_async_main``) that verl's core config lacks, and the core keys whose
meaning these entries change, each with its fate on megatron-rl (``keys.Rule``, read by ``entry.py``;
docs/configuration.md, "verl's async entries").

Semantics (verl-project/verl at 1dda039b9, verl/experimental/fully_async_policy/fully_async_rollouter.py and
fully_async_trainer.py):

- verl's fully async trainer takes ``required_samples = ppo_mini_batch_size x require_batches`` prompts per local
  step (one optimizer step each) and syncs the weights every ``trigger_parameter_sync_step`` local steps. A step
  here trains ``data.train_batch_size`` prompts in ``ppo_mini_batch_size`` mini-batches and then syncs, so
  ``data.train_batch_size = ppo_mini_batch_size x require_batches x trigger_parameter_sync_step``: the same
  optimizer steps between two syncs, on the same prompts (verl requires ``data.train_batch_size=0``).
- ``staleness_threshold``: verl's rollouter stops when the samples generated since the last sync (those queued
  or in flight included) reach ``required_samples x trigger_parameter_sync_step x (1 + staleness_threshold)``,
  i.e. it runs up to ``1 + staleness_threshold`` syncs' worth of prompts ahead. Here the rollouter runs whole
  batches (one sync's prompts each) ahead: ``async_training.buffer_batches = ceil(1 + staleness_threshold)``,
  and a sample's oldest token then lags the policy by at most that many versions, which
  ``async_training.max_staleness`` is set to (verl drops nothing for staleness; at that bound nothing is dropped
  here either). Rounding up: a fraction of a batch ahead is a whole batch here.
- ``rollout.total_rollout_steps``: prompts to generate (verl's dataloader yields one prompt a step,
  ``data.gen_batch_size=1``); verl trains ``int(total_rollout_steps / (required_samples x trigger))`` syncs:
  ``trainer.total_training_steps`` here.
- ``rollout.nnodes`` x ``rollout.n_gpus_per_node``: the rollout's own GPUs, where verl starts one replica per
  ``rollout.tensor_model_parallel_size`` GPUs: ``rollout.mode=server`` with ``rollout.num_servers`` = GPUs / TP,
  ``rollout.servers_per_node`` = ``n_gpus_per_node`` / TP over several nodes.
"""

from __future__ import annotations

import math
from typing import Mapping

from megatron_rl.compat.verl.keys import ABSENT, Fate, Rewrite, Rule, bare, is_null, refuse, truthy, verl_default
from megatron_rl.rollout.engines import ENGINES

_TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"
_MINI = "actor_rollout_ref.actor.ppo_mini_batch_size"


def _int(key: str, value: str, low: int) -> int:
    try:
        number = int(bare(value))
    except ValueError:
        number = low - 1
    if number < low:
        refuse(f"{key}={value} must be an integer >= {low}")
    return number


def _setting(seen: Mapping[str, str], key: str) -> str:
    """The command line's value, else verl's default (core config)."""
    if key in seen:
        return seen[key]
    default = verl_default(key)
    return "" if default is ABSENT or default is None else str(default)


# ---------------------------------------------------------------------------------------------- both entries

def _mode(mode: str) -> Rewrite:
    def rewrite(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
        if bare(value) != mode:
            refuse(f"{key}={value}: this entry runs async_training.mode={mode}; drop the key (or use "
                    "megatron_rl.compat.verl.trainer.main_ppo with async_training.mode=...)")
        return [f"async_training.mode={mode}"]

    return rewrite


def _hybrid_engine(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if truthy(value):
        refuse(f"{key}={value}: verl's async trainers run the rollout on GPUs of its own (they assert "
                "hybrid_engine=False); here that is rollout servers. For a colocated rollout use "
                "`python3 -m megatron_rl.compat.verl.trainer.main_ppo`")
    return []


def _server_mode(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if bare(value) not in ("async", "server"):
        refuse(f"{key}={value}: verl's async trainers drive the rollout replicas as servers (mode async); "
                "here that is actor_rollout_ref.rollout.mode=server: drop the key or set it to async")
    return ["actor_rollout_ref.rollout.mode=server"]


def _engine(seen: Mapping[str, str]) -> str:
    return bare(seen.get("actor_rollout_ref.rollout.name", "hf"))


def _rollout_nodes(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    nodes = _int(key, value, 1)
    spec = ENGINES.get(_engine(seen))
    if nodes > 1 and spec is not None and spec.servers_on_trainer_host and not seen.get(
            "actor_rollout_ref.rollout.server_urls"):
        refuse(f"{key}={value}: rollout.name={spec.name} servers here take their weights through /dev/shm of "
                "trainer rank 0's host, so they all run on one node (docs/rollout.md, 'vLLM servers'; NCCL weight "
                "transfer to other nodes is not built): set rollout.nnodes=1 with rollout.n_gpus_per_node = the "
                "rollout's GPUs on that node")
    return []


def _rollout_gpus(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    per_node = _int(key, value, 1)
    nodes = _int("rollout.nnodes", seen.get("rollout.nnodes", "1"), 1)
    if seen.get("actor_rollout_ref.rollout.server_urls"):
        return []  # servers started elsewhere: the URLs say where
    name = _engine(seen)
    spec = ENGINES.get(name)
    if spec is not None and not spec.run_starts_servers:
        refuse(f"{key}={value}: the run does not start rollout.name={name} servers here; start them on the "
                "rollout's GPUs yourself, give their URLs as actor_rollout_ref.rollout.server_urls and drop "
                "rollout.nnodes / rollout.n_gpus_per_node (docs/rollout.md)")
    tp = _int(_TP, _setting(seen, _TP) or "1", 1) if spec is None or spec.tensor_parallel else 1
    if per_node % tp:
        refuse(f"{key}={value} is not a multiple of {_TP}={tp}: a rollout server (one replica of TP GPUs) "
                "does not span nodes")
    out = [f"actor_rollout_ref.rollout.num_servers={nodes * per_node // tp}"]
    if nodes > 1:
        out.append(f"actor_rollout_ref.rollout.servers_per_node={per_node // tp}")
    return out


def _standalone_memory(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    return [] if is_null(value) else [f"actor_rollout_ref.rollout.gpu_memory_utilization={bare(value)}"]


def _rollout_log_probs(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    return [f"algorithm.rollout_correction.bypass_mode={'true' if truthy(value) else 'false'}"]


_PLACEMENT = (
    Rule("async_training.mode", Fate.mapped, "the entry's mode; another value is refused", None),  # per entry
    Rule("actor_rollout_ref.hybrid_engine", Fate.mapped,
         "False: the rollout runs on GPUs of its own, rollout servers here (actor_rollout_ref.rollout.mode=server); "
         "True is refused (verl's async trainers assert False)", _hybrid_engine),
    Rule("actor_rollout_ref.rollout.mode", Fate.mapped,
         "async -> server: verl's async trainers drive their replicas as servers, as rollout.mode=server here",
         _server_mode),
    Rule("rollout.nnodes", Fate.mapped,
         "the rollout's own nodes (with rollout.n_gpus_per_node -> rollout.num_servers); > 1 is refused for vLLM, "
         "whose servers load weights through /dev/shm of trainer rank 0's host", _rollout_nodes),
    Rule("rollout.n_gpus_per_node", Fate.mapped,
         "-> actor_rollout_ref.rollout.num_servers = rollout.nnodes x n_gpus_per_node / rollout TP (one server per "
         "verl replica), and rollout.servers_per_node = n_gpus_per_node / TP when nnodes > 1; refused for engines "
         "whose servers the run does not start (SGLang: give rollout.server_urls)", _rollout_gpus),
    Rule("actor_rollout_ref.actor.use_rollout_log_probs", Fate.mapped,
         "the rollout's log-probs as the old ones: -> algorithm.rollout_correction.bypass_mode", _rollout_log_probs),
)


def _with_mode(mode: str, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    return tuple(Rule(r.pattern, r.fate, r.why, _mode(mode)) if r.pattern == "async_training.mode" else r
                 for r in rules)


# ---------------------------------------------------------------------------------------------- fully async

def _per_sync(seen: Mapping[str, str]) -> int:
    """Prompts between two weight syncs in verl's fully async trainer: one step here."""
    mini = _int(_MINI, _setting(seen, _MINI), 1)
    require = _int("async_training.require_batches", seen["async_training.require_batches"], 1)
    trigger = _int("async_training.trigger_parameter_sync_step", seen["async_training.trigger_parameter_sync_step"], 1)
    return mini * require * trigger


def _staleness(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    try:
        threshold = float(bare(value))
    except ValueError:
        threshold = -1.0
    if not threshold >= 0:
        refuse(f"{key}={value} must be >= 0 (a fraction of a sync's samples)")
    ahead = math.ceil(1 + threshold)
    return [f"async_training.buffer_batches={ahead}", f"async_training.max_staleness={ahead}"]


def _sync_step(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    _int(key, value, 1)
    return []


def _train_batch_size(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    per_sync = _per_sync(seen)
    given = _int(key, value, 0)
    if given not in (0, per_sync):
        refuse(f"{key}={value}: verl's fully async rollouter requires data.train_batch_size=0 (its batch is "
                f"ppo_mini_batch_size x require_batches x trigger_parameter_sync_step = {per_sync} prompts per sync, "
                "one step here); drop the key or set it to 0")
    return [f"data.train_batch_size={per_sync}"]


def _total_rollout_steps(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if is_null(value):
        return []  # verl: the dataset x trainer.total_epochs, as here
    prompts = _int(key, value, 1)
    per_sync = _per_sync(seen)
    steps = prompts // per_sync
    if steps < 1:
        refuse(f"{key}={value}: fewer prompts than one sync's {per_sync} (ppo_mini_batch_size x require_batches x "
                "trigger_parameter_sync_step), so verl trains 0 steps; raise it")
    return [f"trainer.total_training_steps={steps}"]


def _gen_batch_size(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
    if _int(key, value, 1) != 1:
        refuse(f"{key}={value}: verl's fully async rollouter requires data.gen_batch_size=1; here the rollouter "
                "generates whole batches of data.train_batch_size prompts; drop the key")
    return []


def _only(accepted: str, what: str) -> Rewrite:
    """verl's config-file value is accepted (no effect here), another is refused with ``what``."""
    def rewrite(key: str, value: str, seen: Mapping[str, str]) -> list[str]:
        if bare(value).lower() != accepted.lower():
            refuse(f"{key}={value}: {what}; only verl's default ({accepted}) is accepted here")
        return []

    return rewrite


FULLY_ASYNC_RULES: tuple[Rule, ...] = _with_mode("fully_async", (
    *_PLACEMENT,
    Rule("async_training.staleness_threshold", Fate.mapped,
         "verl lets the rollouter run up to 1 + threshold syncs' worth of samples ahead (a fraction of samples); "
         "here whole batches run ahead and the bound is in weight versions: -> async_training.buffer_batches = "
         "async_training.max_staleness = ceil(1 + threshold) (nothing dropped for staleness, as in verl)",
         _staleness),
    Rule("async_training.trigger_parameter_sync_step", Fate.mapped,
         "local steps between two syncs: -> data.train_batch_size = ppo_mini_batch_size x require_batches x "
         "trigger_parameter_sync_step (one step here = one sync, the same optimizer steps between syncs)",
         _sync_step),
    Rule("async_training.require_batches", Fate.mapped,
         "mini-batches per local step: -> data.train_batch_size (with trigger_parameter_sync_step)", _sync_step),
    Rule("data.train_batch_size", Fate.mapped,
         "verl requires 0 here: -> ppo_mini_batch_size x require_batches x trigger_parameter_sync_step (prompts "
         "per sync)", _train_batch_size),
    Rule("rollout.total_rollout_steps", Fate.mapped,
         "prompts to generate: -> trainer.total_training_steps = total_rollout_steps // prompts per sync "
         "(verl's total_train_steps; its trainer does not read trainer.total_training_steps)", _total_rollout_steps),
    Rule("data.gen_batch_size", Fate.mapped,
         "verl streams one prompt at a time (requires 1); here the rollouter generates whole batches of "
         "data.train_batch_size prompts, every group of rollout.n responses whole: 1 accepted, no effect",
         _gen_batch_size),
    Rule("rollout.n", Fate.dropped,
         "the fully async config's top-level rollout.n is not read by verl's code; the responses per prompt are "
         "actor_rollout_ref.rollout.n"),
    Rule("actor_rollout_ref.rollout.standalone_gpu_memory_utilization", Fate.mapped,
         "every rollout server here is standalone: a value -> actor_rollout_ref.rollout.gpu_memory_utilization "
         "(null: that key's)", _standalone_memory),
    Rule("async_training.use_trainer_do_validate", Fate.mapped,
         "validation runs on the rollout servers here", _only("False", "validation on the trainer's GPUs is not "
                                                                      "built here; it runs on the rollout servers")),
    Rule("async_training.use_dynamic_resource_scheduling", Fate.mapped,
         "rollout replicas on the trainer's GPUs are not built here",
         _only("False", "rollout replicas on the trainer's GPUs (dynamic resource scheduling) are not built here")),
    Rule("async_training.dynamic_schedule_*", Fate.dropped,
         "read by verl's dynamic resource scheduling only, which is refused here"),
    Rule("async_training.concurrent_samples_per_replica", Fate.mapped,
         "requests in flight per server here are actor_rollout_ref.rollout.max_num_seqs",
         _only("16", "requests in flight per rollout server here are actor_rollout_ref.rollout.max_num_seqs")),
))

# (key, value, why): the entry's keys as verl's fully_async_ppo_megatron_trainer.yaml sets them (or as its trainer
# requires), given to their rules when the command line does not set them
FULLY_ASYNC_IMPLIED: tuple[tuple[str, str, str], ...] = (
    ("async_training.mode", "fully_async", "verl's fully async entry"),
    ("actor_rollout_ref.hybrid_engine", "False", "verl's fully async trainer requires it"),
    ("actor_rollout_ref.rollout.mode", "async", "verl's default"),
    ("async_training.staleness_threshold", "0.1", "verl's fully async config"),
    ("async_training.trigger_parameter_sync_step", "4", "verl's fully async config"),
    ("async_training.require_batches", "1", "verl's fully async config"),
    ("data.train_batch_size", "0", "verl's fully async rollouter requires it"),
    ("rollout.nnodes", "1", "verl's fully async config"),
    ("rollout.n_gpus_per_node", "8", "verl's fully async config"),
    ("rollout.total_rollout_steps", "100", "verl's fully async config"),
)

# ---------------------------------------------------------------------------------------------- one step off

ONE_STEP_OFF_RULES: tuple[Rule, ...] = _with_mode("one_step_off", _PLACEMENT)

ONE_STEP_OFF_IMPLIED: tuple[tuple[str, str, str], ...] = (
    ("async_training.mode", "one_step_off", "verl's one-step-off entry"),
    ("actor_rollout_ref.hybrid_engine", "False", "verl's one-step-off trainer places the rollout apart"),
    ("actor_rollout_ref.rollout.mode", "async", "verl's default"),
    ("rollout.nnodes", "1", "verl's one-step-off config"),
    ("rollout.n_gpus_per_node", "8", "verl's one-step-off config"),
)

# verl's async configs set this core key (before the user's arguments, which win): "only then will the use of log
# probs be correct"
ASYNC_CONFIG_DEFAULTS: tuple[tuple[str, str, str], ...] = (
    ("algorithm.rollout_correction.bypass_mode", "True",
     "verl's async configs: the rollout's log-probs are the old ones (decoupled from the trainer's)"),
)
