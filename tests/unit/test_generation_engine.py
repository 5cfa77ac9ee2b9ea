"""The generation engine's own rules (titanlike/inference), and scripts/generate.py on them.

- Sampling: repetition penalty, temperature, top-k and top-p give transformers' logits processors'
  and warpers' scores on the same logits; a seed makes samples reproducible.
- The engine: a batch gives each row what it gives alone; a row ends at a stop token (kept last),
  a stop string (cut from the text), max_new_tokens or the context, each with its reason; streamed
  text pieces add up to the final text. Rows that ended stop costing decode steps (compaction)
  without changing a seeded call's samples (every family's cache: test_family_conformance.py).
  Compiled (a torch.compile'd decode step on static caches) it gives the eager tokens and compiles
  once: tests/integration/test_generation_engine_compiled.py.
  A continuous batch compiling in the background serves eager until each shape is ready (here, with
  a stand-in for the compiled step).
- The program: batched and streamed output agree, prompts come from a JSONL file, chat mode renders
  the chat template, the speed goes to stderr, and every bad value is one sentence.
Families against transformers' generate: tests/conformance/test_generation.py.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from family_checks import materialize
from titanlike.inference import Engine, GenerationError, SamplingParams
from titanlike.inference.sampling import apply_repetition_penalty, draw, filter_top_k, filter_top_p, next_tokens
from titanlike.models.registry import get_model_spec


@pytest.fixture(scope="module")
def model():
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], vocab_size=256, n_layers=2, max_seq_len=40)
    return materialize(spec.model_cls, args, seed=0).eval()


# ---------------------------------------------------------------- sampling against transformers


def test_filters_equal_transformers_processors():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    history = torch.randint(0, 50, (4, 6), generator=g)
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, history, True)

    want = transformers.RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 1.3), want)
    for k in (1, 5, 49):
        want = transformers.TopKLogitsWarper(k)(history, logits.clone())
        assert torch.equal(filter_top_k(logits, k), want)
    for p in (0.05, 0.5, 0.9):
        want = transformers.TopPLogitsWarper(p)(history, logits.clone())
        assert torch.equal(filter_top_p(logits, p).isinf(), want.isinf()), p
        assert torch.equal(filter_top_p(logits, p)[~want.isinf()], want[~want.isinf()])


def test_sampling_is_seeded_and_greedy_is_the_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=g)
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9)
    draw = lambda seed: next_tokens(logits, params, seen=None, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(5), draw(5))
    assert torch.equal(next_tokens(logits, SamplingParams(), seen=None, generator=None), logits.argmax(-1))
    # top_k 1 leaves one token whatever the temperature.
    one = SamplingParams(temperature=2.0, top_k=1)
    assert torch.equal(next_tokens(logits, one, seen=None, generator=torch.Generator().manual_seed(0)),
                       logits.argmax(-1))


def test_draw_samples_the_distribution_and_never_a_filtered_token():
    # One uniform number per row through the cumulative distribution (sampling.py draw): 200,000 rows
    # of one distribution with zeros at both ends and inside land as torch.multinomial's do.
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    rows = probs.expand(200_000, -1)
    counts = torch.bincount(draw(rows, torch.Generator().manual_seed(0)), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    torch.testing.assert_close(counts / counts.sum(), probs.double(), atol=4e-3, rtol=0)
    theirs = torch.bincount(torch.multinomial(rows, 1, generator=torch.Generator().manual_seed(0))[:, 0],
                            minlength=len(probs)).double()
    assert (counts - theirs).abs().max() / counts.sum() < 6e-3
    # Uniform numbers at both ends of their range still give a token of probability > 0.
    one = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.3, 0.0, 0.7]])
    for end in (0.0, 1.0):
        with mock.patch.object(torch, "rand", lambda shape, generator, **kw: torch.full(shape, end, **kw)):
            assert draw(one, None).tolist() == [2, 1 if end == 0 else 3]
    seeded = lambda seed: draw(rows[:50], torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(seeded(3), seeded(3))


@pytest.mark.parametrize("field,value,words", [
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "temperature must be"),
    ("top_p", 0.0, "top_p must be a number in (0, 1]"),
    ("top_p", 1.5, "top_p must be a number in (0, 1]"),
    ("top_k", -1, "top_k must be an integer >= 0"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer of at least 1"),
    ("stop_strings", ("",), "stop_strings must be non-empty strings"),
])
def test_a_sampling_value_out_of_range_is_one_sentence(field, value, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the engine


def test_a_batch_gives_each_row_what_it_gives_alone_and_rows_end_on_their_own(model):
    engine = Engine(model)
    prompts = [[5, 9, 17, 3, 44, 12, 8], [7, 31, 90], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]]
    alone = [engine.generate([p], SamplingParams(max_new_tokens=8))[0][0].tokens for p in prompts]
    batch, stats = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [c.tokens for c in batch] == alone
    assert stats.new_tokens == 24 and stats.time_to_first_token > 0

    # A stop token ends its row (kept last), the others go on; reasons per row.
    stop = alone[1][2]
    ended, _ = engine.generate(prompts, SamplingParams(max_new_tokens=8, stop_token_ids={stop}))
    assert ended[1].tokens == alone[1][:alone[1].index(stop) + 1] and ended[1].finish_reason == "stop"
    for row in (0, 2):
        want = alone[row][:alone[row].index(stop) + 1] if stop in alone[row] else alone[row]
        assert ended[row].tokens == want

    # The context (40 tokens) ends a row: prompt + new tokens never exceed it.
    long_prompt = list(range(3, 38))
    (full,), _ = engine.generate([long_prompt], SamplingParams(max_new_tokens=20))
    assert len(full.tokens) == 40 - 35 and full.finish_reason == "context"


def test_logprobs_equal_an_uncached_forward_and_cost_nothing_when_off(model):
    """Engine log-probabilities (RL's engine logps): each drawn token's log_softmax(logits / T) equals a full
    uncached forward's within 1e-5 in fp32, in a batch of prompts of different lengths; off by default."""
    from titanlike.inference.engine import uncached_logits

    engine = Engine(model)
    prompts = [[5, 9, 17, 3, 44, 12, 8], [7, 31, 90]]
    for params in (SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, seed=3, logprobs=True),
                   SamplingParams(max_new_tokens=10, logprobs=True)):
        completions, _ = engine.generate(prompts, params)
        for prompt, c in zip(prompts, completions):
            assert len(c.logprobs) == len(c.tokens)
            logits = uncached_logits(model, prompt, c.tokens[:-1]) / (params.temperature or 1.0)
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)
    plain, _ = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.7, seed=3))
    assert all(c.logprobs is None for c in plain)
    assert [c.tokens for c in plain] == [c.tokens[:4] for c in engine.generate(prompts, SamplingParams(
        max_new_tokens=4, temperature=0.7, seed=3, logprobs=True))[0]]


