"""torchtitan's configs run here unchanged (README: Coming from torchtitan).

The TOML files in tests/fixtures/torchtitan/ were written for these tests in torchtitan's layouts:
every key of v0.2.2's schema at its default, its debug and 8B presets, and v0.1.0's spellings.
Each loads and validates; the debug ones also train a few steps through train.py. Unknown keys are
reported together; the keys titanlike learned for torchtitan do what they say.
"""

from __future__ import annotations

import dataclasses
import gc
import gzip
import json
import re
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch

from conftest import read_metrics
from titanlike.config import ConfigError, load_job_config
from titanlike.config import loader as config_loader
from titanlike.config.compat import TORCHTITAN_KEYS, NotHere
from titanlike.config.loader import near_certain
from titanlike.config.schema import JobConfig
from titanlike.train.plan import plan_job

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "torchtitan"
HF_TOKENIZER = REPO / "tests" / "assets" / "tokenizer"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    # The fixtures' paths (./tests/assets/tokenizer, ...) are relative to the repository, as
    # torchtitan's are to its checkout.
    monkeypatch.chdir(REPO)


def load(*argv: str) -> tuple[JobConfig, list[str]]:
    notes: list[str] = []
    return load_job_config(list(argv), notes=notes), notes


def fixture(name: str) -> list[str]:
    return ["--job.config_file", str(FIXTURES / name)]


def noted_keys(notes: list[str]) -> set[str]:
    assert all("\n" not in n for n in notes)
    return {n.split()[0] for n in notes}


# ---------------------------------------------------------------- every key of the v0.2.2 schema


