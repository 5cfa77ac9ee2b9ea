"""scripts/serve.py (titanlike/inference/server.py) through the official `openai` client.

One server for the module: a random GPT-2 (context 256) written as a Hugging Face folder with the
debug tokenizer, started by build_server (the program's own path) on 127.0.0.1, an ephemeral port,
in this process's threads, with 3 slots. Checked: completions and chat (the chat template's prompt,
the same tokens as the engine gives it), streaming (the pieces add up to the answer), n > 1 and a
seed's reproducibility, concurrent clients (each gets what it gets alone, greedy, and they share
decode steps: continuous batching, with more requests than slots), a client that disconnects mid-
stream (its sequence is cancelled, its slot freed, the server goes on), and 4xx answers naming the
problem for an over-long prompt, a malformed body, a sampling value out of range and an unknown model,
each followed by a request that is served. An encoder-only checkpoint is refused at start.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from family_checks import materialize
from titanlike.models.registry import get_model_spec

openai = pytest.importorskip("openai")

CONTEXT = 256
SLOTS = 3


def _write(spec_name: str, folder, context_len: int | None = None, **changes):
    from titanlike.checkpoint.hf import write_hf
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    spec = get_model_spec(spec_name)
    args = dataclasses.replace(spec.flavors["debugmodel_tiny" if spec_name == "bert" else "debugmodel"],
                               vocab_size=tokenizer.vocab_size, **changes)
    write_hf(materialize(spec.model_cls, args).state_dict(), spec, args, str(folder), context_len=context_len,
             bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, tokenizer_path=DEFAULT_TOKENIZER_PATH)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from titanlike.cli.serve import build_server

    folder = _write("gpt2", tmp_path_factory.mktemp("tiny-gpt2"), CONTEXT, n_layers=2, dim=64, n_heads=4,
                    max_seq_len=CONTEXT)
    app, error = build_server([str(folder), "--port", "0", "--max-batch-size", str(SLOTS),
                               "--served-model-name", "tiny"])
    assert error is None, error
    app.start()
    yield app
    app.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)


def _health(server) -> dict:
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
        return json.loads(r.read())


def _complete(client, prompt: str, **kw) -> str:
    kw.setdefault("temperature", 0)
    return client.completions.create(model="tiny", prompt=prompt, **kw).choices[0].text


PROMPTS = ["In the beginning", "And God said", "Let there be light", "The earth was", "without form", "and void"]


def test_models_health_completions_and_chat(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = _health(server)
    assert health["status"] == "ok" and health["slots"] == SLOTS

    result = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    choice = result.choices[0]
    assert choice.finish_reason == "length" and result.usage.completion_tokens == 12
    processor = server.processor
    # GPT-2's export frames a text with nothing, no BOS (issue 45.20): the prompt is its text's tokens.
    assert result.usage.prompt_tokens == len(processor.tokenizer.encode(PROMPTS[0], bos=False, eos=False))

    # What the engine gives the chat template's prompt alone, with the template's end of turn.
    from titanlike.inference import Engine, SamplingParams

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    ids = processor.encode(messages)
    stops = processor.stop_ids(chat=True)
    (want,), _ = Engine(server.engine.model).generate(
        [ids], SamplingParams(max_new_tokens=10, stop_token_ids=stops),
        detokenize=lambda t: processor.tokenizer.decode([x for x in t if x not in stops]))
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content == want.text
    assert chat.usage.prompt_tokens == len(ids)

    # Streaming: the pieces add up to the answer; chat's first chunk names the role.
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True) if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == choice.text
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    # A stop string cuts the text.
    stop = choice.text[4:7]
    assert _complete(client, PROMPTS[0], max_tokens=12, stop=[stop]) == choice.text[:choice.text.index(stop)]


def test_n_choices_and_a_seed_reproduce(client):
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, top_p=0.9, n=3, seed=11)
    first = [c.text for c in client.completions.create(**kw).choices]
    again = [c.text for c in client.completions.create(**kw).choices]
    assert first == again and len(set(first)) > 1  # choices of one seed draw apart
    assert [c.text for c in client.completions.create(**{**kw, "seed": 12}).choices] != first


def test_concurrent_clients_get_what_they_get_alone_and_share_steps(server, client):
    alone = {p: _complete(client, p, max_tokens=6 + 3 * i) for i, p in enumerate(PROMPTS)}
    steps = _health(server)["decode_steps"]
    answers, barrier = {}, threading.Barrier(len(PROMPTS))

    def ask(i: int, prompt: str) -> None:
        barrier.wait()
        answers[prompt] = _complete(client, prompt, max_tokens=6 + 3 * i)

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers == alone
    # Alone, each request takes one decode step per token after its first; together (6 requests on
    # 3 slots, the later ones refilling slots as the first end) they share most steps.
    shared = _health(server)["decode_steps"] - steps
    assert shared < sum(6 + 3 * i - 1 for i in range(len(PROMPTS))) * 0.75, shared


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server, client):
    before = _health(server)["cancelled"]
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=CONTEXT - 10, temperature=0,
                                       stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.time() + 10
    while time.time() < deadline and (_health(server)["cancelled"] == before or _health(server)["running"]):
        time.sleep(0.05)
    health = _health(server)
    assert health["cancelled"] == before + 1 and health["running"] == 0, health
    assert _complete(client, PROMPTS[3], max_tokens=4)


def test_the_text_leaves_out_special_tokens_unless_asked_to_keep_them(client):
    """As transformers' decode(skip_special_tokens=True) (the comparison on the same ids:
    tests/unit/test_processor.py); vLLM's skip_special_tokens false keeps them. A random model
    greedily names some of the tokenizer's 256 reserved tokens within these 48 tokens."""
    import re

    kept = [_complete(client, p, max_tokens=48, extra_body={"skip_special_tokens": False}) for p in PROMPTS]
    skipped = [_complete(client, p, max_tokens=48) for p in PROMPTS]
    special = re.compile(r"<\|[a-z_0-9]+\|>")
    assert any(special.search(text) for text in kept), kept
    assert skipped == [special.sub("", text) for text in kept]
    assert _complete(client, PROMPTS[0], max_tokens=48, extra_body={"skip_special_tokens": True}) == skipped[0]


