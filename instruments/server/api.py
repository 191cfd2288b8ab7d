"""OpenAI's request and response bodies: what a request asks, checked, and what goes back.
Torch-free, no I/O: ``instruments.server.app`` calls these.

  job = parse_completion(body, model) / parse_chat(body, model)   a ``Job`` (the prompt as ids,
        max_tokens, sampling, stream, stop strings, eos handling, what to include), or
        ``ApiError`` (status, message, type, param, code) for anything it cannot serve
  error_body(err)           {"error": {"message", "type", "param", "code"}}, OpenAI's shape
  chunk(job, rid, ...) / final(job, rid, ...)   one SSE chunk / the whole non-streamed body
  Detokenizer(decode)       text deltas from token ids, holding back an unfinished UTF-8
                            character; ``StopMatcher`` holds back what could still be a stop
                            string's start

A field this server does not implement (``n`` > 1, logprobs, penalties, ``best_of``, ``echo``,
``logit_bias``, tools) is refused with 400 naming it, never ignored. Unknown fields are ignored,
as OpenAI's server does. ``max_tokens`` absent: the room left in the model's context (vLLM's
choice). ``temperature`` absent: 1.0, OpenAI's default. ``ignore_eos`` (vLLM's and
llama.cpp's extension) generates to ``max_tokens``; ``return_token_ids`` (vLLM's) adds each
chunk's token ids, which the exactness tests read.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from engine.serving.sampling import MAX_SEED, MAX_TEMPERATURE

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256
MAX_BODY_BYTES = 8 * 2**20  # a prompt of the longest context, as JSON, is far smaller


class ApiError(Exception):
    """A request answered with an OpenAI-style error body and a 4xx (or 5xx) status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (status, message, param,
                                                                      code, type_)


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


@dataclass
class Job:
    """One request, as the engine core and the stream need it."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stream: bool
    ignore_eos: bool
    stop: list[str] = field(default_factory=list)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage every chunk
    token_ids: bool = False  # return_token_ids


# ------------------------------------------------------------------------------ checking
def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"{name} must be a number, got {v!r}", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"{name} must be within {lo:g}..{hi:g}, got {v!r}", name)
    return float(v)


def _whole(body: dict, name: str, lo: int, hi: int, default: int | None = None
           ) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be a whole number, got {v!r}", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"{name} must be within {lo}..{hi}, got {v}", name)
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true or false, got {v!r}", name)
    return v


UNSUPPORTED = {  # field -> the value that asks for nothing (None is always fine)
    "n": 1, "best_of": 1, "echo": False, "logprobs": (False, 0), "top_logprobs": 0,
    "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": "",
    "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
}


def _refuse_unsupported(body: dict) -> None:
    for name, fine in UNSUPPORTED.items():
        v = body.get(name)
        if v is None or v == fine or (isinstance(fine, tuple) and v in fine):
            continue
        raise ApiError(400, f"{name}={v!r} is not supported by this server; allowed: leave "
                       f"it out" + (f" or {fine!r}" if not isinstance(fine, tuple) else ""),
                       name, "unsupported_parameter")


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a string or a list of non-empty strings, got {v!r}",
                       "stop")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop allows at most {MAX_STOP} strings of at most "
                       f"{MAX_STOP_CHARS} characters", "stop")
    return stops


def _common(body: Any, served: str, kind: str, prompt: list[int], context: int) -> Job:
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(404, f"the model {model!r} does not exist here; allowed: {served!r}",
                       "model", "model_not_found")
    _refuse_unsupported(body)
    if len(prompt) >= context:
        raise ApiError(400, f"the prompt is {len(prompt)} tokens; this model's maximum context "
                       f"length is {context} tokens, and at least one must be left to generate",
                       "prompt" if kind == "completion" else "messages", "context_length_exceeded")
    room = context - len(prompt)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _whole(body, key, 1, 10**9, room)
    assert max_tokens is not None
    if max_tokens > room:
        raise ApiError(400, f"this model's maximum context length is {context} tokens: the "
                       f"prompt's {len(prompt)} + {key}={max_tokens} = "
                       f"{len(prompt) + max_tokens}; allowed: {key} of at most {room}", key,
                       "context_length_exceeded")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, f"stream_options must be an object, got {opts!r}", "stream_options")
    opts = opts or {}
    return Job(kind=kind, model=served, prompt=prompt, max_tokens=max_tokens,
               temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
               top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
               top_k=max(_whole(body, "top_k", -1, 10**9, 0) or 0, 0),  # -1: vLLM's no cut
               seed=_whole(body, "seed", 0, MAX_SEED),
               stream=_flag(body, "stream"), ignore_eos=_flag(body, "ignore_eos"),
               stop=_stop(body), include_usage=bool(opts.get("include_usage")),
               continuous_usage=bool(opts.get("continuous_usage_stats")),
               token_ids=_flag(body, "return_token_ids"))


def _ids(v: Any, vocab: int) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in v):
        bad = next((t for t in v if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary; allowed: "
                           f"0..{vocab - 1}", "prompt")
        return list(v)
    return None


def parse_completion(body: Any, served: str, tok: Any, context: int, vocab: int) -> Job:
    """/v1/completions: ``prompt`` is a string or token ids (one prompt a request)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    ids = _ids(p, vocab)
    if ids is None:
        if not isinstance(p, str):
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt "
                           f"per request), got {type(p).__name__}", "prompt")
        ids = tok.encode(p)
    if not ids:
        raise ApiError(400, "the prompt is empty; give at least one token", "prompt")
    return _common(body, served, "completion", ids, context)


