"""The attention backends: every way the model's attention runs, and the choice among them.

- varlen.py: the backend signature (`AttnMeta`, `AttentionBackend`) and the portable SDPA paths
- lse.py, tiles.py: log-sum-exp blocks and their merges; the CPU's oneDNN key tiles
- spec.py: what a family's attention needs (windows, soft-caps, scale) and which backend honours it
- select.py: the varlen backend chosen once at model build (flash-attn, torch varlen, SDPA)
- tree.py, tree_select.py: tree (cascade) attention along the trie, and its backend choice
- paths.py: the model's attention paths (backend, tree backend, CPU kernel) chosen at load

Nothing here imports the families or the runner: they import this.
"""
