"""Model registry: model → versions → config, job queue (batcher) and workers."""

from frontend.models.registry import ModelEntry, ModelRegistry, ModelVersion

__all__ = ["ModelEntry", "ModelRegistry", "ModelVersion"]