def test_rows_of_one_prompt_share_its_prefill(model):
    """Rows with the same prompt (GRPO's G completions of each prompt) prefill it once and copy its
    cache: each row decodes what the prompt decodes alone, and the log-probabilities of the tokens each
    row draws equal an uncached forward's within 1e-5, as in a batch of distinct prompts."""
    from titanlike.inference.engine import uncached_logits

    engine = Engine(model)
    a, b = [5, 9, 17, 3, 44, 12, 8], [7, 31, 90]
    prefilled = []
    prefill = engine.prefill
    engine.prefill = lambda tokens, *args, **kw: prefilled.append(len(tokens)) or prefill(tokens, *args, **kw)
    greedy, _ = engine.generate([a, b, a, a], SamplingParams(max_new_tokens=8))
    alone = [engine.generate([p], SamplingParams(max_new_tokens=8))[0][0].tokens for p in (a, b)]
    assert [c.tokens for c in greedy] == [alone[0], alone[1], alone[0], alone[0]]
    sampled, _ = engine.generate([a, b, a, a], SamplingParams(max_new_tokens=10, temperature=1.0, seed=3,
                                                              logprobs=True))
    assert prefilled == [2, 1, 1, 2]
    assert len({tuple(c.tokens) for c in (sampled[0], sampled[2], sampled[3])}) > 1  # the rows draw apart
    for prompt, c in zip([a, b, a, a], sampled):
        logits = uncached_logits(model, prompt, c.tokens[:-1])
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)


