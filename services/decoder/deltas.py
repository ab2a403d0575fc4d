"""Turn successive ``RequestOutput`` snapshots into stream deltas.

The engine reports the whole committed text each time. A streamed delta may only carry
text that can no longer change, so the concatenation of the deltas equals the final
text: while a request runs, trailing replacement characters (an incomplete UTF-8
sequence) and the last ``len(longest stop string) - 1`` characters (a stop string may be
forming, and the engine cuts the text where it starts) are held back.
"""

from __future__ import annotations

from detserve.outputs import RequestOutput, TokenLogprob

_REPLACEMENT = "\ufffd"


class DeltaTracker:
    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._sent_chars = 0
        self._sent_tokens = 0

    @property
    def sent_tokens(self) -> int:
        return self._sent_tokens

    def update(self, out: RequestOutput
               ) -> tuple[str, tuple[int, ...], tuple[TokenLogprob, ...] | None]:
        """Text, token ids and logprobs that ``out`` adds to what was already sent."""
        text = out.text
        limit = len(text) if out.finished else self._stable_length(text)
        new_text = text[self._sent_chars:limit] if limit > self._sent_chars else ""
        self._sent_chars = max(self._sent_chars, limit)
        new_ids = tuple(out.token_ids[self._sent_tokens:])
        new_lps = None if out.logprobs is None else tuple(out.logprobs[self._sent_tokens:])
        self._sent_tokens = len(out.token_ids)
        return new_text, new_ids, new_lps

    def _stable_length(self, text: str) -> int:
        limit = len(text) - self._hold
        while limit > 0 and text[limit - 1] == _REPLACEMENT:
            limit -= 1
        return max(limit, 0)