def parse_chat(body: Any, served: str, tok: Any, context: int) -> Job:
    """/v1/chat/completions: ``messages`` rendered with the model's chat template."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    turns = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                             "developer"):
            raise ApiError(400, f"each message needs a role of system, user or assistant, got "
                           f"{m!r}"[:200], "messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(x, dict) and x.get("type") == "text" for x in c):
                raise ApiError(400, "only text content parts are supported", "messages")
            c = "".join(str(x.get("text", "")) for x in c)
        if not isinstance(c, str):
            raise ApiError(400, f"message content must be a string, got {c!r}"[:200],
                           "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        turns.append({"role": role, "content": c})
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, "this model has no chat template; allowed: /v1/completions",
                       "messages")
    ids = tok.encode(tok.chat_messages(turns))
    return _common(body, served, "chat", ids, context)


# ------------------------------------------------------------------------------ answering
def usage(job: Job, generated: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": generated,
            "total_tokens": len(job.prompt) + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chunk(job: Job, rid: str, created: int, text: str, ids: list[int],
          finish: str | None, first: bool, use: dict | None) -> dict[str, Any]:
    """One streamed chunk: ``text`` (and ``ids`` when asked), ``finish`` on the last."""
    if job.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
            {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    if job.token_ids:
        choice["token_ids"] = ids
    out = {"id": rid, "object": obj, "created": created, "model": job.model,
           "choices": [choice]}
    if use is not None:
        out["usage"] = use
    return out


def usage_chunk(job: Job, rid: str, created: int, use: dict) -> dict[str, Any]:
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": job.model, "choices": [],
            "usage": use}


def final(job: Job, rid: str, created: int, text: str, ids: list[int], finish: str,
          use: dict) -> dict[str, Any]:
    """The whole body of a request that did not stream."""
    if job.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                          "content": text},
                                  "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    if job.token_ids:
        choice["token_ids"] = ids
        choice["prompt_token_ids"] = job.prompt
    return {"id": rid, "object": obj, "created": created, "model": job.model,
            "choices": [choice], "usage": use}


def now_s() -> int:
    return int(time.time())


class Detokenizer:
    """Text deltas of a growing list of token ids (TGI's prefix/read offsets): the text of the
    ids since ``prefix`` is decoded each time, and what is new past ``read`` is given once it
    ends in a whole character."""

    def __init__(self, decode: Any) -> None:
        self.decode, self.ids, self.prefix, self.read = decode, [], 0, 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back (an unfinished character at the end of the stream)."""
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]


class StopMatcher:
    """Text given out as it comes, less what could still begin a stop string; ``feed`` returns
    (text to send, stopped)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held = stops, ""
        self.keep = max((len(s) for s in stops), default=1) - 1

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        cut = max(len(buf) - self.keep, 0)
        self.held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
