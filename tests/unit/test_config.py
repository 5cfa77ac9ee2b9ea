import pytest
import torch

from titanlike.config import ConfigError, HelpRequested, help_text, load_job_config
from titanlike.train.plan import plan_job


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults():
    cfg = load_job_config([])
    assert cfg.model.name == "llama3"
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.compile.components == ["model", "loss"]


def test_toml_then_cli_overrides_in_order(tmp_path):
    path = write(tmp_path, '[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\n')
    cfg = load_job_config(["--job.config_file", path, "--training.steps", "9", "--optimizer.lr=0.5"])
    assert cfg.training.steps == 9
    assert cfg.training.seq_len == 64
    assert cfg.optimizer.lr == 0.5
    assert cfg.job.config_file == path


def test_booleans_flags_negation_and_explicit_values():
    assert load_job_config(["--metrics.enable_tensorboard"]).metrics.enable_tensorboard is True
    assert load_job_config(["--metrics.enable_tensorboard", "false"]).metrics.enable_tensorboard is False
    assert load_job_config(["--metrics.enable_tensorboard=true"]).metrics.enable_tensorboard is True
    cfg = load_job_config(["--metrics.enable_tensorboard", "--metrics.no_enable_tensorboard"])
    assert cfg.metrics.enable_tensorboard is False
    # A flag followed by another option does not swallow it.
    cfg = load_job_config(["--compile.enable", "--training.steps", "3"])
    assert cfg.compile.enable and cfg.training.steps == 3


def test_lists_and_optionals():
    cfg = load_job_config(["--compile.components", "model", "--checkpoint.exclude_from_loading=optimizer,lr_scheduler"])
    assert cfg.compile.components == ["model"]
    assert cfg.checkpoint.exclude_from_loading == ["optimizer", "lr_scheduler"]
    cfg = load_job_config(["--lr_scheduler.decay_ratio", "0.2"])
    assert cfg.lr_scheduler.decay_ratio == 0.2
    assert load_job_config(["--lr_scheduler.decay_ratio", "none"]).lr_scheduler.decay_ratio is None


def test_sections_of_objectives_and_families_are_read_printed_and_default():
    from titanlike.config import JobConfig, config_to_dict

    cfg = load_job_config(["--masked_lm.mask_prob", "0.2", "--span_corruption.decoder_seq_len", "16",
                           "--hybrid.layer_pattern", "M*"])
    assert (cfg.masked_lm.mask_prob, cfg.span_corruption.decoder_seq_len, cfg.hybrid.layer_pattern) == (0.2, 16, "M*")
    printed = config_to_dict(cfg)
    assert printed["masked_lm"] == {"mask_prob": 0.2, "short_seq_prob": 0.1}
    assert printed["hybrid"]["layer_pattern"] == "M*"
    assert JobConfig().span_corruption.decoder_seq_len == 128  # a config built in code reads the defaults
    with pytest.raises(AttributeError):
        JobConfig().no_such_section


def test_a_registered_dataset_kind_is_a_config_value_with_its_rules(monkeypatch):
    """training.dataset / validation.dataset take what the data loader registers (no list in config/),
    and the config checks the kind's own path and streaming rules before anything runs."""
    from titanlike.config import sections, validate_values
    from titanlike.data import kinds, loader

    with pytest.raises(ConfigError, match="training.dataset must be one of .*webdataset"):
        load_job_config(["--training.dataset", "shards"])
    monkeypatch.setattr(kinds, "_KINDS", dict(kinds._KINDS))
    monkeypatch.setattr(sections, "_DATASET_KINDS", dict(sections._DATASET_KINDS))
    loader.register_dataset_kind("shards", lambda **_: None, shuffle=False, needs_path=False, streaming=True)
    assert load_job_config(["--training.dataset", "shards"]).training.dataset == "shards"
    with pytest.raises(ConfigError, match="validation.dataset shards takes no dataset_path"):
        validate_values(load_job_config(["--validation.enable", "--validation.dataset", "shards",
                                         "--validation.dataset_path", "x"]))
    with pytest.raises(ConfigError, match="for a streaming shards dataset"):
        validate_values(load_job_config(["--validation.enable", "--validation.dataset", "shards"]))