def _decode_rows(engine: Engine) -> list[int]:
    """The rows each decode step of the engine's calls computes (its hook's batch), appended as they run."""
    rows, real = [], engine.decode_step
    engine.decode_step = lambda tokens, cache: rows.append(cache.batch_size) or real(tokens, cache)
    return rows


def test_rows_that_ended_stop_costing_decode_steps_and_a_seed_draws_the_same_samples(model):
    """Once half the cache's rows or fewer still run, the engine decodes those only in a cache of their
    own (copy_row): each step computes at least the rows still running and fewer than twice as many,
    each compaction at least halving the rows. Every prompt gets the tokens, log-probabilities (within 1e-6), streamed
    tokens and texts it gets when every row is decoded to the end (Engine(compact=False)): a row draws
    the random number it draws in the whole batch, and keeps its repetition-penalty history."""
    text = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    prompts = [[5, 9, 17, 3, 44, 12, 8], [7, 31, 90], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]] * 4
    prompts[5] = [60, 61]  # rows of one prompt share a prefill, the others' their own
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=11, logprobs=True, repetition_penalty=1.3)
    (first, _), = [Engine(model, compact=False).generate(prompts, params)]
    # Stop ids (tokens these rows draw) that end half the rows within 3 tokens, others later, two never:
    # a long tail, and compactions of a compacted cache.
    stop = {first[row].tokens[t] for row, t in enumerate([1, 2, 1, 2, 1, 2, 6, 7, 6, 10])}
    params = dataclasses.replace(params, stop_token_ids=stop)
    runs = {}
    for compact in (False, True):
        engine = Engine(model, compact=compact)
        rows, tokens = _decode_rows(engine), []
        completions, stats = engine.generate(prompts, params, detokenize=text,
                                             on_token=lambda row, token: tokens.append((row, token)))
        runs[compact] = completions, rows, tokens, stats
    (plain, every, streamed, _), (compacted, rows, compact_streamed, stats) = runs[False], runs[True]
    assert [c.tokens for c in compacted] == [c.tokens for c in plain]
    assert [(c.text, c.finish_reason) for c in compacted] == [(c.text, c.finish_reason) for c in plain]
    assert compact_streamed == streamed
    for ours, theirs in zip(compacted, plain):
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-6, rtol=0)
    lengths = [len(c.tokens) for c in plain]
    assert min(lengths) <= 3 and max(lengths) >= 10, lengths  # the long tail the check needs
    assert every == [len(prompts)] * stats.decode_steps
    sizes = sorted(set(rows), reverse=True)  # each compaction at least halves: at most log2(batch) of them
    assert len(rows) == stats.decode_steps and rows == sorted(rows, reverse=True) and len(sizes) > 2
    assert all(2 * smaller <= larger for larger, smaller in zip(sizes, sizes[1:])), rows
    for step, size in enumerate(rows):
        running = sum(n > step + 1 for n in lengths)  # step k decodes the token k + 1 of the rows still running
        assert running <= size < 2 * running, (step, rows, lengths)
    assert sum(rows) < sum(every) // 2
    # Greedy as well: the tokens of a full forward over each prompt and its tokens so far.
    greedy = SamplingParams(max_new_tokens=12, stop_token_ids=stop)
    engine = Engine(model)
    rows = _decode_rows(engine)
    completions, _ = engine.generate(prompts[:6], greedy)
    assert rows[-1] < 6 and [c.tokens for c in completions] == \
        [c.tokens for c in Engine(model, compact=False).generate(prompts[:6], greedy)[0]]
    # Compiled, the rows stay in the one static cache (engine.py: another batch size is another graph).
    assert not Engine(model, compile=True).compact


