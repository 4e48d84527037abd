"""Token-budget batching and the CPU-prep / model-worker pipeline in front of a model runner.

The public surface: ``Scheduler`` (scheduler/scheduler.py), its errors, the runner contract it
drives (scheduler/contract.py) and the batching policies' names (scheduler/policy.py).
"""
from .contract import ModelRunner, Prepared
from .forming import PrefixPolicy
from .outcomes import BatchFailed, WorkerDead
from .policy import POLICIES
from .scheduler import Scheduler, SubmitResult

__all__ = ["BatchFailed", "ModelRunner", "POLICIES", "PrefixPolicy", "Prepared", "Scheduler", "SubmitResult",
           "WorkerDead"]
