"""``ts.torch_handler.base_handler`` → Conveyor's BaseHandler (the same class, not a copy)."""

from handlers.base_handler import BaseHandler, logger, timed
from ts.utils.util import list_classes_from_module, load_label_mapping

__all__ = ["BaseHandler", "list_classes_from_module", "load_label_mapping", "logger", "timed"]
