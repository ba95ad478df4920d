"""How the engine drives its ranks: one Executor, whatever the rank count."""

from kvserve.engine.executor.executor import Executor, executor_for
from kvserve.engine.executor.multiproc_executor import MultiprocExecutor
from kvserve.engine.executor.uniproc_executor import UniprocExecutor

__all__ = ["Executor", "MultiprocExecutor", "UniprocExecutor", "executor_for"]
