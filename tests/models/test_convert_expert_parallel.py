"""megatron-rl-convert at EP > 1 (``--ep``, ``--etp``): HF -> Megatron -> HF bit-exact across TP / PP / EP / ETP
layouts for tiny random MoE models, each rank loading only its experts (1/(EP*ETP) of their bytes), bad sizes
refused before any process starts naming the flag, and checkpoints written at EP=2 loading at EP=2 and EP=1.

A new MoE variant is one more entry of ``MODELS``: Qwen3-MoE, Mixtral, Qwen2-MoE with a gated shared expert and
dense layers (decoder_sparse_step, mlp_only_layers) and Qwen3-MoE with a dense first layer.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shared_expert_jobs
from convert_ep_jobs import convert_steps_job, trainer_checkpoint_job
from megatron_rl.distributed import run_multiprocess
from megatron_rl.weights.convert_cli import main
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

# name -> writer of a tiny random HF checkpoint (path, seed); 4 experts each
MODELS = {
    "qwen3_moe": lambda path, seed: make_tiny_hf_checkpoint(
        path, "qwen3_moe", seed=seed, with_tokenizer=False, norm_topk_prob=False),
    "mixtral": lambda path, seed: make_tiny_hf_checkpoint(
        path, "mixtral", seed=seed, with_tokenizer=False, sliding_window=None),
    # 6 layers, MoE at 1 and 5 with a gated shared expert, the others dense
    "qwen2_moe_shared": lambda path, seed: shared_expert_jobs.make_checkpoint(path, "qwen2_moe", seed=seed),
    # layer 0 dense (mlp_only_layers=[0]), layer 1 MoE: at PP=2 the first stage holds no experts
    "qwen3_moe_dense_first": lambda path, seed: shared_expert_jobs.make_checkpoint(path, "qwen3_moe", seed=seed),
}

# (command, source, out, tp, pp, ep, etp) on 4 ranks: ETP=1 and ETP=2, TP=2 and PP=2, and EP changes between
# writing and reading (EP=2 -> EP=1 reads every expert from a checkpoint that stored them by EP rank).
STEPS_4 = [
    ("hf-to-mcore", "hf", "mcore_tp2pp2ep2etp1", 2, 2, 2, 1),
    ("mcore-to-hf", "mcore_tp2pp2ep2etp1", "back_tp2ep2etp2", 2, 1, 2, 2),
    ("hf-to-mcore", "hf", "mcore_tp2ep2etp2", 2, 1, 2, 2),
    ("mcore-to-hf", "mcore_tp2ep2etp2", "back_pp2ep2", 1, 2, 2, 1),
    ("mcore-to-hf", "mcore_tp2ep2etp2", "back_ep1", 1, 1, 1, None),
]


def _tiny_moe(path: Path, name: str, seed: int = 0) -> Path:
    return MODELS[name](path, seed)


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def assert_bit_exact(converted: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    assert converted.keys() == original.keys()
    differing = [name for name, tensor in original.items() if not torch.equal(converted[name], tensor)]
    assert not differing, differing[:5]


def expert_bytes(original: dict[str, torch.Tensor], layers: range | None = None) -> int:
    """Bytes of the routed experts' HF tensors (of ``layers``; shared experts are not routed experts)."""
    def wanted(name: str) -> bool:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        return ".experts." in name and (layers is None or (match is not None and int(match.group(1)) in layers))

    return sum(t.numel() * t.element_size() for name, t in original.items() if wanted(name))


def stage_expert_bytes(original: dict[str, torch.Tensor], num_layers: int, pp: int) -> list[int]:
    per_stage = num_layers // pp
    return [expert_bytes(original, range(s * per_stage, (s + 1) * per_stage)) for s in range(pp)]


# ---------------------------------------------------------------- checks before any process starts