def test_old_spellings_of_moved_keys_load_with_a_note(tmp_path):
    """training.mask_prob & co. before [masked_lm] / [span_corruption] held them: one old key feeds
    every section that now holds it, with the loader's one-line note."""
    notes: list[str] = []
    cfg = load_job_config(["--training.mask_prob", "0.3", "--training.decoder_seq_len", "16"], notes=notes)
    assert (cfg.masked_lm.mask_prob, cfg.span_corruption.mask_prob, cfg.span_corruption.decoder_seq_len) == (
        0.3, 0.3, 16)
    assert notes == [
        "training.mask_prob is deprecated (titanlike 0.1.0's spelling); read as masked_lm.mask_prob and "
        "span_corruption.mask_prob",
        "training.decoder_seq_len is deprecated (titanlike 0.1.0's spelling); read as span_corruption.decoder_seq_len"]
    path = tmp_path / "both.toml"
    path.write_text("[training]\nmask_prob = 0.3\n[masked_lm]\nmask_prob = 0.2\n")
    with pytest.raises(ConfigError, match="sets masked_lm.mask_prob twice, as training.mask_prob and as "
                                          "masked_lm.mask_prob, to different values; keep masked_lm.mask_prob"):
        load_job_config(["--job.config_file", str(path)])


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--trainig.steps", "3"], "unknown config section 'trainig'; did you mean 'training'?"),
        (["--training.step", "3"], "unknown config key 'training.step'; did you mean 'training.steps'?"),
        (["--training.lr", "3"], "did you mean 'optimizer.lr'?"),
        (["--training.steps", "three"], "training.steps must be an integer"),
        (["--optimizer.lr", "fast"], "optimizer.lr must be a number"),
        (["--metrics.enable_tensorboard=maybe"], "must be true or false"),
        (["--training.mixed_precision_param", "bf16"], "must be one of bfloat16, float16, float32"),
        (["--training.steps"], "--training.steps needs a value"),
        (["--training.no_steps"], "only applies to true/false options"),
        (["stray"], "unexpected argument 'stray'"),
        (["--job.config_file", "/nonexistent.toml"], "does not exist"),
    ],
)
def test_errors_are_one_clear_sentence(argv, fragment):
    with pytest.raises(ConfigError) as err:
        load_job_config(argv)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_toml_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job_config(["--job.config_file", write(tmp_path, "[training\nsteps=")])
    with pytest.raises(ConfigError, match="unknown config key 'training.stepz'; did you mean 'training.steps'"):
        load_job_config(["--job.config_file", write(tmp_path, "[training]\nstepz = 3\n")])
    with pytest.raises(ConfigError, match="must be a \\[section\\] table"):
        load_job_config(["--job.config_file", write(tmp_path, "steps = 3\n")])


def test_help_lists_every_option_with_default_and_doc():
    with pytest.raises(HelpRequested):
        load_job_config(["--help"])
    text = help_text()
    assert "--parallelism.data_parallel_shard_degree (int, default -1)" in text
    assert "the rest of the world size" in text
    assert "(foreach | fused | for-loop)" in text
    from dataclasses import fields

    from titanlike.config import config_sections

    # JobConfig's sections and those objectives and model families register.
    assert {"training", "masked_lm", "span_corruption", "hybrid"} <= set(config_sections())
    for name, section in config_sections().items():
        for f in fields(section):
            assert f"--{name}.{f.name} (" in text


_MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]


