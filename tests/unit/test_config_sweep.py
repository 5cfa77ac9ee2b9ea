"""Every config field with hostile values of its type (issue 33 item 9), generated from the schema:
the next field added is covered without editing this file.

A value is either planned (plan_job: the whole job checked before any process group) or refused
with one ConfigError sentence naming the field; nothing else may come out (a traceback, an
OverflowError, a hang on a device file). Values that no field can mean are always refused: NaN and
infinities, integers beyond 2^53, text with a NUL character.
"""

from __future__ import annotations

import typing

import pytest

from titanlike.config import ConfigError, load_job_config
from titanlike.config.loader import _fields, _unwrap_optional, config_sections
from titanlike.train.plan import plan_job

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--metrics.no_enable_tensorboard"]

REFUSED = object()  # marks a hostile value every field must refuse

HOSTILE = {
    int: ["-1", "0", "1", "9007199254740993", "-9007199254740993", "1e20", "1.5", "abc", "", ("nan", REFUSED)],
    float: ["-1", "0", "1e308", "-1e308", "abc", "", ("nan", REFUSED), ("inf", REFUSED), ("-inf", REFUSED)],
    bool: ["maybe", "2", ""],
    str: ["", "-1", "..", "/", "/proc/self/mem", "/dev/zero", "x" * 5000, ("a\0b", REFUSED)],
    list: ["", ",", "-1,-1,-1", "1e20,1,1", "x" * 5000, ("a\0b", REFUSED)],
    # A table of settings its owner reads ([model.args]: the model family's fields).
    dict: ["", ",", "=", "dim", "dim=-1", "n_layers=1e20", "vocab_size=9007199254740993", "x" * 5000,
           "x" * 5000 + "=1", ("a\0b=1", REFUSED), ("dim=nan", REFUSED), ("norm_eps=inf", REFUSED)],
}
for big in ("9007199254740993", "-9007199254740993", "1e20"):
    HOSTILE[int][HOSTILE[int].index(big)] = (big, REFUSED)


def _cases():
    for section, cls in config_sections().items():
        for key, (field_, tp) in _fields(cls).items():
            base, optional = _unwrap_optional(tp)
            kind = list if typing.get_origin(base) is list else base
            values = list(HOSTILE[kind]) + (["none"] if optional else [])
            for value in values:
                raw, refused = value if isinstance(value, tuple) else (value, None)
                yield pytest.param(section, key, raw, refused is REFUSED, id=f"{section}.{key}={raw[:20]!r}")


@pytest.mark.parametrize("section, key, value, must_refuse", list(_cases()))
def test_a_hostile_value_is_planned_or_refused_in_one_sentence(tmp_path, monkeypatch, section, key, value,
                                                                must_refuse):
    monkeypatch.chdir(tmp_path.parent.parent)  # relative paths resolve outside the repository
    import os

    from conftest import REPO

    argv = [*BASE, f"--{section}.{key}", value]
    argv[1] = str(REPO / argv[1])
    if (section, key) != ("job", "dump_folder"):
        argv += ["--job.dump_folder", str(tmp_path / "run")]
    try:
        cfg = load_job_config(argv)
        plan_job(cfg, world_size=int(os.environ.get("SWEEP_WORLD_SIZE", 2)))
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message and message, message
        return
    assert not must_refuse, f"--{section}.{key} {value!r} was accepted"
