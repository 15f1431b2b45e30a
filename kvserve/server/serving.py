"""The OpenAI endpoints' logic: prepare (tokenize, timed; validate against the engine's limits),
run through the AsyncEngine, and answer whole or as a server-sent-event stream. A client that
disconnects aborts its requests (the engine frees their KV blocks within a step)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.metrics.timeline import RequestTimeline, now
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import InvalidRequestError, SamplingParams
from kvserve.server import openai_format as fmt
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.errors import APIError, from_exception
from kvserve.server.protocol import (ChatCompletionRequest, CompletionRequest, TokenizeRequest, chat_dicts,
                                     template_flags)


@dataclass(slots=True)
class Prepared:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    timeline: RequestTimeline


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(self, llm, engine: AsyncEngine, model_name: str):
        self.llm, self.engine, self.model_name = llm, engine, model_name
        self.tokenizer = llm.tokenizer

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           "model", "model_not_found")

    # ------------------------------------------------------------------ preparing
    def _prepared(self, prefix: str, arrival: float, text: str | None, ids: list[int], params) -> Prepared:
        timeline = RequestTimeline(arrival=arrival, tokenized=now())
        self.llm.engine.validate_prompt(ids, params)
        return Prepared(self.engine.new_request_id(prefix), text, ids, timeline)

    def prepare_completion(self, body: CompletionRequest, arrival: float) -> tuple[list[Prepared], SamplingParams]:
        params = body.sampling_params()
        out = []
        for i, p in enumerate(body.prompts()):
            if isinstance(p, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise InvalidRequestError(f"prompt[{i}] must be a string or a list of token ids", "prompt")
            text, ids = self.llm.encode(p)
            if text is None:
                text = self.tokenizer.decode(ids) if ids and max(ids) < self.llm.engine.vocab_size and min(ids) >= 0 else None
            out.append(self._prepared("cmpl", arrival, text, ids, params))
        return out, params

    def encode_chat(self, body: ChatCompletionRequest | TokenizeRequest) -> tuple[str, list[int]]:
        """The prompt text and ids of a chat or /tokenize request's messages (the same for both)."""
        return self.llm.encode_chat(chat_dicts(body.messages), **template_flags(body))  # template errors: 400s

    def prepare_chat(self, body: ChatCompletionRequest, arrival: float) -> tuple[Prepared, SamplingParams]:
        params = body.sampling_params()
        text, ids = self.encode_chat(body)
        return self._prepared("chatcmpl", arrival, text, ids, params), params

    # ------------------------------------------------------------------ running
    def _streams(self, prepared: list[Prepared], params: SamplingParams,
                 cache_salt: str | None = None) -> list[AsyncIterator[RequestOutput]]:
        return [self.engine.generate(p.request_id, p.prompt_ids, params, p.prompt, p.timeline, cache_salt)
                for p in prepared]

    async def _collect(self, request: Request, gens) -> list[RequestOutput]:
        async def drain(gen):
            last = None
            async for out in gen:
                last = out
            return last

        task = asyncio.ensure_future(asyncio.gather(*(drain(g) for g in gens)))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.2)
                if done:
                    return task.result()
                if await request.is_disconnected():  # an answer no one reads; a CancelledError here was
                    # logged by uvicorn as "Exception in ASGI application" with a traceback, once per disconnect
                    raise APIError(499, "the client closed the request before its answer",
                                   code="client_closed_request")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    @staticmethod
    async def _merge(gens) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave several requests' outputs as they come, tagged with the prompt index."""
        if len(gens) == 1:
            async for out in gens[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            try:
                async for out in gen:
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001
                await queue.put((i, e))
            await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            remaining = len(gens)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ /v1/completions
    async def completion(self, body: CompletionRequest, request: Request, arrival: float):
        self.check_model(body.model)
        include_usage = body.include_usage
        prepared, params = self.prepare_completion(body, arrival)
        gens = self._streams(prepared, params, body.cache_salt)
        if body.stream:
            return StreamingResponse(self._completion_stream(body, prepared, params, gens, include_usage),
                                     media_type="text/event-stream")
        outs = await self._collect(request, gens)
        choices = []
        for i, (p, out) in enumerate(zip(prepared, outs)):
            for c in out.outputs:
                choices.append(self._completion_choice(body, p, out, c, i * params.n + c.index))
        completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        resp = fmt.envelope("text_completion", fmt.new_id("cmpl"), self.model_name, choices,
                            usage=fmt.usage(sum(len(p.prompt_ids) for p in prepared), completion_tokens),
                            kvserve_timings=choices[0]["kvserve_timings"] if choices else None)
        return JSONResponse(resp)

    def _completion_choice(self, body, p: Prepared, out: RequestOutput, c: CompletionOutput, index: int) -> dict:
        text = c.text
        logprobs = None
        prefix = (p.prompt or "") if body.echo else ""
        if body.logprobs is not None:
            pieces = fmt.token_pieces(self.tokenizer, c.token_ids, p.prompt_ids)
            entries = list(c.logprobs or [])
            if body.echo:
                pieces = fmt.token_pieces(self.tokenizer, p.prompt_ids) + pieces
                entries = list(out.prompt_logprobs or [None] * len(p.prompt_ids)) + entries
            logprobs = fmt.completion_logprobs(self.tokenizer, pieces, entries)
        return fmt.completion_choice(index, prefix + text, c, logprobs)

    async def _completion_stream(self, body, prepared, params, gens, include_usage) -> AsyncIterator[str]:
        rid = fmt.new_id("cmpl")
        ended: set[int] = set()
        echoed: set[int] = set()
        # characters of the token pieces already streamed per choice: text_offset counts from their start, as
        # the whole response's does (not the text sent: that lags while a stop string holds text back)
        piece_chars: dict[int, int] = {}
        completion_tokens = 0
        try:
            async for i, out in self._merge(gens):
                for c in out.outputs:
                    index = i * params.n + c.index
                    if index in ended:
                        continue
                    text, pieces, entries = c.delta_text, [], []
                    if body.logprobs is not None and c.delta_token_ids:
                        ctx = prepared[i].prompt_ids + c.token_ids[:len(c.token_ids) - len(c.delta_token_ids)]
                        pieces = fmt.token_pieces(self.tokenizer, c.delta_token_ids, ctx)
                        entries = (c.logprobs or [])[-len(pieces):]
                    if body.echo and index not in echoed:
                        echoed.add(index)
                        text = (prepared[i].prompt or "") + text
                        if body.logprobs is not None:  # the echoed prompt's tokens, as in the whole response
                            pieces = fmt.token_pieces(self.tokenizer, prepared[i].prompt_ids) + pieces
                            entries = list(out.prompt_logprobs or [None] * len(prepared[i].prompt_ids)) + entries
                    logprobs = None
                    if pieces:
                        logprobs = fmt.completion_logprobs(self.tokenizer, pieces, entries, piece_chars.get(index, 0))
                        piece_chars[index] = piece_chars.get(index, 0) + sum(len(piece) for piece in pieces)
                    if not text and not c.finished and logprobs is None:
                        continue
                    if c.finished:
                        ended.add(index)
                        completion_tokens += len(c.token_ids)
                    choice = fmt.completion_choice(index, text, c if c.finished else None, logprobs)
                    yield sse(fmt.envelope("text_completion", rid, self.model_name, [choice]))
            if include_usage:
                prompt_tokens = sum(len(p.prompt_ids) for p in prepared)
                yield sse(fmt.envelope("text_completion", rid, self.model_name, [],
                                       usage=fmt.usage(prompt_tokens, completion_tokens)))
            yield sse("[DONE]")
        except Exception as e:  # after the 200 has been sent: report in-band, then end the stream
            yield sse(from_exception(e).body())
            yield sse("[DONE]")

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat(self, body: ChatCompletionRequest, request: Request, arrival: float):
        self.check_model(body.model)
        include_usage = body.include_usage
        p, params = self.prepare_chat(body, arrival)
        gens = self._streams([p], params, body.cache_salt)
        if body.stream:
            return StreamingResponse(self._chat_stream(body, p, params, gens[0], include_usage),
                                     media_type="text/event-stream")
        (out,) = await self._collect(request, gens)
        choices = []
        for c in out.outputs:
            logprobs = None
            if body.logprobs:
                pieces = fmt.token_pieces(self.tokenizer, c.token_ids, p.prompt_ids)
                logprobs = fmt.chat_logprobs(self.tokenizer, pieces, c.logprobs or [])
            choices.append(fmt.chat_choice(c.index, c, logprobs))
        resp = fmt.envelope("chat.completion", fmt.new_id("chatcmpl"), self.model_name, choices,
                            usage=fmt.usage(len(p.prompt_ids), sum(len(c.token_ids) for c in out.outputs)),
                            kvserve_timings=choices[0]["kvserve_timings"] if choices else None)
        return JSONResponse(resp)

    async def _chat_stream(self, body, p: Prepared, params, gen, include_usage) -> AsyncIterator[str]:
        rid = fmt.new_id("chatcmpl")
        chunk = lambda choices, **kw: sse(fmt.envelope("chat.completion.chunk", rid, self.model_name, choices, **kw))  # noqa: E731
        ended: set[int] = set()
        completion_tokens = 0
        try:
            for i in range(params.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for out in gen:
                for c in out.outputs:
                    if c.index in ended:
                        continue
                    logprobs = None
                    if body.logprobs and c.delta_token_ids:
                        ctx = p.prompt_ids + c.token_ids[:len(c.token_ids) - len(c.delta_token_ids)]
                        pieces = fmt.token_pieces(self.tokenizer, c.delta_token_ids, ctx)
                        logprobs = fmt.chat_logprobs(self.tokenizer, pieces, (c.logprobs or [])[-len(pieces):])
                    if not c.delta_text and not c.finished and logprobs is None:
                        continue
                    choice = {"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                              "logprobs": logprobs, "finish_reason": c.finish_reason}
                    if c.finished:
                        ended.add(c.index)
                        completion_tokens += len(c.token_ids)
                        choice["stop_reason"] = c.stop_reason
                        choice["kvserve_timings"] = fmt.timings(c.latency)
                    yield chunk([choice])
            if include_usage:
                yield chunk([], usage=fmt.usage(len(p.prompt_ids), completion_tokens))
            yield sse("[DONE]")
        except Exception as e:
            yield sse(from_exception(e).body())
            yield sse("[DONE]")
