"""``ts.context`` → Conveyor's Context (same constructor, attributes and methods)."""

from backend.context import Context, RequestProcessor

__all__ = ["Context", "RequestProcessor"]