def test_every_v022_key_at_its_default_loads_and_validates():
    cfg, notes = load(*fixture("v0.2.2_defaults.toml"))
    plan_job(cfg, world_size=1)
    # Only keys at a value titanlike does not act on are noted; the rest do what they say.
    assert noted_keys(notes) == {
        "profiling.profiler_warmup", "metrics.disable_color_printing",
        "parallelism.pipeline_parallel_expert_parallel_overlap",
        "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "experimental.custom_args_module"}
    assert cfg.float8.filter_fqns == []  # [quantize.linear.float8] is [float8]
    assert cfg.activation_checkpoint.mode == "selective" and cfg.activation_checkpoint.preserve_rng_state
    assert (cfg.training.dataset, cfg.validation.dataset, cfg.validation.seq_len) == ("c4_test", "c4_validation", 2048)
    assert (cfg.parallelism.pipeline_parallel_first_stage_less_layers, cfg.training.gc_freq) == (1, 50)


def _differing_defaults() -> set[str]:
    """Keys of torchtitan v0.2.2 whose default is not titanlike's (what titanlike does, for the
    keys it has no counterpart for)."""
    with open(FIXTURES / "v0.2.2_defaults.toml", "rb") as f:
        theirs = config_loader._flatten_toml(tomllib.load(f), "defaults")
    # TOML has no null: torchtitan's keys whose default is None.
    theirs += [(k, None) for k in (
        "job.save_config_file", "model.tokenizer_path", "lr_scheduler.total_steps", "lr_scheduler.decay_ratio",
        "training.dataset_path", "training.dataloader.prefetch_factor", "parallelism.module_fqns_per_model_part",
        "parallelism.pipeline_parallel_layers_per_stage", "checkpoint.initial_load_path",
        "quantize.linear.float8.recipe_name", "fault_tolerance.semi_sync_method", "validation.dataset_path",
        "validation.dataloader.prefetch_factor", "debug.seed")]
    ours = JobConfig()
    differ = set()
    for name, value in theirs:
        option = config_loader._resolve(name)
        assert option is not None, name
        if option.section:
            mine = getattr(getattr(ours, option.section), option.key)
        else:
            mine = option.not_here.value
        if value is not None:
            value = config_loader._convert(name, value, option.tp, None)
        if mine != value:
            differ.add(name)
    return differ


def test_defaults_that_differ_from_torchtitan_are_listed_in_the_readme():
    readme = (REPO / "README.md").read_text()
    section = readme.split("### Coming from torchtitan", 1)[1].split("\n#", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_.0-9]+)` \|", section, flags=re.M))
    spelled = {"float8.filter_fqns": "quantize.linear.float8.filter_fqns"}  # the README uses our section
    assert {spelled.get(k, k) for k in listed} == _differing_defaults()


def test_compat_table_holds_no_key_of_the_schema():
    # Schema keys are resolved first: a table entry for one would never be read (e.g. a torchtitan
    # key that a later change implemented): delete the entry then.
    schema = {f"{name}.{f.name}" for name, section in config_loader.config_sections().items()
              for f in dataclasses.fields(section)}
    assert not schema & set(TORCHTITAN_KEYS)
    for name, entry in TORCHTITAN_KEYS.items():
        if not isinstance(entry, NotHere):
            assert config_loader._resolve(entry.target) is not None, name  # every rename lands somewhere


# ---------------------------------------------------------------- the presets' layouts


def test_v022_debug_layout_loads_and_validates():
    cfg, notes = load(*fixture("llama3_debug_v0.2.2.toml"))
    assert notes == ["metrics.disable_color_printing has no effect in titanlike: titanlike's console log is "
                     "never colored"]
    assert cfg.float8.filter_fqns == ["output"] and cfg.model.hf_assets_path == "./tests/assets/tokenizer"
    assert (cfg.lr_scheduler.total_steps, cfg.training.gc_freq, cfg.validation.seq_len) == (10, 2, 32)
    assert cfg.checkpoint.enable_first_step_checkpoint and cfg.activation_checkpoint.selective_ac_option == "2"
    dims = plan_job(cfg, world_size=8).dims
    assert dims.dp_shard == 8


def test_v022_8b_layout_validates_once_its_assets_exist():
    cfg, notes = load(*fixture("llama3_8b_v0.2.2.toml"))
    assert notes == []
    with pytest.raises(ConfigError) as err:
        plan_job(cfg, world_size=64)
    assert str(err.value) == "model.hf_assets_path ./assets/hf/Llama-3.1-8B does not exist or is not a folder"
    cfg, _ = load(*fixture("llama3_8b_v0.2.2.toml"), "--model.hf_assets_path", str(HF_TOKENIZER))
    assert plan_job(cfg, world_size=64).dims.dp_shard == 64
    assert (cfg.training.dataset, cfg.metrics.enable_tensorboard, cfg.profiling.enable_profiling) == ("c4", True, True)


def test_v010_spellings_are_read_with_a_note_naming_the_new_key():
    cfg, notes = load(*fixture("llama3_debug_v0.1.0.toml"))
    renamed = {"job.print_args": "job.print_config", "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
               "training.compile": "compile.enable", "training.seed": "debug.seed",
               "training.deterministic": "debug.deterministic", "checkpoint.enable_checkpoint": "checkpoint.enable",
               "checkpoint.last_save_model_weights_only": "checkpoint.last_save_model_only",
               "checkpoint.initial_load_model_weights_only": "checkpoint.initial_load_model_only",
               "memory_estimation.enabled": "memory_estimation.enable",
               "experimental.custom_args_module": "job.custom_config_module"}
    by_key = {n.split()[0]: n for n in notes}
    for old, new in renamed.items():
        assert new in by_key.pop(old)
    # What is left: keys that do nothing here, each saying why.
    assert set(by_key) == {"job.use_for_integration_test", "metrics.disable_color_printing"}
    assert (cfg.debug.seed, cfg.lr_scheduler.min_lr_factor, cfg.compile.enable, cfg.checkpoint.enable) == (7, 0.1, False, False)
    assert cfg.checkpoint.last_save_model_only is False and cfg.float8.filter_fqns == ["output"]
    # v0.1.0's [mx] is titanlike's own section (its recipe is checked when model.converters names mx).
    assert (cfg.mx.recipe_name, cfg.mx.filter_fqns) == ("mxfp8", ["output"])
    plan_job(cfg, world_size=1)


@pytest.mark.parametrize("argv, section, key, value", [
    (["--training.compile"], "compile", "enable", True),
    (["--checkpoint.enable_checkpoint", "--checkpoint.no_enable_checkpoint"], "checkpoint", "enable", False),
    (["--quantize.linear.float8.emulate"], "float8", "emulate", True),
    (["--quantize.linear.float8.filter_fqns", "output,layers.0"], "float8", "filter_fqns", ["output", "layers.0"]),
    (["--lr_scheduler.lr_min=0.25"], "lr_scheduler", "min_lr_factor", 0.25),
    (["--job.print_args", "true"], "job", "print_config", True),
    (["--model.converters", "quantize.linear.float8"], "model", "converters", ["float8"]),  # v0.2.2's registry name
    (["--quantize.linear.mx.filter_fqns", "output,layers.0"], "mx", "filter_fqns", ["output", "layers.0"]),
    (["--quantize.linear.mx.recipe_name", "mxfp8_rceil_wgrad_with_hp"], "mx", "recipe_name", "mxfp8_rceil_wgrad_with_hp"),
    (["--quantize.grouped_mm.mx.fqns", "experts"], "mx", "grouped_mm_fqns", ["experts"]),
    # v0.2.2's two MX converters are our one mx, named once.
    (["--model.converters", "quantize.linear.mx,quantize.grouped_mm.mx"], "model", "converters", ["mx"]),
    (["--checkpoint.export_dtype", "float16"], "checkpoint", "export_dtype", "float16"),
])
def test_torchtitan_spellings_on_the_command_line(argv, section, key, value):
    cfg, _ = load(*argv)
    assert getattr(getattr(cfg, section), key) == value


def test_both_spellings_of_one_key_in_a_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\ncompile = true\n[compile]\nenable = false\n")
    with pytest.raises(ConfigError, match=r"sets compile.enable twice, as training.compile and as compile.enable, "
                                          r"to different values; keep compile.enable"):
        load("--job.config_file", str(path))
    # The command line overrides the file, whichever spelling each uses.
    path.write_text("[training]\ncompile = true\n")
    assert load("--job.config_file", str(path), "--compile.no_enable")[0].compile.enable is False


# ---------------------------------------------------------------- unknown keys, all at once


def test_unknown_keys_of_file_and_command_line_in_one_sentence(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\nstepz = 3\n[checkpoint]\nenable_checkpointing = true\n[trainig]\nsteps = 4\n"
                    "seq_len = 8\n[quantize.linear.float8]\nfilter_fqn = []\n")
    with pytest.raises(ConfigError) as err:
        load("--job.config_file", str(path), "--training.lr", "3", "--job.nope", "--metrics.enable_tensorbaord")
    assert str(err.value) == (
        "7 unknown config keys or sections: 'training.stepz' (did you mean 'training.steps'?), "
        "'checkpoint.enable_checkpointing', section 'trainig' (did you mean 'training'?), "
        "'quantize.linear.float8.filter_fqn' (did you mean 'quantize.linear.float8.filter_fqns'?), "
        "'training.lr' (did you mean 'optimizer.lr'?), 'job.nope', "
        "'metrics.enable_tensorbaord' (did you mean 'metrics.enable_tensorboard'?)")


def test_suggestions_only_when_near_certain():
    checkpoint_keys = [f.name for f in dataclasses.fields(JobConfig().checkpoint)]
    # Without the table, v0.1.0's enable_checkpoint resembles create_seed_checkpoint (which writes a
    # step-0 seed and exits): no suggestion beats that one.
    assert near_certain("enable_checkpoint", checkpoint_keys) is None
    assert near_certain("intervall", checkpoint_keys) == "interval"
    assert near_certain("step", ["steps", "seed"]) == "steps"
    assert near_certain("AdamW".lower(), ["AdamW", "Adam"]) == "AdamW"
    assert near_certain("lr", ["lr1", "lr2"]) is None  # two equally close: no guess
    # An older spelling with a typo is corrected to the key it became.
    with pytest.raises(ConfigError, match=r"'checkpoint.enable_checkpoints'; did you mean 'checkpoint.enable'\?"):
        load("--checkpoint.enable_checkpoints")


# ---------------------------------------------------------------- keys titanlike has no counterpart for


@pytest.mark.parametrize("argv, message", [
    (["--training.dtype", "bfloat16"], 'training.dtype = "bfloat16" is not supported: parameters and optimizer state '
     'stay float32 here (bfloat16 compute is training.mixed_precision_param); remove it or set it to "float32"'),
    (["--fault_tolerance.enable"], "fault_tolerance.enable = true is not supported: titanlike has no TorchFT "
     "integration; remove it or set it to false"),
    (["--job.custom_config_module", "evil.module"], 'job.custom_config_module = "evil.module" is not supported: '
     "titanlike never imports code a config names (model families register in titanlike.models); remove it or "
     'set it to ""'),
    (["--parallelism.module_fqns_per_model_part", "layers.0"], "parallelism.module_fqns_per_model_part"),
    (["--training.dataloader.num_workers", "4"], "training.dataloader.num_workers = 4 is not supported"),
    (["--comm.mode", "fake_backend"], "a dry run without GPUs is estimation/estimate.py"),
])
def test_unsupported_values_are_refused_in_one_sentence(argv, message):
    with pytest.raises(ConfigError) as err:
        load(*argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_keys_without_effect_are_noted_and_their_match_is_silent():
    _, notes = load("--metrics.disable_color_printing", "--profiling.profiler_warmup", "1",
                    "--fault_tolerance.replica_id", "0", "--training.dtype", "float32")
    assert notes == []  # each says what titanlike does
    # torchtitan's MoE presets set the float8 grouped-GEMM experts without enabling its converter.
    _, notes = load("--quantize.grouped_mm.float8.fqns", "experts")
    assert notes == ["quantize.grouped_mm.float8.fqns has no effect in titanlike: float8 grouped GEMMs for experts "
                     "are not implemented in titanlike yet (model.converters refuses quantize.grouped_mm.float8)"]
    _, notes = load("--quantize.linear.mx.mxfp8_dim1_cast_kernel_choice", "cuda",
                    "--quantize.grouped_mm.mx.recipe_name", "mxfp8_rceil")
    assert notes == ["quantize.linear.mx.mxfp8_dim1_cast_kernel_choice has no effect in titanlike: torchao's MXFP8 "
                     "linear picks its own cast kernels", "quantize.grouped_mm.mx.recipe_name has no effect in "
                     "titanlike: the experts' grouped GEMMs use mx.recipe_name, as the linear layers do"]
    _, notes = load("--metrics.no_disable_color_printing", "--profiling.profiler_warmup", "3")
    assert notes == ["metrics.disable_color_printing has no effect in titanlike: titanlike's console log is never "
                     "colored", "profiling.profiler_warmup has no effect in titanlike: titanlike's profiler warms up "
                     "one step before each traced step"]


# ---------------------------------------------------------------- model.hf_assets_path


def test_hf_assets_tokenizer_gives_the_debug_tokenizers_ids():
    from titanlike.data import DEFAULT_CORPUS_PATH, DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.loader import C4_TEST_DOCUMENTS

    ours, hf = build_tokenizer(DEFAULT_TOKENIZER_PATH), build_tokenizer(str(HF_TOKENIZER))
    assert (hf.vocab_size, hf.bos_id, hf.eos_id) == (ours.vocab_size, ours.bos_id, ours.eos_id)
    with gzip.open(DEFAULT_CORPUS_PATH, "rt") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(C4_TEST_DOCUMENTS // 4), f)]
    docs += ["Héllo wörld 😀 don't 1234567", "a <|end_of_text|> b <|begin_of_text|>", "  \n\n\t x"]
    assert hf.encode_batch(docs, bos=True, eos=True) == ours.encode_batch(docs, bos=True, eos=True)
    # A document cannot forge a special token; asked for, special strings are the special ids.
    assert ours.eos_id not in hf.encode("a <|end_of_text|> b", bos=False, eos=False)
    assert hf.encode("a<|end_of_text|>", bos=False, eos=False, allowed_special="all")[-1] == ours.eos_id
    assert hf.decode(hf.encode(docs[0], bos=False, eos=False)) == docs[0]


def test_export_copies_the_hf_tokenizer_it_was_trained_with(tmp_path):
    from titanlike.data import build_tokenizer
    from titanlike.data.hf_tokenizer import tokenizer_record, write_hf_tokenizer

    record = tokenizer_record(build_tokenizer(str(HF_TOKENIZER)))
    export = write_hf_tokenizer(str(tmp_path), record["path"], fingerprint=record["fingerprint"], vocab_size=2048)
    assert export.converted, export.message
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (HF_TOKENIZER / name).read_bytes()
    export = write_hf_tokenizer(str(tmp_path), record["path"], fingerprint="0" * 64)
    assert not export.converted and "no longer holds the tokenizer the model was trained with" in export.message


def test_hf_assets_path_problems_are_config_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_bytes((HF_TOKENIZER / "tokenizer.json").read_bytes())
    (bad / "tokenizer_config.json").write_text('{"eos_token": "<|no_such_token|>"}')
    cases = [
        (["--model.hf_assets_path", str(tmp_path / "empty")],
         f"model.hf_assets_path {tmp_path / 'empty'} has no tokenizer.json (torchtitan's scripts/download_hf_assets.py"),
        (["--model.hf_assets_path", str(bad)],
         "tokenizer_config.json names eos_token '<|no_such_token|>', which is not in the vocabulary"),
        (["--model.hf_assets_path", str(HF_TOKENIZER), "--model.tokenizer_path", "x.model"],
         "model.tokenizer_path and model.hf_assets_path both name a tokenizer; set only one"),
        # torchtitan loads Hugging Face weights from hf_assets_path when no initial_load_path is given.
        (["--model.hf_assets_path", str(HF_TOKENIZER), "--checkpoint.enable", "--checkpoint.initial_load_in_hf"],
         f"checkpoint.initial_load_path {HF_TOKENIZER} has no config.json, so it is not a Hugging Face model folder"),
    ]
    for argv, fragment in cases:
        with pytest.raises(ConfigError) as err:
            plan_job(load(*argv)[0], world_size=1)
        assert fragment in str(err.value) and "\n" not in str(err.value), argv


# ---------------------------------------------------------------- datasets c4, c4_test, c4_validation


def _loader(dataset: str, dataset_path: str | None = None, seq_len: int = 64):
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_dataloader, build_tokenizer

    return build_dataloader(dataset=dataset, dataset_path=dataset_path, tokenizer=build_tokenizer(DEFAULT_TOKENIZER_PATH),
                            seq_len=seq_len, local_batch_size=2, global_batch_size=2, dp_rank=0, dp_degree=1, seed=0)


def test_c4_test_is_a_small_local_slice_of_the_embedded_corpus():
    from titanlike.data import DEFAULT_CORPUS_PATH, DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.loader import C4_TEST_DOCUMENTS
    from titanlike.data.text_datasets import iter_documents, pack_documents

    tokens = pack_documents(list(iter_documents(DEFAULT_CORPUS_PATH))[:C4_TEST_DOCUMENTS],
                            build_tokenizer(DEFAULT_TOKENIZER_PATH))
    loader = _loader("c4_test")
    assert len(loader.dataset.samples.source) == len(tokens) // 65  # windows of seq_len + 1 tokens
    assert len(loader.dataset.samples.source) < len(_loader("default").dataset.samples.source) / 9
    batch = next(iter(loader))
    inputs, labels = batch["inputs"], batch["labels"]
    assert inputs.shape == (2, 64) and torch.equal(inputs[:, 1:], labels[:, :-1])


def test_c4_offline_fails_in_one_sentence(monkeypatch):
    from titanlike.data import DataError

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(DataError) as err:
        _loader("c4")
    assert str(err.value) == ("dataset c4 streams allenai/c4 through the `datasets` package, which is not installed "
                              "(pip install datasets); without it use c4_test or a text dataset")

    def load_dataset(path, **kwargs):
        raise ConnectionError(f"Couldn't reach 'allenai/c4' on the Hub\n(LocalEntryNotFoundError) {kwargs['split']}")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(DataError) as err:
        _loader("c4_validation", "/data/c4")
    assert str(err.value) == (
        "dataset c4_validation could not open /data/c4 (en, validation split) with `datasets` (ConnectionError: "
        "Couldn't reach 'allenai/c4' on the Hub (LocalEntryNotFoundError) validation); offline, set "
        "training.dataset_path to a local copy of C4 or use c4_test")


@pytest.mark.parametrize("argv, fragment", [
    (["--validation.enable", "--validation.dataset", "c4_validation"],
     "validation.steps must be set (>= 1) for a streaming c4_validation dataset"),
    (["--training.dataset", "c4_test", "--validation.enable"], "a c4_test training dataset has no held-out split"),
    (["--training.dataset", "c4_test", "--training.dataset_path", "x"], "the c4_test dataset is the embedded corpus"),
    (["--validation.enable", "--validation.seq_len", "4096"], "validation.seq_len must be -1 (training's) or 1 to "
     "training.seq_len 2048"),
    (["--validation.enable", "--validation.seq_len", "64", "--parallelism.pipeline_parallel_degree", "2"],
     "validation.seq_len 64 must be -1 or training.seq_len 2048 under pipeline parallelism"),
])
def test_dataset_and_validation_rules(argv, fragment):
    with pytest.raises(ConfigError) as err:
        plan_job(load(*argv)[0], world_size=2 if "2" in argv else 1)
    assert fragment in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- the other keys titanlike learned


def test_pipeline_first_and_last_stage_less_layers_follow_torchtitans_rule():
    from titanlike.parallel.pipeline import plan_layout

    # torchtitan counts the embedding and the output as layers and spreads the sum evenly.
    assert plan_layout(16, 4, "1F1B", None).layers == (4, 4, 4, 4)  # titanlike's rule, unchanged
    assert plan_layout(16, 4, "1F1B", None, 1, 1).layers == (4, 5, 4, 3)
    assert plan_layout(16, 4, "1F1B", None, 0, 2).layers == (5, 5, 4, 2)
    assert plan_layout(16, 2, "Interleaved1F1B", 3, 1, 1).layers == (2, 3, 3, 3, 3, 2)
    assert plan_layout(6, 2, "Interleaved1F1B", None, None, 1).layers == (1, 2, 2, 1)  # the other end counts 1
    with pytest.raises(ValueError, match="with parallelism.pipeline_parallel_first_stage_less_layers 4, the first of "
                                         "4 stages over 8 layers would hold no transformer layer"):
        plan_layout(8, 4, "1F1B", None, 4, 1)
    with pytest.raises(ConfigError, match="pipeline_parallel_last_stage_less_layers must be 0 or more, got -1"):
        plan_job(load("--parallelism.pipeline_parallel_last_stage_less_layers", "-1")[0], world_size=1)


def test_activation_checkpoint_options_reach_torch_checkpoint():
    from titanlike.models.llama3 import Transformer, llama3_flavors
    cfg, _ = load("--activation_checkpoint.mode", "full", "--activation_checkpoint.preserve_rng_state",
                  "--activation_checkpoint.determinism_check", "none", "--activation_checkpoint.no_early_stop")
    opts = plan_job(cfg, world_size=1).parallelize
    from titanlike.parallel.activation_checkpoint import apply_activation_checkpointing

    with torch.device("meta"):
        model = Transformer(llama3_flavors["debugmodel_tiny"])
    apply_activation_checkpointing(model, opts.activation_checkpoint_mode, opts.selective_ac_option,
                                   opts.checkpoint_options, opts.memory_budget)
    kwargs = next(iter(model.layers.values())).checkpoint_fn.keywords
    assert {k: kwargs[k] for k in ("preserve_rng_state", "determinism_check", "debug", "early_stop")} == {
        "preserve_rng_state": True, "determinism_check": "none", "debug": False, "early_stop": False}


def test_memory_budget_mode_sets_the_partitioners_budget(monkeypatch):
    import torch._functorch.config as functorch_config

    from titanlike.parallel.activation_checkpoint import apply_activation_checkpointing

    with pytest.raises(ConfigError, match="memory_budget is decided by torch.compile's partitioner, so it needs "
                                          "compile.enable"):
        plan_job(load("--activation_checkpoint.mode", "memory_budget")[0], world_size=1)
    plan_job(load("--activation_checkpoint.mode", "memory_budget", "--compile.enable")[0], world_size=1)
    monkeypatch.setattr(functorch_config, "activation_memory_budget", 1.0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2)})
    apply_activation_checkpointing(model, "memory_budget", "2", memory_budget=0.3)
    assert functorch_config.activation_memory_budget == 0.3
    assert isinstance(model.layers["0"], torch.nn.Linear)  # no wrapper: the compiler decides


def test_compile_backend_must_be_torchs():
    with pytest.raises(ConfigError, match="compile.backend 'inductr' is not a torch.compile backend; known: "):
        plan_job(load("--compile.enable", "--compile.backend", "inductr")[0], world_size=1)
    plan_job(load("--compile.enable", "--compile.backend", "aot_eager")[0], world_size=1)


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
def test_periodic_gc_collects_at_its_steps_only():
    from titanlike.train.gc_schedule import PeriodicGC

    class Node:
        pass

    assert gc.isenabled()
    with PeriodicGC(3) as schedule:
        assert not gc.isenabled()
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        for step in (1, 2):
            schedule.step_done(step)
        assert alive() is not None  # no automatic collection, none before step 3
        schedule.step_done(3)
        assert alive() is None and schedule.collections == 1
    assert gc.isenabled()
    with PeriodicGC(50, debug=True) as schedule:
        for step in range(1, 4):
            schedule.step_done(step)
        assert schedule.collections == 3  # gc_debug: every step


# ---------------------------------------------------------------- checkpoint keys


def test_checkpoint_load_only_first_step_and_full_initial_load(tmp_path):
    from test_checkpoint_manager import Job, run

    from titanlike.checkpoint import published_steps

    # enable_first_step_checkpoint: step 1 is saved although the interval is 3.
    first = run(tmp_path / "first", 2, "--checkpoint.enable_first_step_checkpoint")
    assert published_steps(first.folder()) == [1]
    assert published_steps(run(tmp_path / "plain", 2).folder()) == []
    # load_only: resumes from the folder, writes nothing (step 3 is at the interval).
    job = Job(tmp_path / "first", "--checkpoint.load_only")
    assert job.start() == 1
    job.train(3)
    job.manager.close()
    assert published_steps(first.folder()) == [1]
    # initial_load_model_only off: another run's full checkpoint, optimizer and step included.
    full = run(tmp_path / "full", 3, "--checkpoint.no_last_save_model_only")
    source = str(Path(full.folder()) / "step-3")
    model_only = Job(tmp_path / "b", "--checkpoint.initial_load_path", source)
    assert model_only.start() == 0
    resumed = Job(tmp_path / "c", "--checkpoint.initial_load_path", source, "--checkpoint.no_initial_load_model_only")
    assert resumed.start() == 3
    assert resumed.optimizer.state_dict()["state"][0]["step"] == full.optimizer.state_dict()["state"][0]["step"]
    for job in (model_only, resumed):
        job.manager.close()


@pytest.mark.parametrize("argv, fragment", [
    (["--checkpoint.load_only"], "checkpoint.load_only needs checkpoint.enable"),
    (["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.create_seed_checkpoint"],
     "checkpoint.load_only saves nothing, so it excludes create_seed_checkpoint"),
    (["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", ".",
      "--checkpoint.no_initial_load_model_only"], "initial_load_in_hf loads a model only"),
    (["--lr_scheduler.total_steps", "0"], "lr_scheduler.total_steps must be at least 1"),
    (["--training.gc_freq", "0"], "training.gc_freq must be at least 1, got 0"),
    (["--debug.deterministic_warn_only"], "debug.deterministic_warn_only only applies with debug.deterministic"),
])
def test_rules_of_the_new_keys(argv, fragment):
    with pytest.raises(ConfigError) as err:
        plan_job(load(*argv)[0], world_size=1)
    assert fragment in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- short runs through train.py


SHORT = ["--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--metrics.enable_jsonl"]


@pytest.fixture
def one_thread():
    # As the subprocess launches of tests/conftest.py (OMP_NUM_THREADS=1): the CI machine's cores
    # are shared, and a tiny model gains nothing from intra-op threads but their spinning.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
def test_v022_debug_layout_trains(tmp_path, caplog, one_thread):
    import train
    from titanlike.train.optimizer import lr_factor

    with caplog.at_level("INFO", logger="titanlike"):
        assert train.main([*fixture("llama3_debug_v0.2.2.toml"), *SHORT, "--job.dump_folder", str(tmp_path)]) == 0
    assert "config: metrics.disable_color_printing has no effect in titanlike" in caplog.text
    assert "model after conversion and parallelization:\nTransformer(" in caplog.text  # model.print_after_conversion
    records = read_metrics(tmp_path)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(0 < r["loss"] < 20 for r in steps)
    # lr_scheduler.total_steps 10: step 3 follows the 10-step curve (stable), not a 3-step one (decaying).
    schedule = dict(warmup_steps=1, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)
    assert steps[2]["lr"] == pytest.approx(8e-4 * lr_factor(2, total_steps=10, **schedule)) == 8e-4
    assert lr_factor(2, total_steps=3, **schedule) == 0.5
    # validation.seq_len 32 (2 samples of 32 tokens) every 2 steps and after the last.
    assert [(r["step"], r["validation_tokens"]) for r in records if "validation_loss" in r] == [(2, 64), (3, 64)]
    # checkpoint.enable_first_step_checkpoint: step 1 besides the last; job.save_config_file.
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()
                  if p.name != ".titanlike.lock") == ["step-1", "step-3"]
    saved = json.loads((tmp_path / "job_config.json").read_text())
    assert saved["lr_scheduler"]["total_steps"] == 10 and saved["model"]["hf_assets_path"] == "./tests/assets/tokenizer"


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
def test_v010_debug_layout_trains(tmp_path, caplog, one_thread):
    import train

    with caplog.at_level("INFO", logger="titanlike"):
        assert train.main([*fixture("llama3_debug_v0.1.0.toml"), *SHORT, "--job.dump_folder", str(tmp_path)]) == 0
    assert "config: training.compile is deprecated (torchtitan v0.1.0's spelling); read as compile.enable" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
