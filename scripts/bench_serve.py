"""titanlike-serve against `transformers serve --continuous-batching` on the same model folder: tokens/s,
p50/p95 latency, time to first token and the server's peak memory at 1, 4, 16 and 64 concurrent clients.

    python scripts/bench_serve.py                       # a random ~27M Llama made with transformers
    python scripts/bench_serve.py --model FOLDER        # a Hugging Face folder of your own
    python scripts/bench_serve.py --quick               # a tiny model, 1 and 2 clients, 4 tokens (a test)

Each server runs in a process of its own with one thread (OMP_NUM_THREADS=1; titanlike-serve's
--max-batch-size is the largest client count, and transformers' KV cache is sized to hold what titanlike's
holds: that many sequences of 1024 tokens). Every client sends streamed /v1/completions requests of --tokens
greedy tokens (a prompt each, one request after another, --requests each): with --client openai (the
default) each is a thread of the official `openai` client; with --client async all are aiohttp coroutines in
one thread that parse each event with json alone, a fraction of the CPU, which matters where the clients
share the server's cores. Rounds are paired (titanlike, transformers, titanlike, ...) so a shared machine's
load hits both alike; each figure is the median over --rounds. Time to first token is the first streamed
text; tokens are the usage the server reports; CPU ms/token is the server process's CPU time (psutil,
children included) over the round's tokens, the figure a loaded machine disturbs least; peak memory is the
largest resident set of the server process seen while it served; client ms/token is the CPU time of the
clients (this process) over the round's tokens; dropped counts the streams a server closed before their end
(left out of the tokens and latencies: a server the kernel's OOM killer ends mid-round shows so). Ratios are
titanlike's over transformers' for tokens/s, latency and memory, and transformers' over titanlike's for CPU
per token (above 1: titanlike spends less).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["In the beginning God created the heaven and the earth.", "And the earth was without form, and void;",
           "And God said, Let there be light: and there was light.", "And God saw the light, that it was good:"]


MAX_MODEL_LEN = 1024  # the tokens a sequence may hold, both servers
TRANSFORMERS_PAGE = 256  # transformers' continuous batching: tokens of one page of its KV cache (page_size)


def make_model(folder: str, *, quick: bool) -> str:
    """A random Llama saved by transformers (about 27M parameters; --quick: about 1M) with titanlike's
    debug tokenizer written beside it (data/hf_tokenizer.py), so both servers read the same files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.hf_tokenizer import write_hf_tokenizer

    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2) if quick else \
        dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=1024, rope_theta=500000.0,
                         bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, tie_word_embeddings=False,
                         **size)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    write_hf_tokenizer(folder, DEFAULT_TOKENIZER_PATH, vocab_size=tokenizer.vocab_size, model_max_length=1024)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process: started, waited for (/health), its peak resident memory sampled, stopped."""

    def __init__(self, name: str, command: list[str], port: int, model_name: str, log: str):
        self.name, self.command, self.port, self.model_name = name, command, port, model_name
        self.url = f"http://127.0.0.1:{port}"
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's titanlike
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log = open(log, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.peak = 0
        self._sampling = False

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer /health within {timeout:g} s; see {self.log.name}")

    def wait_for_line(self, text: str, timeout: float) -> None:
        """Until the server's log holds `text`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.log.flush()
            with open(self.log.name) as f:
                if text in f.read():
                    return
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log.name}")
            time.sleep(0.5)
        raise RuntimeError(f"{self.name}'s log did not say {text!r} within {timeout:g} s; see {self.log.name}")

    def sample_memory(self) -> threading.Thread:
        import psutil

        process = psutil.Process(self.process.pid)
        self._sampling = True

        def loop():
            while self._sampling:
                try:
                    rss = process.memory_info().rss + sum(c.memory_info().rss for c in process.children(True))
                except psutil.Error:
                    return
                self.peak = max(self.peak, rss)
                time.sleep(0.05)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        return thread

    def cpu_seconds(self) -> float:
        """CPU time the server process (and its children) has used so far."""
        import psutil

        processes = [psutil.Process(self.process.pid)]
        processes += processes[0].children(True)
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    def stop(self) -> None:
        self._sampling = False
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def one_request(client, model: str, prompt: str, tokens: int) -> tuple[float, float, int]:
    """(seconds to the first text, seconds in all, tokens generated) of one streamed completion."""
    started = time.perf_counter()
    first, count = None, 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    total = time.perf_counter() - started
    return (first if first is not None else total), total, count


