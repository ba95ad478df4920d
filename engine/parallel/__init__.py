"""Tensor parallelism's processes and collectives: the process group of one machine's ranks
(process_group.py) and ranks 1..N-1 as worker processes (worker_processes.py). The model side
(local sizes, sharded layers and loading) is engine/model's; the executor that drives the ranks
is engine/executor/multiproc_executor.py."""

from kvserve.engine.model.tensor_parallel import check_tensor_parallel
from kvserve.engine.parallel.worker_processes import WorkerDiedError

__all__ = ["WorkerDiedError", "check_tensor_parallel"]
