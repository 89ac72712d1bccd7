"""``ts.utils.util`` → Conveyor's equivalents (PredictionException is the class the worker maps to a status)."""

from typing import Any

import yaml

from backend.errors import PredictionException
from backend.handler_utils import list_classes_from_module, load_label_mapping, map_class_to_label


def get_yaml_config(yaml_file_path: str) -> Any:
    with open(yaml_file_path, encoding="utf-8") as f:
        return yaml.safe_load(f)


__all__ = ["PredictionException", "get_yaml_config", "list_classes_from_module", "load_label_mapping",
           "map_class_to_label"]
