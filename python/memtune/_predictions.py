"""What compute_metrics receives, built from the fused LM head a chunk of rows at a time.

The engine never holds a [sequences, positions, vocabulary] logits array. For every evaluated
micro-batch it hands this sink the batch's ids and unshifted labels, then its rows: a row is a
position that has a target (the next token's label), and for each row either its argmax id and
the label's log-prob (computed where the logits are) or the [rows, V] logits chunk itself, which
a reduction (top-k, chosen token ids, the user's preprocess_logits_for_metrics) turns into a few
numbers per row before the chunk's memory is reused. Predictions are laid out as Trainer lays out
`preprocess_logits_for_metrics(logits, labels)`'s results: [sequences, positions, ...], position t
being the prediction made at token t (of label t + 1), -100 where no prediction was made and as
padding, beside label_ids, the unshifted labels padded with -100.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

PAD = -100


class EvalPrediction:
    """Hugging Face's EvalPrediction: predictions, label_ids (and inputs, losses: None here);
    unpacks as (predictions, label_ids)."""

    def __init__(self, predictions, label_ids, inputs=None, losses=None):
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses

    def __iter__(self):
        return iter((self.predictions, self.label_ids))

    def __getitem__(self, i):
        return (self.predictions, self.label_ids)[i]

    def __len__(self):
        return 2


PredictionsSpec = Union[str, Tuple[str, Any], Callable]


def _torch():
    try:
        import torch  # noqa: F401
        return torch
    except ImportError:
        return None


class Reduction:
    """How a row becomes a prediction. Built-ins: "argmax" (Trainer's
    `preprocess_logits_for_metrics=lambda l, y: l.argmax(-1)`), "label_logprob", ("top_k", k): ids
    and log-probs of the k best tokens, ("token_logits", ids): the logits of the given token ids
    (a classifier's label words); or the user's preprocess_logits_for_metrics(logits, labels),
    called on [rows, V] chunks with the rows' labels (the token each row predicts)."""

    def __init__(self, spec: PredictionsSpec):
        self.spec = spec
        self.from_rows = spec in ("argmax", "label_logprob")
        if isinstance(spec, str):
            if spec not in ("argmax", "label_logprob"):
                raise ValueError(f"predictions={spec!r}: expected 'argmax', 'label_logprob', ('top_k', k), "
                                 f"('token_logits', [ids]) or a function of (logits, labels)")
        elif isinstance(spec, tuple):
            if len(spec) != 2 or spec[0] not in ("top_k", "token_logits"):
                raise ValueError(f"predictions={spec!r}: expected ('top_k', k) or ('token_logits', [ids])")
            if spec[0] == "top_k" and (not isinstance(spec[1], int) or spec[1] < 1):
                raise ValueError(f"predictions=('top_k', {spec[1]!r}): k must be a positive integer")
            if spec[0] == "token_logits":
                self.ids = np.asarray(spec[1], dtype=np.int64)
                if self.ids.ndim != 1 or self.ids.size == 0:
                    raise ValueError("predictions=('token_logits', ids): ids must be a non-empty list of token ids")
        elif not callable(spec):
            raise TypeError(f"predictions: expected a name, a tuple or a function, got {type(spec).__name__}")

    def rows(self, argmax: np.ndarray, logprob: np.ndarray) -> np.ndarray:
        return argmax.astype(np.int64) if self.spec == "argmax" else logprob.copy()

    def logits(self, logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
        spec = self.spec
        if isinstance(spec, tuple) and spec[0] == "token_logits":
            if self.ids.max() >= logits.shape[1] or self.ids.min() < 0:
                raise ValueError(f"predictions=('token_logits', ids): ids must be below the vocabulary size "
                                 f"{logits.shape[1]}")
            return logits[:, self.ids].copy()
        if isinstance(spec, tuple):  # top_k: ids and log-probs, best first
            k = min(spec[1], logits.shape[1])
            ids = np.argpartition(-logits, k - 1, axis=1)[:, :k]
            top = np.take_along_axis(logits, ids, axis=1)
            order = np.argsort(-top, axis=1, kind="stable")
            ids = np.take_along_axis(ids, order, axis=1)
            top = np.take_along_axis(top, order, axis=1)
            peak = logits.max(axis=1, keepdims=True)
            lse = peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True))
            return np.stack([ids.astype(np.float32), (top - lse).astype(np.float32)], axis=-1)
        # The user's function, on torch tensors when torch is installed (as Trainer calls it).
        torch = _torch()
        if torch is not None:
            with warnings.catch_warnings():  # a read-only view: the chunk is the engine's memory
                warnings.simplefilter("ignore", UserWarning)
                chunk = torch.from_numpy(logits)
            out = spec(chunk, torch.from_numpy(targets.astype(np.int64)))
            del chunk
            if isinstance(out, torch.Tensor):
                out = out.detach().cpu().numpy()
        else:
            out = spec(logits, targets.astype(np.int64))
        out = np.array(out, copy=True)  # never a view of the chunk
        if out.ndim == 0 or out.shape[0] != logits.shape[0]:
            raise ValueError(
                f"preprocess_logits_for_metrics returned shape {tuple(out.shape)} for a [{logits.shape[0]}, "
                f"{logits.shape[1]}] chunk: expected one result per row (shape [{logits.shape[0]}, ...])")
        return out


