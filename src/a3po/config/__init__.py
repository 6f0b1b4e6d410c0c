"""Typed configuration: the schema (schema.py) and its strict loader (load.py)."""

from a3po.config.load import ConfigError, all_keys, dump_yaml, load_config, to_dict
from a3po.config.schema import Config

__all__ = ["Config", "ConfigError", "all_keys", "dump_yaml", "load_config", "to_dict"]
