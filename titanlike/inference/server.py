"""An OpenAI-compatible HTTP server over continuous batching (scripts/serve.py builds it).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events with
"stream": true), GET /v1/models, GET /health. Request fields: model, prompt (text, texts, token
ids or lists of them) or messages, max_tokens, temperature, top_p, n, stop, seed, stream,
stream_options.include_usage, and as extensions (vLLM's names) top_k, repetition_penalty and
skip_special_tokens (default true: the text leaves out special tokens, as transformers' decode does).
A completion's suffix (OpenAI's insertion) becomes a fill-in-the-middle prompt, PSM as the model was
trained with [fim] (data/fim.py): `<fim_prefix> prompt <fim_suffix> suffix <fim_middle>`, the answer
being the middle; a tokenizer without those tokens gets a 400 (titanlike-serve --fim-tokens names others).
Fields whose behaviour this server does not have (logprobs, echo, logit_bias, penalties
other than 0, best_of, tools, a response_format other than text) are refused rather than ignored, so
a client never gets an answer to a question it did not ask; so are fields the endpoint does not know
("Unrecognized request argument supplied: NAME", as OpenAI answers), a temperature outside OpenAI's
[0, 2] and stream_options without stream. Each request is logged in one line: its id, tokens in and
out, time and status.

The HTTP stack is the standard library's ThreadingHTTPServer: one thread per connection parses,
validates and tokenizes, then waits on a queue; one engine thread owns the model and steps the
ContinuousBatch (continuous.py), so every request in flight shares each decode step and a finished
sequence's slot is refilled at the next one. No dependency to install, and the request rate a
generating model sustains (tens per second at most) is far below what a thread per connection
handles; an ASGI stack (uvicorn + starlette) would add two dependencies and an event loop beside
the same engine thread for no gain here.

A client that disconnects is noticed when its next piece of stream cannot be written: its
sequences are cancelled and their slots freed at the next step. A request the server cannot serve
gets a 4xx with OpenAI's error body ({"error": {"message", "type", "param", "code"}}), its message
one sentence naming the field; nothing a request holds can stop the engine thread.

What a client on the network controls is bounded (docs/reliability.md lists each case): an optional
API key (`Authorization: Bearer KEY`, compared in constant time) on every route but /health; the
body's size (a missing, negative or malformed Content-Length is refused before anything is read),
its JSON (integers of more digits than Python reads, nesting deeper than MAX_JSON_DEPTH), the
sequences one request may queue (prompts x n) and all requests together, the stop strings' number
and length; each connection has a read timeout and their number a cap, so slow or half-open
clients hold neither threads nor memory for long. A non-streamed client that disconnects is noticed
while it waits (its socket polled) and its sequences cancelled; a sampling step that raises ends
only the requests it was serving. drain() stops accepting and lets the requests in flight finish
for a bounded time (titanlike-serve on SIGTERM).
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import re
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from titanlike.inference.continuous import ContinuousBatch, Sequence
from titanlike.inference.engine import Engine, GenerationError
from titanlike.inference.processor import Processor
from titanlike.inference.sampling import MAX_SEED, SamplingParams

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
# The fill-in-the-middle tokens of StarCoder-style tokenizers, fim.*_token's defaults (objectives/causal_lm.py).
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
MAX_N = 64
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024  # all stop strings together: each decode step searches the new text for them
MAX_JSON_DEPTH = 32  # a request body is a few levels deep (messages -> parts -> text)
MAX_REQUEST_SEQUENCES = 256  # prompts x n of one request
MAX_QUEUED_SEQUENCES = 1024  # sequences waiting for a slot, all requests together
MAX_CONNECTIONS = 256
READ_TIMEOUT = 30.0  # seconds a connection may take to send a request's next bytes
DISCONNECT_POLL = 0.1  # seconds between looks at a waiting non-streamed client's socket

# SamplingParams names its fields; the API names them so.
_API_NAMES = {"max_new_tokens": "max_tokens", "stop_strings": "stop"}
_FINISH = {"stop": "stop", "length": "length", "context": "length"}
# The request fields each endpoint knows (OpenAI's, and vLLM's top_k and repetition_penalty); any other
# is refused as OpenAI refuses it. Those this server cannot honour are refused when set, in parse.
_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "logprobs",
           "logit_bias", "presence_penalty", "frequency_penalty", "user", "top_k", "repetition_penalty",
           "skip_special_tokens"}
_ENDPOINT_FIELDS = {False: _FIELDS | {"prompt", "best_of", "echo", "suffix"},
                    True: _FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                     "response_format"}}
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]


def _max_int_digits() -> int:
    try:
        limit = sys.get_int_max_str_digits()
    except AttributeError:  # Python before 3.11 (and its security releases) has no limit
        limit = 0
    return limit or 4300  # 0: the limit is off in this process; 4300 is Python's default


def _parse_json(raw: bytes):
    """json.loads with Python's limit on an integer's digits and MAX_JSON_DEPTH (ApiError 400)."""
    digits = _max_int_digits()

    def parse_int(text: str) -> int:
        if len(text.lstrip("-")) > digits:
            raise ApiError(400, f"the request body holds an integer of {len(text.lstrip('-'))} digits, more than the "
                           f"{digits} this server reads")
        return int(text)

    try:
        body = json.loads(raw, parse_int=parse_int)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON ({_one_line(e)})") from None
    stack = [(body, 1)]
    while stack:  # iterative, so a deep body cannot exhaust the stack here either
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)
                         if isinstance(v, (dict, list)))
    return body


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


class ApiError(Exception):
    """A request refused: HTTP status, one sentence, the field it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class _Request:
    """A validated request: its prompts, the settings of each choice, and how to answer."""

    chat: bool
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice, prompt-major: choice index = prompt * n + j
    n: int
    stream: bool
    include_usage: bool
    skip_special_tokens: bool = True  # the text leaves out the tokenizer's special tokens


