"""Every config.json value a Hugging Face adapter reads has a rule (HFAdapter.config_rules), so that a
hostile value is refused in one sentence naming the key before config_to_args sees it (issue 33
item 5). Generated from the registered families: the next family, or the next key an adapter
reads, is covered without editing this file."""

from __future__ import annotations

import pytest

from titanlike.models.registry import get_model_spec, model_names


class Recording(dict):
    """A config.json that remembers every key read from it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def _configs(spec):
    """config.json of every flavor the adapter can write (one per model_type it reads)."""
    for flavor, args in spec.flavors.items():
        try:
            yield flavor, spec.hf.args_to_config(args)
        except ValueError:  # a flavor with no Hugging Face equivalent
            continue


@pytest.mark.parametrize("name", [n for n in model_names() if get_model_spec(n).hf is not None])
def test_every_key_an_adapter_reads_has_a_rule(name):
    spec = get_model_spec(name)
    read: set[str] = set()
    for flavor, config in _configs(spec):
        recording = Recording(config)
        args = spec.hf.read_config(recording)
        assert args is not None
        read |= recording.read
    assert read, f"{name}: no flavor gives a config.json"
    assert sorted(read - set(spec.hf.config_rules)) == [], f"{name}'s adapter reads keys without a rule"
    # And each rule accepts what the adapter itself writes.
    for flavor, config in _configs(spec):
        for key, rule in spec.hf.config_rules.items():
            if key in config:
                assert rule(config[key]) is None, (flavor, key, config[key])
