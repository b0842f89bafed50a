"""Incremental detokenisation and stop strings for one sequence.

`tokenizers`' `DecodeStream` turns each new token into the text it adds (None
while a UTF-8 character is split across tokens), so a token costs O(1)
instead of re-decoding the whole output. At the end the full output is
decoded once (`tokenizer.decode`, exactly what a non-streaming caller would
get: it also renders trailing incomplete bytes as U+FFFD), and the streamed
text is reconciled with it. Tokenizers without a Rust backend (slow
tokenizers) and those that post-process the decoded text
(`clean_up_tokenization_spaces`) re-decode the whole output per token.

Stop strings are looked for only once more than `min_tokens` tokens are out,
and then only in the text the new token added (with the characters that may
start a stop string before it): vLLM's rule, so a stop string that the first
`min_tokens` tokens complete does not end the output.
"""

from __future__ import annotations

from moeflow.serving.sampling import find_stop


class Detokenizer:
    """Text of one sequence's output as tokens arrive, with stop strings held back.

    Args:
        tokenizer: the served tokenizer (transformers).
        stops: stop strings (the text ends before the first one found).
        min_tokens: stop strings count only from the token after this many (vLLM's min_tokens).
    """

    def __init__(self, tokenizer, stops: list[str], min_tokens: int = 0):
        self.tokenizer, self.stops, self.min_tokens = tokenizer, stops, min_tokens
        self.ids: list[int] = []
        self.count = 0  # tokens added (an EOS included)
        self.text = ""  # decoded so far (stop string cut off once found)
        self.emitted = 0  # chars of `text` already sent
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars that may start a stop string
        backend = getattr(tokenizer, "_tokenizer", None)
        self.stream = None
        if backend is not None and getattr(tokenizer, "is_fast", False) \
                and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            # lazy: tokenizers: heavy, loaded only when this runs
            from tokenizers.decoders import DecodeStream

            self.backend, self.stream = backend, DecodeStream(skip_special_tokens=True)

    def add(self, token: int | None, final: bool) -> bool:
        """Add a token (None: the sequence ended on one that is not text, EOS); `final`: nothing
        follows. Returns True when a stop string ends the text."""
        before = len(self.text)
        self.count += 1
        if token is not None:
            self.ids.append(token)
            if self.stream is not None:
                self.text += self.stream.step(self.backend, token) or ""
        if final or self.stream is None:
            full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            # the full decode replaces the streamed text only where it extends what was sent:
            # a decoder that rewrites earlier text (not seen with DecodeStream, but a custom
            # tokenizer may) must not make the stream repeat or lose characters
            if self.stream is None or full.startswith(self.text[:self.emitted]):
                self.text = full
        if self.stops and self.count > self.min_tokens:
            start = max(0, before - self.hold)
            hit = find_stop(self.text[start:], self.stops)
            if hit is not None:
                self.text = self.text[:start + hit]
                return True
        return False

    def take(self, final: bool) -> str:
        """The text not yet sent: all of it when `final`, else all but what may start a stop string
        (or an incomplete character)."""
        end = len(self.text)
        if not final:
            end -= self.hold
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1  # re-decoding tokenizers: wait for the rest of the character
        out = self.text[self.emitted:max(end, self.emitted)]
        self.emitted = max(end, self.emitted)
        return out
