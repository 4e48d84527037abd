"""Token-budget batching, the trie index and the CPU-prep / model-worker pipeline."""
from .pipeline import BatchFailed, BatchTrace, WorkerDead
from .service import ClientDisconnected, Scheduler, SubmitResult

__all__ = ["BatchFailed", "BatchTrace", "ClientDisconnected", "Scheduler", "SubmitResult", "WorkerDead"]
