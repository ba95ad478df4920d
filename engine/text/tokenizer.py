"""Text <-> token ids for one model, built on the `tokenizers` library.

Two sources: a GGUF file (vocabulary rebuilt from its metadata, see tokenizer_gguf.py) or a
Hugging Face directory (tokenizer.json + tokenizer_config.json, with chat_template.jinja or a
processor's chat_template.json when present). Whether a BOS token is added is decided by the
model's post-processor, never here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, processors

from kvserve.engine.text.chat_template import ChatTemplate, ChatTemplateError
from kvserve.engine.text.tokenizer_gguf import TokenizerLoadError, bos_eos_post_processor, read_gguf_tokenizer

__all__ = ["Tokenizer", "TokenizerLoadError"]

_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)
        self.chat_template = chat_template
        self._added_token_ids = frozenset(tokenizer.get_added_tokens_decoder())
        # Byte-level BPE spells each byte as one visible character; this maps them back.
        self._byte_of_char = _unicode_to_byte() if isinstance(tokenizer.decoder, decoders.ByteLevel) else None
        # Compiled once: Jinja compilation costs milliseconds, rendering microseconds.
        self._template = None if chat_template is None else ChatTemplate(
            chat_template, bos_token=self._token_or_none(bos_token_id), eos_token=self._token_or_none(eos_token_id))

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: Path) -> "Tokenizer":
        parts = read_gguf_tokenizer(Path(path))
        return cls(parts.tokenizer, bos_token_id=parts.bos_token_id, eos_token_id=parts.eos_token_id,
                   chat_template=parts.chat_template)

    @classmethod
    def from_hf_dir(cls, path: Path) -> "Tokenizer":
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(f"{path} has no tokenizer.json; kvserve needs the fast-tokenizer file "
                                     "(save it with transformers' tokenizer.save_pretrained)")
        try:
            tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise TokenizerLoadError(f"{tokenizer_file} cannot be parsed: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        bos = _special_token_id(tokenizer, config.get("bos_token"))
        eos = _special_token_id(tokenizer, config.get("eos_token"))
        # tokenizer_config's add_bos_token/add_eos_token, when present, override tokenizer.json's
        # post-processor, as transformers does for Llama-style tokenizers.
        if "add_bos_token" in config or "add_eos_token" in config:
            tokens = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.get_vocab_size(with_added_tokens=True))]
            post = bos_eos_post_processor(tokens, bos if config.get("add_bos_token") else None,
                                          eos if config.get("add_eos_token") else None)
            if post is not None:
                tokenizer.post_processor = post
            elif isinstance(tokenizer.post_processor, processors.TemplateProcessing):
                tokenizer.post_processor = None
        return cls(tokenizer, bos_token_id=bos, eos_token_id=eos, chat_template=_hf_chat_template(path, config))

    # --- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text such as "<|im_end|>" becomes its single id (chat
        templates rely on it); BOS/EOS are added only when the model's tokenizer adds them."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`. Bytes that do not form a whole UTF-8 character decode to U+FFFD."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; a byte-level token may be part of a UTF-8 character."""
        self._check_id(token_id)
        token = self._tokenizer.id_to_token(token_id) or ""
        if token_id in self._added_token_ids:  # added tokens are stored as plain text
            return token.encode("utf-8")
        table = self._byte_of_char
        if table is not None and all(ch in table for ch in token):
            return bytes(table[ch] for ch in token)
        match = _BYTE_FALLBACK_TOKEN.fullmatch(token)
        if match:  # sentencepiece byte-fallback token
            return bytes([int(match.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")  # sentencepiece spells a space as U+2581

    def token_to_text(self, token_id: int) -> str:
        """One token as text for logprobs display: bytes that are not whole UTF-8 characters are
        shown as \\xNN escapes instead of U+FFFD, so distinct tokens stay distinguishable."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="backslashreplace")

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template (none in its GGUF metadata or tokenizer_config.json); "
                "use the completions API with a plain prompt instead")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    # --- helpers --------------------------------------------------------------------------------

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tokenizer.id_to_token(token_id)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_id={self.eos_token_id}, chat_template={'yes' if self.chat_template else 'no'})")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object")
    return data


def _special_token_id(tokenizer: HFTokenizer, spec: object) -> int | None:
    """tokenizer_config spells a special token as a string or as {"content": ...}."""
    content = spec.get("content") if isinstance(spec, dict) else spec
    if not isinstance(content, str):
        return None
    return tokenizer.token_to_id(content)


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    # Newer checkpoints ship the template as its own file; older ones inside tokenizer_config.json,
    # either as a string or as a list of named templates.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    # Multimodal checkpoints (Gemma 3 4B/12B/27B) ship their processor's template as chat_template.json.
    processor_file = path / "chat_template.json"
    template = config.get("chat_template")
    if processor_file.is_file():
        try:
            template = json.loads(processor_file.read_text(encoding="utf-8")).get("chat_template", template)
        except (json.JSONDecodeError, AttributeError) as exc:
            raise TokenizerLoadError(f"{processor_file} is not a JSON object with a chat_template ({exc})") from exc
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the
    other 68 bytes are shifted to code points 256 and up so every byte has a visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table
