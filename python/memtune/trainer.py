"""Trainer: Hugging Face Trainer's API over memtune's engine.

`train()` runs `memtune train` and `evaluate()` / `predict()` run `memtune eval` in this process
(the extension module, outside the GIL), with the Trainer's hooks: log records, step ends,
checkpoints, and the evaluation's predictions, which compute_metrics receives in either of
Trainer's protocols without the logits ever existing in full (see _predictions.py).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import _memtune
from ._data import dataset_file
from ._predictions import PredictionSink, Reduction
from .training_args import _PYTHON_ONLY, TrainingArguments, as_config

TrainOutput = collections.namedtuple("TrainOutput", ["global_step", "training_loss", "metrics"])
PredictionOutput = collections.namedtuple("PredictionOutput", ["predictions", "label_ids", "metrics"])


@dataclass
class TrainerState:
    """Trainer's TrainerState fields that memtune's runs fill."""

    epoch: Optional[float] = None
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: int = 0
    log_history: List[Dict[str, float]] = field(default_factory=list)
    best_metric: Optional[float] = None
    best_global_step: Optional[int] = None
    best_model_checkpoint: Optional[str] = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True


@dataclass
class TrainerControl:
    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class TrainerCallback:
    """Trainer's callback hooks that memtune calls (a transformers.TrainerCallback works too):
    on_train_begin, on_step_end, on_log, on_evaluate, on_save, on_train_end. Setting
    control.should_training_stop ends training after the current step."""

    def on_train_begin(self, args, state, control, **kwargs): pass
    def on_step_end(self, args, state, control, **kwargs): pass
    def on_log(self, args, state, control, logs=None, **kwargs): pass
    def on_evaluate(self, args, state, control, metrics=None, **kwargs): pass
    def on_save(self, args, state, control, **kwargs): pass
    def on_train_end(self, args, state, control, **kwargs): pass


def _directory_of(obj: Any, name: str) -> str:
    """A model or tokenizer argument as a directory: a path, a memtune.Model, or an object loaded
    from a directory (a transformers model or tokenizer: its name_or_path)."""
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
    elif hasattr(obj, "path"):
        path = obj.path
    elif hasattr(obj, "name_or_path"):
        path = obj.name_or_path
    else:
        raise TypeError(f"{name}: expected a model directory, a memtune.Model or an object loaded from a directory, "
                        f"got {type(obj).__name__}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{name}: {path}: not a directory (expected a Hugging Face model directory)")
    return path


def _lora_flags(peft_config: Any) -> List[str]:
    """PEFT's LoraConfig (or a dict of its fields) as `memtune train` flags."""
    get = (lambda k, d=None: peft_config.get(k, d)) if isinstance(peft_config, dict) else \
        (lambda k, d=None: getattr(peft_config, k, d))
    flags = ["--tuner_type", "lora", "--lora_rank", str(get("r", 8)), "--lora_alpha", str(get("lora_alpha", 8)),
             "--lora_dropout", str(get("lora_dropout", 0.0))]
    targets = get("target_modules")
    if targets:
        flags += ["--target_modules", targets if isinstance(targets, str) else ",".join(sorted(targets))]
    if get("use_rslora", False):
        flags += ["--use_rslora", "true"]
    return flags


