"""The training loops (docs/trainer.md): synchronous, one step off policy and fully async, each a short driver
over the shared steps; the run's assembly (workers, rollout, reward), checkpoints and tracking."""