class OpenAIServer:
    """The HTTP server and its engine thread. start() serves in background threads; shutdown() stops."""

    def __init__(self, engine: Engine, processor: Processor, *, model_name: str, slots: int = 8,
                 host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 max_connections: int = MAX_CONNECTIONS, read_timeout: float = READ_TIMEOUT,
                 drain_seconds: float = 30.0, fim_tokens: tuple[str, str, str] = FIM_TOKENS):
        """processor: the prompts' tokens and the answers' text (processor.py); chat needs its template.
        api_key: what every route but /health requires as `Authorization: Bearer KEY` (None: none).
        drain_seconds: what titanlike-serve gives drain() on SIGTERM. fim_tokens: the prefix, suffix and
        middle tokens a completion's suffix is written with, by their text."""
        self.engine, self.processor, self.model_name = engine, processor, model_name
        self.fim_tokens = tuple(fim_tokens)
        from titanlike.data.fim import token_id

        ids = [token_id(processor.tokenizer, t) for t in self.fim_tokens]
        self._fim_ids = None if None in ids else ids
        self.drain_seconds = drain_seconds
        self.api_key = api_key or None
        self.batch = ContinuousBatch(engine, slots)
        self.created = int(time.time())
        self.compiled = (0, 0.0)  # (decode-step shapes compiled, seconds): warm_up, compile_in_background
        self._stop = threading.Event()
        self.draining = False
        self._inflight = 0  # POST requests being answered (drain waits for them)
        self._inflight_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        handler = type("Handler", (_Handler,), {"app": self, "timeout": read_timeout})
        self.http = _HTTPServer((host, port), handler, max_connections)

    def warm_up(self) -> tuple[int, float]:
        """Compile the decode step's shapes before serving (continuous.py warm_up), so no request waits
        for a compile: (shapes, seconds), kept in `compiled` for the start line; (0, 0.0) when eager.
        torch keeps what it compiled on disk (inductor's FX graph and AOTAutograd caches, under
        TORCHINDUCTOR_CACHE_DIR), so the next start of the same model compiles in a fraction of the time."""
        started = time.perf_counter()
        shapes = self.batch.warm_up()
        self.compiled = (shapes, time.perf_counter() - started if shapes else 0.0)
        return self.compiled

    def compile_in_background(self, say=None) -> int:
        """Serve eager at once and compile the decode step's shapes in a thread (continuous.py
        compile_in_background), each shape switching to its compiled step when it is ready; the number of
        shapes (0 when eager). say(line) gets "compiled N shapes of the decode step in X s" at the end."""
        def done(compiled: int, seconds: float) -> None:
            self.compiled = (compiled, seconds)
            if say is not None:
                failed = f"; {total - compiled} failed and stay eager" if compiled < total else ""
                say(f"compiled {compiled} shapes of the decode step in {seconds:.1f} s{failed}")

        total = len(self.batch.shapes())
        return self.batch.compile_in_background(done)

    @property
    def address(self) -> tuple[str, int]:
        return self.http.server_address[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> OpenAIServer:
        """Serve in background threads (the engine's and the accept loop's)."""
        for target in (self._engine_loop, self.http.serve_forever):
            thread = threading.Thread(target=target, daemon=True, name=f"titanlike-serve-{target.__name__}")
            thread.start()
            self._threads.append(thread)
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until KeyboardInterrupt (the engine in a thread of its own)."""
        thread = threading.Thread(target=self._engine_loop, daemon=True, name="titanlike-serve-engine")
        thread.start()
        try:
            self.http.serve_forever()
        finally:
            self._stop.set()
            self.http.server_close()

    def shutdown(self) -> None:
        self.batch.stop_compiling()
        self._stop.set()
        self.http.shutdown()
        self.http.server_close()
        for thread in self._threads:
            thread.join(timeout=10)

    def drain(self, seconds: float) -> int:
        """Stop accepting, let the requests in flight finish for up to `seconds`, cancel what is left
        (answered 503), then stop; the number of sequences cancelled."""
        self.draining = True
        self.batch.stop_compiling()
        self.http.shutdown()  # the accept loop ends; open connections finish their request
        self.http.server_close()
        deadline = time.monotonic() + max(seconds, 0)
        while self.batch.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        cancelled = self.batch.cancel_all()
        deadline = time.monotonic() + 5  # the cancelled requests' answers are written by their threads
        while (self._inflight or self.batch.busy()) and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        return cancelled

    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            if not self.batch.wait_for_work(timeout=0.1):
                continue
            try:
                self.batch.step()
            except Exception as e:  # a model error ends the requests in flight, not the server
                logger.error(f"generation step failed, ending the requests it served: {_one_line(e)}")
                self.batch.fail_all(e)

    # Requests ------------------------------------------------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "titanlike",
                "max_model_len": self.batch.capacity}

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "slots": self.batch.slots, "running": self.batch.active,
                "waiting": len(self.batch.waiting), "decode_steps": self.batch.steps,
                "cancelled": self.batch.cancelled}

    def parse(self, body: dict, *, chat: bool) -> _Request:
        """Validate a request body (ApiError, one sentence naming the field, for a bad one)."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required: a string naming the model (GET /v1/models lists it)", "model")
        if model != self.model_name:
            raise ApiError(404, f"the model '{model}' is not served here; this server serves '{self.model_name}'",
                           "model", "model_not_found")
        unknown = sorted(set(body) - _ENDPOINT_FIELDS[chat])
        if unknown:
            raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
        for name in ("logprobs", "top_logprobs", "echo", "logit_bias", "presence_penalty",
                     "frequency_penalty", "tools", "tool_choice"):
            if body.get(name) and body.get(name) != "none":  # absent, null, false, 0, empty, "none": nothing
                raise ApiError(400, f"'{name}' is not supported by this server", name)
        response_format = body.get("response_format")
        if response_format is not None and response_format != {"type": "text"}:
            kind = response_format.get("type") if isinstance(response_format, dict) else response_format
            raise ApiError(400, f"'response_format' of type {kind!r} is not supported by this server (only text)",
                           "response_format")
        n = body.get("n", 1)
        if n is None:
            n = 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise ApiError(400, f"'n' must be an integer from 1 to {MAX_N}, got {n!r}", "n")
        best_of = body.get("best_of")
        if best_of is not None and best_of != n:
            raise ApiError(400, "'best_of' is not supported by this server (only best_of = n)", "best_of")
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise ApiError(400, f"'stream' must be true or false, got {stream!r}", "stream")
        options = body.get("stream_options")
        if options is not None and not stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
        options = options or {}
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        include_usage = bool(options.get("include_usage", False))
        skip_special_tokens = body.get("skip_special_tokens", True)
        if skip_special_tokens is None:
            skip_special_tokens = True
        if not isinstance(skip_special_tokens, bool):
            raise ApiError(400, f"'skip_special_tokens' must be true or false, got {skip_special_tokens!r}",
                           "skip_special_tokens")

        if chat:
            prompts = [self._chat_prompt(body.get("messages"))]
            stops = self.processor.stop_ids(chat=True)
        else:
            prompts = self._completion_prompts(body.get("prompt"), n, body.get("suffix"))
            stops = self.processor.stop_ids(chat=False)

        context = self.batch.capacity
        for prompt in prompts:
            if len(prompt) >= context:
                raise ApiError(400, f"the prompt has {len(prompt)} tokens, which leaves no room in this model's "
                               f"context of {context} tokens; shorten it to at most {context - 1}",
                               "messages" if chat else "prompt", "context_length_exceeded")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
        longest = max(map(len, prompts))
        if max_tokens is None:
            # OpenAI's defaults: 16 for a completion; a chat answer may fill the context.
            max_tokens = context - longest if chat else min(16, context - longest)
        elif isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1 \
                and longest + max_tokens > context:
            raise ApiError(400, f"this model's context is {context} tokens, but the prompt's {longest} tokens and "
                           f"max_tokens {max_tokens} ask for {longest + max_tokens}; lower max_tokens to at most "
                           f"{context - longest}", "max_tokens", "context_length_exceeded")

        stop = body.get("stop")
        stop_strings = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
        if stop_strings is None:
            stop_strings = ()
        elif not isinstance(stop_strings, tuple) or len(stop_strings) > MAX_STOP_STRINGS:
            raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
        stop_chars = sum(len(s) for s in stop_strings if isinstance(s, str))
        if stop_chars > MAX_STOP_CHARS:
            raise ApiError(400, f"'stop' holds {stop_chars} characters, more than the {MAX_STOP_CHARS} this server "
                           "searches each new piece of text for", "stop")
        seed = body.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed <= MAX_SEED:
            raise ApiError(400, f"'seed' must be an integer from 0 to {MAX_SEED}, got {seed}", "seed")
        fields = {"max_new_tokens": max_tokens, "stop_strings": stop_strings, "stop_token_ids": stops}
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("repetition_penalty", 1.0)):
            value = body.get(name)
            fields[name] = default if value is None else value
        temperature = fields["temperature"]
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
                and temperature > MAX_TEMPERATURE:
            raise ApiError(400, f"'temperature' must be from 0 to {MAX_TEMPERATURE:g}, got {temperature}",
                           "temperature")
        if fields["top_k"] == -1:  # vLLM's spelling of "no top-k"
            fields["top_k"] = 0
        params = []
        for _ in prompts:
            for j in range(n):
                # Each choice draws from a generator of its own, so what it gets does not depend on
                # the other requests in the batch; seed + j keeps n choices of one seed apart.
                choice_seed = (seed + j) % (MAX_SEED + 1) if isinstance(seed, int) and not isinstance(seed, bool) \
                    else seed
                try:
                    params.append(SamplingParams(**fields, seed=choice_seed))
                except ValueError as e:
                    name, _, rest = str(e).partition(" ")
                    name = _API_NAMES.get(name, name)
                    raise ApiError(400, f"'{name}' {rest}", name) from None
        return _Request(chat, prompts, params, n, bool(stream), include_usage, skip_special_tokens)

    def _completion_prompts(self, prompt, n: int = 1, suffix=None) -> list[list[int]]:
        if suffix is not None and not isinstance(suffix, str):
            raise ApiError(400, f"'suffix' must be a string, got {type(suffix).__name__}", "suffix")
        if suffix:
            if self._fim_ids is None:
                raise ApiError(400, "'suffix' needs fill-in-the-middle tokens, and this model's tokenizer has no "
                               f"{', '.join(self.fim_tokens)} (titanlike-serve --fim-tokens names the ones it was "
                               "trained with)", "suffix")
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt))):
                raise ApiError(400, "'suffix' needs text prompts, not token ids", "suffix")

        def bad() -> ApiError:
            return ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                            "lists of token ids", "prompt")

        if prompt is None:
            raise ApiError(400, "'prompt' is required", "prompt")
        if isinstance(prompt, str):
            items = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt:
            items = prompt
        else:
            raise ApiError(400, "'prompt' is empty: give some text or token ids", "prompt") \
                if isinstance(prompt, list) else bad()
        if len(items) * n > MAX_REQUEST_SEQUENCES:  # before tokenizing them all
            raise ApiError(400, f"{len(items)} prompts x n {n} ask for {len(items) * n} sequences, more than the "
                           f"{MAX_REQUEST_SEQUENCES} one request may queue; send fewer prompts or a lower n",
                           "prompt" if len(items) > 1 else "n")
        out, vocab = [], self.processor.tokenizer.vocab_size
        for item in items:
            if isinstance(item, str) and suffix:
                out.append(self._fim_prompt(item, suffix))
            elif isinstance(item, str):
                out.append(self.processor.encode(item))
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                if not item:
                    raise ApiError(400, "a prompt of token ids is empty: give at least one token", "prompt")
                bad_ids = [t for t in item if not 0 <= t < vocab]
                if bad_ids:
                    raise ApiError(400, f"the prompt's token id {bad_ids[0]} is not in the model's vocabulary of "
                                   f"{vocab}", "prompt")
                out.append(list(item))
            else:
                raise bad()
        return out

    def _fim_prompt(self, prompt: str, suffix: str) -> list[int]:
        """PSM, as [fim] trains it: the framing's leading ids (a BOS), <PRE> prompt <SUF> suffix <MID>."""
        pre, suf, mid = self._fim_ids
        encode = self.processor.tokenizer.encode
        return [*self.processor.framing.before, pre, *encode(prompt, bos=False, eos=False), suf,
                *encode(suffix, bos=False, eos=False), mid]

    def _chat_prompt(self, messages) -> list[int]:
        if self.processor.template is None:
            raise ApiError(400, "this server has no chat template: use /v1/completions", "messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' is required: a non-empty list of {\"role\", \"content\"} objects",
                           "messages")
        plain = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a 'role' string", "messages")
            content = message.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, f"messages[{i}].content holds a part other than text, which this model "
                                   "cannot read", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", "messages")
            plain.append({"role": message["role"], "content": content})
        try:
            return self.processor.encode(plain)
        except Exception as e:  # the template refuses the conversation (a role it does not know, a limit...)
            raise ApiError(400, f"the chat template cannot render these messages: {_one_line(e)}",
                           "messages") from None

    def submit(self, request: _Request, events: queue.Queue) -> list[Sequence]:
        """Queue every choice of a request; events receive ("text", index, piece) and ("done", index, seq)."""
        seqs = []
        stop_ids = frozenset().union(*(params.stop_token_ids for params in request.params))

        def detokenize(ids: list[int]) -> str:
            return self.processor.decode(ids, stop_ids=stop_ids, skip_special_tokens=request.skip_special_tokens)

        queued = len(self.batch.waiting)
        if queued + len(request.params) > MAX_QUEUED_SEQUENCES:
            raise ApiError(503, f"the server is busy: {queued} sequences wait for a slot and this request would add "
                           f"{len(request.params)}, past the {MAX_QUEUED_SEQUENCES} it queues; retry later",
                           code="overloaded")
        try:
            for index, params in enumerate(request.params):
                prompt = request.prompts[index // request.n]
                seqs.append(self.batch.submit(
                    prompt, params, detokenize=detokenize,
                    on_text=lambda seq, text, index=index: events.put(("text", index, text)),
                    on_done=lambda seq, index=index: events.put(("done", index, seq))))
        except GenerationError as e:
            for seq in seqs:
                self.batch.cancel(seq)
            raise ApiError(400, str(e), "prompt") from None
        return seqs


class _HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `max_connections` open connections (one thread each): one past
    the cap is answered 503 and closed at once, so clients that hold connections open cannot
    exhaust threads or memory; the read timeout (the handler's) ends the ones that stall."""

    daemon_threads = True
    request_queue_size = 1024  # the listen backlog (socketserver's default is 5)

    def __init__(self, address, handler, max_connections: int):
        self._slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            logger.warning(f"{client_address[0]} refused: {self.max_connections} connections are open already")
            try:
                body = json.dumps(ApiError(503, f"the server has {self.max_connections} connections open already; "
                                           "retry later", code="overloaded").body()).encode()
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        # One line, not socketserver's traceback on stderr: a client's misbehaviour is not the server's.
        error = sys.exc_info()[1]
        logger.warning(f"{client_address[0]} connection ended: {_one_line(error) if error else 'unknown error'}")


def _finish_reason(seq: Sequence) -> str:
    return _FINISH.get(seq.completion.finish_reason, seq.completion.finish_reason or "stop")


class _Handler(BaseHTTPRequestHandler):
    app: OpenAIServer
    _body_read = True  # False while a POST's body is unread (do_POST)
    protocol_version = "HTTP/1.1"
    server_version = "titanlike"

    def log_message(self, format, *args):  # through logging, not stderr
        logger.info("%s %s", self.address_string(), format % args)

    def _send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, error: ApiError) -> None:
        if not self._body_read:  # the connection cannot carry another request
            self.close_connection = True
        self._send_json(error.status, error.body())

    def _authorize(self) -> None:
        """ApiError 401 unless the request carries the server's API key (compared in constant time)."""
        key = self.app.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "this server requires an API key: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), key.encode()):
            raise ApiError(401, "the API key is not this server's", code="invalid_api_key")

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/health", "/v1/health"):
            return self._send_json(200, self.app.health())
        try:
            self._authorize()
        except ApiError as e:
            logger.info(f"{self.address_string()} GET {path}: status 401")
            return self._error(e)
        if path == "/v1/models":
            return self._send_json(200, self.app.models())
        if path == f"/v1/models/{self.app.model_name}":
            return self._send_json(200, self.app._model_card())
        self._error(ApiError(404, f"no such endpoint: GET {path}", code="not_found"))

    def log_request(self, code="-", size="-"):
        if self.command != "POST":  # a POST gets its own line, with its id, tokens and time (do_POST)
            super().log_request(code, size)

    def send_response(self, code, message=None):
        self._status = code
        super().send_response(code, message)

    def do_POST(self):
        path = self.path.split("?")[0].rstrip("/")
        start = time.monotonic()
        self._rid, self._status, self._tokens, self._body_read, self._refusal = "-", None, (0, 0), False, ""
        with self.app._inflight_lock:
            self.app._inflight += 1
        try:
            self._post(path)
        finally:
            with self.app._inflight_lock:
                self.app._inflight -= 1
            logger.info(f"{self.address_string()} POST {path} {self._rid}: status {self._status}, "
                        f"{self._tokens[0]} tokens in, {self._tokens[1]} out, {time.monotonic() - start:.3f} s"
                        + (f": {self._refusal}" if self._refusal else ""))

    def _post(self, path: str) -> None:
        chat = {"/v1/completions": False, "/v1/chat/completions": True}.get(path)
        try:
            if self.app.draining:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            self._authorize()
            body = self._read_body()
            if chat is None:
                raise ApiError(404, f"no such endpoint: POST {path}", code="not_found")
            request = self.app.parse(body, chat=chat)
        except ApiError as e:
            self._refusal = e.message
            return self._error(e)
        self._tokens = (sum(map(len, request.prompts)), 0)
        events: queue.Queue = queue.Queue()
        try:
            seqs = self.app.submit(request, events)
        except ApiError as e:
            self._refusal = e.message
            return self._error(e)
        try:
            if request.stream:
                self._stream(request, seqs, events)
            else:
                self._answer(request, seqs, events)
        except (OSError, ValueError):  # BrokenPipe, ConnectionReset, a send that timed out, a closed file
            # The client left (or stopped reading): free its slots at the next step.
            self._refusal = "the client disconnected"
            self._status = 499  # nginx's code for a request its client closed
            self.close_connection = True
        finally:
            self._tokens = (self._tokens[0], sum(len(seq.completion.tokens) for seq in seqs))
            for seq in seqs:
                self.app.batch.cancel(seq)

    def _read_body(self):
        """The request's JSON body, read only when its Content-Length is a plain number within the cap
        (`int()` would take "-1", which reads to the end of the stream, and " +1_0")."""
        if self.headers.get("Transfer-Encoding") is not None:
            raise ApiError(411, "a chunked request body is not accepted: send it with a Content-Length header")
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            raise ApiError(411, "the request has no Content-Length header")
        if len(set(lengths)) > 1 or not re.fullmatch(r"[0-9]{1,18}", lengths[0]):
            raise ApiError(400, f"the Content-Length header must be one non-negative number, got "
                           f"{', '.join(lengths)[:40]!r}")
        length = int(lengths[0])
        if length > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.timeout:g} s") from None
        if len(raw) < length:
            raise ApiError(400, f"the request body ended after {len(raw)} of the {length} bytes its Content-Length "
                           "announced")
        self._body_read = True
        return _parse_json(raw)

    def _client_gone(self) -> bool:
        """Whether the client closed its end (a non-streamed request's client is otherwise silent)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _ids(self, chat: bool) -> tuple[str, str]:
        self._rid, kind = (f"chatcmpl-{uuid.uuid4().hex}", "chat.completion") if chat else \
            (f"cmpl-{uuid.uuid4().hex}", "text_completion")
        return self._rid, kind

    def _usage(self, request: _Request, seqs: list[Sequence]) -> dict:
        prompt = sum(map(len, request.prompts))
        completion = sum(len(seq.completion.tokens) for seq in seqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _answer(self, request: _Request, seqs: list[Sequence], events: queue.Queue) -> None:
        remaining, look = len(seqs), time.monotonic() + DISCONNECT_POLL
        while remaining:
            if time.monotonic() >= look:  # text events keep coming while it decodes: look by the clock
                if self._client_gone():
                    raise ConnectionAbortedError("the client disconnected")
                look = time.monotonic() + DISCONNECT_POLL
            try:
                kind, _, seq = events.get(timeout=DISCONNECT_POLL)
            except queue.Empty:
                continue
            if kind == "done":
                remaining -= 1
                if seq.completion.finish_reason == "error":
                    self._refusal = f"generation failed: {_one_line(seq.error)}"
                    return self._error(ApiError(500, self._refusal))
                if seq.completion.finish_reason == "cancelled" and self.app.draining:
                    self._refusal = "the server is shutting down"
                    return self._error(ApiError(503, "the server shut down before this request finished",
                                                code="shutting_down"))
        rid, kind = self._ids(request.chat)
        choices = []
        for index, seq in enumerate(seqs):
            choice = {"index": index, "finish_reason": _finish_reason(seq), "logprobs": None}
            if request.chat:
                choice["message"] = {"role": "assistant", "content": seq.completion.text}
            else:
                choice["text"] = seq.completion.text
            choices.append(choice)
        self._send_json(200, {"id": rid, "object": kind, "created": int(time.time()), "model": self.app.model_name,
                              "choices": choices, "usage": self._usage(request, seqs)})

    def _stream(self, request: _Request, seqs: list[Sequence], events: queue.Queue) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream ends when the connection does
        self.end_headers()
        rid, kind = self._ids(request.chat)
        kind += ".chunk" if request.chat else ""
        created = int(time.time())

        def send(payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def chunk(choices: list[dict]) -> dict:
            return {"id": rid, "object": kind, "created": created, "model": self.app.model_name, "choices": choices}

        def choice(index: int, piece: str | None, finish: str | None, first: bool = False) -> dict:
            if request.chat:
                delta = {"role": "assistant", "content": ""} if first else {} if piece is None else {"content": piece}
                return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": index, "text": piece or "", "logprobs": None, "finish_reason": finish}

        if request.chat:
            send(chunk([choice(i, None, None, first=True) for i in range(len(seqs))]))
        remaining = len(seqs)
        while remaining:
            try:
                kind_, index, value = events.get(timeout=1.0)
            except queue.Empty:
                # Nothing new (the request waits for a slot): a comment line, so a client that left
                # is noticed while it waits too.
                self.wfile.write(b": waiting\n\n")
                self.wfile.flush()
                continue
            if kind_ == "text":
                send(chunk([choice(index, value, None)]))
                continue
            remaining -= 1
            if value.completion.finish_reason == "error":
                self._refusal = f"generation failed: {_one_line(value.error)}"
                send({"error": ApiError(500, self._refusal).body()["error"]})
                return
            if value.completion.finish_reason == "cancelled" and self.app.draining:
                self._refusal = "the server is shutting down"
                send({"error": ApiError(503, "the server shut down before this request finished",
                                        code="shutting_down").body()["error"]})
                return
            send(chunk([choice(index, None, _finish_reason(value))]))
        if request.include_usage:
            send({**chunk([]), "usage": self._usage(request, seqs)})
        send("[DONE]")


__all__ = ["ApiError", "OpenAIServer"]
