"""``megatron-rl-convert``: HF directory <-> Megatron distributed checkpoint, with logit verification.

    megatron-rl-convert hf-to-mcore --hf-dir Qwen2.5-7B --out ckpt/qwen-mcore --tp 2 --pp 2 --verify
    megatron-rl-convert mcore-to-hf --mcore-dir ckpt/qwen-mcore --out Qwen2.5-7B-back --verify
    megatron-rl-convert mcore-to-hf --mcore-dir run/global_step_40/actor --hf-config Qwen2.5-7B --out step40-hf
    megatron-rl-convert hf-to-mcore --hf-dir Qwen3-30B-A3B --out ckpt/a3b-mcore --tp 2 --ep 4 --etp 1

Run it plainly and it starts PP * lcm(TP, EP*ETP) local processes itself (gloo without CUDA, nccl with it);
run it under torchrun/srun and it uses the launched ranks (Megatron-Core's rules: TP*PP divides WORLD_SIZE,
EP*ETP the ranks of a pipeline stage). With ``--ep`` each rank loads, holds and saves only its experts
(1/EP of them, 1/(EP*ETP) of their bytes); the run prints the most expert bytes a rank loaded.
The Megatron checkpoint is a ``megatron.core.dist_checkpointing`` directory (``<out>/weights``) next to the HF config.json and
tokenizer files, so it can be loaded back at any TP/PP. A trainer checkpoint (``<run>/global_step_N/actor``) is a
distributed checkpoint without an HF config beside it: pass the trained model's HF directory as ``--hf-config``
(config and tokenizer come from there, the weights from the checkpoint; optimizer state is ignored).
A reward model (``<Family>ForSequenceClassification``, one label) converts with its score head both ways;
``--verify`` then compares its score at every position.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from megatron_rl import distributed  # by module: the tests replace its process starters
from megatron_rl.distributed.collectives import backend_device
from megatron_rl.models.checkpoint_safety import check_checkpoint_metadata
from megatron_rl.models.hf_config import load_hf_config
from megatron_rl.weights.convert_layout import ConvertLayout, check_convert_layout
from megatron_rl.weights.convert_report import RankReport, expert_load, expert_summary, gather_reports, rank_report

CONVERT_META = "megatron_rl_convert.json"
WEIGHTS_DIR = "weights"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl-convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF directory -> Megatron distributed checkpoint")
    to_mcore.add_argument("--hf-dir", required=True, type=Path)
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF directory")
    to_hf.add_argument("--mcore-dir", required=True, type=Path)
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    to_hf.add_argument("--hf-config", type=Path, default=None,
                       help="for a trainer checkpoint (global_step_N/actor): the trained model's HF directory")
    for command in (to_mcore, to_hf):
        command.add_argument("--out", required=True, type=Path)
        command.add_argument("--tp", type=int, default=1, help="tensor-parallel size to convert with")
        command.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to convert with")
        command.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
        command.add_argument("--etp", type=int, default=None,
                             help="expert tensor-parallel size (MoE models): 1 or --tp (default --tp)")
        command.add_argument(
            "--dtype", choices=sorted(DTYPES), default=None, help="default: the source dtype"
        )
        command.add_argument("--verify", action="store_true", help="compare logits against transformers")
        command.add_argument("--verify-tol", type=float, default=1e-3, help="max |logit diff| accepted")
        command.add_argument("--verify-seqs", type=int, default=4)
        command.add_argument("--verify-len", type=int, default=32)
    return parser


def _source_dtype(config_json: Path) -> torch.dtype:
    with open(config_json) as f:
        raw = json.load(f)
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return DTYPES.get(name, torch.float32)


def _mcore_dtype(mcore_dir: Path) -> torch.dtype:
    """The dtype the Megatron checkpoint was written in (hf-to-mcore records it)."""
    meta = mcore_dir / CONVERT_META
    if meta.is_file():
        with open(meta) as f:
            return DTYPES[json.load(f)["dtype"]]
    return _source_dtype(mcore_dir / "config.json")


def _copy_hf_metadata(src: Path, dst: Path) -> None:
    from megatron_rl.weights.export import TOKENIZER_FILES  # lazy: megatron-core

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _init_layout(args: argparse.Namespace) -> None:
    distributed.init_model_parallel(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)


def hf_to_mcore_rank(args: argparse.Namespace) -> list[RankReport]:
    """This rank's part of hf-to-mcore (collective); every rank's report."""
    # lazy: megatron-core (the CLI checks its flags and the model before any rank loads one)
    from megatron_rl.distributed.sharded_save import save_sharded
    from megatron_rl.models.api import build_from_hf

    dtype = DTYPES[args.dtype] if args.dtype else _source_dtype(args.hf_dir / "config.json")
    _init_layout(args)
    # A reward model (<Family>ForSequenceClassification) converts with its score head as the value head.
    reward_model = load_hf_config(args.hf_dir).sequence_classifier
    chunks = build_from_hf(args.hf_dir, params_dtype=dtype, progress=True, value_head=reward_model)
    for chunk in chunks:  # norms too (Megatron creates them fp32), as Float16Module would
        chunk.to(dtype)
    # the model holds this rank's experts only: what build_from_hf read of them
    loaded = expert_load(item for chunk in chunks for item in chunk.named_parameters())
    weights = args.out / WEIGHTS_DIR
    if torch.distributed.get_rank() == 0:
        _copy_hf_metadata(args.hf_dir, args.out)
        weights.mkdir(parents=True, exist_ok=True)
        with open(args.out / CONVERT_META, "w") as f:
            json.dump(
                {
                    "source": str(args.hf_dir),
                    "tp": args.tp,
                    "pp": args.pp,
                    "ep": args.ep,
                    "etp": args.tp if args.etp is None else args.etp,
                    "dtype": str(dtype).removeprefix("torch."),
                },
                f,
                indent=2,
            )
    torch.distributed.barrier()
    save_sharded(chunks[0].sharded_state_dict(), str(weights))
    del chunks
    diff = _verify(_load_mcore(args.out, args.out)[0], args.hf_dir, dtype, args) if args.verify else None
    return gather_reports(rank_report(diff, loaded))


def _weights_dir(mcore_dir: Path) -> Path:
    """``<dir>/weights`` of a converted checkpoint, or ``<dir>`` itself for a trainer checkpoint."""
    for weights in (mcore_dir / WEIGHTS_DIR, mcore_dir):
        if (weights / "metadata.json").is_file():
            return weights
    raise FileNotFoundError(
        f"{mcore_dir} is not a Megatron distributed checkpoint: expected {mcore_dir / WEIGHTS_DIR}/metadata.json "
        f"(written by hf-to-mcore) or {mcore_dir}/metadata.json (a trainer checkpoint, <run>/global_step_N/actor)"
    )


def _config_dir(args: argparse.Namespace) -> Path:
    """Where config.json and the tokenizer are: --hf-config, else the converted checkpoint itself."""
    if args.hf_config is not None:
        return args.hf_config
    if _weights_dir(args.mcore_dir) == args.mcore_dir:
        raise SystemExit(
            f"megatron-rl-convert: {args.mcore_dir} is a trainer checkpoint (global_step_N/actor): it holds no HF "
            "config. Pass the trained model's HF directory (the run's actor_rollout_ref.model.path) as --hf-config"
        )
    return args.mcore_dir


def _load_mcore(
    mcore_dir: Path, config_dir: Path, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.nn.Module], list[tuple[str, torch.Tensor]]]:
    """The model at the initialised layout with the checkpoint's weights, and the tensors this rank loaded
    (at EP > 1 the sharded state dict asks the checkpoint only for this rank's experts)."""
    from megatron.core import dist_checkpointing

    from megatron_rl.models.builder import build_gpt_model  # lazy: megatron-core

    hf = load_hf_config(config_dir)
    chunks = build_gpt_model(hf, params_dtype=dtype, init_weights=False, value_head=hf.sequence_classifier)
    weights = _weights_dir(mcore_dir)
    check_checkpoint_metadata(weights)  # refuse a .metadata pickle that would run code (issue 33)
    if weights == mcore_dir:  # a trainer checkpoint: the model under "model0" beside optimizer and scheduler state
        state = dist_checkpointing.load({"model0": chunks[0].sharded_state_dict()}, str(weights))["model0"]
    else:
        state = dist_checkpointing.load(chunks[0].sharded_state_dict(), str(weights))
    chunks[0].load_state_dict(state)
    return chunks, list(state.items())


def mcore_to_hf_rank(args: argparse.Namespace) -> list[RankReport]:
    """This rank's part of mcore-to-hf (collective); every rank's report."""
    from megatron_rl.weights.export import save_hf_checkpoint  # lazy: megatron-core

    config_dir = _config_dir(args)
    dtype = DTYPES[args.dtype] if args.dtype else _mcore_dtype(config_dir)
    _init_layout(args)
    chunks, state = _load_mcore(args.mcore_dir, config_dir, dtype)
    loaded = expert_load(state)
    del state
    save_hf_checkpoint(
        chunks,
        args.out,
        tokenizer_dir=config_dir,
        dtype=dtype,
        max_shard_bytes=int(args.max_shard_gb * 1024**3),
        progress=True,
    )
    del chunks
    diff = _verify(_load_mcore(args.mcore_dir, config_dir)[0], args.out, dtype, args) if args.verify else None
    return gather_reports(rank_report(diff, loaded))


def _verify(
    chunks: list[torch.nn.Module], hf_dir: Path, dtype: torch.dtype, args: argparse.Namespace
) -> float | None:
    """Max |logit| difference (a reward model: |score| at every position) between the Megatron chunks and
    transformers on random sequences, on the last pipeline stage; all-reduced so every rank returns it. Both sides compute in fp32; the
    transformers weights are first rounded to the conversion ``dtype``, as the converted ones were."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl.models.api import compute_full_logits, position_ids_from_mask  # lazy: megatron-core

    hf = chunks[0].hf_config
    # NCCL moves only CUDA tensors: the model's inputs and the all-reduced difference live on the
    # backend's device (the CPU generator keeps the sequences the same on every machine).
    device = backend_device()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, hf.vocab_size, (args.verify_seqs, args.verify_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, : args.verify_len // 4] = 0  # one left-padded prompt
    logits = compute_full_logits(chunks, input_ids.to(device=device), attention_mask.to(device=device))
    diff = torch.zeros(1, dtype=torch.float64, device=device)
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        model_cls = AutoModelForSequenceClassification if hf.sequence_classifier else AutoModelForCausalLM
        reference = model_cls.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        for param in reference.parameters():  # parameters only: the RoPE buffers stay fp32 on both sides
            param.data = param.data.to(dtype).float()
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask))
        with torch.no_grad():
            if hf.sequence_classifier:  # the score at every position (the RM reads it at the last real token)
                expected = reference.score(reference.model(**inputs).last_hidden_state)
            else:
                expected = reference(**inputs).logits
        valid = attention_mask.bool()
        diff[0] = (logits.cpu() - expected)[valid].abs().max().double().to(device=device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def _launched_world() -> int | None:
    """WORLD_SIZE when launched by torchrun / srun, else None (the converter spawns its ranks)."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def _run(rank_fn, args: argparse.Namespace, layout: ConvertLayout) -> list[RankReport]:
    if _launched_world() is not None:
        distributed.init_distributed()
        return rank_fn(args)
    world = layout.world_size
    return distributed.run_multiprocess(
        rank_fn, world, args, timeout_s=24 * 3600, threads_per_rank=max(1, (os.cpu_count() or 1) // world)
    )[0]


def _check_source(args: argparse.Namespace) -> ConvertLayout:
    """Fail fast, before any process starts, on an unsupported model or a TP/PP/EP/ETP that does not fit the
    model or the launched ranks; returns the layout."""
    try:
        source = args.hf_dir if args.command == "hf-to-mcore" else _config_dir(args)
        return check_convert_layout(load_hf_config(source), args.tp, args.pp, args.ep, args.etp, _launched_world())
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"megatron-rl-convert: {error}") from None


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = _parser().parse_args(argv)
    layout = _check_source(args)
    rank_fn = hf_to_mcore_rank if args.command == "hf-to-mcore" else mcore_to_hf_rank
    reports = _run(rank_fn, args, layout)
    diff = reports[0].diff
    ok = not args.verify or diff <= args.verify_tol
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"wrote {args.out}")
        summary = expert_summary(reports)
        if summary is not None:
            print(f"{summary} at {layout.flags()}")
        if args.verify:
            verdict = "ok" if ok else "FAILED"
            print(f"verify: max |logit diff| = {diff:.3e} ({verdict}, tolerance {args.verify_tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
