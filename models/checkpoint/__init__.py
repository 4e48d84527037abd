"""A checkpoint on disk: its config.json (config.py), what its directory says about the model
(directory.py: kind, pooling, prompts, special tokens) and its weights (loader.py)."""
