"""Incremental detokenization of one output sequence, and stop-string matching on its text.

Text is decoded with the prefix_offset/read_offset algorithm (HF TGI, vLLM), so a character whose
UTF-8 bytes span several tokens is emitted once, whole, and streamed deltas concatenate exactly to
the final text. Stop strings are searched only where new text could complete one (O(new) per step),
and a stream never emits any part of a stop string.
"""
from __future__ import annotations

import os

from kvserve.sampling_params import SamplingParams

#: How many prompt tokens give the first output tokens their decoding context (as in vLLM).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text, step by step.

    ``tokenizer`` is a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
    Decoding uses the last :data:`PROMPT_CONTEXT_TOKENS` prompt tokens as context, so the first
    output token's leading space is kept. If the prompt ends inside a UTF-8 character, that whole
    character is output text (``decode(prompt).rstrip("\ufffd") + output_text == decode(prompt + output)``).

    Feed only tokens whose text belongs in the output: the engine must NOT pass the final EOS /
    ``stop_token_ids`` token to :meth:`update`.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._backend_decode = _backend_decode(tokenizer)
        self._stop = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context  # decoding window: prompt context + output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""
        self._num_emitted_chars = 0  # length of the text already returned by take_delta
        self._stop_str: str | None = None
        self.num_used = 0  # of the last update's new_token_ids: those up to and including a stop match

    # ------------------------------------------------------------------ public API
    @property
    def output_text(self) -> str:
        """All output text so far (truncated at a stop match; may include text a stream holds back)."""
        return self._text

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the text, or ``None``."""
        return self._stop_str

    def update(self, new_token_ids: list[int], num_output_tokens: int) -> str | None:
        """Decode ``new_token_ids`` (appended to the output) and look for stop strings.

        Args:
            new_token_ids: the output tokens generated since the last call (1 normally; more under
                speculative decoding). Tokens are processed one by one; after a stop match the rest
                are ignored (``num_used`` then says how many were taken).
            num_output_tokens: the number of output tokens INCLUDING ``new_token_ids``; a stop
                string is only looked for in text decoded once this count reaches ``min_tokens``.
        Returns:
            The matched stop string (``output_text`` is then cut right before it, or right after it
            when ``include_stop_str_in_output``), else ``None``.
        Raises:
            RuntimeError: called again after a stop string matched.
        """
        if self._stop_str is not None:
            raise RuntimeError("update() called after a stop string matched; the sequence is finished")
        first_count = num_output_tokens - len(new_token_ids) + 1
        self.num_used = len(new_token_ids)
        for n, token_id in enumerate(new_token_ids):
            start = len(self._text)
            self._text += self._decode_next(token_id)
            if self._stop and first_count + n >= self._min_tokens and len(self._text) > start:
                stop = self._check_stop(start)
                if stop is not None:
                    self.num_used = n + 1
                    return stop
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls.

        While not ``finished``, the last ``len(longest stop string) - 1`` characters are held back
        (they could be the start of a stop string), so no part of a stop string is ever emitted.
        When ``finished``, everything is flushed, including any complete characters still waiting in
        the decoding window (an incomplete trailing UTF-8 character is dropped, never sent as U+FFFD).
        """
        if finished and self._stop_str is None:
            self._text += self._flush_window()
        end = len(self._text)
        if not finished and self._stop_str is None and self._max_stop_len > 1:
            end -= self._max_stop_len - 1
        if end <= self._num_emitted_chars:
            return ""
        delta = self._text[self._num_emitted_chars:end]
        self._num_emitted_chars = end
        return delta

    # ------------------------------------------------------------------ helpers
    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        """Append one token to the window; return its new complete text ('' while a character is
        incomplete). Standard algorithm: text of ``ids[prefix:]`` minus text of ``ids[prefix:read]``."""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset:])
        if new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = _text_after(self._decode(self._ids[self._prefix_offset:self._read_offset]), new_text)
        if delta:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._trim_window()
        return delta

    def _trim_window(self) -> None:
        """Drop ids before ``prefix_offset`` so the window (and each decode) stays O(1)."""
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _flush_window(self) -> str:
        """Complete characters decoded from ids not yet emitted (trailing U+FFFD stripped)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:]).rstrip(_REPLACEMENT_CHAR)
        self._prefix_offset = self._read_offset = len(self._ids)
        return _text_after(prefix_text, new_text)

    def _check_stop(self, start: int) -> str | None:
        """Find a stop string ending after ``start`` (i.e. in the newly decoded text).

        Among matches, the one that ENDS first wins (as if text arrived one character at a time,
        so the result does not depend on how text splits into tokens); on an equal end, the longer
        one. Truncates ``self._text`` and returns the stop string, or returns ``None``.
        """
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stop:
            idx = self._text.find(stop, max(0, start - len(stop) + 1))
            if idx != -1:
                cand = (idx + len(stop), -len(stop), stop)
                best = cand if best is None or cand[:2] < best[:2] else best
        if best is None:
            return None
        end, neg_len, stop = best
        self._text = self._text[:end] if self._include_stop else self._text[:end + neg_len]
        self._stop_str = stop
        return stop


def _backend_decode(tokenizer):
    """The ``decode`` of a fast tokenizer's Rust ``tokenizers.Tokenizer``, when the Hugging Face
    tokenizer's own ``decode`` returns exactly its text: no ``clean_up_tokenization_spaces`` (else None).
    Two decodes run per output token and step; the transformers layer around them costs several times
    the Rust call itself (kwargs, type checks), ~0.1 ms a step at batch 1 once a decode step has
    evicted the caches."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    # a tokenizer class with a decode of its own (transformers' codegen and whisper tokenizers) keeps it
    owners = {name: next((c.__module__ for c in type(tokenizer).__mro__ if name in vars(c)), "")
              for name in ("decode", "_decode")}
    if not (owners["decode"] == "transformers.tokenization_utils_base"
            and owners["_decode"] in ("transformers.tokenization_utils_tokenizers",
                                      "transformers.tokenization_utils_fast")):
        return None
    return backend.decode


def _text_after(prefix_text: str, new_text: str) -> str:
    """The part of ``new_text`` beyond ``prefix_text``.

    Normally ``prefix_text`` is a prefix of ``new_text``. When it is not — the prompt context ends
    inside a UTF-8 character, so ``prefix_text`` ends with U+FFFD where ``new_text`` has the completed
    character — the text after their common prefix is new (the completed character included).
    """
    if new_text.startswith(prefix_text):
        return new_text[len(prefix_text):]
    return new_text[len(os.path.commonprefix([prefix_text, new_text])):]
