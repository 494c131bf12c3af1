"""memtune: fine-tune and evaluate Qwen-family models with planned memory, from Python.

    from memtune import Trainer, TrainingArguments

Trainer's API (train, evaluate, predict, save_model, callbacks, both compute_metrics protocols)
over memtune's engine, whose logits never exist in full; plan() and generate() for the rest.
"""

from ._memtune import MemtuneError
from ._predictions import EvalPrediction
from .api import Model, generate, plan, run
from .trainer import (PredictionOutput, TrainOutput, Trainer, TrainerCallback, TrainerControl,
                      TrainerState)
from .training_args import TrainingArguments

__all__ = ["EvalPrediction", "MemtuneError", "Model", "PredictionOutput", "TrainOutput", "Trainer",
           "TrainerCallback", "TrainerControl", "TrainerState", "TrainingArguments", "generate", "plan", "run"]
