"""Validation rules of the [checkpoint] section: one clear sentence each, before any process starts."""

import pytest

from titanlike.config import ConfigError, load_job_config
from titanlike.train.plan import plan_job


def check(argv, world=1):
    plan_job(load_job_config(argv), world_size=world)


@pytest.fixture
def dcp_dir(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    return str(tmp_path / "dcp")


@pytest.fixture
def hf_dir(tmp_path):
    """A Hugging Face folder's config.json (the plan reads it: it sizes the model); the weights are the
    load's to read."""
    import json

    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(spec.hf.args_to_config(spec.flavors["debugmodel"])))
    return str(tmp_path / "hf")


def test_checkpointing_and_its_entry_points_are_accepted(dcp_dir, hf_dir):
    check(["--checkpoint.enable"])
    check(["--checkpoint.enable", "--checkpoint.async_mode", "async_with_pinned_mem", "--checkpoint.keep_latest_k", "0"])
    check(["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"])
    check(["--checkpoint.enable", "--checkpoint.initial_load_path", dcp_dir])
    check(["--checkpoint.enable", "--checkpoint.initial_load_path", hf_dir, "--checkpoint.initial_load_in_hf"])
    check(["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "bfloat16"])
    check(["--checkpoint.enable", "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler,dataloader"])


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--checkpoint.interval", "0"], "checkpoint.interval must be at least 1, got 0"),
        (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k must be 0 (keep all) or more, got -1"),
        (["--checkpoint.load_step", "-2"], "checkpoint.load_step must be -1 (the latest) or a step >= 0"),
        (["--checkpoint.folder", ""], "checkpoint.folder must not be empty"),
        (["--checkpoint.exclude_from_loading", "optimizer,optimiser"],
         "checkpoint.exclude_from_loading may only name model, optimizer"),
        (["--checkpoint.initial_load_path", "/no/such/ckpt"],
         "checkpoint.initial_load_path /no/such/ckpt does not exist"),
        (["--checkpoint.initial_load_in_hf"], "initial_load_in_hf needs checkpoint.initial_load_path"),
        (["--checkpoint.last_save_in_hf", "--checkpoint.no_last_save_model_only"],
         "last_save_in_hf writes the model only, so it needs checkpoint.last_save_model_only"),
    ],
)
def test_rules(argv, fragment):
    with pytest.raises(ConfigError) as err:
        check(["--checkpoint.enable", *argv])
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("option", [["--checkpoint.create_seed_checkpoint"], ["--checkpoint.last_save_in_hf"]])
def test_entry_points_need_checkpointing_enabled(option):
    with pytest.raises(ConfigError, match=f"checkpoint.{option[0].split('.')[1]} needs checkpoint.enable"):
        check(option)


def test_initial_load_path_needs_enable(dcp_dir):
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path needs checkpoint.enable"):
        check(["--checkpoint.initial_load_path", dcp_dir])


def test_initial_load_path_must_be_the_declared_format(dcp_dir, hf_dir):
    with pytest.raises(ConfigError, match="has no .metadata, so it is not a DCP checkpoint"):
        check(["--checkpoint.enable", "--checkpoint.initial_load_path", hf_dir])
    with pytest.raises(ConfigError, match="has no config.json, so it is not a Hugging Face model folder"):
        check(["--checkpoint.enable", "--checkpoint.initial_load_path", dcp_dir, "--checkpoint.initial_load_in_hf"])


def test_async_mode_choices_are_enforced():
    with pytest.raises(ConfigError, match="must be one of disabled, async, async_with_pinned_mem"):
        load_job_config(["--checkpoint.async_mode", "background"])


def test_bad_checkpoint_option_exits_2_without_starting(tmp_path):
    from conftest import TINY_JOB, train_here

    proc = train_here([*TINY_JOB, "--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                       "--checkpoint.interval", "0"])
    assert proc.returncode == 2
    assert "config error: checkpoint.interval must be at least 1, got 0" in proc.stderr


def test_validate_checkpoint_config_raises_value_error_without_a_job_validator():
    """The manager owns its section's rules: ValueError, usable before any job validation."""
    from titanlike.checkpoint.manager import CHECKPOINT_COMPONENTS, COMPONENTS, validate_checkpoint_config
    from titanlike.models.registry import get_model_spec

    assert CHECKPOINT_COMPONENTS == COMPONENTS
    cfg = load_job_config(["--checkpoint.enable", "--checkpoint.exclude_from_loading", "rng,model"])
    validate_checkpoint_config(cfg.checkpoint, get_model_spec(cfg.model.name))
    cfg = load_job_config(["--checkpoint.interval", "0"])
    with pytest.raises(ValueError, match="^checkpoint.interval must be at least 1, got 0$"):
        validate_checkpoint_config(cfg.checkpoint, get_model_spec(cfg.model.name))

