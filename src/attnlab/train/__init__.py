from .checkpoint import CheckpointManager, verify_checkpoint
from .loop import TrainResult, run_training

__all__ = ["CheckpointManager", "verify_checkpoint", "TrainResult", "run_training"]
