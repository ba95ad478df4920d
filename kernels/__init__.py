"""kvserve.kernels: paged attention and KV-cache writes. Imports nothing else of kvserve."""
