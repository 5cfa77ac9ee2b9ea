"""titanlike-serve (scripts/serve.py) as a process: it says where it listens, and SIGTERM drains (issue 46).

SIGTERM used to kill the requests in flight with no answer and no message. Now: no new connection
is accepted, a request that finishes within --drain-seconds is answered 200, one that does not is
answered 503 in OpenAI's error shape, and the process says so and exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from family_checks import materialize

REPO = Path(__file__).resolve().parents[2]


def _folder(folder: Path) -> Path:
    from titanlike.checkpoint.hf import write_hf
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.models.registry import get_model_spec

    tok, spec = build_tokenizer(DEFAULT_TOKENIZER_PATH), get_model_spec("gpt2")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=tok.vocab_size, n_layers=2, dim=64,
                               n_heads=4, max_seq_len=256)
    write_hf(materialize(spec.model_cls, args).state_dict(), spec, args, str(folder), context_len=256,
             bos_id=tok.bos_id, eos_id=tok.eos_id, tokenizer_path=DEFAULT_TOKENIZER_PATH)
    return folder


def _post(url: str, body: dict, answers: dict, name: str) -> None:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            answers[name] = (r.status, json.loads(r.read()))
    except urllib.error.HTTPError as e:
        answers[name] = (e.code, json.loads(e.read()))


def test_sigterm_finishes_or_cancels_the_requests_in_flight_within_the_bound_and_exits_0(tmp_path):
    folder = _folder(tmp_path / "tiny")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TITANLIKE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve.py"), str(folder), "--port", "0",
                             "--served-model-name", "tiny", "--max-batch-size", "2", "--drain-seconds", "1"],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        start = lines.get(timeout=120)
        assert start.startswith("serving tiny at http://127.0.0.1:"), start
        assert "bound to 127.0.0.1, this machine only" in start
        url = start.split(" at ")[1].split("/v1")[0]
        answers: dict = {}
        short = {"model": "tiny", "prompt": "In the beginning", "max_tokens": 50, "temperature": 0}
        long = {"model": "tiny", "prompt": "And God said", "max_tokens": 240, "n": 64, "temperature": 0}
        threads = [threading.Thread(target=_post, args=(url, short, answers, "short"))]
        threads[0].start()
        time.sleep(0.1)  # the short request takes a slot first
        threads.append(threading.Thread(target=_post, args=(url, long, answers, "long")))
        threads[1].start()
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        received = lines.get(timeout=10)
        assert received.startswith("received SIGTERM: no new connections;") and "up to 1 s" in received, received
        host, port = url.rsplit("/", 1)[1].split(":")
        refused, deadline = False, time.monotonic() + 3  # the accept loop ends within its poll interval
        while not refused and time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=2).close()
                time.sleep(0.1)
            except OSError:
                refused = True
        assert refused, "new connections were still accepted 3 s into the drain"
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - sent < 15
        for thread in threads:
            thread.join(30)
        rest = "".join(lines.get_nowait() for _ in range(lines.qsize()))
        assert rest.startswith("stopped (") and "sequences cancelled)" in rest and "Traceback" not in rest, rest
        status, body = answers["short"]
        assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), answers["short"]
        status, body = answers["long"]
        assert status == 503 and body["error"]["message"] == "the server shut down before this request finished"
        assert body["error"]["code"] == "shutting_down"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
