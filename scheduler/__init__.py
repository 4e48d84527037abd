"""Token-budget batching and the CPU-prep / model-worker pipeline (scheduler/pipeline.py)."""
from .pipeline import BatchFailed, WorkerDead
from .service import Scheduler, SubmitResult

__all__ = ["BatchFailed", "Scheduler", "SubmitResult", "WorkerDead"]