class PredictionSink:
    """The engine's evaluation observer (see the module's doc) and compute_metrics' caller, in one
    of Trainer's two protocols: once over the eval set's predictions, or per batch
    (batch_eval_metrics: compute_metrics(EvalPrediction, compute_result), the last batch's result
    being the metrics)."""

    def __init__(self, reduction: Reduction, compute_metrics: Optional[Callable], batch_eval_metrics: bool = False,
                 keep: bool = False):
        self.reduction = reduction
        self.compute_metrics = compute_metrics
        self.batch_eval_metrics = batch_eval_metrics and compute_metrics is not None
        self.keep = keep or (compute_metrics is not None and not self.batch_eval_metrics)
        self.needs_logits = not reduction.from_rows
        self.reset()

    def reset(self):
        self.predictions: List[np.ndarray] = []
        self.labels: List[np.ndarray] = []
        self.pending: Optional[EvalPrediction] = None
        self.result = None
        self.last: Optional[EvalPrediction] = None
        self.batches = 0

    # The engine's calls.
    def start_batch(self, input_ids, labels, cu_seqlens):
        self.batch_labels = labels
        self.cu = cu_seqlens
        self.positions: List[np.ndarray] = []
        self.values: List[np.ndarray] = []

    def rows(self, positions, targets, argmax, logprob):
        self.positions.append(positions)
        self.values.append(self.reduction.rows(argmax, logprob))

    def logits(self, positions, targets, logits):
        self.positions.append(positions)
        self.values.append(self.reduction.logits(logits, targets))

    def finish_batch(self):
        positions = np.concatenate(self.positions) if self.positions else np.zeros(0, np.int32)
        values = np.concatenate(self.values) if self.values else None
        sequences = []
        for s in range(len(self.cu) - 1):
            begin, end = int(self.cu[s]), int(self.cu[s + 1])
            labels = self.batch_labels[begin:end].astype(np.int64)
            if values is None:
                pred = np.full(end - begin, PAD, dtype=np.int64)
            else:
                pred = np.full((end - begin,) + values.shape[1:], PAD, dtype=values.dtype)
                mine = (positions >= begin) & (positions < end)
                pred[positions[mine] - begin] = values[mine]
            sequences.append((pred, labels))
        self.batches += 1
        if self.batch_eval_metrics:
            if self.pending is not None:
                self.compute_metrics(self.pending, compute_result=False)
            self.pending = self._prediction([p for p, _ in sequences], [l for _, l in sequences], tensors=True)
        if self.keep:
            for pred, labels in sequences:
                self.predictions.append(pred)
                self.labels.append(labels)

    def compute(self):
        """compute_metrics' dict for the evaluation that just ended (None without compute_metrics);
        with `keep`, the eval set's EvalPrediction stays in `last`."""
        self.last = self.prediction() if self.keep else None
        self.predictions, self.labels = [], []
        result = None
        if self.compute_metrics is not None and self.batch_eval_metrics:
            if self.pending is not None:
                result = self.compute_metrics(self.pending, compute_result=True)
            self.pending = None
        elif self.compute_metrics is not None:
            result = self.compute_metrics(self.last)
        self.result = result
        return result

    # Assembling.
    def prediction(self) -> EvalPrediction:
        return self._prediction(self.predictions, self.labels, tensors=False)

    @staticmethod
    def _prediction(predictions: Sequence[np.ndarray], labels: Sequence[np.ndarray], tensors: bool):
        preds, label_ids = _pad(predictions), _pad(labels)
        torch = _torch() if tensors else None
        if torch is not None:  # Trainer's batch_eval_metrics hands over tensors
            preds, label_ids = torch.from_numpy(preds), torch.from_numpy(label_ids)
        return EvalPrediction(preds, label_ids)


def _pad(arrays: Sequence[np.ndarray]) -> np.ndarray:
    if not arrays:
        return np.zeros((0, 0), dtype=np.int64)
    length = max(a.shape[0] for a in arrays)
    out = np.full((len(arrays), length) + arrays[0].shape[1:], PAD, dtype=arrays[0].dtype)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return out
