"""GET /tokenizer_info, as vLLM serves it: what a client needs to tokenize and template like the
server (lm-eval's remote tokenizer reads eos/bos/pad tokens and the chat template from it, then
calls /tokenize and /detokenize)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kvserve.server.serving_state import ServingState


def tokenizer_info_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        engine = state.ready_engine()
        tokenizer = engine.tokenizer

        def token(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)

        return {
            "tokenizer_class": "kvserve",
            "eos_token": token(tokenizer.eos_token_id),
            "bos_token": token(tokenizer.bos_token_id),
            "pad_token": None,
            "chat_template": tokenizer.chat_template,
            "model_max_length": engine.max_model_len,
            "vocab_size": tokenizer.vocab_size,
        }

    return router
