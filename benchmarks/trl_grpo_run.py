"""One Hugging Face TRL GRPOTrainer run on megatron-rl's synthetic task, the same model, prompts, reward and
hyperparameters as ours (benchmarks/test_vs_trl.py runs it in its own process, like ours, so start-up counts).

    python benchmarks/trl_grpo_run.py --spec spec.json --out result.json

Writes {"startup_s": process start -> first optimizer step begins, "startup_cpu_s": this process's CPU seconds
until then, "step_s": [seconds per generation round (our step)], "step_cpu_s": [its CPU seconds]}.
One of our training steps (``prompts`` x n responses, 2 optimizer steps) is one TRL generation round:
``steps_per_generation`` = 2 optimizer steps of ``prompts / 2`` x n completions each.
"""

from __future__ import annotations

import argparse
import json
import time

START = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = json.loads(open(args.spec).read())

    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rl.reward.scorers.digits import compute_score

    torch.set_num_threads(spec["threads"])
    rows = pq.read_table(spec["train"]).to_pylist()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                 for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)

    def digits_reward(completions, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_score("synthetic/copy", text, truth)["score"] for text, truth in zip(texts, ground_truth)]

    n, prompts = spec["n"], spec["prompts"]
    config = GRPOConfig(
        output_dir=spec["workdir"], use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        max_steps=2 * spec["steps"], seed=spec["seed"], data_seed=spec["seed"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, warmup_steps=0,
        per_device_train_batch_size=prompts // 2 * n, gradient_accumulation_steps=1, steps_per_generation=2,
        num_generations=n, max_completion_length=spec["response_length"], temperature=1.0, top_p=1.0,
        beta=0.0, epsilon=0.2, num_iterations=1, disable_dropout=True, dataloader_num_workers=0,
        gradient_checkpointing=False,  # TRL's default recomputes activations: slower for models this small
        bf16=False,  # TRL defaults to bf16 autocast, which is slow on CPU; ours trains in fp32 here too
    )
    marks: list[float] = []
    cpu_marks: list[float] = []  # this process's CPU seconds: what the work costs whatever else loads the machine

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())

    trainer = GRPOTrainer(model=model, reward_funcs=digits_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    marks.append(time.perf_counter())
    cpu_marks.append(time.process_time())
    # a generation round (our step) = two optimizer steps; the round starts at the first of them
    rounds = [marks[i + 2] - marks[i] for i in range(0, len(marks) - 2, 2)]
    cpu_rounds = [cpu_marks[i + 2] - cpu_marks[i] for i in range(0, len(cpu_marks) - 2, 2)]
    with open(args.out, "w") as out:
        json.dump({"startup_s": marks[0] - START, "startup_cpu_s": cpu_marks[0], "step_s": rounds,
                   "step_cpu_s": cpu_rounds}, out)


if __name__ == "__main__":
    main()