def stream_openai(server: Server, clients: int, requests: int, tokens: int) -> list[tuple[float, float, int]]:
    """`clients` threads of the openai client, each sending `requests` requests one after another."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
    results: list[tuple[float, float, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        try:
            for j in range(requests):
                started = time.perf_counter()
                try:
                    result = one_request(client, server.model_name, PROMPTS[(i + j) % len(PROMPTS)], tokens)
                except openai.APIConnectionError:  # the server closed the stream before its end
                    result = (time.perf_counter() - started, time.perf_counter() - started, DROPPED)
                with lock:
                    results.append(result)
        except BaseException as e:  # reported after the round
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{server.name} with {clients} clients: {errors[0]!r}")
    return results


def stream_async(server: Server, clients: int, requests: int, tokens: int) -> list[tuple[float, float, int]]:
    """The same requests from `clients` aiohttp coroutines in one thread: each server-sent event is
    read as a line and parsed with json alone, so the clients cost a fraction of the openai client's
    CPU (pydantic objects and a thread per client) and dilute the servers' difference less on a
    machine whose cores the clients share with the server."""
    import asyncio
    import json

    import aiohttp

    async def one(session, prompt: str) -> tuple[float, float, int]:
        started = time.perf_counter()
        first, count = None, 0
        body = {"model": server.model_name, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{server.url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"status {response.status}: {(await response.text())[:300]}")
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"{chunk['error']}")
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.perf_counter() - started
                if chunk.get("usage"):
                    count = chunk["usage"]["completion_tokens"]
        total = time.perf_counter() - started
        return (first if first is not None else total), total, count

    async def one_or_dropped(session, prompt: str) -> tuple[float, float, int]:
        started = time.perf_counter()
        try:
            return await one(session, prompt)
        except aiohttp.ClientPayloadError:  # the server closed the stream before its end
            return time.perf_counter() - started, time.perf_counter() - started, DROPPED

    async def rounds() -> list[tuple[float, float, int]]:
        timeout = aiohttp.ClientTimeout(total=600)
        # A new connection per request for both servers (titanlike-serve closes each stream's).
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            async def work(i: int) -> list[tuple[float, float, int]]:
                return [await one_or_dropped(session, PROMPTS[(i + j) % len(PROMPTS)]) for j in range(requests)]

            done = await asyncio.gather(*(work(i) for i in range(clients)))
        return [result for results in done for result in results]

    try:
        return asyncio.run(rounds())
    except Exception as e:
        raise RuntimeError(f"{server.name} with {clients} clients: {e!r}") from e


CLIENTS = {"openai": stream_openai, "async": stream_async}
DROPPED = -1  # the token count of a request whose stream the server closed before its end


def run_round(server: Server, clients: int, requests: int, tokens: int, client: str = "openai") -> dict:
    """One round of `clients` concurrent clients (CLIENTS[client]), each sending `requests` requests
    one after another; client CPU ms/token is this process's CPU time (the clients') over the tokens."""
    cpu, own = server.cpu_seconds(), time.process_time()
    started = time.perf_counter()
    results = CLIENTS[client](server, clients, requests, tokens)
    wall = time.perf_counter() - started
    cpu, own = server.cpu_seconds() - cpu, time.process_time() - own
    dropped = sum(r[2] == DROPPED for r in results)
    results = [r for r in results if r[2] != DROPPED] or [(wall, wall, 0)]
    latencies = sorted(r[1] for r in results)
    count = max(1, sum(r[2] for r in results))
    return {"tokens_per_s": sum(r[2] for r in results) / wall, "p50": statistics.median(latencies),
            "p95": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
            "ttft": statistics.median(r[0] for r in results), "tokens": sum(r[2] for r in results),
            "cpu_ms_per_token": 1000 * cpu / count, "client_ms_per_token": 1000 * own / count,
            "dropped": dropped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: a random ~27M Llama)")
    parser.add_argument("--clients", default="1,4,16,64", help="concurrent client counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each request (greedy)")
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends per round")
    parser.add_argument("--rounds", type=int, default=2, help="paired rounds per client count (median)")
    parser.add_argument("--compile", action="store_true", help="titanlike-serve --compile")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="openai",
                        help="openai: a thread of the openai client per client; async: aiohttp coroutines in one "
                        "thread (lighter, so the clients' CPU dilutes the servers' difference less)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 and 2 clients, 4 tokens, 1 round, "
                        "titanlike-serve alone, a warm-up request through each client (a smoke test of this script)")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.tokens, args.requests, args.rounds = "1,2", 4, 1, 1
    counts = [int(c) for c in args.clients.split(",")]
    work = tempfile.mkdtemp(prefix="bench_serve_")
    try:
        folder = args.model or make_model(os.path.join(work, "llama"), quick=args.quick)
        port_ours, port_theirs = free_port(), free_port()
        ours = [sys.executable, "-c", "import sys; from titanlike.cli.serve import main; sys.exit(main(sys.argv[1:]))",
                folder, "--port", str(port_ours), "--max-batch-size", str(max(counts)),
                "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "model"]
        if args.compile:
            ours.append("--compile")
        servers = [Server("titanlike", ours, port_ours, "model", os.path.join(work, "titanlike.log"))]
        if not args.quick:
            # Its KV cache holds what titanlike's does (slots x 1024 tokens, in pages of 256 tokens): by
            # default it takes 90% of the free memory, which on a shared machine got it killed (OOM).
            theirs = ["transformers", "serve", folder, "--continuous-batching", "--device", "cpu", "--host",
                      "127.0.0.1", "--port", str(port_theirs), "--log-level", "error",
                      "--cb-num-blocks", str(-(-max(counts) * MAX_MODEL_LEN // TRANSFORMERS_PAGE))]
            servers.append(Server("transformers", theirs, port_theirs, folder, os.path.join(work, "transformers.log")))
        try:
            for server in servers:
                started = time.perf_counter()
                server.wait(args.start_timeout)
                print(f"{server.name} answered /health after {time.perf_counter() - started:.1f} s", flush=True)
                if args.compile and server.name == "titanlike":
                    # titanlike-serve --compile answers at once, eager, while it compiles its decode step's
                    # shapes in the background: measure the compiled server, once its log says they are done.
                    server.wait_for_line("shapes of the decode step in", args.start_timeout)
                    print(f"titanlike compiled its decode step after {time.perf_counter() - started:.1f} s", flush=True)
                # A warm-up request (loads the model, first-call costs); --quick sends one through each client.
                for client in sorted(CLIENTS) if args.quick else [args.client]:
                    run_round(server, 1, 1, 2, client)
                server.sample_memory()
            figures: dict[tuple[str, int], list[dict]] = {}
            for clients in counts:
                for _ in range(args.rounds):
                    for server in servers:  # paired: each round measures both, one after the other
                        figures.setdefault((server.name, clients), []).append(
                            run_round(server, clients, args.requests, args.tokens, args.client))
                        print(f"{clients} clients, {server.name}: {figures[(server.name, clients)][-1]}", flush=True)
            peaks = {server.name: server.peak for server in servers}
        except BaseException:
            for server in servers:  # what the server said before it failed (its log goes with the temp folder)
                server.log.flush()
                with open(server.log.name) as log:
                    print(f"--- the end of {server.name}'s log:\n" + "".join(log.readlines()[-15:]), flush=True)
            raise
        finally:
            for server in servers:
                server.stop()
        print(f"\n{args.tokens} greedy tokens per request, {args.requests} requests per client per round, median of "
              f"{args.rounds} paired rounds, one thread per server, {args.client} clients")
        print(f"{'clients':>7} {'server':>12} {'tokens/s':>9} {'p50 s':>7} {'p95 s':>7} {'TTFT s':>7} "
              f"{'CPU ms/token':>12} {'client ms/token':>15} {'dropped':>7}")
        for clients in counts:
            rows = {}
            for server in servers:
                runs = figures[(server.name, clients)]
                rows[server.name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                row = rows[server.name]
                row["dropped"] = sum(r["dropped"] for r in runs)  # over all rounds
                print(f"{clients:>7} {server.name:>12} {row['tokens_per_s']:9.1f} {row['p50']:7.2f} {row['p95']:7.2f} "
                      f"{row['ttft']:7.3f} {row['cpu_ms_per_token']:12.2f} {row['client_ms_per_token']:15.2f} "
                      f"{row['dropped']:7d}")
            if len(rows) == 2:
                a, b = rows["titanlike"], rows["transformers"]
                print(f"{clients:>7} {'ratio':>12} {a['tokens_per_s'] / b['tokens_per_s']:8.2f}x "
                      f"{a['p50'] / b['p50']:6.2f}x {a['p95'] / b['p95']:6.2f}x {a['ttft'] / b['ttft']:6.2f}x "
                      f"{b['cpu_ms_per_token'] / a['cpu_ms_per_token']:11.2f}x")
        memory = "  ".join(f"{name} {peak / 2**20:.0f} MiB" for name, peak in peaks.items())
        ratio = f" (ratio {peaks['titanlike'] / peaks['transformers']:.2f}x)" if len(peaks) == 2 else ""
        print(f"peak resident memory: {memory}{ratio}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
