"""Offline Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``.chat(messages)``.

Tokenization (timed as part of each request's anatomy) and chat templates come from the model's
own tokenizer (HF ``transformers``). ``stream`` yields outputs with text deltas as they are made.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Mapping, Sequence

from kvserve.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig, parse_bytes, SpecDecodeConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.metrics.timeline import RequestTimeline, now
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import InvalidRequestError, SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


# apply_chat_template's own parameters and the variables it sets for the template (transformers 4.4x-5.x):
# a chat_template_kwargs entry of one of these names would clash with kvserve's call or replace the
# conversation itself, so it is refused
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "compiled_template"})


def check_chat_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``kwargs`` as a dict of template variables ({} for None); InvalidRequestError naming
    ``chat_template_kwargs`` for a non-mapping, a non-string key or a name in RESERVED_TEMPLATE_KWARGS."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(f"chat_template_kwargs must be an object of template variables, got "
                                  f"{type(kwargs).__name__}", "chat_template_kwargs")
    for key in kwargs:
        if not isinstance(key, str):
            raise InvalidRequestError(f"chat_template_kwargs keys must be strings, got {key!r}", "chat_template_kwargs")
        if key in RESERVED_TEMPLATE_KWARGS:
            hint = (f"; use the request's own `{key}` field" if key in ("add_generation_prompt", "continue_final_message")
                    else "")
            raise InvalidRequestError(f"chat_template_kwargs must not set `{key}`: it is one of the chat template "
                                      f"call's own arguments or variables{hint}", "chat_template_kwargs")
    return dict(kwargs)


def load_chat_template(value: str) -> str:
    """A chat template's text from ``value``: the contents of the file it names, else ``value`` itself where
    it holds Jinja (``{`` or ``}``) or a line break. ConfigError naming ``chat_template`` for a value that
    is neither (a path that does not exist), a file that cannot be read, or a template Jinja cannot parse
    (the message has its line)."""
    import os

    if not isinstance(value, str) or not value:
        raise ConfigError(f"chat_template must be a file or a Jinja template, got {value!r}")
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"chat_template: cannot read {value!r}: {e}") from None
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ConfigError(f"chat_template {value!r} is not a file (none there) and holds no Jinja")
    try:  # transformers' own compiler (its sandbox and extensions); private, so only where it exists
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return text
    try:
        _compile_jinja_template(text)
    except Exception as e:  # jinja2.TemplateSyntaxError and the like
        raise ConfigError(f"chat_template does not parse as Jinja: {e}") from None
    return text


class LLM:
    """Load a model and generate.

    ``model``: a catalog name (default ``smollm2-135m``), a ``.gguf`` file, a HF directory, or a
    dummy preset (``load_format="dummy"``). ``kv_cache_memory``: bytes or a size like ``"512MiB"``;
    ``num_kv_blocks`` instead gives the pool in blocks. ``kv_cache_dtype``: auto|float32|bfloat16|fp8_e4m3|
    fp8_e5m2|int8 (the 1-byte kinds keep a float32 scale per token and KV head). ``num_scheduler_steps``:
    decode steps per engine step where the decode plan can run them back to back (``SchedulerConfig``).
    ``chat_template``: a Jinja chat template (a file, or the template's text) used instead of the
    model's, as vLLM's ``--chat-template``; a model without one (the bundled Gemma-3 GGUF) needs it for
    ``chat``. Raises ConfigError for bad settings.
    """

    def __init__(self, model: str = "smollm2-135m", *, dtype: str = "float32", weight_dtype: str = "auto", load_format: str = "auto",
                 seed: int = 0, block_size: int = 16, kv_cache_memory: int | str | None = None,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 0, num_scheduler_steps: int = 1, dummy_config=None, num_threads: int = 0, progress: bool = True,
                 enable_prefix_caching: bool = True, kv_cache_dtype: str = "auto",
                 speculative_method: str | None = None, num_speculative_tokens: int = 3,
                 draft_model: str | None = None, draft_load_format: str = "auto",
                 prompt_lookup_min: int = 1, prompt_lookup_max: int = 4, compile: bool = False,
                 chat_template: str | None = None):
        template = load_chat_template(chat_template) if chat_template is not None else None
        mem = parse_bytes(kv_cache_memory) if kv_cache_memory is not None else None
        config = EngineConfig(
            model=model, dtype=dtype, weight_dtype=weight_dtype, load_format=load_format, seed=seed, dummy_config=dummy_config,
            num_threads=num_threads, compile=compile,
            cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=mem, num_blocks=num_kv_blocks,
                              enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, num_scheduler_steps=num_scheduler_steps),
            spec_decode=SpecDecodeConfig(method=speculative_method, num_speculative_tokens=num_speculative_tokens,
                                         draft_model=draft_model, draft_load_format=draft_load_format,
                                         prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max))
        self.engine = LLMEngine(config, progress=progress)
        if template is not None:
            self.tokenizer.chat_template = template
        self._ids = itertools.count()
        self._inbox: dict[str, list[RequestOutput]] = {}  # request_id → outputs its caller has not taken

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Text → token ids with the tokenizer's own special-token rule; ids pass through."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                  "prompt")

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool | None = None,
                            continue_final_message: bool = False,
                            chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Render messages with the model's chat template (text; tokenized without adding a BOS). Role
        ``developer`` (OpenAI's newer name for it) is rendered as ``system``, as the server does.
        ``add_generation_prompt`` (open the assistant's turn) defaults to ``not continue_final_message``;
        both set true raises InvalidRequestError naming ``continue_final_message``, as the server's 400 and
        Hugging Face's apply_chat_template do. ``chat_template_kwargs``: extra variables for the template
        (e.g. ``{"date_string": "7 Dec 2026"}`` for Llama 3.1's; names the template does not read are
        ignored), as vLLM's field of that name; names that are apply_chat_template's own parameters or
        the variables it sets (``messages``, ``tools``, ...) raise InvalidRequestError naming
        ``chat_template_kwargs``. A template that fails raises InvalidRequestError naming
        ``chat_template_kwargs`` where the messages render without them, else ``messages``, as the
        server's 400."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to true: "
                                      "the first continues the last message, the second starts a new one",
                                      "continue_final_message")
        extra = check_chat_template_kwargs(chat_template_kwargs)
        if not messages:
            raise InvalidRequestError("messages must contain at least one message", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"] \
                    or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}] must have a string 'role' and a string 'content'",
                                          f"messages[{i}]")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("this model has no chat template; use generate() with a raw prompt",
                                      "messages")
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        flags = {"tokenize": False, "continue_final_message": continue_final_message,
                 "add_generation_prompt": not continue_final_message if add_generation_prompt is None
                 else add_generation_prompt}
        try:
            return self.tokenizer.apply_chat_template(messages, **flags, **extra)
        except Exception as e:  # the template's own errors (Jinja's, raise_exception, a recursion limit)
            if extra:  # the variables' fault if the messages render without them
                try:
                    self.tokenizer.apply_chat_template(messages, **flags)
                except Exception:
                    pass
                else:
                    raise InvalidRequestError(f"chat_template_kwargs: the chat template failed with these variables "
                                              f"(it renders the messages without them): {e}",
                                              "chat_template_kwargs") from None
            raise InvalidRequestError(f"messages: the chat template rejected them: {e}", "messages") from None

    def encode_chat(self, messages: Sequence[Message], **kw) -> tuple[str, list[int]]:
        text = self.apply_chat_template(messages, **kw)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ generation
    def add(self, prompt: Prompt, params: SamplingParams, *, chat: bool = False, **chat_kw) -> str:
        """Tokenize (timed) and queue one request; returns its request_id."""
        timeline = RequestTimeline(arrival=now())
        text, ids = self.encode_chat(prompt, **chat_kw) if chat else self.encode(prompt)
        timeline.tokenized = now()
        rid = str(next(self._ids))
        self.engine.add_request(rid, ids, params, prompt=text, timeline=timeline)
        self._inbox[rid] = []
        return rid

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion (continuous batching); outputs in the prompts' order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Iterable) or isinstance(prompts, (dict, bytes)):
            raise InvalidRequestError(f"prompts must be a string, a list of token ids or a list of prompts, "
                                      f"got {type(prompts).__name__}", "prompt")
        return self._run([(p, {}) for p in prompts], sampling_params, chat=False)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool | None = None, continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Like ``generate`` for conversations (one list of messages, or a list of them); the two flags and
        ``chat_template_kwargs`` as in ``apply_chat_template`` (InvalidRequestError where both flags are
        true)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of messages (or of conversations)",
                                      "messages")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        kw = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
              "chat_template_kwargs": chat_template_kwargs}
        return self._run([(c, kw) for c in convs], sampling_params, chat=True)

    def stream(self, prompt: Prompt | Sequence[Message], sampling_params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[RequestOutput]:
        """Yield one RequestOutput per step that changed it (``delta_text`` is the new text)."""
        rid = self.add(prompt, sampling_params or SamplingParams(), chat=chat)
        try:
            while True:
                if not self._inbox[rid]:
                    self._step()
                for out in self._take(rid):
                    yield out
                    if out.finished:
                        return
        finally:
            self._inbox.pop(rid, None)
            self.engine.abort_request(rid)

    def _run(self, items, sampling_params, chat: bool) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(items))
        order: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:  # a prompt that fails validation aborts the ones queued before it
            for (p, kw), sp in zip(items, params):
                order.append(self.add(p, sp, chat=chat, **kw))
            while len(done) < len(order):
                self._step()
                for rid in order:
                    for out in self._take(rid):
                        if out.finished:
                            done[rid] = out
        finally:
            for rid in order:
                self._inbox.pop(rid, None)
                if rid not in done:
                    self.engine.abort_request(rid)
        return [done[r] for r in order]

    def _step(self) -> None:
        """One engine step; each output waits in its request's inbox until its caller takes it, so
        interleaved ``stream``/``generate`` calls never lose each other's outputs."""
        for out in self.engine.step():
            box = self._inbox.get(out.request_id)
            if box is not None:
                box.append(out)

    def _take(self, rid: str) -> list[RequestOutput]:
        outs, self._inbox[rid] = self._inbox[rid], []
        return outs


def _per_prompt(sp, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [sp] * n
    bad = [p for p in (sp if isinstance(sp, (list, tuple)) else [sp]) if not isinstance(p, SamplingParams)]
    if bad:
        raise InvalidRequestError(f"sampling_params must be a SamplingParams or a list of them, got "
                                  f"{type(bad[0]).__name__}", "sampling_params")
    sp = list(sp)
    if len(sp) != n:
        raise InvalidRequestError(f"got {len(sp)} sampling_params for {n} prompts", "sampling_params")
    return sp
