"""Continuous batching: the scheduler (admission, step budget, KV blocks, preemption) and the step loop that runs
many requests in each forward pass."""
