"""An OpenAI-compatible HTTP server over continuous batching (scripts/serve.py builds it).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events with
"stream": true), GET /v1/models, GET /health. Request fields: model, prompt (text, texts, token
ids or lists of them) or messages, max_tokens, temperature, top_p, n, stop, seed, stream,
stream_options.include_usage, and as extensions (vLLM's names) top_k and repetition_penalty.
Fields whose behaviour this server does not have (logprobs, echo, suffix, logit_bias, penalties
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
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from titanlike.inference.continuous import ContinuousBatch, Sequence
from titanlike.inference.engine import Engine, GenerationError
from titanlike.inference.processor import Processor
from titanlike.inference.sampling import SamplingParams

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
MAX_N = 64
MAX_STOP_STRINGS = 4  # OpenAI's limit

# SamplingParams names its fields; the API names them so.
_API_NAMES = {"max_new_tokens": "max_tokens", "stop_strings": "stop"}
_FINISH = {"stop": "stop", "length": "length", "context": "length"}
# The request fields each endpoint knows (OpenAI's, and vLLM's top_k and repetition_penalty); any other
# is refused as OpenAI refuses it. Those this server cannot honour are refused when set, in parse.
_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "logprobs",
           "logit_bias", "presence_penalty", "frequency_penalty", "user", "top_k", "repetition_penalty"}
_ENDPOINT_FIELDS = {False: _FIELDS | {"prompt", "best_of", "echo", "suffix"},
                    True: _FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                     "response_format"}}
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]


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


class OpenAIServer:
    """The HTTP server and its engine thread. start() serves in background threads; shutdown() stops."""

    def __init__(self, engine: Engine, processor: Processor, *, model_name: str, slots: int = 8,
                 host: str = "127.0.0.1", port: int = 8000):
        """processor: the prompts' tokens and the answers' text (processor.py); chat needs its template."""
        self.engine, self.processor, self.model_name = engine, processor, model_name
        self.batch = ContinuousBatch(engine, slots)
        self.created = int(time.time())
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        handler = type("Handler", (_Handler,), {"app": self})
        self.http = ThreadingHTTPServer((host, port), handler)
        self.http.daemon_threads = True

    @property
    def address(self) -> tuple[str, int]:
        return self.http.server_address[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> OpenAIServer:
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
        self._stop.set()
        self.http.shutdown()
        self.http.server_close()
        for thread in self._threads:
            thread.join(timeout=10)

    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            if not self.batch.wait_for_work(timeout=0.1):
                continue
            try:
                self.batch.step()
            except Exception as e:  # a model error ends the requests in flight, not the server
                logger.exception("generation step failed")
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
        for name in ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "presence_penalty",
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

        if chat:
            prompts = [self._chat_prompt(body.get("messages"))]
            stops = self.processor.stop_ids(chat=True)
        else:
            prompts = self._completion_prompts(body.get("prompt"))
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
        seed = body.get("seed")
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
                choice_seed = seed + j if isinstance(seed, int) and not isinstance(seed, bool) else seed
                try:
                    params.append(SamplingParams(**fields, seed=choice_seed))
                except ValueError as e:
                    name, _, rest = str(e).partition(" ")
                    name = _API_NAMES.get(name, name)
                    raise ApiError(400, f"'{name}' {rest}", name) from None
        return _Request(chat, prompts, params, n, bool(stream), include_usage)

    def _completion_prompts(self, prompt) -> list[list[int]]:
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
        out, vocab = [], self.processor.tokenizer.vocab_size
        for item in items:
            if isinstance(item, str):
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
        except Exception as e:  # the template refuses the conversation (a role it does not know...)
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ApiError(400, f"the chat template cannot render these messages: {message}", "messages") from None

    def submit(self, request: _Request, events: queue.Queue) -> list[Sequence]:
        """Queue every choice of a request; events receive ("text", index, piece) and ("done", index, seq)."""
        seqs = []
        stop_ids = frozenset().union(*(params.stop_token_ids for params in request.params))

        def detokenize(ids: list[int]) -> str:
            return self.processor.decode(ids, stop_ids=stop_ids)

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


def _finish_reason(seq: Sequence) -> str:
    return _FINISH.get(seq.completion.finish_reason, seq.completion.finish_reason or "stop")


class _Handler(BaseHTTPRequestHandler):
    app: OpenAIServer
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
        if error.status in (411, 413):  # the body was not read: the connection cannot carry another request
            self.close_connection = True
        self._send_json(error.status, error.body())

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/health", "/v1/health"):
            return self._send_json(200, self.app.health())
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
        self._rid, self._status, self._tokens = "-", None, (0, 0)
        try:
            self._post(path)
        finally:
            logger.info(f"{self.address_string()} POST {path} {self._rid}: status {self._status}, "
                        f"{self._tokens[0]} tokens in, {self._tokens[1]} out, {time.monotonic() - start:.3f} s")

    def _post(self, path: str) -> None:
        chat = {"/v1/completions": False, "/v1/chat/completions": True}.get(path)
        try:
            body = self._read_body()
            if chat is None:
                raise ApiError(404, f"no such endpoint: POST {path}", code="not_found")
            request = self.app.parse(body, chat=chat)
        except ApiError as e:
            return self._error(e)
        self._tokens = (sum(map(len, request.prompts)), 0)
        events: queue.Queue = queue.Queue()
        try:
            seqs = self.app.submit(request, events)
        except ApiError as e:
            return self._error(e)
        try:
            if request.stream:
                self._stream(request, seqs, events)
            else:
                self._answer(request, seqs, events)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            # The client left: free its slots at the next step.
            self.close_connection = True
        finally:
            self._tokens = (self._tokens[0], sum(len(seq.completion.tokens) for seq in seqs))
            for seq in seqs:
                self.app.batch.cancel(seq)

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None:
            raise ApiError(411, "the request has no Content-Length header")
        try:
            length = int(length)
        except ValueError:
            raise ApiError(400, f"the Content-Length header is not a number: {length!r}") from None
        if length > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None

    def _ids(self, chat: bool) -> tuple[str, str]:
        self._rid, kind = (f"chatcmpl-{uuid.uuid4().hex}", "chat.completion") if chat else \
            (f"cmpl-{uuid.uuid4().hex}", "text_completion")
        return self._rid, kind

    def _usage(self, request: _Request, seqs: list[Sequence]) -> dict:
        prompt = sum(map(len, request.prompts))
        completion = sum(len(seq.completion.tokens) for seq in seqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _answer(self, request: _Request, seqs: list[Sequence], events: queue.Queue) -> None:
        remaining = len(seqs)
        while remaining:
            kind, _, seq = events.get()
            if kind == "done":
                remaining -= 1
                if seq.completion.finish_reason == "error":
                    return self._error(ApiError(500, f"generation failed: {seq.error}"))
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
                send({"error": ApiError(500, f"generation failed: {value.error}").body()["error"]})
                return
            send(chunk([choice(index, None, _finish_reason(value))]))
        if request.include_usage:
            send({**chunk([]), "usage": self._usage(request, seqs)})
        send("[DONE]")


__all__ = ["ApiError", "OpenAIServer"]
