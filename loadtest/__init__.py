"""kvserve.loadtest: a load generator for any OpenAI-compatible server (CLI: `kvserve-bench`).

It imports nothing else of kvserve, so it measures kvserve and its peers the same way.
"""

from .arrivals import ArrivalProcess
from .client import Endpoint, EndpointError, send_request
from .datasets import BenchRequest, DatasetError, PrefixDataset, RandomDataset, SyntheticChatDataset
from .goodput import GoodputError, GoodputSLO
from .jsonl_dataset import JsonlDataset
from .metrics import BenchmarkMetrics, LatencyStats, compute_metrics
from .records import ErrorKind, RequestRecord, RunResult
from .report import format_table, save_result
from .runner import BenchmarkError, LoadConfig, run_load
from .sweep import SweepPoint, parse_rates, run_sweep

__all__ = [
    "ArrivalProcess",
    "BenchRequest",
    "BenchmarkError",
    "BenchmarkMetrics",
    "DatasetError",
    "Endpoint",
    "EndpointError",
    "ErrorKind",
    "GoodputError",
    "GoodputSLO",
    "JsonlDataset",
    "LatencyStats",
    "LoadConfig",
    "PrefixDataset",
    "RandomDataset",
    "RequestRecord",
    "RunResult",
    "SweepPoint",
    "SyntheticChatDataset",
    "compute_metrics",
    "format_table",
    "parse_rates",
    "run_load",
    "run_sweep",
    "save_result",
    "send_request",
]
