"""LLM: the offline API, named as vLLM users know it.

    llm = LLM(model="SmolLM2-135M-Instruct")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import gc
from typing import Sequence

from tqdm import tqdm

from kvserve.engine.config import DEFAULT_MODEL, EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import OutputAccumulator, RequestOutput
from kvserve.engine.text.tokenizer import Tokenizer
from kvserve.scheduler.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        enforce_eager: bool = False,
        seed: int = 0,
        quantization: str | None = None,
        cpu_threads: int | None = None,
        tensor_parallel_size: int = 1,
        speculative_config: dict | str | None = None,
        jump_forward: bool = True,
    ) -> None:
        config = EngineConfig(
            model=model, dtype=dtype, device=device, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype,
            enforce_eager=enforce_eager, seed=seed, quantization=quantization, cpu_threads=cpu_threads,
            tensor_parallel_size=tensor_parallel_size, speculative_config=speculative_config,
            jump_forward=jump_forward,
        )
        self.engine = LLMEngine.from_config(config)
        self._next_id = 0
        # Loading and compiling leave ~440k objects (the model, compiled graphs, torch's and the
        # compiler's own) that the collector has not yet counted as old: the first generate of a
        # W64-sized workload then paid a full collection over all of them (~180 ms of a 10 s run).
        # Collected here, they are the old generation already, and a later full collection waits
        # until a quarter as many new objects have outlived the younger generations.
        gc.collect()

    def close(self) -> None:
        """Stops tensor-parallel worker processes (`with LLM(...) as llm:` does it on exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt and returns the outputs in prompt order. A single prompt
        may be a string or a token-id list; `sampling_params` is one object or one per prompt."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts; "
                    "give one, or one per prompt"
                )
        ids = []
        for prompt, params in zip(prompt_list, params_list):
            request_id = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(request_id, prompt, params)
            ids.append(request_id)

        running = {request_id: OutputAccumulator() for request_id in ids}
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm or len(ids) < 2) as progress:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    running[delta.request_id].add(delta)
                    if delta.finished:
                        finished[delta.request_id] = running.pop(delta.request_id).result()
                        progress.update(1)
        return [finished[request_id] for request_id in ids]

    def chat(
        self, messages: list[dict], sampling_params: SamplingParams | None = None, *, use_tqdm: bool = False
    ) -> RequestOutput:
        prompt = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([prompt], sampling_params, use_tqdm=use_tqdm)[0]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one token-id prompt
    return prompts