@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr("megatron_rl.distributed.run_multiprocess", refuse)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ep", "3"], "--ep 3 --etp 1 (--tp 1): {src}: num_experts=4 is not divisible by EP=3"),
        (["--ep", "0"], "--ep must be >= 1, got 0"),
        (["--etp", "0"], "--etp must be >= 1, got 0"),
        (["--tp", "2", "--etp", "3"], "--ep 1 --etp 3 (--tp 2): {src}: moe_intermediate_size (per expert)=16 is "
                                      "not divisible by ETP=3"),
        (["--tp", "4", "--ep", "2", "--etp", "2"], "--ep 2 --etp 2 (--tp 4): {src}: expert_tensor_parallel_size=2 "
                                                   "must be 1 or the TP size"),
    ],
)
def test_expert_parallel_sizes_that_do_not_fit_are_refused_naming_the_flag(tmp_path, no_spawn, flags, message):
    hf_dir = _tiny_moe(tmp_path / "hf", "qwen3_moe")
    for command in (["hf-to-mcore", "--hf-dir"], ["mcore-to-hf", "--hf-config", str(hf_dir), "--mcore-dir"]):
        with pytest.raises(SystemExit, match=re.escape("megatron-rl-convert: " + message.format(src=hf_dir / "config.json"))):
            main([*command, str(hf_dir), "--out", str(tmp_path / "o"), *flags])


def test_expert_parallel_on_a_dense_model_is_refused(tmp_path, no_spawn):
    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen2", with_tokenizer=False)
    with pytest.raises(SystemExit, match=re.escape(f"--ep 2: {hf_dir / 'config.json'} is a dense model (Qwen2ForCausalLM)")):
        main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "o"), "--ep", "2"])
    with pytest.raises(SystemExit, match=re.escape(f"--etp 1: {hf_dir / 'config.json'} is a dense model")):
        main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "o"), "--etp", "1"])


