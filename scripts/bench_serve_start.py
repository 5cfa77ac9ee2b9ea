"""How soon `titanlike-serve --compile` answers, and what compiling in the background costs the eager
steps that serve meanwhile (titanlike/inference/continuous.py compile_in_background).

    python scripts/bench_serve_start.py FOLDER                 # a Hugging Face or checkpoint folder
    python scripts/bench_serve_start.py FOLDER --skip-server   # only the in-process part

Server part: the server started as a process (one thread, OMP_NUM_THREADS=1) twice, the first time with
an empty TORCHINDUCTOR_CACHE_DIR and the second with what the first left there; each time the seconds
from the process's start to its start line, to the first answered request (--max-tokens greedy
tokens), and to its "compiled N shapes" line. In-process part: the same model through two continuous
batches, an eager one stepped in this thread while a compiled one compiles in the background, rounds of
--max-tokens tokens for one request before, during and after the compile (CPU seconds of this process
and wall seconds: the compile thread's work is in the CPU figure during it; wall is what a client sees).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _answer(url: str, max_tokens: int) -> dict:
    body = json.dumps({"model": "m", "prompt": "In the beginning", "max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(f"{url}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def server_start(folder: str, cache_dir: str, max_tokens: int, slots: int, max_len: int) -> dict:
    """One start: seconds to the start line, to the first answer and to the compiled line; the answers'
    texts (the first, and one after the compile)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONPATH": REPO}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "serve.py"), folder, "--port", "0",
                             "--served-model-name", "m", "--compile", "--max-batch-size", str(slots),
                             "--max-model-len", str(max_len)],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put((time.perf_counter(), line)) for line in proc.stderr],
                     daemon=True).start()
    result: dict = {}
    try:
        while "listening" not in result:
            at, line = lines.get(timeout=600)
            if line.startswith("error:"):
                raise SystemExit(f"the server did not start: {line.strip()}")
            if line.startswith("serving m at "):
                result["listening"] = at - started
                url = line.split(" at ")[1].split("/v1")[0]
        first = _answer(url, max_tokens)
        result["first_answer"] = time.perf_counter() - started
        result["first_text"] = first["choices"][0]["text"]
        while "compiled" not in result:
            at, line = lines.get(timeout=900)
            if line.startswith("compiled "):
                result["compiled"] = at - started
                result["compiled_line"] = line.strip()
            elif "failed" in line or "Error" in line:
                print(line.rstrip(), file=sys.stderr)
        result["after_text"] = _answer(url, max_tokens)["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return result


def in_process(folder: str, max_tokens: int, slots: int, max_len: int, cache_dir: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # empty: a first start's compile, before torch is imported
    import torch

    from titanlike.inference import ContinuousBatch, Engine, SamplingParams
    from titanlike.inference.loading import load_for_inference

    torch.set_num_threads(1)
    model, _ = load_for_inference(folder)
    eager = ContinuousBatch(Engine(model, context_len=max_len), slots=slots)
    compiled = ContinuousBatch(Engine(model, context_len=max_len, compile=True), slots=slots)
    prompt = list(range(3, 19))
    params = SamplingParams(max_new_tokens=max_tokens)

    def one_round() -> tuple[float, float, list[int]]:
        seq = eager.submit(prompt, params)
        cpu, wall = time.process_time(), time.perf_counter()
        eager.run()
        return time.process_time() - cpu, time.perf_counter() - wall, seq.completion.tokens

    def report(name: str, rounds: list) -> None:
        cpu = sorted(r[0] for r in rounds)[len(rounds) // 2]
        wall = sorted(r[1] for r in rounds)[len(rounds) // 2]
        print(f"{name}: {len(rounds)} rounds, median {max_tokens / wall:.1f} tokens/s wall, "
              f"{max_tokens / cpu:.1f} tokens per CPU-second of this process", flush=True)

    before = [one_round() for _ in range(5)]
    done = threading.Event()
    started = time.perf_counter()
    compiled.compile_in_background(lambda n, s: done.set())
    during = []
    while not done.is_set():
        during.append(one_round())
    print(f"compiled {len(compiled.shapes())} shapes in the background in {time.perf_counter() - started:.1f} s")
    after = [one_round() for _ in range(5)]
    report("eager before the compile", before)
    report("eager while compiling", during)
    report("eager after the compile", after)
    same = {tuple(r[2]) for r in before + during + after}
    print(f"greedy tokens the same in every round: {len(same) == 1}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8, help="--max-batch-size (8: the server's default)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-in-process", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_server:
        with tempfile.TemporaryDirectory() as cache_dir:
            for start in ("first start (empty inductor cache)", "second start"):
                r = server_start(args.folder, cache_dir, args.max_tokens, args.slots, args.max_model_len)
                print(f"{start}: start line {r['listening']:.1f} s, first answer {r['first_answer']:.1f} s, "
                      f"'{r['compiled_line']}' at {r['compiled']:.1f} s; answers equal before and after the "
                      f"compile: {r['first_text'] == r['after_text']}", flush=True)
    if not args.skip_in_process:
        with tempfile.TemporaryDirectory() as cache_dir:
            in_process(args.folder, args.max_tokens, args.slots, args.max_model_len, cache_dir)


if __name__ == "__main__":
    main()
