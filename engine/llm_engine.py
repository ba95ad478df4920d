"""LLMEngine: the synchronous step loop.

    scheduler_output = scheduler.schedule()
    runner_output    = executor.execute(scheduler_output)       # every rank's model runner
    updates          = scheduler.update_from_output(scheduler_output, runner_output)
    outputs          = output_processor.process(updates)          # what the user sees

OutputProcessor (output_processor.py) turns the updates into detokenized, stop-string-checked
RequestOutput deltas, advancing grammar matchers; this loop finishes what a stop string ended and
emits the stats records.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Sequence

from kvserve.engine.admission import AdmissionCheck
from kvserve.engine.config import EngineConfig
from kvserve.engine.model.model_config import ModelConfig, end_of_generation_ids
from kvserve.engine.executor import Executor
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.output_tracker import OutputTracker, child_request_id
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.structured_output import GrammarCompiler, StructuredOutputManager, XGrammarCompile
from kvserve.engine.spec_decode import NgramDrafter
from kvserve.engine.stats import EngineLoad, StatsListener, StepStats
from kvserve.engine.text.tokenizer import Tokenizer
from kvserve.scheduler import RequestUpdate, Scheduler
from kvserve.scheduler.output import SchedulerOutput
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        executor: Executor,
        stats_listeners: Sequence[StatsListener] = (),
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = end_of_generation_ids(model_config, tokenizer.eos_token_id)
        self.scheduler = scheduler
        self.executor = executor
        self.admission = AdmissionCheck(scheduler.config, model_config.vocab_size)
        self.stats_listeners = list(stats_listeners)
        self.tracker = OutputTracker(tokenizer)
        self.grammar_compiler = GrammarCompiler(XGrammarCompile(tokenizer, model_config.vocab_size, self.eos_token_ids))
        self.structured_output = StructuredOutputManager(model_config.vocab_size)
        self.output_processor = OutputProcessor(self.tracker, self.structured_output)
        self._seed_rng = random.Random(config.seed)
        self._last_prefix_stats = (0, 0)
        spec = config.speculative_config
        self.drafter = NgramDrafter(spec) if spec is not None else None

    @classmethod
    def from_config(cls, config: EngineConfig, stats_listeners: Sequence[StatsListener] = ()) -> "LLMEngine":
        from kvserve.engine.engine_builder import build_engine_parts

        parts = build_engine_parts(config)
        return cls(parts.config, parts.model_config, parts.tokenizer, parts.scheduler, parts.executor, stats_listeners)

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens of one request at most: the scheduler's setting, resolved from
        --max-model-len (or the model's context length) when the engine was built."""
        return self.scheduler.config.max_model_len

    # ------------------------------------------------------------------ requests in

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, priority: int = 0,
                      cache_salt: str | None = None) -> None:
        """Raises AdmissionError (naming the parameter) for a request the engine would not take;
        add_request runs it for every request, and callers may run it earlier. A constraint is
        compiled here, on the caller's thread (AsyncEngine compiles on its own threads instead)."""
        self.admission.check(prompt_token_ids, params, priority=priority, cache_salt=cache_salt)
        if params.structured_output is not None:
            self.grammar_compiler.compile(params.structured_output)  # StructuredOutputError names the field

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        grammar: Any = None,
    ) -> None:
        """`prompt` is text or token ids; a caller that already tokenized the text passes the ids
        too, so the text is kept for the output without being encoded twice. `priority` orders the
        request under priority scheduling (lower runs first); `cache_salt` keeps its prefix-cache
        entries apart from requests with another salt (or none). `grammar`: params.structured_output
        compiled already (GrammarCompiler), so this thread does not compile it."""
        if request_id in self.tracker.groups:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is not None:
            token_ids = [int(t) for t in prompt_token_ids]
        elif isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        self.admission.check(token_ids, params, priority=priority, cache_salt=cache_salt)
        if params.structured_output is not None and grammar is None:
            grammar = self.grammar_compiler.compile(params.structured_output)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        requests = [
            Request(
                request_id=child_request_id(request_id, index),
                prompt_token_ids=token_ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                priority=priority,
                cache_salt=cache_salt,
                parent_id=request_id,
                index=index,
                seed=self._seed_for(params, index),
            )
            for index in range(params.n)
        ]
        self.tracker.add(request_id, text, requests)
        for request in requests:
            if grammar is not None:
                self.structured_output.add(request.request_id, grammar)
            self.scheduler.add_request(request)

    def _seed_for(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return self._seed_rng.getrandbits(63)
        # Completion 0 uses the user's seed as given; siblings derive theirs from it.
        return params.seed & _SEED_MASK if index == 0 else hash((params.seed, index)) & _SEED_MASK

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Aborts requests (unknown or finished ids are ignored) and returns their last deltas."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        now = time.monotonic()
        outputs = []
        for request_id in ids:
            group = self.tracker.groups.get(request_id)
            if group is None:
                continue
            children = self.tracker.child_ids(request_id)
            self.scheduler.finish_requests(children, FinishReason.ABORT)
            for child in children:
                self._emit_finished(self.tracker.on_finished(child, FinishReason.ABORT, None, now))
                self.structured_output.remove(child)
            if self.drafter is not None:
                self.drafter.forget(children)
            output = group.take_output()
            if output is not None:
                outputs.append(output)
            self.tracker.pop_if_finished(group)
        return outputs

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (daemon processes: they would also end with
        this process) and the grammar compile threads. The engine cannot step afterwards."""
        self.grammar_compiler.close()
        self.executor.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.tracker.groups)

    def load(self) -> EngineLoad:
        """A snapshot of requests and KV blocks; call it on the thread that steps the engine."""
        kv = self.scheduler.kv_cache_manager.stats()
        return EngineLoad(self.scheduler.num_running, self.scheduler.num_waiting, kv.blocks_total,
                          kv.blocks_used, kv.blocks_cached, kv.blocks_free)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Runs one model step; returns a delta for each request that gained text or finished."""
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            if not scheduler_output.is_empty:  # only ended requests to report: the runner drops them
                self.executor.execute(scheduler_output)
            return []
        for new in scheduler_output.new_requests:  # scheduled for the first time
            self.tracker.mark_scheduled(new.request_id, start)
        prompt_tokens = self._prompt_tokens(scheduler_output) if self.stats_listeners else 0
        token_mask = self.structured_output.token_mask(scheduler_output)
        # Unconstrained steps (nearly all) call the executor exactly as before.
        runner_output = (self.executor.execute(scheduler_output) if token_mask is None
                         else self.executor.execute(scheduler_output, token_mask))
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        jump_forward = self._jump_forward if token_mask is not None and self.config.jump_forward else None
        processed = self.output_processor.process(updates, runner_output.prompt_logprobs, time.monotonic(),
                                                  constrained=token_mask is not None, jump_forward=jump_forward)
        updates = [*updates, *processed.forced]
        for child_id, stop_string in processed.stopped:  # ended by a stop string: still running here
            self.scheduler.finish_requests([child_id], FinishReason.STOP, stop_string)
        for stats in processed.finished:
            self._emit_finished(stats)
        if self.drafter is not None:
            self._propose_drafts(scheduler_output, updates)
        self._emit_step(scheduler_output, updates, prompt_tokens, start, time.monotonic())
        return processed.outputs

    def _jump_forward(self, updates: Sequence[RequestUpdate]) -> list[RequestUpdate]:
        """Jump-forward decoding: a constrained request whose grammar now admits one continuation
        text gets that text's tokens appended at once (computed with its next step), instead of
        one forward per token. Not for requests that asked for logprobs (forced tokens have no
        distribution to report)."""
        encode = self._encode_forced_text
        forced = []
        for update in updates:
            request = update.request
            if (not update.new_token_ids or request.status is not RequestStatus.RUNNING
                    or request.sampling_params.logprobs is not None or request.request_id not in self.structured_output):
                continue
            token_ids = self.structured_output.forced_tokens(request.request_id, encode, self.tokenizer.token_to_bytes)
            if token_ids:
                forced.append(self.scheduler.append_forced_tokens(request.request_id, token_ids))
        return forced

    def _encode_forced_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _propose_drafts(self, output: SchedulerOutput, updates: list[RequestUpdate]) -> None:
        """Drafts for the requests whose next step is a decode (they gained tokens and run on)."""
        assert self.drafter is not None
        self.drafter.forget(u.request.request_id for u in updates if u.request.status is RequestStatus.FINISHED)
        running = [u.request for u in updates if u.new_token_ids and u.request.status is RequestStatus.RUNNING]
        validate = self.structured_output.valid_drafts if len(self.structured_output) else None
        self.drafter.propose(running, self.scheduler.num_running, validate)

    # ------------------------------------------------------------------ stats out

    def _emit_finished(self, stats) -> None:
        for listener in self.stats_listeners:
            listener.on_request_finished(stats)

    def _prompt_tokens(self, output: SchedulerOutput) -> int:
        """Prompt tokens this step computes (before it runs: the requests still know their share)."""
        total = 0
        for scheduled in output.scheduled:
            request = self.scheduler.get_request(scheduled.request_id)
            if request is not None:
                total += max(0, min(scheduled.seq_len, request.num_prompt_tokens) - scheduled.num_computed_tokens)
        return total

    def _emit_step(self, output: SchedulerOutput, updates: list[RequestUpdate], prompt_tokens: int, start: float,
                   end: float) -> None:
        if not self.stats_listeners:
            return
        num_drafts = num_draft_tokens = num_accepted = 0
        accepted_per_position: list[int] = []
        if self.drafter is not None:
            kept = {u.request.request_id: len(u.new_token_ids) for u in updates}
            for scheduled in output.scheduled:
                if scheduled.spec_token_ids and scheduled.request_id in kept:
                    num_drafts += 1
                    num_draft_tokens += len(scheduled.spec_token_ids)
                    accepted = max(0, kept[scheduled.request_id] - 1)
                    num_accepted += accepted
                    accepted_per_position += [0] * (len(scheduled.spec_token_ids) - len(accepted_per_position))
                    for position in range(accepted):
                        accepted_per_position[position] += 1
        kv = self.scheduler.kv_cache_manager.stats()
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        last_queries, last_hits = self._last_prefix_stats
        self._last_prefix_stats = (queries, hits)
        stats = StepStats(
            timestamp=end,
            duration_s=end - start,
            num_scheduled_tokens=output.num_scheduled_tokens,
            num_prompt_tokens=prompt_tokens,
            num_generation_tokens=sum(len(u.new_token_ids) for u in updates),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preempted=len(output.preempted_request_ids),
            kv_blocks_total=kv.blocks_total,
            kv_blocks_used=kv.blocks_used,
            kv_blocks_cached=kv.blocks_cached,
            kv_blocks_free=kv.blocks_free,
            prefix_cache_queries=queries - last_queries,
            prefix_cache_hits=hits - last_hits,
            spec_num_drafts=num_drafts,
            spec_num_draft_tokens=num_draft_tokens,
            spec_num_accepted_tokens=num_accepted,
            spec_accepted_per_position=tuple(accepted_per_position),
        )
        for listener in self.stats_listeners:
            listener.on_step(stats)