def test_launched_ranks_are_checked_with_megatrons_rules(tmp_path, no_spawn, monkeypatch):
    """Under torchrun: EP*ETP must divide the ranks of a pipeline stage, TP*PP the world (before init)."""
    hf_dir = _tiny_moe(tmp_path / "hf", "mixtral")
    base = ["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "o")]
    monkeypatch.setattr("megatron_rl.distributed.init_distributed", lambda: pytest.fail("initialised"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit, match=re.escape(
        "--ep 2 * --etp 2 = 4 does not divide the 2 ranks of a pipeline stage (WORLD_SIZE=4 / --pp 2); "
        "launch 8 ranks"
    )):
        main([*base, "--tp", "2", "--pp", "2", "--ep", "2"])
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match=re.escape(
        "launched with WORLD_SIZE=3, which --tp 2 * --pp 1 = 2 does not divide (launch 2 ranks)"
    )):
        main([*base, "--tp", "2"])


def test_spawned_ranks_fit_the_dense_and_the_expert_layout():
    from megatron_rl.weights.convert_layout import ConvertLayout

    assert ConvertLayout(tp=2, pp=2).world_size == 4
    assert ConvertLayout(tp=1, pp=1, ep=2, etp=1).world_size == 2  # two data-parallel replicas of the dense part
    assert ConvertLayout(tp=2, pp=1, ep=2, etp=2).world_size == 4
    assert ConvertLayout(tp=2, pp=2, ep=4, etp=1).world_size == 8
    assert ConvertLayout(tp=4, pp=1, ep=2, etp=1).world_size == 4  # experts over EP x expert-DP inside TP=4


# ---------------------------------------------------------------- round trips


@pytest.mark.distributed
@pytest.mark.slow  # one group of 4 ranks, five conversions
@pytest.mark.parametrize("name", sorted(MODELS))
def test_round_trip_at_expert_parallel_is_bit_exact_and_loads_only_owned_experts(tmp_path, name):
    hf_dir = _tiny_moe(tmp_path / "hf", name)
    original = tensors(hf_dir)
    total = expert_bytes(original)
    num_layers = 1 + max(int(n.split(".")[2]) for n in original if n.startswith("model.layers."))
    results = run_multiprocess(convert_steps_job, 4, str(hf_dir), str(tmp_path), STEPS_4, timeout_s=900)
    for index, (command, _, out, tp, pp, ep, etp) in enumerate(STEPS_4):
        etp = tp if etp is None else etp
        reports = results[0][index]["reports"]
        assert [r.rank for r in reports] == [0, 1, 2, 3]
        # each rank holds 1/EP of its pipeline stage's experts, in 1/ETP shards
        stages = stage_expert_bytes(original, num_layers, pp)
        assert [r.expert_bytes for r in reports] == [stages[r.coords[0]] // (ep * etp) for r in reports], out
        assert sum({r.coords: r.expert_bytes for r in reports}.values()) == total
        if command == "hf-to-mcore":
            for per_rank, report in zip(results, reports):
                owned = {f".experts.{e}." for e in per_rank[index]["owned"]}
                read = per_rank[index]["reads"]
                assert all(any(o in n for o in owned) for n in read), (out, read)
                assert bool(read) == (report.expert_bytes > 0), (out, read)
        else:
            assert_bit_exact(tensors(tmp_path / out), original)


@pytest.mark.distributed
@pytest.mark.slow  # two CLI runs, each starting two ranks
def test_cli_converts_at_expert_parallel_and_reports_the_expert_bytes(tmp_path, capsys):
    hf_dir = _tiny_moe(tmp_path / "hf", "qwen3_moe")
    original = tensors(hf_dir)
    total = expert_bytes(original)
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(mcore), "--tp", "2", "--ep", "2",
                 "--etp", "1", "--verify"]) == 0
    out = capsys.readouterr().out
    assert (f"experts: a rank loaded at most 8 expert tensors, {total // 2} of the model's {total} expert bytes "
            "(0.500) at --tp 2 --pp 1 --ep 2 --etp 1") in out
    assert float(re.search(r"max \|logit diff\| = (\S+) \(ok", out).group(1)) <= 1e-4
    assert '"ep": 2' in (mcore / "megatron_rl_convert.json").read_text()
    assert main(["mcore-to-hf", "--mcore-dir", str(mcore), "--out", str(back), "--ep", "2"]) == 0
    assert f"{total // 2} of the model's {total} expert bytes (0.500) at --tp 1 --pp 1 --ep 2 --etp 1" in (
        capsys.readouterr().out
    )
    assert_bit_exact(tensors(back), original)


@pytest.mark.distributed
@pytest.mark.slow  # one group of 2 ranks: three actors, two conversions
def test_trainer_checkpoint_written_at_ep2_resumes_and_converts_at_ep2_and_ep1(tmp_path):
    """The trainer's loader reads a checkpoint written at EP=2 at EP=2 (weights and Adam state) and EP=1 (the
    weights: Megatron's Adam state of the experts is a separate optimizer only at EP > 1), and the converter
    reads it at both."""
    hf_dir = _tiny_moe(tmp_path / "hf", "qwen3_moe")
    other = _tiny_moe(tmp_path / "other", "qwen3_moe", seed=1)  # the resuming actors start from other weights
    ckpt = tmp_path / "run" / "global_step_1" / "actor"
    rank0, _ = run_multiprocess(trainer_checkpoint_job, 2, str(hf_dir), str(other), str(ckpt), str(tmp_path),
                                timeout_s=900)
    trained = rank0["trained"]
    assert not all(torch.equal(t, tensors(hf_dir)[n]) for n, t in trained.items())  # the update moved weights
    for ep in (2, 1):
        assert_bit_exact(rank0["loaded"][ep], trained)
        out, reports = rank0["converted"][ep]
        assert_bit_exact(tensors(Path(out)), trained)
        assert {r.expert_bytes for r in reports} == {expert_bytes(trained) // ep}
