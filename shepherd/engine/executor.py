"""Re-export of the step contract, which now lives in shepherd/step.py."""
from shepherd.step import Executor, ScheduledBatch, ScheduledSeq, StepResult, SwapOp

__all__ = ["Executor", "ScheduledBatch", "ScheduledSeq", "StepResult", "SwapOp"]