class Trainer:
    """Hugging Face Trainer's constructor and methods over memtune's engine.

    model: a model directory (or a memtune.Model, or a transformers model loaded from a
    directory: its directory is used). peft_config: a peft.LoraConfig (LoRA), else full
    fine-tuning. predictions: what EvalPrediction.predictions holds when no
    preprocess_logits_for_metrics is given ("argmax", "label_logprob", ("top_k", k),
    ("token_logits", ids)); see _predictions.Reduction.
    """

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, model_init=None, compute_loss_func=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), preprocess_logits_for_metrics=None, tokenizer=None,
                 peft_config=None, predictions="argmax"):
        for name, value in (("model_init", model_init), ("compute_loss_func", compute_loss_func)):
            if value is not None:
                raise NotImplementedError(f"Trainer({name}=...): memtune's loss is its fused cross-entropy; "
                                          f"{name} is not supported")
        if any(o is not None for o in optimizers):
            raise NotImplementedError("Trainer(optimizers=...): memtune runs its own AdamW with the arguments' "
                                      "learning_rate, betas, epsilon, weight_decay and lr_scheduler_type")
        if model is None:
            raise ValueError("Trainer(model=...): a model directory is required")
        self.model_path = _directory_of(model, "model")
        self.args = args if args is not None else TrainingArguments()
        self.config = as_config(self.args)
        self.data_collator = data_collator  # memtune batches and pads by itself
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        tok = processing_class if processing_class is not None else tokenizer
        self.tokenizer_path = _directory_of(tok, "processing_class") if tok is not None else None
        if compute_metrics is not None and not callable(compute_metrics):
            raise TypeError(f"compute_metrics: expected a function, got {type(compute_metrics).__name__}")
        if preprocess_logits_for_metrics is not None and not callable(preprocess_logits_for_metrics):
            raise TypeError("preprocess_logits_for_metrics: expected a function of (logits, labels)")
        self.compute_metrics = compute_metrics
        self.reduction = Reduction(preprocess_logits_for_metrics or predictions)
        self.peft_config = peft_config
        self.callbacks = list(callbacks or [])
        self.state = TrainerState()
        self.control = TrainerControl()
        self._trained: Optional[str] = None  # output_dir once train() finished
        self._bar = None

    # Arguments.
    def _arg(self, key, default=None):
        value = self.config.get(key, default)
        return default if value is None else value

    def _common_flags(self) -> List[str]:
        flags = ["--backend", str(self._arg("backend", "cpu")), "--max_length", str(self._arg("max_length", 2048))]
        if self.tokenizer_path:
            flags += ["--tokenizer", self.tokenizer_path]
        if self._arg("template"):
            flags += ["--template", str(self._arg("template"))]
        return flags

    def add_callback(self, callback):
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def _call(self, event: str, **kwargs):
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is not None:
                method(self.args, self.state, self.control, **kwargs)

    def _sink(self, keep: bool = False) -> PredictionSink:
        return PredictionSink(self.reduction, self.compute_metrics, bool(self._arg("batch_eval_metrics", False)),
                              keep=keep)

    def _output(self, text: str):
        # The engine's report lines; its log records are printed by on_log, its progress line is
        # the tqdm bar's.
        text = text.rsplit("\r", 1)[-1].replace("\x1b[2K", "").rstrip("\n")  # after a rewritten progress line
        if text and not text.lstrip().startswith("{"):
            self._write(text)

    def _write(self, line: str):
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, file=sys.stdout, flush=True)

    # Training.
    def train(self, resume_from_checkpoint=None, **kwargs) -> TrainOutput:
        if kwargs:
            raise TypeError(f"train() got unexpected arguments: {', '.join(kwargs)}")
        if self.train_dataset is None:
            raise ValueError("Trainer.train(): train_dataset is required")
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.config.get("resume_from_checkpoint")
        out_dir = str(self._arg("output_dir", "trainer_output"))
        scratch = tempfile.mkdtemp(prefix="memtune-")
        try:
            config = {k: v for k, v in self.config.items() if k not in _PYTHON_ONLY}
            if isinstance(config.get("report_to"), str):
                config["report_to"] = [config["report_to"]]
            config_path = os.path.join(scratch, "training_args.json")
            with open(config_path, "w", encoding="utf-8") as f:
                json.dump(config, f)
            cmd = ["train", "--config", config_path, "--model_name_or_path", self.model_path, "--output_dir", out_dir,
                   "--train_file", dataset_file(self.train_dataset, "train_dataset", scratch), "--metrics", "eval_loss"]
            cmd += self._common_flags()
            cmd += _lora_flags(self.peft_config) if self.peft_config is not None else ["--tuner_type", "full"]
            if self.eval_dataset is not None:
                cmd += ["--eval_file", dataset_file(self.eval_dataset, "eval_dataset", scratch)]
            if resume_from_checkpoint:
                cmd += ["--resume_from_checkpoint",
                        "last" if resume_from_checkpoint is True else os.fspath(resume_from_checkpoint)]
            self.state = TrainerState()
            self.control = TrainerControl()
            hooks = _TrainHooks(self, self._sink() if self.compute_metrics is not None else None)
            self._call("on_train_begin")
            start = time.time()
            try:
                _memtune.run(cmd, hooks, self._output)
            finally:
                if self._bar is not None:
                    self._bar.close()
                    self._bar = None
            runtime = time.time() - start
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self._trained = out_dir
        self._read_state(out_dir)
        losses = [(r["step"], r["loss"]) for r in self.state.log_history if "loss" in r and "step" in r]
        train_loss, previous = 0.0, 0
        for step, loss in losses:  # each logged loss is the mean over the steps since the last
            train_loss += loss * (step - previous)
            previous = step
        train_loss = train_loss / previous if previous else float("nan")
        steps = max(self.state.global_step, 1)
        metrics = {"train_runtime": runtime, "train_steps_per_second": steps / max(runtime, 1e-9),
                   "train_loss": train_loss, "epoch": self.state.epoch}
        self.state.log_history.append(dict(metrics, step=self.state.global_step))
        self._call("on_train_end")
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _read_state(self, out_dir: str):
        path = os.path.join(out_dir, "trainer_state.json")
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        for key in ("epoch", "global_step", "max_steps", "num_train_epochs", "log_history", "best_metric",
                    "best_global_step", "best_model_checkpoint"):
            if key in saved:
                setattr(self.state, key, saved[key])

    # Evaluation.
    def _model_flags(self) -> List[str]:
        if self._trained and self.peft_config is not None:
            return ["--model", self.model_path, "--adapter", self._trained]
        return ["--model", self._trained or self.model_path]

    def _run_eval(self, dataset, name: str, sink: PredictionSink) -> Dict[str, float]:
        scratch = tempfile.mkdtemp(prefix="memtune-")
        try:
            cmd = ["eval", *self._model_flags(), "--eval_file", dataset_file(dataset, name, scratch),
                   "--per_device_eval_batch_size", str(self._arg("per_device_eval_batch_size", 8)),
                   "--metrics", "eval_loss", *self._common_flags()]
            if self._arg("bf16", False):
                cmd.append("--bf16")
            elif self._arg("fp16", False):
                cmd.append("--fp16")
            hooks = _EvalHooks(sink)
            _memtune.run(cmd, hooks, self._output)
            return hooks.result
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> Dict[str, float]:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer.evaluate(): no eval_dataset (pass one here or to Trainer)")
        sink = self._sink()
        start = time.time()
        result = self._run_eval(dataset, "eval_dataset", sink)
        metrics = self._metrics(result, sink, metric_key_prefix, time.time() - start)
        self.state.log_history.append(dict(metrics, step=self.state.global_step))
        self._call("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        sink = self._sink(keep=True)
        start = time.time()
        result = self._run_eval(test_dataset, "test_dataset", sink)
        metrics = self._metrics(result, sink, metric_key_prefix, time.time() - start)
        prediction = sink.last
        return PredictionOutput(prediction.predictions, prediction.label_ids, metrics)

    def _metrics(self, result, sink, prefix, runtime) -> Dict[str, float]:
        metrics = {f"{prefix}_loss": result["eval_loss"]}
        for key, value in (sink.result or {}).items():
            metrics[key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"] = value
        examples = result.get("eval_examples", 0)
        metrics[f"{prefix}_runtime"] = runtime
        metrics[f"{prefix}_samples_per_second"] = examples / max(runtime, 1e-9)
        metrics[f"{prefix}_steps_per_second"] = sink.batches / max(runtime, 1e-9)
        return metrics

    def save_model(self, output_dir: Optional[str] = None):
        """Copies the trained model (full fine-tuning) or adapter (LoRA) with its tokenizer files
        into output_dir (default: args.output_dir, where train() already wrote them)."""
        if not self._trained:
            raise ValueError("Trainer.save_model(): nothing has been trained yet (call train() first)")
        target = output_dir or self._trained
        if os.path.abspath(target) == os.path.abspath(self._trained):
            return
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(self._trained):
            source = os.path.join(self._trained, name)
            if os.path.isfile(source) and (name.endswith((".safetensors", ".json")) and
                                           not name.startswith(("trainer_state", "memory", "run_args"))):
                shutil.copy2(source, os.path.join(target, name))


class _TrainHooks:
    """The engine's hooks of a train() run."""

    def __init__(self, trainer: Trainer, sink: PredictionSink):
        self.trainer = trainer
        self.predictions = sink

    def on_log(self, text: str):
        t = self.trainer
        record = json.loads(text)
        t.state.log_history.append(record)
        t.state.global_step = record.get("step", t.state.global_step)
        t.state.epoch = record.get("epoch", t.state.epoch)
        if any(k.startswith("eval_") for k in record):
            t._call("on_evaluate", metrics=record)
        shown = ("loss", "grad_norm", "learning_rate", "epoch", "skipped")
        t._write(str({k: v for k, v in record.items() if k in shown or k.startswith("eval_")}))
        t._call("on_log", logs=record)

    def on_step_end(self, step: int, max_steps: int):
        t = self.trainer
        t.state.global_step, t.state.max_steps = step, max_steps
        if t._bar is None and not t._arg("disable_tqdm", False):
            try:  # the bar starts with the first step, after the run's own report lines
                from tqdm.auto import tqdm
                t._bar = tqdm(total=max_steps, initial=step - 1, unit="step", dynamic_ncols=True)
            except ImportError:  # no progress bar without tqdm (pip install memtune[progress])
                t.config["disable_tqdm"] = True
        if t._bar is not None:
            if t._bar.total != max_steps:
                t._bar.total = max_steps
            t._bar.update(step - t._bar.n)
        t._call("on_step_end")

    def on_save(self, checkpoint: str):
        self.trainer._call("on_save", checkpoint=checkpoint)

    def should_stop(self) -> bool:
        return bool(self.trainer.control.should_training_stop)


class _EvalHooks:
    def __init__(self, sink: PredictionSink):
        self.predictions = sink
        self.result = None

    def on_eval_result(self, text: str):
        self.result = json.loads(text)
