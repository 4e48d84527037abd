"""One module per model family; each composes models/layers.py and subclasses
models.protocol.ScoringModel, and exposes `build(cfg, ops, rope_device=..., head=...)`.
models/registry.py maps `model_type` to the module."""
