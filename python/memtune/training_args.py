"""TrainingArguments with Hugging Face's names and defaults.

A `transformers.TrainingArguments`, its `to_dict()` or a JSON file of it is accepted as it is:
`memtune train --config` reads it, applies the keys memtune has, names the ones it accepts and
ignores (logging integrations, dataloader workers, ...) and refuses, naming the key, the ones it
cannot honour (deepspeed, fsdp, torch_compile, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Union


@dataclass
class TrainingArguments:
    """Hugging Face's TrainingArguments (the fields memtune runs with, same names and defaults).

    Three fields are memtune's own: `backend` ("cpu" or "vulkan"), `max_length` (tokens an example
    keeps; Hugging Face leaves that to the tokenizer) and `template` (the chat template's name;
    default: the model family's). `report_to` defaults to "none" (transformers 5's default).
    """

    output_dir: str = "trainer_output"
    overwrite_output_dir: bool = False
    eval_strategy: str = "no"
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    eval_accumulation_steps: Optional[int] = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    logging_dir: Optional[str] = None
    logging_steps: float = 500
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: Optional[int] = None
    seed: int = 42
    data_seed: Optional[int] = None
    bf16: bool = False
    fp16: bool = False
    eval_steps: Optional[float] = None
    load_best_model_at_end: bool = False
    metric_for_best_model: Optional[str] = None
    greater_is_better: Optional[bool] = None
    label_smoothing_factor: float = 0.0
    report_to: Union[None, str, List[str]] = "none"
    gradient_checkpointing: bool = False
    batch_eval_metrics: bool = False
    disable_tqdm: bool = False
    resume_from_checkpoint: Optional[str] = None
    # memtune's own
    backend: str = "cpu"
    max_length: int = 2048
    template: Optional[str] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# Keys the Python layer takes out of a config before it becomes `memtune train --config`: they
# are the Trainer's business here (progress bar, per-batch metrics) or set by it.
_PYTHON_ONLY = ("disable_tqdm", "batch_eval_metrics", "resume_from_checkpoint")


def as_config(args: Any) -> dict:
    """The arguments as a dict of Hugging Face keys: from memtune's TrainingArguments,
    transformers' (its to_dict()), a dict, or the path of a JSON file."""
    if args is None:
        return TrainingArguments().to_dict()
    if isinstance(args, TrainingArguments):
        return args.to_dict()
    if isinstance(args, (str, os.PathLike)):
        path = os.fspath(args)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"args: {path}: expected a JSON file of TrainingArguments ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"args: {path}: expected a JSON object of TrainingArguments")
        return data
    if isinstance(args, dict):
        return dict(args)
    if hasattr(args, "to_json_string"):  # transformers.TrainingArguments (its JSON-safe dict)
        return json.loads(args.to_json_string())
    raise TypeError(
        f"args: expected memtune.TrainingArguments, transformers.TrainingArguments, a dict or a JSON file path, "
        f"got {type(args).__name__}")
