"""Committed tokens -> text, stop strings and stream deltas: the one place text is made.

While a request runs its text is decoded incrementally (a few tokens a step, not the whole
output) and a trailing incomplete UTF-8 sequence is held back until its last byte arrives;
once it has finished, its text is one decode of the whole output, cut where the first stop
string starts. Every output carries its ``Delta``: what it adds to the request's previous
output. A delta only releases text that can no longer change (not a trailing replacement
character, not the last ``len(longest stop string) - 1`` characters, where a stop string
may be forming), so a stream's deltas add up to the final text. ``DeltaCursor`` is that
rule on its own: the router's replay uses it to release a replayed output past what the
client already has.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from detserve.model.tokenizer import Tokenizer
from detserve.outputs import Delta, RequestOutput, TokenLogprob
from detserve.sequence import Sequence

_REPLACEMENT = "\ufffd"


class DeltaCursor:
    """How much of one output a stream has released: ``chars`` characters of its text and
    ``tokens`` of its tokens. ``stop``: the request's stop strings (their prefixes are held
    back while it runs)."""

    def __init__(self, stop: Seq[str] = (), chars: int = 0, tokens: int = 0) -> None:
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.chars = chars
        self.tokens = tokens

    def advance(self, text: str, token_ids: Seq[int], logprobs: Seq[TokenLogprob] | None,
                finished: bool) -> Delta:
        """The part of the output so far (``text``, ``token_ids``, ``logprobs``) not yet
        released, of the text only what can no longer change unless ``finished``."""
        limit = len(text) if finished else self._stable_length(text)
        new_text = text[self.chars:limit] if limit > self.chars else ""
        self.chars = max(self.chars, limit)
        new_ids = tuple(token_ids[self.tokens:])
        new_lps = None if logprobs is None else tuple(logprobs[self.tokens:])
        self.tokens = max(self.tokens, len(token_ids))
        return Delta(new_text, new_ids, new_lps)

    def _stable_length(self, text: str) -> int:
        limit = len(text) - self._hold
        while limit > 0 and text[limit - 1] == _REPLACEMENT:
            limit -= 1
        return max(limit, 0)


@dataclass
class _Detok:
    """Incremental detokenization of one running request: ``text`` is the decode of
    output[:read]; the next decode starts at ``prefix`` so merges come out as in context."""

    text: str = ""
    prefix: int = 0
    read: int = 0


class OutputProcessor:
    """Text, stop strings and ``RequestOutput``s of the engine's requests. Reads
    ``Sequence``s, never changes them; keeps its own state per running request (dropped
    with the request's final output)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._detok: dict[str, _Detok] = {}
        self._cursors: dict[str, DeltaCursor] = {}

    def text(self, seq: Sequence) -> str:
        """The committed output as text (see the module's docstring), before stop strings."""
        ids = seq.committed_output
        skip = seq.params.skip_special_tokens
        if seq.finished:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)
        d = self._detok.setdefault(seq.request_id, _Detok())
        if d.read > len(ids):  # output shortened (a stop token cut it): start over
            d.text, d.prefix, d.read = "", 0, 0
        if d.read == len(ids):
            return d.text
        before = self.tokenizer.decode(ids[d.prefix:d.read], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[d.prefix:], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            d.text, d.prefix, d.read = d.text + after[len(before):], d.read, len(ids)
        return d.text

    def stop_string_end(self, seq: Sequence) -> int | None:
        """The position (in ``seq.token_ids``) of the first token whose committed text
        holds one of the request's stop strings, or None (the scheduler's stop check). The
        answer depends on the tokens alone, not on how many of them a step settled: a
        window the lane commits at once stops where token-by-token decoding would have.
        Text only grows as tokens are added, so the first such token is found by
        bisection (a few decodes, once per request that stops this way)."""
        stop = seq.params.stop
        if _stop_cut(self.text(seq), stop) is None:
            return None
        skip = seq.params.skip_special_tokens
        prompt = seq.num_prompt

        def hit(idx: int) -> bool:
            ids = seq.token_ids[prompt:idx + 1]
            return _stop_cut(self.tokenizer.decode(ids, skip_special_tokens=skip),
                             stop) is not None

        lo, hi = prompt, seq.num_settled - 1  # (the whole settled output holds one)
        while lo < hi:
            mid = (lo + hi) // 2
            if hit(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def build(self, seq: Sequence, num_new: int) -> RequestOutput:
        """The output of ``seq`` now, ``num_new`` of its tokens committed since the last."""
        rid = seq.request_id
        text = self.text(seq)
        if seq.params.stop:
            cut = _stop_cut(text, seq.params.stop)
            if cut is not None:
                text = text[:cut]
        token_ids = list(seq.committed_output)
        logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
        cursor = self._cursors.get(rid) or self._cursors.setdefault(
            rid, DeltaCursor(seq.params.stop))
        delta = cursor.advance(text, token_ids, logprobs, seq.finished)
        if seq.finished:
            self._detok.pop(rid, None)
            del self._cursors[rid]
        return RequestOutput(
            request_id=rid, prompt_token_ids=seq.prompt_token_ids,  # never mutated
            token_ids=token_ids, text=text, finished=seq.finished,
            finish_reason=seq.finish_reason if seq.finished else None,
            logprobs=logprobs, is_deterministic=seq.deterministic, num_new_tokens=num_new,
            stats=seq.stats, delta=delta,
            prompt_logprobs=(list(seq.prompt_logprobs)
                             if seq.params.prompt_logprobs is not None else None))


def _stop_cut(text: str, stop: Seq[str]) -> int | None:
    """Where the first of the ``stop`` strings found in ``text`` starts, or None."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None
