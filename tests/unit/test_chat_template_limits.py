"""Chat templates are data, not code (issue 46): templates that walk attributes, escape through format
strings, loop or recurse without end, or multiply strings are stopped in one sentence naming the
template and the rule, wherever a template is rendered: directly, in SFT data preparation, in DPO,
at serve start and per request, and in generate. Rendering many turns is linear where it is ours.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import urllib.request

import pytest

from family_checks import materialize
from sft_assets import TAGGED, tokenizer_folder
from titanlike.data import DataError, build_tokenizer
from titanlike.data.chat_template import (CHATML_TEMPLATE, ChatTemplate, TemplateLimitError, load_chat_template,
                                          render, tokenize_conversation)

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]

# (name, template, words of the rule it breaks)
HOSTILE = [
    ("attribute walk", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "the sandbox refuses"),
    ("method of a message", "{{ messages.append(1) }}", "the sandbox refuses"),
    ("string multiplied", "{{ 'a' * 10**10 }}", "a string or list multiplied would hold 10000000000"),
    ("list multiplied", "{% for m in messages * 10**9 %}{% endfor %}", "multiplied would hold 2000000000"),
    ("huge range", "{% for i in range(10**9) %}{% endfor %}", "beyond the size limit"),
    ("range past the cap", "{% for i in range(100001) %}{% endfor %}", "range() of 100001 items"),
    ("nested range loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "ran past the time limit of 1 s"),
    ("recursion through a macro", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("macros that fan out", "{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}"
     "{{ f(0) }}", "ran past the time limit of 1 s"),
    ("a string doubled", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}{{ ns.s }}", "a string joined would hold"),
    ("a macro doubling its argument", "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}"
     "{{ d('ab', 40) }}", "a call's argument would hold"),
    ("a filter's width", "{{ 'a'|center(10**10) }}", "a filter's argument 10000000000"),
    ("a format's width", "{{ '{:>999999999999}'.format(1) }}", "a format's width or precision"),
    ("a %-format's width", "{{ '%0999999999999d' % 1 }}", "a format's width or precision"),
    ("too much text", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the rendered text would hold"),
]


def _one_sentence(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text, text
    return text


@pytest.mark.parametrize("name, source, words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_template_stops_in_one_sentence_naming_it_and_the_rule(name, source, words):
    template = ChatTemplate(source, f"hostile.jinja ({name})", {}, time_limit=1.0, max_chars=1 << 26)
    start = time.monotonic()
    with pytest.raises(TemplateLimitError) as e:
        render(template, MESSAGES)
    assert time.monotonic() - start < 5
    text = _one_sentence(e.value)
    assert text.startswith(f"the chat template (hostile.jinja ({name})) was stopped: ") and words in text, text


def test_format_string_escapes_reach_nothing():
    """'{0.__class__}'.format(x) goes through the sandbox's formatter: the attribute is refused and
    renders as nothing, never as the class."""
    for source in ("{{ '{0.__class__}'.format(messages) }}|{{ '{0.__class__.__mro__}'.format('') }}",
                   "{{ '{0[0].__class__.__init__.__globals__}'.format(messages) }}",
                   "{{ '{m.__class__}'.format_map({'m': messages}) }}", "{{ '%r' % messages.__class__ }}"):
        try:
            text, _ = render(ChatTemplate(source, "escape.jinja", {}), MESSAGES)
        except TemplateLimitError as e:  # or refused outright
            assert "was stopped: the sandbox refuses access to attribute '__" in _one_sentence(e)
        else:
            assert "class" not in text and "globals" not in text and "builtins" not in text, text


def test_the_environment_is_the_immutable_sandbox():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from titanlike.data.chat_template import _compile

    compiled, _ = _compile(CHATML_TEMPLATE)
    assert isinstance(compiled.environment, ImmutableSandboxedEnvironment)


def test_renders_in_threads_keep_their_own_spans():
    """Server threads render one compiled template at once: each rendering's generation spans are its own."""
    from concurrent.futures import ThreadPoolExecutor

    template = ChatTemplate(TAGGED["chatml"], "chatml", {})
    conversations = [[{"role": "user", "content": "q" * i}, {"role": "assistant", "content": "a" * (i + 1)}]
                     for i in range(1, 40)]
    alone = [render(template, c) for c in conversations]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda c: render(template, c), conversations * 5)) == alone * 5