@pytest.mark.parametrize("call,status,words", [
    (dict(prompt="word " * 300), 400, "leaves no room in this model's context of 256 tokens"),
    (dict(prompt=PROMPTS[0], max_tokens=CONTEXT), 400, "lower max_tokens to at most"),
    (dict(prompt=PROMPTS[0], temperature=-1), 400, "'temperature' must be a finite number >= 0"),
    (dict(prompt=PROMPTS[0], top_p=1.5), 400, "'top_p' must be a number in (0, 1]"),
    (dict(prompt=PROMPTS[0], n=0), 400, "'n' must be an integer from 1"),
    (dict(prompt=PROMPTS[0], logprobs=2), 400, "'logprobs' is not supported"),
    (dict(prompt=PROMPTS[0], suffix=" and the earth"), 400, "'suffix' needs fill-in-the-middle tokens, and this "
     "model's tokenizer has no <fim_prefix>, <fim_suffix>, <fim_middle> (titanlike-serve --fim-tokens"),
    (dict(prompt=[], max_tokens=3), 400, "'prompt' is empty"),
    (dict(prompt=[5, 99999]), 400, "token id 99999 is not in the model's vocabulary"),
    (dict(prompt=PROMPTS[0], extra_body={"skip_special_tokens": "no"}), 400,
     "'skip_special_tokens' must be true or false"),
    (dict(prompt=PROMPTS[0], model="gpt-4"), 404, "the model 'gpt-4' is not served here"),
])
def test_a_bad_request_is_a_4xx_naming_the_problem_and_the_server_goes_on(client, call, status, words):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**{"model": "tiny", **call})
    assert e.value.status_code == status and words in e.value.message, e.value.message
    assert "\n" not in e.value.body["message"]
    assert _complete(client, PROMPTS[0], max_tokens=2)


