"""Token-budget batching, the trie index and the CPU-prep / model-worker pipeline."""
