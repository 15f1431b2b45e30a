"""Building OpenAI response objects (completions and chat; whole and streamed chunks), logprobs in
both formats, and per-token text pieces that concatenate exactly to the decoded text of the tokens
returned (where a stop string ends the output, its tokens are among them, though the text stops before
it, as in vLLM)."""
from __future__ import annotations

import time
import uuid

from kvserve.outputs import CompletionOutput, LatencyBreakdown, TokenLogprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def timings(lat: LatencyBreakdown | None) -> dict | None:
    """kvserve's latency anatomy for one choice (ms), the ``kvserve_timings`` extension field."""
    return None if lat is None else {k: round(v, 3) if isinstance(v, float) else v for k, v in lat.as_dict().items()}


def token_pieces(tokenizer, ids: list[int], context: list[int] = (), skip_special_tokens: bool = True) -> list[str]:
    """Text of each token such that ``"".join(pieces) == decode(ids)`` in the context of the preceding
    ``context`` ids. A token that ends inside a multi-byte character gets "" and the character goes
    to the token that completes it."""
    ids, ctx = list(ids), list(context)[-4:]
    seq = ctx + ids
    pieces, emitted = [], len(ctx)
    for i in range(len(ctx), len(seq)):
        w = max(0, emitted - 6)
        old = tokenizer.decode(seq[w:emitted], skip_special_tokens=skip_special_tokens)
        new = tokenizer.decode(seq[w:i + 1], skip_special_tokens=skip_special_tokens)
        if new.endswith("\ufffd"):
            pieces.append("")
            continue
        pieces.append(new[len(old):])
        emitted = i + 1
    return pieces


def _alt_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, pieces: list[str], entries: list[TokenLogprobs | None], offset0: int = 0) -> dict:
    """Legacy completions format: tokens, token_logprobs, top_logprobs, text_offset (offsets into the
    returned text). ``None`` entries (the first prompt token) give null logprob and top list."""
    text_offset, pos = [], offset0
    for p in pieces:
        text_offset.append(pos)
        pos += len(p)
    return {
        "tokens": pieces,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else {_alt_text(tokenizer, t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)}
                         for e in entries],
        "text_offset": text_offset,
    }


def chat_logprobs(tokenizer, pieces: list[str], entries: list[TokenLogprobs]) -> dict:
    def item(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(item(p, e.logprob), top_logprobs=[item(_alt_text(tokenizer, t), lp)
                                                                for t, lp in zip(e.top_token_ids, e.top_logprobs)])
                        for p, e in zip(pieces, entries)]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, rid: str, model: str, choices: list[dict], **extra) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}


def completion_choice(index: int, text: str, c: CompletionOutput | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": c.finish_reason if c is not None else None,
            "stop_reason": c.stop_reason if c is not None else None,
            "kvserve_timings": timings(c.latency) if c is not None else None}


def chat_choice(index: int, c: CompletionOutput, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "kvserve_timings": timings(c.latency)}
