"""Serve a titanlike checkpoint (DCP step folder or checkpoint folder, or a Hugging Face folder) over
an OpenAI-compatible HTTP API.

    titanlike-serve outputs/checkpoint --port 8000
    titanlike-serve outputs/sft/checkpoint --max-batch-size 16 --max-model-len 2048

(scripts/serve.py in a checkout.) Endpoints: /v1/completions, /v1/chat/completions (the tokenizer's
chat template, titanlike's llama3 template if it has none), streaming by server-sent events,
/v1/models, /health. Concurrent requests share each decode step (continuous batching: up to
--max-batch-size sequences, a finished one's slot refilled at once). One process, one device; the
logic is titanlike/inference/server.py. With --compile it serves at once with the eager step and
compiles every shape of the decode step in the background, each shape switching to its compiled step
when ready; it says so at start and again when compiling is done, with how many shapes and how long
(torch's on-disk caches make a later start of the same model several times faster:
docs/performance.md).

It listens on 127.0.0.1 (this machine only) unless --host says otherwise, and says so at start; on
every interface without an API key (--api-key or TITANLIKE_API_KEY) it warns that anyone who can
reach the port can use it. SIGTERM (or Ctrl-C) drains: no new connection is accepted, the requests
in flight get up to --drain-seconds to finish, the rest are answered 503, and the exit status is 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

API_KEY_ENV = "TITANLIKE_API_KEY"


def build_server(argv: list[str] | None = None, prog: str | None = None):
    """(OpenAIServer, None) from command-line arguments, or (None, a one-sentence error)."""
    from titanlike.inference.loading import add_model_arguments
    from titanlike.inference.server import FIM_TOKENS

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, compile_shapes="--max-batch-size rows of --max-model-len slots")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                        "checkpoint folder's name)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together (the cache holds "
                        "this many rows of --max-model-len tokens)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + answer (default: the "
                        "model's context, at most 4096, which bounds the cache's memory)")
    parser.add_argument("--chat-template", default="auto", help="'auto' (the tokenizer's, else llama3), a builtin "
                        "name or a Jinja file, as sft.chat_template")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but "
                        f"/health (default: the environment variable {API_KEY_ENV}; neither: no key)")
    parser.add_argument("--drain-seconds", type=float, default=30.0, help="on SIGTERM, how long the requests in "
                        "flight may take to finish before they are cancelled")
    parser.add_argument("--max-connections", type=int, default=256, help="open connections at most (one past it "
                        "is answered 503)")
    parser.add_argument("--read-timeout", type=float, default=30.0, help="seconds a client may take to send the "
                        "next bytes of its request before its connection is closed")
    parser.add_argument("--fim-tokens", default=",".join(FIM_TOKENS), help="the prefix, suffix and middle tokens, "
                        "comma-separated, a completion's 'suffix' is written with (fill-in-the-middle, as the model "
                        "was trained with [fim])")
    args = parser.parse_args(argv)

    from titanlike.inference import GenerationError
    from titanlike.inference.loading import one_process

    try:
        one_process("titanlike-serve")
    except GenerationError as e:
        return None, str(e)
    if args.max_batch_size < 1:
        return None, f"--max-batch-size must be at least 1, got {args.max_batch_size}"
    if args.max_model_len is not None and args.max_model_len < 2:
        return None, f"--max-model-len must be at least 2, got {args.max_model_len}"
    if not 0 <= args.port <= 65535:
        return None, f"--port must be from 0 to 65535, got {args.port}"
    if not 0 <= args.drain_seconds <= 3600:
        return None, f"--drain-seconds must be from 0 to 3600, got {args.drain_seconds:g}"
    if args.max_connections < 1:
        return None, f"--max-connections must be at least 1, got {args.max_connections}"
    fim_tokens = tuple(args.fim_tokens.split(","))
    if len(fim_tokens) != 3 or not all(fim_tokens):
        return None, f"--fim-tokens must name three tokens, prefix,suffix,middle, got {args.fim_tokens!r}"
    if not 0 < args.read_timeout <= 3600:
        return None, f"--read-timeout must be more than 0 and at most 3600 seconds, got {args.read_timeout:g}"
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)

    from titanlike.inference import Engine
    from titanlike.inference.loading import generation_eos_ids, load_model_arguments
    from titanlike.inference.processor import Processor
    from titanlike.inference.server import OpenAIServer

    try:
        model, tokenizer = load_model_arguments(args)
        # A plain completion ends where transformers' would: at generation_config.json's eos_token_id.
        processor = Processor.for_model(model, tokenizer, checkpoint=args.checkpoint,
                                        chat_template=args.chat_template, option="--chat-template",
                                        eos_ids=generation_eos_ids(args.checkpoint, model))
    except GenerationError as e:
        return None, str(e)
    context = model.model_args.context_len
    max_len = args.max_model_len or min(context, 4096)
    if max_len > context:
        return None, f"--max-model-len {max_len} exceeds the model's context of {context} tokens"
    engine = Engine(model, context_len=max_len, start_id=processor.start_id, compile=args.compile)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.checkpoint))
    try:
        server = OpenAIServer(engine, processor, model_name=name, slots=args.max_batch_size, host=args.host,
                              port=args.port, api_key=api_key, max_connections=args.max_connections,
                              read_timeout=args.read_timeout, drain_seconds=args.drain_seconds,
                              fim_tokens=fim_tokens)
    except OSError as e:
        return None, f"cannot listen on {args.host}:{args.port}: {e.strerror or e}"
    return server, None


def start_lines(server) -> list[str]:
    """What titanlike-serve says at start: where it listens, who can reach it, and a warning when
    every interface can without an API key."""
    host, _ = server.address
    everywhere = host in ("0.0.0.0", "::", "")
    reach = "every interface: other machines can reach it" if everywhere else \
        "this machine only" if host in ("127.0.0.1", "::1", "localhost") else f"the interface of {host}"
    shapes, seconds = server.compiled  # set when warm_up compiled every shape before serving
    lines = [f"compiled {shapes} shapes of the decode step in {seconds:.1f} s"] if shapes else []
    lines += [f"serving {server.model_name} at {server.url}/v1 ({server.batch.slots} slots of "
             f"{server.batch.capacity} tokens; bound to {host}, {reach}; "
             f"{'an API key is required' if server.api_key else 'no API key'}; SIGTERM or Ctrl-C drains and stops)"]
    pending = 0 if shapes else len(server.batch.shapes())
    if pending:
        lines.append(f"serving eager; compiling {pending} shapes in the background")
    if everywhere and not server.api_key:
        lines.append(f"warning: listening on {host} without an API key: anyone who can reach port "
                     f"{server.address[1]} can use this model; set --api-key or {API_KEY_ENV}")
    return lines


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    server, error = build_server(argv, prog)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    for line in start_lines(server):
        print(line, file=sys.stderr, flush=True)
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, frame):
        received.append(signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        server.compile_in_background(say=lambda line: print(line, file=sys.stderr, flush=True))
        while not stop.wait(0.5):  # a timed wait, so the handler runs promptly
            pass
        busy = server.batch.active + len(server.batch.waiting)
        print(f"received {received[0]}: no new connections; {busy} sequences in flight get up to "
              f"{server.drain_seconds:g} s to finish", file=sys.stderr, flush=True)
        cancelled = server.drain(server.drain_seconds)
        print(f"stopped ({cancelled} sequences cancelled)", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.batch.stop_compiling(timeout=1):
        # A shape still compiling cannot be interrupted, and the interpreter's exit would wait for
        # inductor's worker threads (a kernel's C++ build: seconds to a minute under load): leave now.
        sys.stdout.flush()
        os._exit(0)
    return 0


def console_main() -> None:
    """The `titanlike-serve` console script."""
    sys.exit(main(prog="titanlike-serve"))
