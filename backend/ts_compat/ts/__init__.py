"""TorchServe compatibility namespace provided by Conveyor (used only when TorchServe is not installed)."""

__version__ = "0.12.0+conveyor"  # the TorchServe API level these shims follow