def test_stop_strings_cut_the_text_and_streamed_pieces_add_up(model):
    engine = Engine(model)
    text = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731  a detokenizer whose pieces are visible
    prompt = [5, 9, 17, 3]
    (plain,), _ = engine.generate([prompt], SamplingParams(max_new_tokens=6), detokenize=text)
    assert plain.text == text(plain.tokens) and plain.finish_reason == "length"
    stop = f"<{plain.tokens[3]}>"
    pieces = []
    (cut,), _ = engine.generate([prompt], SamplingParams(max_new_tokens=6, stop_strings=(stop,)), detokenize=text,
                                on_text=lambda row, piece: pieces.append(piece))
    assert cut.text == text(plain.tokens)[:text(plain.tokens).index(stop)] and cut.finish_reason == "stop"
    assert "".join(pieces) == cut.text


def test_bad_prompts_are_one_sentence(model):
    engine = Engine(model)
    for prompts, words in (([[]], "the prompt is empty"), ([[1, 2], []], "prompt 2 is empty"),
                           ([list(range(40))], "has 40 tokens, which leaves no room in the model's context of 40"),
                           ([], "no prompts")):
        with pytest.raises(GenerationError) as e:
            engine.generate(prompts, SamplingParams())
        assert words in str(e.value) and "\n" not in str(e.value)


def test_continuous_batching_cancels_and_survives_a_failed_step(model):
    """Slots are refilled as sequences end (each prompt gets what it gets alone), a cancelled
    sequence frees its slot at the next step, and a step that raises ends the sequences in flight
    with the error while the batch goes on serving (what the server's engine thread relies on)."""
    from titanlike.inference import ContinuousBatch

    engine = Engine(model)
    prompts = [[5, 9, 17, 3], [7, 31, 90], [100, 101, 102], [44, 12, 8, 8]]
    alone = [engine.generate([p], SamplingParams(max_new_tokens=5))[0][0].tokens for p in prompts]
    batch = ContinuousBatch(engine, slots=2)
    done = []
    seqs = [batch.submit(p, SamplingParams(max_new_tokens=5), on_done=done.append) for p in prompts]
    batch.step()
    batch.cancel(seqs[1])  # running: its slot goes to the third prompt at the next step
    batch.run()
    assert seqs[1].completion.finish_reason == "cancelled" and batch.cancelled == 1 and len(done) == 4
    assert [s.completion.tokens for s in seqs if s is not seqs[1]] == [alone[0], alone[2], alone[3]]
    assert seqs[2].slot == seqs[1].slot

    real, calls = engine.decode_step, []

    def failing(tokens, cache):
        calls.append(1)
        raise RuntimeError("device lost")

    engine.decode_step = failing
    broken = batch.submit(prompts[0], SamplingParams(max_new_tokens=5))
    with pytest.raises(RuntimeError):
        batch.step()
    batch.fail_all(RuntimeError("device lost"))
    assert broken.done and broken.completion.finish_reason == "error" and not batch.busy()
    engine.decode_step = real
    again = batch.submit(prompts[0], SamplingParams(max_new_tokens=5))
    batch.run()
    assert again.completion.tokens == alone[0]