def test_rendering_many_turns_is_linear_and_prefixes_stop_at_the_truncation(monkeypatch):
    """With generation tags each span's start is a running length (it was a sum over every block so far:
    quadratic); without them, prefixes past the tokens a caller keeps are not re-rendered."""
    import titanlike.data.chat_template as module
    from titanlike.data import DEFAULT_TOKENIZER_PATH

    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(8000)]
    tagged = load_chat_template("llama3", tok)
    times = []
    for n in (2000, 8000):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            render(tagged, turns[:n])
            best = min(best, time.perf_counter() - start)
        times.append(best)
    assert times[1] < 8 * times[0], times  # 4x the turns: about 4x the time (it was 16x)

    plain = ChatTemplate(CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
                         "chatml without tags", tagged.variables)
    real, calls = module.render, []
    monkeypatch.setattr(module, "render", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask = tokenize_conversation(plain, tok, turns, max_tokens=64)
    assert len(calls) < 40, len(calls)  # not 2 x 2000 re-renderings
    whole_ids, whole_mask = tokenize_conversation(plain, tok, turns[:20])
    assert ids[:64] == whole_ids[:64] and mask[:64] == whole_mask[:64]


# ------------------------------------------------------------------------ SFT and DPO


@pytest.mark.parametrize("source, words", [
    ("{{ ''.__class__.__mro__ }}", "the sandbox refuses"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran past the time limit"),
    ("{{ 'a' * 10**10 }}", "multiplied would hold"),
])
def test_sft_and_dpo_data_preparation_stop_in_one_sentence(tmp_path, source, words):
    from titanlike.data.conversations import tokenize_conversations
    from titanlike.data.preferences import tokenize_pairs

    tok = build_tokenizer(str(tokenizer_folder(tmp_path / "tok", source)))
    template = dataclasses.replace(load_chat_template("tokenizer", tok), time_limit=1.0)
    with pytest.raises(DataError) as e:
        tokenize_conversations([("conv.jsonl line 3", {"messages": MESSAGES})], template, tok, seq_len=64)
    text = _one_sentence(e.value)
    assert text.startswith("conv.jsonl line 3: the chat template (the chat_template of ") and words in text, text
    with pytest.raises(DataError) as e:
        tokenize_pairs([("pairs.jsonl line 2", {"prompt": "Say yes", "chosen": "yes", "rejected": "no"})], template,
                       tok, seq_len=64)
    text = _one_sentence(e.value)
    assert text.startswith("pairs.jsonl line 2: ") and "was stopped" in text and words in text, text


# ------------------------------------------------------------------------ serve and generate


def _hf_folder(folder, template: str | None):
    from titanlike.checkpoint.hf import write_hf
    from titanlike.data import DEFAULT_TOKENIZER_PATH
    from titanlike.models.registry import get_model_spec

    tok, spec = build_tokenizer(DEFAULT_TOKENIZER_PATH), get_model_spec("gpt2")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=tok.vocab_size, n_layers=1, dim=64,
                               n_heads=4, max_seq_len=128)
    write_hf(materialize(spec.model_cls, args).state_dict(), spec, args, str(folder), context_len=128,
             bos_id=tok.bos_id, eos_id=tok.eos_id, tokenizer_path=DEFAULT_TOKENIZER_PATH)
    if template is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


@pytest.mark.parametrize("source, words", [
    ("{{ ''.__class__.__mro__ }}", "the sandbox refuses access to attribute '__class__'"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "ran past the time limit of 10 s"),
], ids=["attribute-walk", "nested-loops"])
def test_serve_and_generate_refuse_a_hostile_folder_template_at_start_in_one_sentence(tmp_path, capsys, monkeypatch,
                                                                                     source, words):
    """The findings: `titanlike-serve` died with two SecurityError tracebacks, and a nested loop hung
    its start; now one sentence, within the time limit."""
    import types

    import titanlike.data.chat_template as chat_template
    from titanlike.cli import generate
    from titanlike.cli.serve import build_server

    # The default limit (10 s) on a clock that runs 10 times faster in the template sandbox only: the
    # message names the limit the server applies, in one second of the test's time.
    start = time.monotonic()
    monkeypatch.setattr(chat_template, "time",
                        types.SimpleNamespace(monotonic=lambda: start + 10 * (time.monotonic() - start)))

    folder = _hf_folder(tmp_path / "hostile", source)
    app, error = build_server([str(folder), "--port", "0"])
    assert app is None and error.startswith("the chat template (the chat_template of ") and words in error, error
    assert "\n" not in error
    if "__class__" in source:  # generate --chat reads the same template (one 10 s loop is enough)
        assert generate.main([str(folder), "--chat", "--prompt", "hi", "--max-new-tokens", "2"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: the chat template") and words in err and err.count("\n") == 1, err


def test_a_template_that_misbehaves_on_one_request_answers_it_400_and_serves_on(tmp_path, caplog):
    from titanlike.cli.serve import build_server

    source = ("{% for m in messages %}{% if m['content'] == 'attack' %}{{ m.__class__.__mro__ }}"
              "{% elif m['content'] == 'spin' %}{{ 'x' * 10**12 }}{% endif %}"
              "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
              "{% endif %}")
    template_file = tmp_path / "picky.jinja"
    template_file.write_text(source)
    app, error = build_server([str(_hf_folder(tmp_path / "m", None)), "--port", "0", "--served-model-name", "m",
                               "--chat-template", str(template_file)])
    assert error is None, error
    app.start()
    try:
        def chat(content: str) -> tuple[int, dict]:
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2})
            request = urllib.request.Request(f"{app.url}/v1/chat/completions", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        with caplog.at_level(logging.INFO, logger="titanlike.inference.server"):
            for content, words in (("attack", "the sandbox refuses"), ("spin", "multiplied would hold")):
                status, body = chat(content)
                message = body["error"]["message"]
                assert status == 400 and message.startswith("the chat template cannot render these messages: "
                                                            f"the chat template ({template_file}) was stopped")
                assert words in message and "\n" not in message
            deadline = time.time() + 5
            while time.time() < deadline and sum("POST" in r.getMessage() for r in caplog.records) < 2:
                time.sleep(0.02)
        assert not any(r.exc_info for r in caplog.records)
        assert sum("status 400" in r.getMessage() for r in caplog.records) == 2
        status, body = chat("hello")
        assert status == 200 and body["choices"][0]["message"]["content"] is not None
    finally:
        app.shutdown()
