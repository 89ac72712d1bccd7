"""``ts.handler_utils.utils`` → Conveyor's helpers (intermediate replies go over Conveyor's socket codec)."""

from backend.handler_utils import import_class, send_intermediate_predict_response

__all__ = ["import_class", "send_intermediate_predict_response"]