def test_a_continuous_step_computes_the_rows_and_slots_in_use(model):
    """Sequences that end leave their rows to the others (moved down), and each decode step runs on
    the rows that hold a sequence and reads the slots the longest has, eager; compiled (a static
    cache), the smallest row and slot buckets that hold them. Tokens are what each gets alone."""
    from titanlike.inference import ContinuousBatch

    prompts = [[5, 9, 17, 3], [7, 31, 90], [100, 101, 102], [44, 12, 8, 8, 9]]
    lengths = [2, 9, 4, 6]
    for static in (False, True):
        engine = Engine(model)
        alone = [engine.generate([p], SamplingParams(max_new_tokens=n))[0][0].tokens for p, n in zip(prompts, lengths)]
        batch = ContinuousBatch(engine, slots=4)
        batch.cache.static = static
        shapes, real = [], engine.decode_step

        def step(tokens, cache):
            longest = cache.host_max_length
            logits = real(tokens, cache)
            shapes.append((cache.batch_size, batch.active, cache.slots_in_use, longest))
            return logits

        engine.decode_step = step
        seqs = [batch.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
        batch.run()
        assert [s.completion.tokens for s in seqs] == alone
        assert shapes[-1][0] == 1 and seqs[1].slot == 0  # the longest, moved down from row 1
        for rows, live, slots, longest in shapes:
            if static:  # capacity 40: slot buckets 10 and 40; 4 slots: row buckets 1 and 4
                assert rows == (1 if live == 1 else 4) and slots == (10 if longest < 10 else 40), shapes
            else:
                assert rows == live and slots == longest + 1, shapes


def _background_batch(model, fail_rows: int | None = None):
    """A continuous batch of 4 slots whose "compiled" step (a static cache's shapes) is the eager hook
    counted, and a compile thread that waits for the returned gate before its first shape: what
    compile_in_background does, without inductor's minutes. A shape of fail_rows rows fails to compile."""
    import threading

    from titanlike.inference import ContinuousBatch

    engine = Engine(model)
    batch = ContinuousBatch(engine, slots=4)
    batch.cache.static = True
    gate, served = threading.Event(), []  # served: the compiled step's calls from the serving thread
    gate.entered = threading.Event()  # the compile thread is at its first shape
    serving = threading.current_thread()

    def compiled(tokens, cache):
        if threading.current_thread() is not serving:  # the compile thread
            gate.entered.set()
            assert gate.wait(30)
            if cache.batch_size == fail_rows:
                raise RuntimeError("inductor failed\n  on its second line")
        else:
            served.append((cache.batch_size, cache.capacity))
        return engine.eager_step(tokens, cache)

    engine.decode_step = compiled
    return batch, gate, served


def test_a_server_serves_eager_while_the_step_compiles_and_each_shape_switches_when_ready(model, caplog):
    """compile_in_background (titanlike-serve --compile): requests answered before the compile is done
    get the eager tokens from the eager step; once a shape is compiled, its steps are the compiled
    step's (counted); a shape whose compile raises is logged in one sentence and stays eager."""
    from titanlike.inference import ContinuousBatch

    prompts = [[5, 9, 17, 3], [7, 31, 90]]
    params = SamplingParams(max_new_tokens=6)
    alone = [ContinuousBatch(Engine(model), slots=1) for _ in prompts]
    alone = [b.submit(p, params) for b, p in zip(alone, prompts)], alone
    for b in alone[1]:
        b.run()
    alone = [s.completion.tokens for s in alone[0]]
    batch, gate, served = _background_batch(model, fail_rows=4)
    finished = []
    assert batch.compile_in_background(lambda n, s: finished.append(n)) == 4  # rows 1, 4 x slots 10, 40
    before = [batch.submit(p, params) for p in prompts]
    batch.run()  # the compile thread waits at its first shape
    assert [s.completion.tokens for s in before] == alone and batch.steps == 5 and batch.compiled_steps == 0
    assert served == [] and not batch.ready
    gate.set()
    batch._compiler.join(30)
    assert finished == [2] and batch.ready == {(1, 10), (1, 40)}
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        f"compiling the decode step for 4 rows of {slots} slots failed, so that shape stays eager: inductor failed "
        "on its second line" for slots in (10, 40)]
    one = batch.submit(prompts[0], params)
    batch.run()  # one row: the compiled shape
    assert one.completion.tokens == alone[0] and batch.compiled_steps == 5 and served == [(1, 10)] * 5
    both = [batch.submit(p, params) for p in prompts]
    batch.run()  # two rows: the 4-row shape, which failed, stays eager
    assert [s.completion.tokens for s in both] == alone and batch.compiled_steps == 5 and batch.steps == 15


def test_stopping_a_background_compile_returns_at_once_and_compiles_no_further_shape(model):
    """A server that shuts down while compiling does not wait for it: stop_compiling() returns at once
    (the compile thread is a daemon), and the thread stops after the shape in progress."""
    import time

    batch, gate, _ = _background_batch(model)
    finished = []
    batch.compile_in_background(lambda n, s: finished.append(n))
    assert gate.entered.wait(30)
    started = time.monotonic()
    assert not batch.stop_compiling(timeout=0.1)  # a shape is compiling
    assert time.monotonic() - started < 5
    gate.set()
    assert batch.stop_compiling(timeout=30)
    assert batch.ready == {(1, 10)} and finished == []


