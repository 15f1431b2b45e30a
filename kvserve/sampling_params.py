"""OpenAI-shaped sampling parameters for one request; validates itself.

Invalid values raise :class:`InvalidRequestError` (a ``ValueError``) whose ``param`` names the field,
so the server can map it to an OpenAI error object. Nothing here knows about HTTP.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request parameter is invalid. ``param`` is the offending field's name."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


_MAX_LOGPROBS = 20
# Every generated token is checked against every stop string (on the engine's one thread: a request
# with 600,000 of them made another's 16 tokens take 10.8 s instead of 0.27 s) and a stream holds back
# up to the longest stop string's length of text. OpenAI takes 4 stop strings; these bounds are looser.
MAX_STOP = 32  # stop strings per request
MAX_STOP_CHARS = 1000  # characters per stop string
MAX_STOP_TOKEN_IDS = 1000  # stop_token_ids per request
_MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
_GREEDY_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32: sample greedily (as vLLM)
TEMPERATURE_MAX = 2.0  # OpenAI's range for temperature: [0, 2]
_SEED_LIMIT = 2**63  # a 64-bit seed (seed + i for the i-th of n sequences stays below 2**64)


@dataclass
class SamplingParams:
    """How to sample one request's output tokens.

    Greedy when ``temperature < 1e-5`` (also ``top_k == 1``). ``top_k`` of 0 or -1 means off;
    ``top_p`` must be in (0, 1] — ``top_p: 0`` is rejected, use ``temperature: 0`` for greedy.
    ``repetition_penalty`` (CTRL, Keskar et al. 2019) divides positive logits and multiplies negative
    ones of every token seen in the prompt or output; ``presence_penalty`` / ``frequency_penalty``
    (OpenAI) subtract once / per occurrence for tokens seen in the output only.
    ``max_tokens=None`` means "up to the context length". ``stop`` strings are matched on the
    detokenized text and never returned; ``stop_token_ids`` end generation like EOS (the token's
    text is not returned). At most ``MAX_STOP`` (32) stop strings of ``MAX_STOP_CHARS`` (1,000)
    characters and ``MAX_STOP_TOKEN_IDS`` (1,000) stop ids (OpenAI takes 4 stop strings).
    ``logprobs=k`` returns the sampled token's logprob plus the top k.
    ``prompt_logprobs=k`` also returns, for every prompt token after the first, its logprob given
    the tokens before it and the top k (the first prompt token has none).
    ``seed`` makes sampling reproducible whatever else shares the batch.
    ``logit_bias`` (OpenAI): ``{token_id: bias}``, each bias in [-100, 100] added to that token's logit
    before every other processor (-100 in effect bans a token, 100 forces it); logprobs stay those of
    the raw logits. The engine checks the ids against the vocabulary.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    speculative: bool = True  # False: this request never uses speculative decoding
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        _int_at_least("n", self.n, 1)
        _number_in("temperature", self.temperature, 0.0, TEMPERATURE_MAX)
        _number_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if _is_int(self.top_k) and self.top_k < 0:  # -1 was made 0 above
            raise InvalidRequestError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}", "top_k")
        _int_at_least("top_k", self.top_k, 0)
        _number_in("min_p", self.min_p, 0.0, 1.0)
        _number_in("repetition_penalty", self.repetition_penalty, 0.0, float("inf"), low_open=True)
        _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None and (not _is_int(self.seed)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if self.seed is not None and not -_SEED_LIMIT <= self.seed < _SEED_LIMIT:
            raise InvalidRequestError(f"seed must be in [-2**63, 2**63), got {self.seed}", "seed")
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 0)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {getattr(self, name)!r}", name)
        if not isinstance(self.stop, list):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                                      "stop_token_ids")
        if len(self.stop) > MAX_STOP:
            raise InvalidRequestError(f"stop must hold at most {MAX_STOP} strings, got {len(self.stop)}", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                                      f"{len(self.stop_token_ids)}", "stop_token_ids")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop must be a list of non-empty strings, got {s!r}", "stop")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidRequestError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of "
                                          f"{len(s)}", "stop")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {t!r}",
                                          "stop_token_ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError(f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}",
                                          "logit_bias")
            for t, b in self.logit_bias.items():
                if isinstance(t, str):
                    raise InvalidRequestError(f"logit_bias keys must be int token ids here (JSON's string keys are "
                                              f"the HTTP API's form), got {t!r}", "logit_bias")
                if not _is_int(t) or t < 0:
                    raise InvalidRequestError(f"logit_bias keys must be non-negative token ids, got {t!r}",
                                              "logit_bias")
                if not _is_number(b) or not -_MAX_LOGIT_BIAS <= b <= _MAX_LOGIT_BIAS:
                    raise InvalidRequestError(f"logit_bias values must be numbers in [-{_MAX_LOGIT_BIAS:g}, "
                                              f"{_MAX_LOGIT_BIAS:g}], got {b!r} for token {t}", "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int_at_least(name, value, 0)
                if value > _MAX_LOGPROBS:
                    raise InvalidRequestError(f"{name} must be <= {_MAX_LOGPROBS}, got {value}", name)

    # ------------------------------------------------------------------ derived
    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """A processor changes the logits at every step (penalties, logit_bias); min_tokens, which acts
        only on early steps, is not counted. The one list the sampler's greedy fast path and speculative
        decoding (whose verification applies none) both read."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def _as_list(value):
    """None → [], a list or tuple → a list; anything else unchanged (``validate`` rejects it)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else value


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_at_least(name: str, value, low: int) -> None:
    if not _is_int(value):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    if value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value}", name)


def _is_number(x) -> bool:
    """A real number (int or float, not bool, not NaN)."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and x == x


def _number_in(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if not _is_number(value):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", name)
    bad_low = value <= low if low_open else value < low
    if bad_low or value > high:
        lo = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be in {lo}{low}, {high}], got {value}", name)
