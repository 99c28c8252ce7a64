"""One request's answer text as its committed prefix grows: stop strings, ``max_tokens`` and incremental detokenizing.

The decode thread feeds `TextStream.update` the committed left-to-right prefix of the row (the generated tokens
before its first still-masked position, cut at the first end token) after each step. Committed tokens never change,
so the text sent so far is final. Held back: a trailing incomplete character (a byte-level tokenizer's partial UTF-8,
decoded as U+FFFD) and a tail that may be the start of a stop string. ``update`` reports the answer final as soon as
it is: a stop string appears, or a token past ``max_tokens`` is committed, so the row can leave the batch at once.
"""

from dataclasses import dataclass

from tracelock.text import cut_at_stop


@dataclass
class Answer:
    """A finished answer: its text, the token ids it covers, and why it ended ("stop" or "length")."""

    text: str
    token_ids: list
    finish_reason: str


def _stop_prefix_tail(text: str, stops: list) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string (held back until resolved)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class TextStream:
    def __init__(self, tokenizer, max_tokens: int, stops: list):
        self.tokenizer, self.max_tokens, self.stops = tokenizer, max_tokens, list(stops)
        self.sent = ""  # text already handed out as deltas
        self.answer = None  # the Answer once final

    def _decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _covering(self, ids: list, text: str) -> list:
        """The shortest prefix of ``ids`` whose text contains ``text`` (the tokens an answer cut at a stop string
        used)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(ids[:mid])) >= len(text):
                hi = mid
            else:
                lo = mid + 1
        return ids[:lo]

    def _delta(self, text: str) -> str:
        # committed text only grows; a decode that rewrote what was sent (it should not) sends nothing new here,
        # and the final answer's text is still exact (it is decoded from the final tokens)
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def update(self, prefix: list, *, complete: bool = False, ended: bool = False) -> str:
        """Feed the committed prefix (token ids before the first end token); returns the new text to send.

        ``complete``: the row has nothing left to decode (``prefix`` is its whole answer); ``ended``: an end token
        follows ``prefix``. Once the answer is final, `answer` is set and later calls return "".
        """
        if self.answer is not None:
            return ""
        ids = prefix[:self.max_tokens]
        text = self._decode(ids)
        cut, hit = cut_at_stop(text, self.stops)
        if hit:
            self.answer = Answer(cut, self._covering(ids, cut), "stop")
        elif len(prefix) > self.max_tokens:  # a committed token past the cap: cut there
            self.answer = Answer(text, ids, "length")
        elif complete:
            self.answer = Answer(text, ids, "stop" if ended else "length")
        if self.answer is not None:
            return self._delta(self.answer.text)
        safe = text.rstrip("\ufffd")
        return self._delta(safe[:len(safe) - _stop_prefix_tail(safe, self.stops)])
