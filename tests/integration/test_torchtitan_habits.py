"""A torchtitan user's habits work (issue 32 item 6): `CONFIG_FILE=... NGPU=... ./scripts/run_train.sh` with
torchtitan's environment variables (validating once before torchrun starts), `python -m titanlike.train`,
the console scripts of `pip install` (train.py's program lives in the package; the library never imports
the estimator), converters accepting torchtitan's flag spellings, TensorBoard in torchtitan's timestamped
folder, every `fault_tolerance.*` key of torchtitan v0.2.2 reaching the compat table's one sentence."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conftest import REPO, _env

RUN_TRAIN = REPO / "scripts" / "run_train.sh"
DEBUG = REPO / "train_configs" / "debug_model.toml"
SHORT = ["--model.flavor", "debugmodel_tiny", "--training.steps", "2", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--checkpoint.no_enable"]


def run_train_sh(env: dict, *args: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUN_TRAIN), *args], env={**_env(), **env}, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- run_train.sh


def test_run_train_sh_trains_with_torchtitans_environment_variables(tmp_path):
    proc = run_train_sh({"NGPU": "2", "CONFIG_FILE": str(DEBUG)}, *SHORT, "--job.dump_folder", str(tmp_path / "run"),
                        "--metrics.enable_jsonl", "--job.print_args", "false", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "world size 2" in out and "step:     2/2" in out
    # The config's notes once (by the validation before torchrun), and the pre-flight checks once (issue 45.13).
    assert out.count("config: job.print_args is deprecated") == 1, out[-4000:]
    assert "pre-flight checks: run by the launcher before the ranks started" in out
    # LOG_RANK defaults to 0: torchrun shows rank 0's lines only
    assert "[rank0]:" in out and "[rank1]:" not in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


def test_run_train_sh_validates_once_and_starts_no_rank_for_a_bad_config(tmp_path):
    proc = run_train_sh({"NGPU": "3", "CONFIG_FILE": str(DEBUG)}, "--parallelism.tensor_parallel_degree", "2",
                        cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.count("config error: the world size 3 is not divisible") == 1, out
    assert "torch.distributed" not in out and "[rank" not in out and "ChildFailedError" not in out


def test_comm_mode_fake_backend_validates_for_ngpu_ranks_without_starting_them(tmp_path):
    proc = run_train_sh({"NGPU": "8", "COMM_MODE": "fake_backend", "CONFIG_FILE": str(DEBUG)}, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "on world size 8 is valid" in out and "[rank" not in out
    refused = run_train_sh({"NGPU": "8", "COMM_MODE": "local_tensor", "CONFIG_FILE": str(DEBUG)}, cwd=tmp_path)
    assert refused.returncode == 2 and "COMM_MODE=local_tensor is not implemented" in refused.stderr


# ---------------------------------------------------------------- python -m titanlike.train, console scripts


def test_python_m_titanlike_train_outside_the_checkout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "titanlike.train", "--job.config_file", str(DEBUG),
                           "--job.validate_only"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "job.validate_only: llama3 debugmodel on world size 1 is valid" in proc.stderr
    assert not (tmp_path / "outputs").exists()  # nothing trained, nothing written


def test_train_py_is_the_packages_program_with_the_checkouts_memory_check(monkeypatch):
    import train

    import titanlike.cli.train as cli
    from estimation.fits import check_fits

    seen = []
    monkeypatch.setattr(cli, "run_checks", lambda plan, rank, checks: seen.append(checks))
    assert train.main(["--job.validate_only"]) == 0
    assert seen == [[check_fits]]
    assert len(Path(train.__file__).read_text().splitlines()) < 30


def _console_scripts() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    return project["project"]["scripts"], project["tool"]["setuptools"]["packages"]["find"]["include"]


def test_console_scripts_live_in_installed_packages_and_answer_help():
    scripts, include = _console_scripts()
    assert {"titanlike-train", "titanlike-convert", "titanlike-estimate"} <= set(scripts)
    for name, target in scripts.items():
        module = target.split(":")[0]
        # importable from what pip installs: a package that packages.find includes, not scripts/
        assert any(re.fullmatch(p.replace("*", ".*"), module.split(".")[0]) for p in include), (name, module)
    # every one answers --help (exit 0) from outside the checkout: one process, each main in turn
    driver = ("import importlib, sys\n"
              f"scripts = {scripts!r}\n"
              "for name, target in scripts.items():\n"
              "    module, fn = target.split(':')\n"
              "    sys.argv = [name, '--help']\n"
              "    try:\n"
              "        getattr(importlib.import_module(module), fn)()\n"
              "    except SystemExit as e:\n"
              "        print('EXIT', name, e.code, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", driver], cwd="/", env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = dict(re.findall(r"^EXIT (\S+) (\S+)$", proc.stdout, re.M))
    assert codes == {name: "0" for name in scripts}, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "usage: titanlike-train" in proc.stdout and "usage: titanlike-convert" in proc.stdout


def test_the_library_never_imports_the_estimator_which_registers_its_memory_check():
    importers = []
    for path in sorted((REPO / "titanlike").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n == "estimation" or n.startswith("estimation.") for n in names):
                importers.append(str(path.relative_to(REPO)))
    assert importers == []
    # The installed entry point the package's train program finds (titanlike.cli.train.preflight_checks).
    from importlib.metadata import EntryPoint

    from estimation.fits import check_fits
    from titanlike.cli.train import PREFLIGHT_GROUP

    with open(REPO / "pyproject.toml", "rb") as f:
        registered = tomllib.load(f)["project"]["entry-points"][PREFLIGHT_GROUP]
    assert [EntryPoint(n, v, PREFLIGHT_GROUP).load() for n, v in registered.items()] == [check_fits]


# ---------------------------------------------------------------- converters with torchtitan's spellings


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from titanlike.models.llama3 import llama3_flavors
    from titanlike.models.registry import get_model_spec

    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=2048, max_seq_len=64)
    root = tmp_path_factory.mktemp("hf")
    LlamaForCausalLM(LlamaConfig(**get_model_spec("llama3").hf.args_to_config(args))).save_pretrained(root / "hf")
    return root / "hf"


def test_converters_take_torchtitans_flag_spellings(tmp_path, hf_folder, capsys):
    from titanlike.cli import convert

    assert convert.from_hf([str(hf_folder), str(tmp_path / "dcp"), "--model_name", "llama3", "--model_flavor", "8B"],
                           prog="convert_hf_to_dcp.py") == 0
    assert "--model_flavor 8B is not used: the dimensions came from" in capsys.readouterr().out
    assert convert.from_hf([str(hf_folder), str(tmp_path / "wrong"), "--model_name", "gpt2"]) == 1
    assert "config.json describes a llama3 model, nothing written" in capsys.readouterr().err
    assert not (tmp_path / "wrong").exists()
    # torchtitan's convert_to_hf.py flags: --export_dtype, --model_name / --model_flavor, --hf_assets_path
    tokenizer = REPO / "tests" / "assets" / "tokenizer"
    assert convert.main(["to_hf", str(tmp_path / "dcp"), str(tmp_path / "out"), "--export_dtype", "bfloat16",
                         "--hf_assets_path", str(tokenizer)]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "bfloat16"
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------- TensorBoard, fault_tolerance keys


def test_tensorboard_events_go_in_a_timestamped_folder_per_launch(tmp_path):
    from datetime import datetime

    from titanlike.observe.metrics import tensorboard_run_folder

    now = datetime(2026, 3, 4, 5, 6, 7)
    first = tensorboard_run_folder(str(tmp_path / "tb"), now)
    assert first == str(tmp_path / "tb" / "20260304-0506")  # torchtitan's strftime("%Y%m%d-%H%M")
    os.makedirs(first)
    assert tensorboard_run_folder(str(tmp_path / "tb"), now) == str(tmp_path / "tb" / "20260304-050607")
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--job.config_file", str(DEBUG), *SHORT,
                           "--training.steps", "1", "--metrics.enable_tensorboard", "--job.dump_folder",
                           str(tmp_path / "run")], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [p for p in (tmp_path / "run" / "tb").iterdir() if p.is_dir()]  # beside the folder lock
    assert re.fullmatch(r"\d{8}-\d{4}", run.name) and any(run.glob("events.out.tfevents.*"))
    assert f"tensorboard --logdir {tmp_path / 'run' / 'tb'} (this run: {run})" in proc.stderr


# torchtitan v0.2.2: config/job_config.py's FaultTolerance and components/ft/config/job_config.py's extension,
# each key at its default and at another value.
FAULT_TOLERANCE_V022 = {
    "enable": (False, True), "process_group": ("gloo", "nccl"), "process_group_timeout_ms": (10000, 5000),
    "replica_id": (0, 1), "group_size": (0, 2), "min_replica_size": (1, 2), "semi_sync_method": (None, "diloco"),
    "sync_steps": (5, 10), "should_quantize": (False, True), "fragment_sync_delay": (0, 1),
    "fragment_update_alpha": (0.0, 0.5), "module_fqns_per_model_fragment": ([], [["layers.0"], ["layers.1"]]),
    "num_fragments": (1, 2),
}


def _toml(value) -> str:
    return json.dumps(value)  # JSON's strings, numbers, booleans and arrays are TOML's too


@pytest.mark.parametrize("key", sorted(FAULT_TOLERANCE_V022))
def test_every_fault_tolerance_key_reaches_the_compat_sentence(tmp_path, key):
    from titanlike.config import ConfigError, load_job_config

    default, other = FAULT_TOLERANCE_V022[key]
    path = tmp_path / "ft.toml"
    if default is not None:
        path.write_text(f"[fault_tolerance]\n{key} = {_toml(default)}\n")
        notes: list[str] = []
        load_job_config(["--job.config_file", str(path)], notes=notes)  # torchtitan's default: what titanlike does
        assert notes == []
    path.write_text(f"[fault_tolerance]\n{key} = {_toml(other)}\n")
    with pytest.raises(ConfigError) as err:
        load_job_config(["--job.config_file", str(path)])
    assert str(err.value).startswith(f"fault_tolerance.{key} = ")
    assert "is not supported: titanlike has no TorchFT integration" in str(err.value)
