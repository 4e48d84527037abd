"""The torch-free text layer that server/ imports: prompts and instruction formats (prompts.py),
rerank templates (rerank_templates.py) and the pair token budget (pair_budget.py).

Invariant: nothing under models/text imports torch (tests/test_packaging.py checks it), so the
HTTP front ends tokenize without loading the model stack.
"""
