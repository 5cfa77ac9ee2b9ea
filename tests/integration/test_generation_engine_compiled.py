"""The generation engine compiled (titanlike/inference): a torch.compile'd decode step on static caches
gives the eager tokens and compiles once per shape. Inductor runs the C++ compiler in subprocesses. The engine's
other rules: tests/unit/test_generation_engine.py."""

from __future__ import annotations

import dataclasses

import pytest

from family_checks import materialize
from titanlike.inference import Engine, SamplingParams
from titanlike.models.registry import get_model_spec


def test_compiled_decode_gives_the_eager_tokens_without_recompiling():
    """Engine(compile=True): static caches of the context's length and a torch.compile'd decode step
    (inductor), which compiles once for a batch size and is reused by every step of every call, the
    continuous batch's (a server's) once per row and slot bucket it meets (continuous.py); greedy
    tokens equal the eager engine's. One layer: a cold compile on CPU costs seconds per kernel."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from titanlike.inference import ContinuousBatch

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], vocab_size=256, n_layers=1, max_seq_len=40)
    model = materialize(spec.model_cls, args, seed=0).eval()
    prompts = [[[5, 9, 17, 3, 44, 12, 8], [7, 31, 90]], [[1, 2], [60, 61, 62, 63, 64]]]
    params = SamplingParams(max_new_tokens=4)
    eager = Engine(model)
    want = [[c.tokens for c in eager.generate(p, params)[0]] for p in prompts]
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(model, compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, caches = [], []
        for p in prompts:
            got.append([c.tokens for c in engine.generate(p, params)[0]])
            caches.append(engine._cache)
        graphs = counters["stats"]["unique_graphs"]
    # The continuous batch steps only the rows in use over a slot bucket (continuous.py): a graph per
    # shape it meets the first time, none after.
    batch = ContinuousBatch(engine, slots=2)
    seqs = [batch.submit(p, params) for p in prompts[0] + prompts[1]]
    batch.run()
    batch_graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = [batch.submit(p, params) for p in prompts[0] + prompts[1]]
        batch.run()
    assert got == want
    assert [s.completion.tokens for s in seqs] == [s.completion.tokens for s in again] == want[0] + want[1]
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == batch_graphs  # no graph after the first run's
    assert caches[0] is caches[1]  # both calls' batches of 2 decode in one static cache (a CUDA graph's)
    assert batch.cache.static and batch.cache.layer("0").k.shape[2] == 40


def test_grpo_rollouts_from_the_compiled_decode_step_are_the_eager_ones(tmp_path):
    """grpo.compile_generation: the rollout keeps one engine from generation to generation
    (titanlike/rl/rollout.py), its decode step compiled; the same seeds draw the same completions (the
    compiled logits differ from the eager ones by rounding), so rewards, lengths and losses agree, and
    the engine's log-probabilities stay the trainer's. One layer, two generations."""
    from conftest import REPO, read_metrics, train_in_process
    from grpo_assets import prompt_rows
    from sft_assets import reverse_task, write_jsonl

    prompts = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(reverse_task(16, seed=0, words=2)))
    job = ["--job.config_file", str(REPO / "train_configs" / "grpo_debug.toml"), "--model.flavor", "debugmodel_tiny",
           "--model.args.n_layers", "1", "--metrics.log_freq", "1", "--metrics.enable_jsonl",
           "--metrics.no_enable_tensorboard", "--grpo.reward_funcs", "grpo_assets:length_reward",
           "--optimizer.lr", "1e-3", "--training.steps", "2", "--training.dataset_path", str(prompts)]
    from torch._dynamo.utils import counters

    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--grpo.compile_generation"])):
        counters.clear()
        train_in_process([*job, "--job.dump_folder", str(tmp_path / name), *extra])
        runs[name] = read_metrics(tmp_path / name)
    assert counters["stats"]["unique_graphs"] >= 1  # the compiled run's decode step
    for got, want in zip(runs["compiled"], runs["eager"], strict=True):
        assert (got["reward/mean"], got["completion_length/mean"]) == (want["reward/mean"], want["completion_length/mean"])
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
        assert got["mismatch"] < 1e-5


def test_a_compiled_server_compiles_every_shape_before_serving_and_says_so():
    """titanlike-serve --compile: OpenAIServer.warm_up compiles each shape of the continuous batch's step
    (row and slot buckets) before the first request and the start line says how many and how long;
    requests then compile nothing and get the eager engine's greedy tokens. The model and shapes of
    the test above, so inductor's on-disk cache holds its kernels (a few seconds)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from titanlike.cli.serve import start_lines
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.inference.processor import Processor
    from titanlike.inference.server import OpenAIServer

    openai = pytest.importorskip("openai")
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], vocab_size=256, n_layers=1, max_seq_len=40)
    model = materialize(spec.model_cls, args, seed=0).eval()
    prompts = [[5, 9, 17, 3, 44, 12, 8], [7, 31, 90]]
    want = [c.tokens for c in Engine(model).generate(prompts, SamplingParams(max_new_tokens=4))[0]]
    torch._dynamo.reset()
    counters.clear()
    server = OpenAIServer(Engine(model, compile=True), Processor(build_tokenizer(DEFAULT_TOKENIZER_PATH)),
                          model_name="tiny", slots=2, port=0)
    shapes, seconds = server.warm_up()
    assert shapes == 4 == counters["stats"]["unique_graphs"]  # rows 1 and 2, slots 10 and 40
    assert start_lines(server)[0] == f"compiled 4 shapes of the decode step in {seconds:.1f} s"
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0,
                                             extra_body={"skip_special_tokens": False}).choices[0].text
                   for p in prompts]
    finally:
        server.shutdown()
    assert got == [server.processor.decode(tokens, skip_special_tokens=False) for tokens in want]
    assert counters["stats"]["unique_graphs"] == 4


