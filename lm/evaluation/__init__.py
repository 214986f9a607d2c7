"""Judging a run by standard benchmarks: EleutherAI's lm-eval on a meshlm model (`harness`)."""
