"""FastAPI application: OpenAI routes (completions, chat, models), tokenize/detokenize, health and
Prometheus metrics. ``/v1`` routes and tokenize/detokenize require ``Authorization: Bearer KEY``
when the server has an API key; ``/health`` and ``/metrics`` stay open."""
from __future__ import annotations

import secrets
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kvserve.metrics.prometheus import ServerMetrics
from kvserve.metrics.timeline import now
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.errors import APIError, install_handlers, parse_body
from kvserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                     reject_unsupported)
from kvserve.server.serving import OpenAIServing

DEFAULT_MAX_BODY_BYTES = 8 << 20


def create_app(llm, api_key: str | None = None, model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An app serving ``llm`` (a :class:`kvserve.llm.LLM`). The engine thread starts with the app's
    lifespan and stops (aborting what is in flight) when it ends."""
    name = model_name or llm.engine.model_name
    metrics = ServerMetrics(name)
    engine = AsyncEngine(llm.engine, on_step=metrics.on_step)
    serving = OpenAIServing(llm, engine, name)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    install_handlers(app)

    async def auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    protected = [Depends(auth)]

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "kvserve",
                "max_model_len": llm.engine.max_model_len}

    @app.get("/v1/models", dependencies=protected)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=protected)  # the openai client's models.retrieve()
    async def model(model_id: str):
        serving.check_model(model_id)  # 404 model_not_found for another name
        return model_card()

    @app.post("/v1/completions", dependencies=protected)
    async def completions(request: Request):
        arrival = now()
        body = await parse_body(request, CompletionRequest, max_body_bytes)
        return await serving.completion(body, request, arrival)

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request):
        arrival = now()
        body = await parse_body(request, ChatCompletionRequest, max_body_bytes)
        return await serving.chat(body, request, arrival)

    @app.post("/tokenize", dependencies=protected)
    async def tokenize(request: Request):
        body = await parse_body(request, TokenizeRequest, max_body_bytes)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt", "invalid_value")
        if body.messages is not None:  # the prompt /v1/chat/completions would prefill for these messages
            reject_unsupported(body)  # what chat refuses (tools: vLLM's template renders them into the prompt)
            _, ids = serving.encode_chat(body)
        else:
            ids = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.engine.max_model_len}

    @app.post("/detokenize", dependencies=protected)
    async def detokenize(request: Request):
        body = await parse_body(request, DetokenizeRequest, max_body_bytes)
        serving.check_model(body.model)
        vocab = llm.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    @app.get("/", include_in_schema=False)
    async def root():
        return PlainTextResponse(f"kvserve serving {name}: see /v1/models, /health, /metrics\n")

    return app