def test_a_malformed_body_is_a_400(server, client):
    def post(path: str, data: bytes) -> tuple[int, str]:
        request = urllib.request.Request(f"{server.url}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]["message"]

    code, message = post("/v1/completions", b"{not json")
    assert code == 400 and message.startswith("the request body is not valid JSON")
    assert post("/v1/chat/completions", b'{"model": "tiny"}') == (400, "'messages' is required: a non-empty list of "
                                                                       '{"role", "content"} objects')
    code, message = post("/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode())
    assert code == 400 and "holds a part other than text" in message
    assert post("/v1/nothing", b"{}") == (404, "no such endpoint: POST /v1/nothing")
    assert _complete(client, PROMPTS[0], max_tokens=2)


def test_an_encoder_only_checkpoint_is_refused_at_start(tmp_path):
    from titanlike.cli.serve import build_server

    folder = _write("bert", tmp_path / "bert")
    app, error = build_server([str(folder), "--port", "0"])
    assert app is None and "cannot generate text" in error and "encoder" in error and "\n" not in error


def test_a_bad_device_is_one_sentence_from_serve_and_generate(tmp_path, capsys):
    """serve and generate read the same model options (inference/loading.py add_model_arguments): a
    device that is none is refused alike, in one sentence, before anything is loaded."""
    from titanlike.cli import generate
    from titanlike.cli.serve import build_server

    app, error = build_server([str(tmp_path), "--port", "0", "--device", "gpu"])
    assert app is None and error.startswith("--device 'gpu' is not a torch device") and "\n" not in error
    assert generate.main([str(tmp_path), "--device", "gpu"]) == 1
    assert capsys.readouterr().err == f"error: {error}\n"


def test_a_plain_completion_ends_at_generation_configs_eos_ids(tmp_path):
    """As transformers serve does: a Hugging Face folder's generation_config.json eos_token_id (an id or
    a list, what the export writes) ends a plain completion; a value that is no id is refused at start."""
    from titanlike.cli.serve import build_server
    from titanlike.inference import SamplingParams

    folder = _write("gpt2", tmp_path / "gpt2", CONTEXT, n_layers=2, dim=64, n_heads=4, max_seq_len=CONTEXT)
    app, error = build_server([str(folder), "--port", "0", "--served-model-name", "tiny"])
    assert error is None, error
    prompt = app.processor.encode(PROMPTS[0])
    tokens = app.engine.generate([prompt], SamplingParams(max_new_tokens=8))[0][0].tokens
    app.http.server_close()
    config = json.loads((folder / "generation_config.json").read_text())
    stop = tokens[0]  # the first greedy token ends the answer once listed
    assert len(tokens) == 8 and stop != config["eos_token_id"]
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"],
                                                                                          stop]}))
    app, error = build_server([str(folder), "--port", "0", "--served-model-name", "tiny"])
    assert error is None, error
    app.start()
    try:
        client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0, timeout=30)
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == 1
    finally:
        app.shutdown()
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": "end"}))
    app, error = build_server([str(folder), "--port", "0"])
    assert app is None and "eos_token_id \"end\", which is not an id" in error and "\n" not in error


def test_a_suffix_is_a_fill_in_the_middle_prompt(tmp_path):
    """OpenAI's suffix: <PRE> prompt <SUF> suffix <MID>, as [fim] trains (data/fim.py), the answer the middle;
    --fim-tokens names the tokens (here Llama 3 reserved ones of the debug tokenizer)."""
    from titanlike.cli.serve import build_server
    from titanlike.data.fim import token_id

    names = [f"<|reserved_special_token_{k}|>" for k in (2, 4, 3)]
    folder = _write("gpt2", tmp_path / "gpt2", CONTEXT, n_layers=2, dim=64, n_heads=4, max_seq_len=CONTEXT)
    app, error = build_server([str(folder), "--port", "0", "--served-model-name", "tiny", "--fim-tokens", ",".join(names)])
    assert error is None, error
    tokenizer = app.processor.tokenizer
    pre, suf, mid = (token_id(tokenizer, name) for name in names)
    expected = [*app.processor.framing.before, pre, *tokenizer.encode(PROMPTS[0], bos=False, eos=False), suf,
                *tokenizer.encode(" the earth.", bos=False, eos=False), mid]
    assert app._completion_prompts(PROMPTS[0], 1, " the earth.") == [expected]
    app.start()
    try:
        client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0, timeout=30)
        answer = client.completions.create(model="tiny", prompt=PROMPTS[0], suffix=" the earth.", max_tokens=4,
                                           temperature=0)
        assert answer.usage.prompt_tokens == len(expected) and answer.usage.completion_tokens >= 1
        with pytest.raises(openai.APIStatusError, match="'suffix' needs text prompts"):
            client.completions.create(model="tiny", prompt=[5, 6], suffix="x")
    finally:
        app.shutdown()
    app, error = build_server([str(folder), "--port", "0", "--fim-tokens", "a,b"])
    assert app is None and error == "--fim-tokens must name three tokens, prefix,suffix,middle, got 'a,b'"
