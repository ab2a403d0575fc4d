"""What a choice has sent so far, so a deterministic request can be replayed elsewhere.

When a decoder dies mid-stream, a deterministic request is sent again (to any replica with
the same determinism profile) and its output, bit-exact by construction, is checked
against what the client already has: the overlap is dropped, a difference fails the
request instead of sending inconsistent text. The part past what was sent is released by
the engine's own delta rule (``DeltaCursor``), started where the client's stream stands.
"""

from __future__ import annotations

from dataclasses import replace

from detserve.output_processor import DeltaCursor
from detserve.outputs import TokenLogprob
from services.decoder.messages import DecodeChunk


class ReplayDiverged(Exception):
    pass


class SentState:
    def __init__(self) -> None:
        self.token_ids: list[int] = []   # what the client has
        self.text = ""
        self.restart()

    def restart(self) -> None:
        """A new attempt starts from the beginning of the output."""
        self._ids: list[int] = []        # the current attempt's output so far
        self._text = ""
        self._logprobs: list[TokenLogprob] | None = None
        self._cursor = DeltaCursor(chars=len(self.text), tokens=len(self.token_ids))

    def new_part(self, chunk: DecodeChunk) -> DecodeChunk:
        """``chunk`` minus what was already sent (raises ReplayDiverged on a mismatch)."""
        at_tokens, at_chars = len(self._ids), len(self._text)
        self._ids.extend(chunk.token_ids)
        self._text += chunk.text
        if chunk.logprobs is not None:
            self._logprobs = [*(self._logprobs or ()), *chunk.logprobs]
        overlap = min(len(self._ids), len(self.token_ids))
        if self._ids[at_tokens:overlap] != self.token_ids[at_tokens:overlap]:
            raise ReplayDiverged(f"replayed tokens differ at position {at_tokens}")
        overlap = min(len(self._text), len(self.text))
        if self._text[at_chars:overlap] != self.text[at_chars:overlap]:
            raise ReplayDiverged(f"replayed text differs at offset {at_chars}")
        skipped = (self._cursor.tokens > at_tokens, self._cursor.chars > at_chars)
        delta = self._cursor.advance(self._text, self._ids,
                                     None if chunk.logprobs is None else self._logprobs,
                                     finished=True)  # (the decoder held back what may change)
        new = chunk
        if any(skipped):
            new = replace(chunk, text=delta.text, token_ids=delta.token_ids,
                          logprobs=delta.logprobs)
        self.token_ids.extend(new.token_ids)
        self.text += new.text
        return new
