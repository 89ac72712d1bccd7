"""``ts.handler_utils.timer`` → Conveyor's ``timed`` decorator."""

from handlers.base_handler import timed

__all__ = ["timed"]
