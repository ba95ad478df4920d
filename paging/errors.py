"""The exceptions of kvserve.paging. Each message says what went wrong and what to do about it."""

from __future__ import annotations


class PagingError(Exception):
    """Base class: every error raised by kvserve.paging."""


class NoFreeBlocksError(PagingError):
    """Every KV block is in use (none free, none cached and evictable)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(
            f"all {num_blocks} KV cache blocks are in use; free a request (or preempt one) before "
            "allocating, or start the server with more KV memory (--num-kv-blocks / --kv-cache-memory)"
        )
        self.num_blocks = num_blocks


class BlockAllocatorError(PagingError):
    """A block id was released twice, or was never handed out: a bug in the caller that would
    otherwise corrupt the cache silently (two requests writing into one block)."""


class UnknownRequestError(PagingError, KeyError):
    """A request id that holds no blocks was asked for its blocks or forked from."""

    def __init__(self, request_id: str, action: str) -> None:
        super().__init__(f"cannot {action}: request {request_id!r} holds no KV blocks (never allocated, or already freed)")
        self.request_id = request_id

    def __str__(self) -> str:  # KeyError would otherwise print the message with quotes around it
        return str(self.args[0])


class KVCacheTooSmallError(PagingError):
    """The KV cache cannot hold even one request of max_model_len tokens."""

    def __init__(self, max_model_len: int, largest_fitting: int, num_blocks: int, block_size: int) -> None:
        super().__init__(
            f"the KV cache has {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens), "
            f"too few for one request of max_model_len={max_model_len}. The largest max_model_len that fits "
            f"is {largest_fitting}: pass --max-model-len {largest_fitting} (or less), or give the KV cache more "
            "memory with --kv-cache-memory / --num-kv-blocks"
        )
        self.max_model_len = max_model_len
        self.largest_fitting = largest_fitting
