"""Backbones: `ModelSpec`, our own LLaDA/Dream forward, loading official checkpoints, tiny checkpoints."""

from tracelock.models.backbone import BackboneOutput, DiffusionBackbone
from tracelock.models.loading import load_model, load_tokenizer
from tracelock.models.query import CacheQuery, Outputs
from tracelock.models.spec import CheckpointError, ModelSpec
from tracelock.models.tiny import write_tiny_checkpoint

__all__ = ["BackboneOutput", "CacheQuery", "CheckpointError", "DiffusionBackbone", "ModelSpec", "Outputs", "load_model",
           "load_tokenizer", "write_tiny_checkpoint"]
