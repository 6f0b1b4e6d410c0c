"""The run and its pipeline: admission, the rollout worker pool, the training loop, evaluation and logs."""