# ---------------------------------------------------------------- scripts/generate.py


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random GPT-2 (its context is its position table: 48) with the debug tokenizer, written as a
    Hugging Face folder."""
    from titanlike.checkpoint.hf import write_hf
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    spec = get_model_spec("gpt2")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=tokenizer.vocab_size, n_layers=2, dim=64,
                               n_heads=4, max_seq_len=48)
    folder = tmp_path_factory.mktemp("hf")
    write_hf(materialize(spec.model_cls, args).state_dict(), spec, args, str(folder), context_len=48,
             bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, tokenizer_path=DEFAULT_TOKENIZER_PATH)
    return folder


def _run(capsys, *argv) -> tuple[int, str, str]:
    from titanlike.cli import generate

    rc = generate.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_program_batches_streams_and_reads_a_prompts_file(hf_folder, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"In the beginning"\n{"prompt": "And God said"}\n\n{"prompt": "Let"}\n')
    greedy = ("--temperature", "0", "--max-new-tokens", "6")
    rc, streamed, err = _run(capsys, hf_folder, "--prompts-file", prompts, *greedy)
    assert rc == 0 and "tokens/s" in err and "first token after" in err, err
    rc, batched, _ = _run(capsys, hf_folder, "--prompts-file", prompts, "--batch-size", "3", *greedy)
    assert rc == 0 and batched == streamed
    lines = streamed.splitlines()
    assert len(lines) == 3 and lines[1].startswith("And God said")

    # Sampling with every option, reproducible from the seed.
    sampled = ("--prompt", "In the beginning", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.8",
               "--repetition-penalty", "1.2", "--seed", "3", "--max-new-tokens", "6")
    assert _run(capsys, hf_folder, *sampled)[1] == _run(capsys, hf_folder, *sampled)[1]

    # Chat mode: the llama3 template's turn, the answer after "> ".
    rc, out, _ = _run(capsys, hf_folder, "--chat", "--prompt", "hello", *greedy)
    assert rc == 0 and out.startswith("hello\n> "), out


@pytest.mark.parametrize("argv,words", [
    (("--prompt", ""), "--prompt is empty"),
    (("--top-p", "1.5"), "--top-p must be a number in (0, 1]"),
    (("--temperature", "-1"), "--temperature must be a finite number >= 0"),
    (("--repetition-penalty", "0"), "--repetition-penalty must be a finite number > 0"),
    (("--max-new-tokens", "0"), "--max-new-tokens must be an integer of at least 1"),
    (("--batch-size", "0"), "--batch-size must be at least 1"),
    (("--stop-token", "999999"), "--stop-token 999999 is not a token id"),
    (("--prompt", "word " * 60), "which leaves no room in the model's context of 48 tokens"),
])
def test_bad_input_is_one_sentence(hf_folder, capsys, argv, words):
    rc, out, err = _run(capsys, hf_folder, *argv)
    assert rc == 1 and out == "" and err.startswith("error: ") and words in err, err
    assert err.strip().count("\n") == 0, err


def test_a_bad_prompts_file_is_one_sentence(hf_folder, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n{"text": 3}\n')
    rc, _, err = _run(capsys, hf_folder, "--prompts-file", bad)
    assert rc == 1 and "line 2 is not a string" in err and err.strip().count("\n") == 0, err
    bad.write_text("not json\n")
    assert "line 1 is not JSON" in _run(capsys, hf_folder, "--prompts-file", bad)[2]


def test_a_launch_of_several_ranks_is_one_sentence(hf_folder, capsys, monkeypatch):
    """torchrun would run the program once per rank: refused (no pipeline-parallel generation)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc, _, err = _run(capsys, hf_folder)
    assert rc == 1 and "launched as 2 ranks" in err and "pipeline stages" in err and err.strip().count("\n") == 0
