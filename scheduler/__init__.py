"""Token-budget batching and the CPU-prep / model-worker pipeline (scheduler/pipeline.py)."""
from .pipeline import BatchFailed, BatchTrace, WorkerDead
from .service import Scheduler, SubmitResult

__all__ = ["BatchFailed", "BatchTrace", "Scheduler", "SubmitResult", "WorkerDead"]
