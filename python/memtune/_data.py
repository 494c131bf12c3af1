"""Datasets as the files `memtune train` and `memtune eval` read.

A path is read as it is (JSONL in any format the CLI reads: messages, sharegpt, alpaca,
query-response, text, input_ids/labels). A Hugging Face `datasets.Dataset`, or any sequence of
dicts, is written a record per line into the run's scratch directory first.
"""

from __future__ import annotations

import json
import os
from typing import Any


def _plain(value: Any) -> Any:
    """A record's value as JSON can hold it (numpy scalars and arrays from datasets)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def dataset_file(dataset: Any, name: str, scratch: str) -> str:
    """The path of a JSONL file holding `dataset` (`name` names the argument in errors)."""
    if isinstance(dataset, (str, os.PathLike)):
        path = os.fspath(dataset)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{name}: {path}: no such file (expected a JSONL dataset)")
        return path
    if isinstance(dataset, dict) or not hasattr(dataset, "__iter__"):
        raise TypeError(f"{name}: expected a datasets.Dataset, a list of dicts or a JSONL file path, "
                        f"got {type(dataset).__name__}")
    path = os.path.join(scratch, f"{name}.jsonl")
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for i, record in enumerate(dataset):
            if not isinstance(record, dict):
                raise TypeError(f"{name}[{i}]: expected a dict (a record), got {type(record).__name__}")
            f.write(json.dumps(_plain(record), ensure_ascii=False) + "\n")
            count += 1
    if count == 0:
        raise ValueError(f"{name}: the dataset is empty")
    return path
