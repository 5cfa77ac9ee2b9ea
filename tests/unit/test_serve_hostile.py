"""The server under a hostile client (issue 46): each finding of the red team, proven refused in
OpenAI's error shape with one log line, and a well-behaved request served after it.

One server for the module, as tests/unit/test_serve_refusals.py builds it (a random 2-layer GPT-2,
context 256, the debug tokenizer, build_server on an ephemeral port), with an API key, 2 slots, a
cap of 8 connections and a read timeout of 1 s so the slow-client cases take a second.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
import urllib.error
import urllib.request

import pytest

from family_checks import materialize

openai = pytest.importorskip("openai")

KEY = "s3cret-key"
MAX_CONNECTIONS = 8
PROMPT = "In the beginning"


def _folder(tmp_path_factory):
    from titanlike.checkpoint.hf import write_hf
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.models.registry import get_model_spec

    tokenizer, spec = build_tokenizer(DEFAULT_TOKENIZER_PATH), get_model_spec("gpt2")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=tokenizer.vocab_size, n_layers=2, dim=64,
                               n_heads=4, max_seq_len=256)
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    write_hf(materialize(spec.model_cls, args).state_dict(), spec, args, str(folder), context_len=256,
             bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, tokenizer_path=DEFAULT_TOKENIZER_PATH)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _folder(tmp_path_factory)


@pytest.fixture(scope="module")
def server(folder):
    from titanlike.cli.serve import build_server

    app, error = build_server([str(folder), "--port", "0", "--max-batch-size", "2", "--served-model-name", "tiny",
                               "--api-key", KEY, "--max-connections", str(MAX_CONNECTIONS), "--read-timeout", "1"])
    assert error is None, error
    app.start()
    yield app
    app.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30)


def _health(server) -> dict:
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
        return json.loads(r.read())


def _served(client) -> None:
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


def _raw(server, data: bytes, *, half_close: bool = True, timeout: float = 10) -> tuple[int, dict]:
    """Send raw bytes, read the answer: (status, its JSON body)."""
    with socket.create_connection(server.address, timeout=timeout) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before reading (a refused connection)
            pass
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            piece = sock.recv(65536)
            if not piece:
                break
            reply += piece
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else {}


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


def _post(body: bytes, *, length: str | None = None, extra: str = "", auth: bool = True) -> bytes:
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {KEY}\r\n" if auth else ""
    head += f"Content-Length: {len(body) if length is None else length}\r\n" if length != "" else ""
    return (head + extra + "\r\n").encode() + body


def _good(**extra) -> bytes:
    return json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}).encode()


def _openai_shape(body: dict) -> str:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"], body
    return error["message"]


def test_the_api_key_is_required_on_every_route_but_health(server, client):
    for path in ("/v1/models", "/v1/models/tiny"):
        request = urllib.request.Request(f"{server.url}{path}")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 401
        assert "requires an API key" in _openai_shape(json.loads(e.value.read()))
    assert _health(server)["status"] == "ok"
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret-kez", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "invalid_api_key" and "not this server's" in e.value.body["message"]
    status, body = _raw(server, _post(_good(), auth=False))
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    assert [m.id for m in client.models.list().data] == ["tiny"]
    _served(client)


@pytest.mark.parametrize("length, extra, status, words", [
    ("-1", "", 400, "must be one non-negative number"),
    ("+5", "", 400, "must be one non-negative number"),
    ("1_0", "", 400, "must be one non-negative number"),
    ("", "", 411, "has no Content-Length"),
    (None, "Transfer-Encoding: chunked\r\n", 411, "chunked request body is not accepted"),
    (None, "Content-Length: 3\r\n", 400, "must be one non-negative number"),
    (str(1 << 40), "", 413, "exceeds the limit"),
])
def test_a_lying_or_negative_content_length_is_refused_before_reading(server, client, length, extra, status,
                                                                      words):
    # With Content-Length -1 the old server read until the client closed: any body size passed the cap.
    code, body = _raw(server, _post(_good(), length=length, extra=extra))
    assert code == status and words in _openai_shape(body), body
    _served(client)


def test_a_body_shorter_than_announced_times_out_with_408(server, client):
    start = time.monotonic()
    with socket.create_connection(server.address, timeout=10) as sock:
        sock.sendall(_post(_good(), length="500"))  # and then nothing: a slow or half-open client
        reply = b""
        while piece := sock.recv(65536):  # the server answers, then closes
            reply += piece
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply, reply
    assert time.monotonic() - start < 8
    code, body = _raw(server, _post(_good()[:-5], length=str(len(_good()))))  # closes early: short
    assert code == 400 and "ended after" in _openai_shape(body)
    _served(client)


@pytest.mark.parametrize("body, words", [
    (b'{"model": "tiny", "prompt": "x", "seed": ' + b"9" * 5000 + b"}", "an integer of 5000 digits"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (json.dumps({"model": "tiny", "prompt": "x", "user": json.loads("[" * 33 + "]" * 33)}).encode(),
     "nests deeper than 32 levels"),
    (b"\xff\xfe{}", "not valid JSON"),
], ids=["5000-digit-int", "100k-deep", "33-deep", "not-utf8"])
def test_huge_integers_and_deep_json_are_a_400_in_one_log_line(server, client, caplog, capfd, body, words):
    with caplog.at_level(logging.INFO, logger="titanlike.inference.server"):
        code, answer = _raw(server, _post(body))
        deadline = time.time() + 5  # the line is written once the answer is sent
        while time.time() < deadline and not any("POST" in r.getMessage() for r in caplog.records):
            time.sleep(0.02)
    assert code == 400 and words in _openai_shape(answer), answer
    lines = [r for r in caplog.records if "POST /v1/completions" in r.getMessage()]
    assert len(lines) == 1 and "status 400" in lines[0].getMessage() and words in lines[0].getMessage()
    assert not any(r.exc_info for r in caplog.records) and "Traceback" not in capfd.readouterr().err
    _served(client)


@pytest.mark.parametrize("call, param, words", [
    (dict(temperature=1e-40), "temperature", "'temperature' must be a finite number >= 0 (0: greedy, else at least"),
    (dict(temperature=0.5, extra_body={"repetition_penalty": 1e-40}), "repetition_penalty",
     "'repetition_penalty' must be a finite number > 0, from 0.01 to 100"),
    (dict(temperature=0.5, extra_body={"repetition_penalty": 1e40}), "repetition_penalty", "from 0.01 to 100"),
    (dict(seed=2**64), "seed", "'seed' must be an integer from 0 to 9223372036854775807"),
    (dict(seed=-1), "seed", "'seed' must be an integer from 0 to"),
    (dict(stop=["x" * 2000]), "stop", "'stop' holds 2000 characters, more than the 1024"),
    (dict(stop=["a" * 400] * 3), "stop", "'stop' holds 1200 characters"),
    (dict(n=64, prompt=[PROMPT] * 5), "prompt", "5 prompts x n 64 ask for 320 sequences, more than the 256"),
    (dict(max_tokens=10**30), "max_tokens", "lower max_tokens to at most"),
])
def test_values_that_would_break_the_step_are_refused_per_request(client, call, param, words):
    """temperature or repetition_penalty 1e-40 and seed 2**64 made the engine step raise, failing every
    request in flight; now each is a 400 of its own request."""
    call = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **call}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**call)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
    _served(client)


def test_a_seed_at_the_top_of_the_range_still_serves_n_choices(client):
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, seed=2**63 - 1, temperature=1)
    assert len(answer.choices) == 2


def test_the_waiting_queue_is_capped_with_a_503(server, client, monkeypatch):
    import titanlike.inference.server as module

    monkeypatch.setattr(module, "MAX_QUEUED_SEQUENCES", 1)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2)
    assert e.value.status_code == 503 and "the server is busy" in e.value.body["message"]
    monkeypatch.undo()
    _served(client)


def test_a_step_that_raises_fails_only_the_requests_it_was_serving(server):
    """Defence in depth behind the 400s above: a sequence whose settings break sampling ends alone
    ("error"), and a decode that raises ends the sequences in rows, not those still waiting."""
    from titanlike.inference.continuous import ContinuousBatch
    from titanlike.inference.sampling import SamplingParams

    engine, prompt = server.engine, server.processor.encode(PROMPT)
    alone = engine.generate([prompt], SamplingParams(max_new_tokens=4))[0][0].tokens
    batch = ContinuousBatch(engine, slots=2)
    hostile = SamplingParams(max_new_tokens=4, temperature=1.0)
    object.__setattr__(hostile, "temperature", 1e-40)  # past validate(): as if a check were missed
    bad = batch.submit(prompt, hostile)
    good = batch.submit(prompt, SamplingParams(max_new_tokens=4))
    batch.run()
    assert bad.completion.finish_reason == "error" and good.completion.tokens == alone

    batch = ContinuousBatch(engine, slots=1)
    first = batch.submit(prompt, SamplingParams(max_new_tokens=4))
    second = batch.submit(prompt, SamplingParams(max_new_tokens=4))
    real = engine.decode

    def failing(tokens, cache):
        raise RuntimeError("device lost")

    engine.decode = failing
    try:
        with pytest.raises(RuntimeError):
            batch.step()
        batch.fail_all(RuntimeError("device lost"))
    finally:
        engine.decode = real
    assert first.completion.finish_reason == "error" and not second.done
    batch.run()
    assert second.completion.tokens == alone


def test_a_non_streamed_client_that_disconnects_frees_its_slots(server, client):
    """64 choices of 240 tokens on 2 slots take seconds; the client leaves after 50 ms and nearly all are
    cancelled (the old server decoded all of them for nobody)."""
    before = _health(server)["cancelled"]
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "n": 64, "temperature": 0}).encode()
    with socket.create_connection(server.address, timeout=10) as sock:
        sock.sendall(_post(body))
        time.sleep(0.05)
    deadline = time.time() + 10
    while time.time() < deadline and (_health(server)["cancelled"] < before + 56 or _health(server)["running"]):
        time.sleep(0.05)
    health = _health(server)
    assert health["cancelled"] >= before + 56 and health["running"] == 0 and health["waiting"] == 0, health
    _served(client)


def test_idle_connections_time_out_and_their_number_is_capped(server, client):
    time.sleep(1.5)  # the client's kept-alive connection times out (1 s) first
    idle = [socket.create_connection(server.address, timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # each has its thread
        code, body = _raw(server, _post(_good()))
        assert code == 503 and f"has {MAX_CONNECTIONS} connections open already" in _openai_shape(body)
        for sock in idle:  # the read timeout (1 s) closes every one of them
            assert sock.recv(100) == b""
    finally:
        for sock in idle:
            sock.close()
    assert server.http.request_queue_size >= 1024
    time.sleep(0.2)
    _served(client)


def test_start_lines_say_the_address_and_warn_on_every_interface_without_a_key(folder, monkeypatch):
    from titanlike.cli.serve import API_KEY_ENV, build_server, start_lines

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    app, error = build_server([str(folder), "--port", "0", "--served-model-name", "tiny"])
    lines = start_lines(app)
    app.http.server_close()
    assert len(lines) == 1 and "bound to 127.0.0.1, this machine only; no API key" in lines[0]
    app, error = build_server([str(folder), "--port", "0", "--host", "0.0.0.0"])
    lines = start_lines(app)
    app.http.server_close()
    assert "bound to 0.0.0.0, every interface" in lines[0]
    assert lines[1].startswith("warning: listening on 0.0.0.0 without an API key") and API_KEY_ENV in lines[1]
    monkeypatch.setenv(API_KEY_ENV, "from-the-environment")
    app, error = build_server([str(folder), "--port", "0", "--host", "0.0.0.0"])
    lines = start_lines(app)
    app.http.server_close()
    assert app.api_key == "from-the-environment" and len(lines) == 1 and "an API key is required" in lines[0]


@pytest.mark.parametrize("option, words", [
    (["--drain-seconds", "-1"], "--drain-seconds must be from 0 to 3600"),
    (["--max-connections", "0"], "--max-connections must be at least 1"),
    (["--read-timeout", "0"], "--read-timeout must be more than 0"),
])
def test_bad_serve_options_are_one_sentence(folder, option, words):
    from titanlike.cli.serve import build_server

    app, error = build_server([str(folder), "--port", "0", *option])
    assert app is None and error.startswith(words) and "\n" not in error
