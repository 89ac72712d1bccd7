"""Typed configuration: server-wide (config.properties) and per model (model-config.yaml)."""

from frontend.config.model_config import ModelConfig, resolve_model_config
from frontend.config.server_config import Address, ServerConfig, load_server_config, locate_config_file, parse_properties

__all__ = [
    "Address", "ModelConfig", "ServerConfig", "load_server_config", "locate_config_file", "parse_properties",
    "resolve_model_config",
]
