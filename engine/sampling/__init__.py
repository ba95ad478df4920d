"""Sampling: the batched sampler and the per-request parameters gathered into tensors."""
