"""One rank of the engine: its shard of the model, its KV cache and its runner, built the same
way on every rank (Worker.build)."""

from kvserve.engine.worker.worker import Worker, WorkerSpec

__all__ = ["Worker", "WorkerSpec"]
