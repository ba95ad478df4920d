"""The iteration-level scheduler (Orca-style continuous batching with chunked prefill).

    scheduler_output = scheduler.schedule()
    runner_output    = model_runner.execute(scheduler_output)
    updates          = scheduler.update_from_output(scheduler_output, runner_output)

There is no prefill phase and no decode phase. Every request has `num_tokens` tokens and
`num_computed_tokens` of them have KV in the cache; a step gives each request part of the
difference, within one token budget. Running requests go first (most want a single decode
token), then waiting prompts in policy order, chunked to fit what is left. Requests join and
leave between any two steps.

When a running request cannot get a block, the newest running request is preempted: its blocks
are freed and it goes back to the front of the waiting queue with num_computed_tokens = 0. It
keeps its output tokens and recomputes prompt + output (the prefix cache makes that cheap), so
its eventual output is the same as if it had never been preempted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, NamedTuple

from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.output import (
    ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput, TokenLogprobs,
)
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.request_queue import OrderKey, RequestQueue, order_key
from kvserve.scheduler.sibling_groups import SiblingGroups
from kvserve.scheduler.stop_checker import check_stop

if TYPE_CHECKING:
    from kvserve.paging import KVCacheManager


class RequestUpdate(NamedTuple):
    """What one step did to one scheduled request: the tokens it gained (none for a prompt chunk
    that stopped short of the prompt's end) and whether it is now finished. (A NamedTuple, like
    ScheduledRequest: one is built per running request per step.)"""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finished: bool


@dataclass
class _StepPlan:
    """What schedule() is building for one step."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        # One request of max_model_len tokens must fit alone: then the oldest running request
        # can always get its blocks by preempting the others, and the scheduler never stalls.
        # (A window group holds a window plus one step's tokens: steps are at most the budget.)
        kv_cache_manager.check_max_model_len_fits(config.max_model_len, config.max_num_batched_tokens)
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.num_preemptions_total = 0
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._order_keys: dict[str, OrderKey] = {}
        self._sequence = itertools.count()
        self._waiting = RequestQueue()
        self._running = RequestQueue()
        self._siblings = SiblingGroups()
        # Requests the runner holds state for that ended since the last step (SchedulerOutput.finished_req_ids).
        self._finished_req_ids: list[str] = []

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled; request ids must be unique")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(f"request {request.request_id!r} must be new (WAITING, nothing computed) to be added")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt; at least one token is needed")
        # The engine's admission check refuses these with a proper error; here they would never fit.
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} prompt tokens but max_model_len is "
                f"{self.config.max_model_len}; shorten the prompt or raise max_model_len"
            )
        held = self._siblings.hold(request)  # raises before changing anything
        self._requests[request.request_id] = request
        self._order_keys[request.request_id] = order_key(self.config.policy, request, next(self._sequence))
        if not held:
            self._push_waiting(request)

    def finish_requests(
        self, request_ids: Iterable[str], reason: FinishReason, stop_reason: int | str | None = None
    ) -> list[Request]:
        """Ends requests wherever they are (aborts, stop strings found by the engine) and frees
        everything they hold. Unknown or already finished ids are ignored. Safe between
        schedule() and update_from_output(): the update skips requests finished meanwhile."""
        finished = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self._running.remove(request, self._order_keys[request_id])
            elif self._siblings.is_held(request):
                pass  # held siblings sit in no queue; _retire drops them from their group
            else:
                self._waiting.remove(request, self._order_keys[request_id])
            request.finish_reason = reason
            request.stop_reason = stop_reason
            self._retire(request)
            finished.append(request)
        return finished

    def append_forced_tokens(self, request_id: str, token_ids: list[int]) -> RequestUpdate:
        """Appends tokens the engine chose without sampling (text a grammar forces: jump-forward
        decoding) to a running request, up to the first that ends it. They are computed with
        the request's next step, which then takes 1 + len(token_ids) tokens (or chunks of them)."""
        request = self._requests[request_id]
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request_id!r} is not running: tokens can only follow a running request's")
        new_token_ids, finished = self._append_tokens(request, token_ids, self.config.max_model_len)
        if finished:
            self._running.remove(request, self._order_keys[request_id])
            self._retire(request)
        return RequestUpdate(request, new_token_ids, [None] * len(new_token_ids), finished)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (None once it has finished)."""
        return self._requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, preempted, or n > 1 siblings waiting to share a prompt."""
        return len(self._requests) - len(self._running)

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        # After a preemption the cache is full: admitting new prompts would only evict the
        # requests that were just preempted, or be preempted in turn next step.
        if not plan.preempted:
            self._schedule_waiting(plan)
        blocks_to_copy = self.kv_cache_manager.take_blocks_to_copy()
        if blocks_to_copy:
            self._send_rewritten_tables(plan, self.kv_cache_manager.take_rewritten_request_ids())
        finished, self._finished_req_ids = self._finished_req_ids, []
        return SchedulerOutput(
            scheduled=plan.scheduled,
            new_requests=plan.new_requests,
            finished_req_ids=finished,
            blocks_to_copy=blocks_to_copy,
            preempted_request_ids=plan.preempted,
        )

    def _send_rewritten_tables(self, plan: _StepPlan, rewritten: set[str]) -> None:
        """Copy-on-write replaced blocks inside these requests' tables: send them whole."""
        for index, scheduled in enumerate(plan.scheduled):
            if scheduled.request_id in rewritten:
                plan.scheduled[index] = scheduled._replace(
                    new_block_ids=self.kv_cache_manager.block_tables(scheduled.request_id), tables_replaced=True)

    def _schedule_running(self, plan: _StepPlan) -> None:
        # Oldest first. Victims come from the back, so a victim is never a request already
        # scheduled in this step, unless the request being served is itself the newest.
        # This loop runs for every running request every step: _chunk_size and _add_to_plan are
        # inlined and the budget kept in a local (a method call per request is measurable).
        running, allocate_slots = self._running, self.kv_cache_manager.allocate_slots
        threshold = self.config.long_prefill_token_threshold
        scheduled = plan.scheduled
        num_running = len(running)  # shrinks as victims leave from the back
        for index, request in enumerate(list(running)):
            if index >= num_running or plan.budget <= 0:
                return
            all_token_ids = request.all_token_ids
            start = request.num_computed_tokens
            num_new = len(all_token_ids) - start
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > plan.budget:
                num_new = plan.budget
            spec: list[int] | tuple[()] = ()
            if request.spec_token_ids and num_new == 1 and request.runner_has_tables:  # drafts to verify
                spec = request.spec_token_ids[:self._num_drafts_that_fit(request, len(request.spec_token_ids),
                                                                        plan.budget)]
                num_new += len(spec)
            while (new_block_ids := allocate_slots(request.request_id, all_token_ids, start, num_new,
                                                   (), request.cache_salt)) is None:
                if spec:  # drafts never cost anyone a preemption: without them first
                    spec, num_new = (), num_new - len(spec)
                    continue
                victim = running.pop_back()
                num_running -= 1
                self._preempt(victim, plan)
                if victim is request:
                    return
            # Positional: field order as declared. The runner holds this request's tables
            # (running requests had theirs sent when admitted or forked), so only what is new.
            num_sent = request.num_sent_tokens
            request.num_sent_tokens = len(all_token_ids)
            if request.runner_has_tables:
                scheduled.append(ScheduledRequest(
                    request.request_id, start, num_new, start + num_new >= len(all_token_ids),
                    all_token_ids[num_sent:], new_block_ids, False, spec,
                ))
            else:
                self._add_to_plan(plan, request, num_new, num_sent)
                continue
            plan.budget -= num_new

    def _num_drafts_that_fit(self, request: Request, num_drafts: int, budget: int) -> int:
        """Drafts beyond the token budget, the context or max_tokens could never be kept: a step
        appends at most drafts + 1 tokens to the request."""
        room = min(num_drafts, budget - 1, self.config.max_model_len - len(request.all_token_ids) - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(0, room)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        kv = self.kv_cache_manager
        while self._waiting and plan.budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting.front()
            # Full blocks already in the cache (from other requests, or its own before a
            # preemption) are reused; at least the last token is always computed, to sample.
            if request.sampling_params.prompt_logprobs is None:
                cached_blocks, num_cached = kv.get_computed_blocks(request.all_token_ids, request.cache_salt)
            else:  # every prompt position must pass through the model to be scored: no cache hits
                cached_blocks, num_cached = [], 0
            num_new = self._chunk_size(request, num_cached, plan.budget)
            if kv.allocate_slots(request.request_id, request.all_token_ids, num_cached, num_new, cached_blocks,
                                 request.cache_salt) is None:
                break  # FCFS: no overtaking the head, so it cannot starve
            self._waiting.pop_front()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:  # counted at the first admission only
                request.num_cached_tokens = num_cached
            self._start_running(request)
            num_sent = request.num_sent_tokens
            request.num_sent_tokens = len(request.all_token_ids)
            self._add_to_plan(plan, request, num_new, num_sent)

    def _chunk_size(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = len(request.all_token_ids) - num_computed
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        return num_new if num_new < budget else budget

    def _add_to_plan(self, plan: _StepPlan, request: Request, num_new: int, num_sent: int) -> None:
        """A request whose tables the runner does not hold: admitted (for the first time, or
        again after a preemption) or forked. The runner gets its tables whole, and, the first
        time, what it keeps of the request; `num_sent` of its tokens it has already."""
        if num_sent == 0:
            plan.new_requests.append(NewRequestData(
                request.request_id, request.num_prompt_tokens, request.sampling_params, request.seed))
        start = request.num_computed_tokens
        all_token_ids = request.all_token_ids
        plan.scheduled.append(ScheduledRequest(
            request.request_id, start, num_new, start + num_new == len(all_token_ids), all_token_ids[num_sent:],
            self.kv_cache_manager.block_tables(request.request_id), True,
        ))
        request.runner_has_tables = True
        plan.budget -= num_new

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """The caller has already taken `request` out of the running set."""
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.runner_has_tables = False
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        plan.preempted.append(request.request_id)
        self._push_waiting(request)
        # Its held siblings cannot fork from blocks it no longer has.
        for sibling in self._siblings.discard(request):
            self._push_waiting(sibling)

    # ------------------------------------------------------------------ after the model ran

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        sampled = dict(zip(runner_output.request_ids, zip(runner_output.sampled_token_ids, runner_output.logprobs)))
        requests, running_status, max_model_len = self._requests, RequestStatus.RUNNING, self.config.max_model_len
        updates = []
        for scheduled in output.scheduled:
            request = requests.get(scheduled.request_id)
            if request is None or request.status is not running_status:
                continue  # finished (e.g. aborted) between schedule() and now
            request.num_computed_tokens += scheduled.num_new_tokens
            finished = False
            if scheduled.samples:
                entry = sampled.get(scheduled.request_id)
                if entry is None or not entry[0] or len(entry[0]) > len(scheduled.spec_token_ids) + 1:
                    raise ValueError(
                        f"the model runner returned {0 if entry is None else len(entry[0])} tokens for "
                        f"{scheduled.request_id!r}, which was scheduled to sample with {len(scheduled.spec_token_ids)} "
                        "drafts; ModelRunnerOutput must hold 1 to drafts + 1 tokens per scheduled request with samples=True"
                    )
                token_ids, token_logprobs = entry
                if scheduled.spec_token_ids:
                    # The tokens kept: the accepted drafts and one more. The KV of the rejected
                    # drafts is dead: those positions are computed again, with the right tokens.
                    request.num_computed_tokens -= len(scheduled.spec_token_ids) + 1 - len(token_ids)
                new_token_ids, finished = self._append_tokens(request, token_ids, max_model_len)
                if token_logprobs is None:
                    logprobs: list[TokenLogprobs | None] = [None] * len(new_token_ids)
                else:
                    logprobs = list(token_logprobs[:len(new_token_ids)])
            else:
                new_token_ids, logprobs = [], []
            # Before the leader can be freed: its siblings fork the prompt's blocks now.
            if (
                request.parent_id is not None
                and request.num_computed_tokens >= len(request.prompt_token_ids)
                and self._siblings.has_held(request)
            ):
                self._fork_siblings(request)
            if finished:
                self._running.remove(request, self._order_keys[request.request_id])
                self._retire(request)
            updates.append(RequestUpdate(request, new_token_ids, logprobs, finished))
        return updates

    @staticmethod
    def _append_tokens(request: Request, token_ids: list[int], max_model_len: int) -> tuple[list[int], bool]:
        """Appends the step's tokens up to the first that ends the request; returns those
        appended and whether it ended. (One token per step without speculative decoding.)"""
        if len(token_ids) == 1:
            request.append_output_token(token_ids[0])
            return token_ids, check_stop(request, max_model_len)
        for count, token_id in enumerate(token_ids, start=1):
            request.append_output_token(token_id)
            if check_stop(request, max_model_len):
                return token_ids[:count], True
        return token_ids, False

    def _fork_siblings(self, leader: Request) -> None:
        """Siblings share the blocks of the leader's first P - 1 positions (P = prompt length)
        and compute the last prompt token themselves, so their first step samples their own
        first token with their own seed:

            position   0 .. P-2        P-1                         P ..
            leader     computed        computed, samples output 0  its outputs
            sibling    shared (fork)   recomputed, samples its 0   its own outputs

        Whoever first writes into a still-shared partial block gets a copy (allocate_slots
        queues the copy-on-write pair; it reaches the runner as blocks_to_copy)."""
        num_shared = leader.num_prompt_tokens - 1
        for sibling in self._siblings.take_held(leader):
            if num_shared == 0 or len(self._running) >= self.config.max_num_seqs:
                self._push_waiting(sibling)
                continue
            self.kv_cache_manager.fork(leader.request_id, sibling.request_id, num_shared)
            sibling.num_computed_tokens = num_shared
            sibling.num_cached_tokens = leader.num_cached_tokens
            self._start_running(sibling)

    # ------------------------------------------------------------------ helpers

    def _push_waiting(self, request: Request) -> None:
        self._waiting.push(request, self._order_keys[request.request_id])

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self._running.push(request, self._order_keys[request.request_id])

    def _retire(self, request: Request) -> None:
        """The caller has taken `request` out of its queue and set its finish reason."""
        if request.status is RequestStatus.RUNNING:
            self.kv_cache_manager.free(request.request_id)
        if request.num_sent_tokens:
            self._finished_req_ids.append(request.request_id)
        request.status = RequestStatus.FINISHED
        del self._requests[request.request_id]
        del self._order_keys[request.request_id]
        for sibling in self._siblings.discard(request):
            self._push_waiting(sibling)
