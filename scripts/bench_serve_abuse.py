"""A well-behaved client's latency and the server's memory while titanlike-serve is abused (issue 46).

    python scripts/bench_serve_abuse.py                      # a random tiny GPT-2, written to a temp folder
    python scripts/bench_serve_abuse.py --checkpoint FOLDER  # a model of your own

Starts scripts/serve.py as a process, then: the good client's latency idle (sequential completions
of --max-tokens greedy tokens); the server's RSS; --hostile-connections connections opened and held
(half idle, half slowloris: a request's headers sent partly, a byte every few seconds); then
--malformed malformed requests sent from 4 threads (negative and lying Content-Length, a
5,000-digit integer, 100k-deep JSON, invalid JSON, temperature 1e-40, 2,000 prompts x n 64, stop
strings of 100k characters, chunked bodies, unknown fields) while the good client measures again;
the hostile connections are closed and the RSS read once more. Prints one line per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def tiny_checkpoint(folder: str) -> str:
    """A random 2-layer GPT-2 (context 256) with the debug tokenizer, as a Hugging Face folder."""
    import dataclasses

    import torch

    from titanlike.checkpoint.hf import write_hf
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.models.registry import get_model_spec

    tok, spec = build_tokenizer(DEFAULT_TOKENIZER_PATH), get_model_spec("gpt2")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=tok.vocab_size, n_layers=2, dim=64,
                               n_heads=4, max_seq_len=256)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    write_hf(model.state_dict(), spec, args, folder, context_len=256, bos_id=tok.bos_id, eos_id=tok.eos_id,
             tokenizer_path=DEFAULT_TOKENIZER_PATH)
    return folder


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def good_latencies(url: str, count: int, max_tokens: int) -> list[float]:
    body = json.dumps({"model": "m", "prompt": "In the beginning", "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    out = []
    for _ in range(count):
        request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as r:
            r.read()
        out.append(time.perf_counter() - start)
    return out


def malformed_requests() -> list[bytes]:
    def post(body: bytes, length: str | None = None, extra: str = "") -> bytes:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body) if length is None else length}\r\n" if length != "" else ""
        return (head + extra + "\r\n").encode() + body

    def request(**fields) -> bytes:
        return json.dumps({"model": "m", "prompt": "x", "max_tokens": 2, **fields}).encode()

    return [
        post(request(), "-1"),
        post(b'{"model": "m", "prompt": "x", "seed": ' + b"9" * 5000 + b"}"),
        post(b"[" * 100_000 + b"]" * 100_000),
        post(b"{not json"),
        post(request(temperature=1e-40)),
        post(request(prompt=["word"] * 2000, n=64)),
        post(request(stop=["s" * 100_000] * 4)),
        post(request(), "", "Transfer-Encoding: chunked\r\n"),
        post(request(frobnicate=1)),
        post(request(), "999999999999"),
    ]


def send_raw(address, data: bytes) -> None:
    try:
        with socket.create_connection(address, timeout=30) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
    except OSError:
        pass  # refused or reset: the server's answer to some of them


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="the model to serve (default: a random tiny GPT-2)")
    parser.add_argument("--hostile-connections", type=int, default=200, help="connections opened and held")
    parser.add_argument("--malformed", type=int, default=1000, help="malformed requests sent")
    parser.add_argument("--requests", type=int, default=40, help="the good client's requests per measurement")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens of each good request")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or tiny_checkpoint(os.path.join(tmp, "tiny"))
        env = {**os.environ, "PYTHONPATH": REPO}
        env.pop("TITANLIKE_API_KEY", None)
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "serve.py"), folder, "--port", "0",
                                 "--served-model-name", "m"], stderr=subprocess.PIPE, text=True, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
        try:
            start = lines.get(timeout=300)
            url = start.split(" at ")[1].split("/v1")[0]
            host, port = url.rsplit("/", 1)[1].split(":")
            address = (host, int(port))
            good_latencies(url, 5, args.max_tokens)  # warm up
            idle = good_latencies(url, args.requests, args.max_tokens)
            rss_start = rss_mib(proc.pid)

            hostile = []
            for i in range(args.hostile_connections):
                sock = socket.create_connection(address, timeout=30)
                if i % 2:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n")
                hostile.append(sock)
            stop = threading.Event()

            def slowloris():
                while not stop.wait(5):
                    for sock in hostile[1::2]:
                        try:
                            sock.sendall(b"X")
                        except OSError:
                            pass

            threading.Thread(target=slowloris, daemon=True).start()
            bad = malformed_requests()
            sent = iter(range(args.malformed))
            lock = threading.Lock()

            def sender():
                while True:
                    with lock:
                        i = next(sent, None)
                    if i is None:
                        return
                    send_raw(address, bad[i % len(bad)])

            senders = [threading.Thread(target=sender, daemon=True) for _ in range(4)]
            attack_start = time.perf_counter()
            for thread in senders:
                thread.start()
            under_attack = []  # for as long as the attack lasts, and at least --requests completions
            while len(under_attack) < args.requests or any(thread.is_alive() for thread in senders):
                under_attack += good_latencies(url, 1, args.max_tokens)
            for thread in senders:
                thread.join()
            attack_seconds = time.perf_counter() - attack_start
            rss_attack = rss_mib(proc.pid)
            stop.set()
            for sock in hostile:
                sock.close()
            time.sleep(2)
            after = good_latencies(url, args.requests, args.max_tokens)
            rss_end = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    def p50(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.1f} ms"

    print(f"good client p50 (completions of {args.max_tokens} tokens): idle {p50(idle)} ({len(idle)}), with "
          f"{args.hostile_connections} hostile connections open and {args.malformed} malformed requests sent "
          f"{p50(under_attack)} ({len(under_attack)}; {statistics.median(under_attack) / statistics.median(idle):.2f}x"
          f"), after {p50(after)} ({len(after)})")
    print(f"malformed requests: {args.malformed} sent in {attack_seconds:.1f} s")
    print(f"server RSS: start {rss_start:.0f} MiB, under attack {rss_attack:.0f} MiB, after {rss_end:.0f} MiB "
          f"({(rss_end - rss_start) / rss_start * 100:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
