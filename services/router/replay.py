"""What a choice has sent so far, so a deterministic request can be replayed elsewhere.

When a decoder dies mid-stream, a deterministic request is sent again (to any replica with
the same determinism profile) and its output, bit-exact by construction, is checked
against what the client already has: the overlap is dropped, a difference fails the
request instead of sending inconsistent text.
"""

from __future__ import annotations

from dataclasses import replace

from services.decoder.messages import DecodeChunk


class ReplayDiverged(Exception):
    pass


class SentState:
    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self._pos_tokens = 0   # position of the current attempt's stream
        self._pos_chars = 0

    def restart(self) -> None:
        """A new attempt starts from the beginning of the output."""
        self._pos_tokens = 0
        self._pos_chars = 0

    def new_part(self, chunk: DecodeChunk) -> DecodeChunk:
        """``chunk`` minus what was already sent (raises ReplayDiverged on a mismatch)."""
        ids = list(chunk.token_ids)
        skip = min(len(ids), max(0, len(self.token_ids) - self._pos_tokens))
        if ids[:skip] != self.token_ids[self._pos_tokens:self._pos_tokens + skip]:
            raise ReplayDiverged(f"replayed tokens differ at position {self._pos_tokens}")
        self._pos_tokens += len(ids)
        text = chunk.text
        skip_chars = min(len(text), max(0, len(self.text) - self._pos_chars))
        if text[:skip_chars] != self.text[self._pos_chars:self._pos_chars + skip_chars]:
            raise ReplayDiverged(f"replayed text differs at offset {self._pos_chars}")
        self._pos_chars += len(text)
        new = chunk
        if skip or skip_chars:
            lps = None if chunk.logprobs is None else chunk.logprobs[skip:]
            new = replace(chunk, text=text[skip_chars:], token_ids=tuple(ids[skip:]),
                          logprobs=lps)
        self.token_ids.extend(new.token_ids)
        self.text += new.text
        return new
