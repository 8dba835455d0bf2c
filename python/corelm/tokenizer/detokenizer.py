"""Turn a stream of token ids into text without ever emitting half a character.

A token may end in the middle of a UTF-8 character (byte-level BPE tokens, SentencePiece <0xNN>
byte-fallback tokens), and some decoders depend on the neighbouring tokens (SentencePiece strips the
space of the first piece). Decoding token by token therefore gives U+FFFD and lost spaces. As vLLM
and TGI do, we decode a small window instead: the last few tokens of the last emitted chunk (context)
plus the tokens not yet emitted, and emit the part of the window's text beyond the context's text once
it no longer ends in U+FFFD. After each emit the window shrinks back to a few tokens, so the work per
token is constant for ordinary text; only a run of tokens that all end mid-character grows the window.

SentencePiece <0xNN> tokens need one more rule: tokenizers' ByteFallback decodes a run of them as a
whole and turns *every* byte of an invalid run into U+FFFD, so a later stray byte can change text that
already looked complete ("&" then 0xB2 decodes as two U+FFFD). We hold a run of byte tokens until a
normal token (or the end) closes it; then the streamed text always equals `decode(ids)`. In practice
this delays a <0x0A> newline by one token.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from . import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4     # context kept from the last chunk; SentencePiece's leading space needs just one


class IncrementalDetokenizer:
    """`add(id)` returns the text completed by this token (possibly ""); `flush()` returns what is left
    at the end of the stream (an incomplete character there becomes U+FFFD); `text` is all emitted text.
    The concatenation equals `tokenizer.decode(all_ids, skip_special_tokens)`."""

    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window: List[int] = []    # context tokens, then pending tokens
        self._n_context = 0             # how many leading window tokens were already emitted
        self._context_text = ""         # decode(window[:n_context])
        self._chunks: List[str] = []

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:       # join lazily, keep the joined string for the next call
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        # A skipped special token decodes to nothing and does not affect its neighbours (tokenizers
        # drops it before running the decoder), so it never needs to enter the window.
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        self._window.append(token_id)
        if self._tokenizer.is_byte_fallback(token_id):
            return ""                   # the run of byte tokens is not closed yet (see above)
        window_text = self._decode(self._window)
        if window_text.endswith(_REPLACEMENT) or len(window_text) <= len(self._context_text):
            return ""                   # mid-character, or nothing visible yet: wait for more tokens
        new = window_text[len(self._context_text):]
        self._set_context(self._window[self._n_context:])
        return self._emit(new)

    def flush(self) -> str:
        if len(self._window) == self._n_context:
            return ""
        rest = self._decode(self._window)[len(self._context_text):]
        self._window, self._n_context, self._context_text = [], 0, ""
        return self._emit(rest)

    def _set_context(self, emitted: List[int]) -> None:
        """The last few just-emitted tokens become the context of the next window. The context must
        not begin inside a run of byte tokens: that run would decode differently on its own."""
        ids = emitted[-_CONTEXT_TOKENS:]
        while ids and self._tokenizer.is_byte_fallback(ids[0]):
            ids = ids[1:]
        self._window, self._n_context, self._context_text = ids, len(ids), self._decode(ids)

    def _decode(self, ids: List[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _emit(self, s: str) -> str:
        if s:
            self._chunks.append(s)
        return s
