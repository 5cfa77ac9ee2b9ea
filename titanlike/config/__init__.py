"""Typed job configuration: schema, TOML + CLI loading, validation."""

from titanlike.config.loader import (
    ConfigError, HelpRequested, config_sections, config_to_dict, help_text, load_job_config,
)
from titanlike.config.schema import JobConfig
from titanlike.config.validate import validate_values

__all__ = [
    "ConfigError",
    "HelpRequested",
    "JobConfig",
    "config_sections",
    "config_to_dict",
    "help_text",
    "load_job_config",
    "validate_values",
]
