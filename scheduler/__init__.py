"""kvserve.scheduler: pure-Python continuous batching (no torch)."""

from kvserve.scheduler.config import SchedulerConfig, SchedulerConfigError, SchedulingPolicy
from kvserve.scheduler.output import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput, TokenLogprobs
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.sampling_params import SamplingParams, SamplingParamsError
from kvserve.scheduler.scheduler import RequestUpdate, Scheduler

__all__ = [
    "FinishReason",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "SamplingParams",
    "SamplingParamsError",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerOutput",
    "SchedulingPolicy",
    "TokenLogprobs",
]