def test_a_server_compiling_in_the_background_switches_each_shape_to_its_compiled_step():
    """titanlike-serve --compile: OpenAIServer.compile_in_background serves eager at once and compiles the
    shapes in a thread on a scratch cache (continuous.py), then says "compiled N shapes"; the guards of
    what it compiled hold for the serving cache's steps, so requests after it recompile nothing, are
    the compiled step's, and get the eager engine's greedy tokens. The model and shapes of the tests above
    (inductor's on-disk cache holds their kernels: a few seconds). Eager answers while a compile is still
    running, and a shape that fails to compile: tests/unit/test_generation_engine.py."""
    import threading

    import torch._dynamo
    from torch._dynamo.utils import counters

    from titanlike.cli.serve import start_lines
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.inference.processor import Processor
    from titanlike.inference.server import OpenAIServer

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], vocab_size=256, n_layers=1, max_seq_len=40)
    model = materialize(spec.model_cls, args, seed=0).eval()
    prompts = [[5, 9, 17, 3, 44, 12, 8], [7, 31, 90]]
    params = SamplingParams(max_new_tokens=4)
    want = [c.tokens for c in Engine(model).generate(prompts, params)[0]]
    torch._dynamo.reset()
    counters.clear()
    server = OpenAIServer(Engine(model, compile=True), Processor(build_tokenizer(DEFAULT_TOKENIZER_PATH)),
                          model_name="tiny", slots=1, port=0)  # 2 shapes: rows 1, slots 10 and 40
    assert start_lines(server)[1] == "serving eager; compiling 2 shapes in the background"
    said, done = [], threading.Event()
    assert server.compile_in_background(say=lambda line: (said.append(line), done.set())) == 2
    assert done.wait(300)
    shapes, seconds = server.compiled
    assert said == [f"compiled 2 shapes of the decode step in {seconds:.1f} s"] and shapes == 2
    assert counters["stats"]["unique_graphs"] >= 2
    batch = server.batch
    with torch._dynamo.config.patch(error_on_recompile=True):
        seqs = [batch.submit(p, params) for p in prompts]
        batch.run()
    assert [s.completion.tokens for s in seqs] == want
    assert batch.compiled_steps == batch.steps == 6  # 3 decode steps each, one prompt at a time, all compiled
    server.http.server_close()
