"""The model families and what they are made of.

- registry.py: `model_type` -> family module, `*For...` architecture -> head, the kinds a head
  serves; families are imported lazily, on the first checkpoint that needs one
- protocol.py: `ScoringModel`, the contract every family implements, and `RerankSpec`
- layers.py: the layers the families compose (RMSNorm, rotary, attention over the trie, MLP)
- qwen3.py (Qwen3, Qwen2, Llama, Mistral), gemma.py (Gemma, Gemma2): one module per family, each
  exposing `build(cfg, ops, rope_device=..., head=...)`

Adding a family: docs/contributing.md.
"""
