"""The server refuses what it cannot honour as OpenAI refuses it (issue 45), through the official
`openai` client, and logs one line per request (its id, tokens in and out, time, status)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from family_checks import materialize

openai = pytest.importorskip("openai")

PROMPTS = ["In the beginning", "And God said"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """tests/unit/test_serve.py's server: a random 2-layer GPT-2 (context 256) with the debug tokenizer,
    started by build_server in this process's threads on an ephemeral port."""
    from titanlike.checkpoint.hf import write_hf
    from titanlike.cli.serve import build_server
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.models.registry import get_model_spec

    tokenizer, spec = build_tokenizer(DEFAULT_TOKENIZER_PATH), get_model_spec("gpt2")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=tokenizer.vocab_size, n_layers=2, dim=64,
                               n_heads=4, max_seq_len=256)
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    write_hf(materialize(spec.model_cls, args).state_dict(), spec, args, str(folder), context_len=256,
             bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, tokenizer_path=DEFAULT_TOKENIZER_PATH)
    app, error = build_server([str(folder), "--port", "0", "--max-batch-size", "2", "--served-model-name", "tiny"])
    assert error is None, error
    app.start()
    yield openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0, timeout=30)
    app.shutdown()


@pytest.mark.parametrize("endpoint, call, param, words", [
    ("chat", dict(response_format={"type": "json_object"}), "response_format",
     "'response_format' of type 'json_object' is not supported"),
    ("chat", dict(extra_body={"frobnicate": 1}), "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ("completions", dict(extra_body={"messages": []}), "messages", "Unrecognized request argument supplied: messages"),
    ("completions", dict(temperature=3), "temperature", "'temperature' must be from 0 to 2, got 3"),
    ("chat", dict(temperature=2.5), "temperature", "'temperature' must be from 0 to 2, got 2.5"),
    ("completions", dict(stream_options={"include_usage": True}), "stream_options",
     "'stream_options' is only allowed when 'stream' is true"),
])
def test_what_the_server_cannot_honour_is_a_400_in_openais_shape(client, endpoint, call, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           **call)
        else:
            client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, **call)
    body = e.value.body
    assert e.value.status_code == 400 and words in body["message"] and "\n" not in body["message"], body
    assert body["param"] == param and body["type"] == "invalid_request_error"


def test_what_it_can_honour_still_answers(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=2, response_format={"type": "text"}, user="someone")
    assert chat.choices[0].message.content is not None
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    assert [c.usage for c in stream][-1].completion_tokens == 2


def test_each_request_is_one_log_line(client, caplog):
    with caplog.at_level(logging.INFO, logger="titanlike.inference.server"):
        answer = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3, temperature=0)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt=PROMPTS[1], temperature=3)
    lines = [r.getMessage() for r in caplog.records if "POST /v1/completions" in r.getMessage()]
    assert len(lines) == 2, lines
    ok, refused = lines
    assert answer.id in ok and "status 200" in ok and f"{answer.usage.prompt_tokens} tokens in, 3 out" in ok, ok
    assert ok.endswith(" s") and "status 400" in refused, refused