@pytest.mark.parametrize(
    "argv, world, fragment",
    [
        (["--parallelism.data_parallel_shard_degree", "3"], 4, "must equal the world size 4"),
        (["--parallelism.data_parallel_replicate_degree", "3"], 4, "not divisible by replicate 3"),
        (["--parallelism.data_parallel_shard_degree", "0"], 1, "must be -1 (the rest) or at least 1"),
        (["--parallelism.tensor_parallel_degree", "0"], 1, "tensor_parallel_degree must be at least 1"),
        (["--parallelism.pipeline_parallel_degree", "0"], 1, "pipeline_parallel_degree must be at least 1"),
        (["--parallelism.expert_parallel_degree", "2"], 2,
         "expert_parallel_degree 2 needs a mixture-of-experts model, and llama3 debugmodel is dense"),
        (["--moe.aux_loss_coeff", "0.01"], 1, "moe.aux_loss_coeff is set but llama3 debugmodel has no mixture-of-experts"),
        ([*_MOE, "--moe.capacity_factor", "0"], 1, "moe.capacity_factor must be > 0"),
        ([*_MOE, "--moe.pad_to_capacity"], 1, "moe.pad_to_capacity needs moe.capacity_factor"),
        ([*_MOE, "--parallelism.expert_parallel_degree", "3"], 4, "expert_parallel_degree 3 must divide"),
        ([*_MOE, "--parallelism.expert_parallel_degree", "16"], 16, "must divide the model's 8 experts"),
        (["--parallelism.expert_tensor_parallel_degree", "2"], 2,
         "expert_tensor_parallel_degree 2 needs a mixture-of-experts model, and llama3 debugmodel is dense"),
        ([*_MOE, "--parallelism.expert_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"], 2,
         "expert_parallel_degree 2 x expert_tensor_parallel_degree 2 = 4 must divide"),
        ([*_MOE, "--parallelism.expert_tensor_parallel_degree", "3"], 3,
         "expert_tensor_parallel_degree 3 must divide the experts' hidden size 128"),
        ([*_MOE, "--parallelism.expert_tensor_parallel_degree", "32"], 32,
         "expert hidden size (128, 4 per expert-tensor-parallel rank) to be multiples of 8; set moe.experts_impl loop"),
        (["--parallelism.enable_async_tensor_parallel"], 1, "needs tensor_parallel_degree > 1"),
        (["--parallelism.enable_async_tensor_parallel", "--parallelism.tensor_parallel_degree", "2"], 2,
         "works through torch.compile"),
        pytest.param(["--parallelism.enable_async_tensor_parallel", "--parallelism.tensor_parallel_degree", "2",
                      "--compile.enable"], 2, "needs CUDA GPUs",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU machines")),
        (["--model.converters", "fp8"], 1, "unknown converter 'fp8'; known converters: float8, lora, mx, te"),
        (["--validation.enable", "--validation.freq", "0"], 1, "validation.freq must be at least 1"),
        (["--validation.enable", "--validation.steps", "0"], 1, "validation.steps must be -1"),
        (["--validation.enable", "--validation.local_batch_size", "0"], 1, "validation.local_batch_size must be"),
        (["--validation.enable", "--training.dataset", "text", "--training.dataset_path", "."], 1,
         "a text training dataset has no held-out split"),
        (["--validation.enable", "--validation.dataset", "text"], 1, "validation.dataset text needs validation.dataset_path"),
        (["--validation.enable", "--validation.dataset", "default", "--validation.dataset_path", "x"], 1,
         "takes no dataset_path"),
        (["--validation.enable", "--validation.dataset", "huggingface", "--validation.dataset_path", "c4"], 1,
         "validation.steps must be set (>= 1) for a streaming huggingface dataset"),
        (["--validation.enable", "--parallelism.pipeline_parallel_degree", "2",
          "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], 2, "have no forward-only mode"),
        (["--validation.enable", "--validation.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2"],
         2, "validation.local_batch_size must equal training.local_batch_size"),
        pytest.param(["--model.attention_backend", "flex"], 1, "flex needs a CUDA GPU",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU machines")),
        (["--model.name", "gpt5"], 1, "model.name 'gpt5' is unknown"),
        (["--model.flavor", "9B"], 1, "model.flavor '9B' is unknown"),
        (["--model.tokenizer_path", "/nope.model"], 1, "does not exist"),
        (["--training.global_batch_size", "12", "--training.local_batch_size", "8"], 1,
         "must be a positive multiple of local_batch_size 8"),
        (["--training.global_batch_size", "8", "--training.local_batch_size", "2"], 8,
         "data-parallel degree 8 = 16"),
        (["--training.seq_len", "0"], 1, "training.seq_len must be at least 1"),
        (["--training.steps", "0"], 1, "training.steps must be at least 1"),
        (["--training.max_norm", "0"], 1, "max_norm must be positive"),
        (["--training.dataset", "text"], 1, "needs training.dataset_path"),
        (["--training.dataset", "text", "--training.dataset_path", "/no/such"], 1, "does not exist"),
        (["--optimizer.lr", "-1"], 1, "optimizer.lr must be positive"),
        (["--optimizer.beta2", "1.5"], 1, "must lie in [0, 1)"),
        (["--lr_scheduler.decay_ratio", "2"], 1, "decay_ratio must lie in [0, 1]"),
        (["--lr_scheduler.min_lr_factor", "-0.1"], 1, "min_lr_factor must lie in [0, 1]"),
        (["--lr_scheduler.warmup_steps", "-1"], 1, "warmup_steps must be non-negative"),
        (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"], 1,
         "selective_ac_option must be 'op' or a positive integer"),
        (["--compile.components", "model,optimizer"], 1, "may only contain model and loss"),
        (["--metrics.log_freq", "0"], 1, "log_freq must be at least 1"),
        (["--training.skip_nonfinite_steps", "-1"], 1, "training.skip_nonfinite_steps must be 0 (stop on the first)"),
        (["--comm.train_timeout_seconds", "0"], 1, "comm.train_timeout_seconds must be at least 1, got 0"),
        (["--comm.trace_buf_size", "-1"], 1, "comm.trace_buf_size must be 0 (no flight recorder) or more"),
        # Sections of objectives check their values whatever the model.
        (["--masked_lm.mask_prob", "1"], 1, "masked_lm.mask_prob must be between 0 and 1 (exclusive), got 1.0"),
        (["--span_corruption.short_seq_prob", "2"], 1, "span_corruption.short_seq_prob must be between 0 and 1, got"),
        (["--span_corruption.mean_noise_span_length", "0.5"], 1, "mean_noise_span_length must be at least 1"),
        (["--span_corruption.decoder_seq_len", "1"], 1, "span_corruption.decoder_seq_len must be at least 2, got 1"),
        # Samples during training (validation.sample_prompts): where every rank computes whole layers.
        (["--validation.sample_prompts", "Hi", "--parallelism.tensor_parallel_degree", "2"], 2,
         "validation.sample_prompts cannot run under tensor parallelism, where a rank does not compute whole layers"),
        (["--validation.sample_prompts", "Hi", "--parallelism.pipeline_parallel_degree", "2"], 2,
         "validation.sample_prompts cannot run under pipeline parallelism"),
        (["--validation.sample_prompts", "Hi", "--compile.enable"], 1,
         "validation.sample_prompts cannot run with compile.enable"),
        (["--validation.sample_prompts", "Hi", "--model.name", "bert", "--model.flavor", "debugmodel_tiny",
          "--training.seq_len", "64"], 1,
         "validation.sample_prompts needs a model that generates text, and bert debugmodel_tiny is an encoder"),
        (["--model.args.score_head", "true"], 1,
         "model.args.score_head is not a size of the model: training.objective reward sets it; remove it"),
        (["--validation.sample_prompts", "Hi", "--training.objective", "reward", "--training.dataset", "text",
          "--training.dataset_path", "tests/assets/dpo/prefer_reverse.jsonl"], 1,
         "validation.sample_prompts needs a model that generates text, and llama3 debugmodel is a reward model"),
        (["--validation.sample_prompts", "Hi " * 1100], 1,
         "validation.sample_prompts[0] has 2201 tokens, which leaves no room in the model's context of 2048 tokens"),
        (["--validation.sample_prompts", "Hi", "--validation.sample_max_tokens", "0"], 1,
         "validation.sample_max_tokens must be at least 1, got 0"),
    ],
)
def test_validation_rules(argv, world, fragment):
    cfg = load_job_config(argv)
    with pytest.raises(ConfigError) as err:
        plan_job(cfg, world_size=world)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_tensor_parallel_head_divisibility():
    # debugmodel has 16 heads and 8 kv heads: TP 16 divides the heads but not the kv heads.
    # The rule is the family's (its args' validate), reported with the model's name.
    cfg = load_job_config(["--parallelism.tensor_parallel_degree", "16"])
    with pytest.raises(ConfigError, match="llama3 debugmodel: 8 key/value heads are not divisible by "
                                          "tensor_parallel_degree 16"):
        plan_job(cfg, world_size=16)
    cfg = load_job_config(["--parallelism.tensor_parallel_degree", "3"])
    with pytest.raises(ConfigError, match="16 attention heads are not divisible by tensor_parallel_degree 3"):
        plan_job(cfg, world_size=3)
    cfg = load_job_config(["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"])
    with pytest.raises(ConfigError, match="seq_len 63 must be divisible by tensor_parallel_degree 2"):
        plan_job(cfg, world_size=2)
    plan_job(load_job_config(["--parallelism.tensor_parallel_degree", "8"]), world_size=8)


def test_valid_layouts_resolve():
    dims = plan_job(load_job_config([]), world_size=8).dims
    assert (dims.dp_replicate, dims.dp_shard) == (1, 8)
    cfg = load_job_config(["--parallelism.data_parallel_replicate_degree", "2"])
    dims = plan_job(cfg, world_size=4).dims
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_degree) == (2, 2, 4)


@pytest.mark.parametrize("preset", ["debug_model", "llama3_100m", "llama3_1b", "llama3_3b", "llama3_8b", "llama3_70b", "llama3_405b"])
def test_presets_parse(preset):
    cfg = load_job_config(["--job.config_file", f"train_configs/{preset}.toml"])
    assert cfg.model.name == "llama3"


# ---------------------------------------------------------------- seq_len within the model's context


def test_seq_len_beyond_the_flavor_context_is_refused():
    # The flavor's max_seq_len is its real context; update_from_config later replaces it with
    # training.seq_len, so the rule reads the flavor's args (DecoderArgs.validate, shared by families).
    cfg = load_job_config(["--training.seq_len", "4096"])
    with pytest.raises(ConfigError) as err:
        plan_job(cfg, world_size=1)
    assert str(err.value) == ("llama3 debugmodel: training.seq_len 4096 exceeds the model's context of 2048 "
                              "positions; set training.seq_len to at most 2048")
    plan_job(load_job_config(["--training.seq_len", "2048"]), world_size=1)
    plan_job(load_job_config(["--model.flavor", "8B", "--training.seq_len", "131072"]), world_size=1)
    with pytest.raises(ConfigError, match="llama3 8B: training.seq_len 131073 exceeds the model's context of 131072"):
        plan_job(load_job_config(["--model.flavor", "8B", "--training.seq_len", "131073"]), world_size=1)


# ---------------------------------------------------------------- data paths at validation time


@pytest.mark.parametrize("argv, fragment", [
    (["--training.dataset_path", "corpus.txt"],
     "training.dataset_path is only read by the text, huggingface and megatron datasets; the default dataset is "
     "the embedded corpus"),
    (["--training.dataset", "text", "--training.dataset_path", "{tmp}/empty"],
     "training.dataset_path: no .txt, .txt.gz, .jsonl, .jsonl.gz files under directory '{tmp}/empty'"),
    (["--training.dataset", "text", "--training.dataset_path", "{tmp}/bad.jsonl"],
     "training.dataset_path: {tmp}/bad.jsonl holds no usable document: 2 of its 2 lines are not JSON objects"),
    (["--validation.enable", "--validation.dataset", "text", "--validation.dataset_path", "{tmp}/empty",
      "--validation.steps", "1"],
     "validation.dataset_path: no .txt, .txt.gz, .jsonl, .jsonl.gz files under directory"),
])
def test_unusable_data_paths_are_config_errors(tmp_path, argv, fragment):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"content": "wrong key"}\nnot json\n')
    cfg = load_job_config([a.format(tmp=tmp_path) for a in argv])
    with pytest.raises(ConfigError) as err:
        plan_job(cfg, world_size=1)
    assert fragment.format(tmp=tmp_path) in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- memory this machine cannot hold


def test_memory_rule_refuses_a_job_no_machine_holds():
    from estimation.fits import check_fits

    # 405B unsharded on one rank: terabytes by the analytic estimate, on any machine.
    cfg = load_job_config(["--model.flavor", "405B", "--training.seq_len", "4096"])
    plan = plan_job(cfg, world_size=1)  # planning does not look at this machine: the estimator plans for others
    with pytest.raises(ConfigError) as err:
        check_fits(plan)
    msg = str(err.value)
    assert msg.startswith("the job needs about ") and " GiB per rank (" in msg and "by the estimator" in msg
    assert "lower training.local_batch_size or training.seq_len" in msg and "\n" not in msg
    assert check_fits(plan_job(load_job_config([]), world_size=1)) is None  # the debug job fits anywhere


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
def test_memory_rule_compares_with_this_machines_share(monkeypatch):
    import estimation.fits as fits

    plan = plan_job(load_job_config(["--training.seq_len", "2048", "--training.local_batch_size", "8"]), world_size=1)
    peak, _ = fits.estimate_peak_memory(plan)
    monkeypatch.setattr(fits.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fits, "device_memory", lambda device: (peak + 2**20, "this host has"))
    assert fits.check_fits(plan) is None  # just fits one rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this host: half each
    with pytest.raises(ConfigError, match=r"this host's \d+\.\d GiB of memory shared by 2 local ranks leave "):
        fits.check_fits(plan)
