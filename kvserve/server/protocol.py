"""OpenAI request schemas (pydantic, strict types: ``"256"`` is not a number) and their mapping to
:class:`~kvserve.sampling_params.SamplingParams`. Range checks live in SamplingParams so the Python
API and HTTP give the same messages."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from kvserve.sampling_params import InvalidRequestError, SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_N = 128  # OpenAI's limit; each choice is a sequence with its own KV blocks
# prompts × n of one completions request: each is a request the engine queues (an 8 MiB body holds a
# million one-token prompts, which at n = 128 queued 128 M requests behind everyone else's)
MAX_SEQUENCES = 4096


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


# OpenAI request fields that change what the answer must be and that kvserve cannot honour: a 400 naming
# the field, never a plain-text answer that looks like success. Each maps to the values that are no-ops.
# Other unknown fields are ignored, as vLLM does (clients send vendor extensions).
_UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,),
}


def reject_unsupported(body: BaseModel) -> None:
    """InvalidRequestError naming the first field of ``_UNSUPPORTED`` that ``body`` carries with a value
    other than its no-ops."""
    for name, value in (body.model_extra or {}).items():
        if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
            raise InvalidRequestError(f"{name} is not supported by this server (kvserve generates plain text "
                                      f"only: no tool calls, structured output, audio or predicted outputs)", name)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share blocks
    speculative: bool = True  # false: this request does not use the server's speculative decoding
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (a JSON key, so a string) -> bias

    def _common(self) -> dict:
        reject_unsupported(self)
        if self.n > MAX_N:
            raise InvalidRequestError(f"n must be <= {MAX_N}, got {self.n}", "n")
        out = {"n": self.n, "seed": self.seed, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
               "include_stop_str_in_output": self.include_stop_str_in_output,
               "skip_special_tokens": self.skip_special_tokens, "speculative": self.speculative,
               "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
               "stop_token_ids": list(self.stop_token_ids or [])}
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.top_k is not None:
            out["top_k"] = 0 if self.top_k == -1 else self.top_k
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                if not key.isascii() or not key.isdigit() or key != str(int(key)):  # "05" would alias "5"
                    raise InvalidRequestError(f"logit_bias keys must be token ids (decimal strings without "
                                              f"leading zeros), got {key!r}", "logit_bias")
                bias[int(key)] = value
            out["logit_bias"] = bias
        return out

    @property
    def include_usage(self) -> bool:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list; each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if len(p) * self.n > MAX_SEQUENCES:
            raise InvalidRequestError(f"{len(p):,} prompts × n {self.n} = {len(p) * self.n:,} sequences, "
                                      f"more than {MAX_SEQUENCES:,} per request; split the prompts over requests",
                                      "prompt")
        return list(p)

    def sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (it must equal n)", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.echo and self.logprobs is not None and self.max_tokens == 0:
            raise InvalidRequestError("echo with logprobs needs max_tokens >= 1 (got 0): prompt logprobs come from a "
                                      "model step, which max_tokens 0 skips", "max_tokens")
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs,
                              prompt_logprobs=self.logprobs if self.echo else None, **self._common())


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = Field(...)
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def chat_dicts(messages: list[ChatMessage]) -> list[dict]:
    """The messages as ``LLM.encode_chat`` takes them (which renders role ``developer`` as ``system``);
    InvalidRequestError for none."""
    if not messages:
        raise InvalidRequestError("messages must contain at least one message", "messages")
    return [{"role": m.role, "content": m.text()} for m in messages]


def template_flags(body: "ChatCompletionRequest | TokenizeRequest") -> dict:
    """add_generation_prompt and continue_final_message of a chat or /tokenize request, for
    ``LLM.encode_chat``. Both set true in the request is an error, as in vLLM (its
    check_generation_prompt); add_generation_prompt left at its default true gives way to continuing.
    A request's own ``chat_template`` is refused (a 400 naming it): vLLM refuses it too unless started
    with --trust-request-chat-template, and kvserve renders only the template it was started with."""
    if (body.model_extra or {}).get("chat_template") is not None:
        raise InvalidRequestError("chat_template is not supported in a request: kvserve renders the template it "
                                  "was started with (the model's, or `kvserve serve --chat-template`); "
                                  "chat_template_kwargs passes variables to it", "chat_template")
    explicit = "add_generation_prompt" in body.model_fields_set  # LLM.encode_chat refuses both true
    return {"add_generation_prompt": body.add_generation_prompt if explicit else None,
            "continue_final_message": body.continue_final_message,
            "chat_template_kwargs": body.chat_template_kwargs}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                                      "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.max_completion_tokens is not None and self.max_completion_tokens < 0:
            raise InvalidRequestError(f"max_completion_tokens must be >= 0, got {self.max_completion_tokens}",
                                      "max_completion_tokens")
        return SamplingParams(max_tokens=max_tokens, logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                              **self._common())


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
