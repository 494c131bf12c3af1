"""memtune.plan, memtune.generate and memtune.Model: the CLI's commands with Python values."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Dict, Iterable, List, Optional, Union

from . import _memtune


def _flags(options: Dict[str, Any]) -> List[str]:
    """Keyword arguments as command-line flags: --name value; True as a bare flag, False and None
    left out, a list joined by commas."""
    out: List[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + name
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return out


def run(*args: str, capture: bool = False) -> Optional[str]:
    """Runs a memtune command line in this process (`memtune.run("plan", "--preset", ...)`); its
    output goes to sys.stdout, or is returned with capture=True. Errors raise MemtuneError."""
    lines: List[str] = []
    if capture:
        _memtune.run([str(a) for a in args], None, lines.append)
        return "".join(lines)
    import sys
    _memtune.run([str(a) for a in args], None, lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    return None


def plan(**flags: Any) -> Dict[str, Any]:
    """The memory plan of a training run before it starts (`memtune plan --json`): its buffers,
    phases, peak and whether it fits, as Python objects. Takes `memtune train`'s flags as keyword
    arguments (model_name_or_path=..., per_device_train_batch_size=4, ...), or a preset=..."""
    return json.loads(run("plan", *_flags(flags), "--json", capture=True))


class Model:
    """A model directory (optionally with a LoRA adapter) for quick checks: generate()."""

    def __init__(self, path: Union[str, os.PathLike], adapter: Optional[str] = None, backend: str = "cpu"):
        self.path = os.fspath(path)
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise FileNotFoundError(f"Model: {self.path}: no config.json (expected a Hugging Face model directory)")
        self.adapter = adapter
        self.backend = backend

    def generate(self, prompts: Union[str, Iterable[Any]], **flags: Any) -> List[Dict[str, Any]]:
        if self.adapter:
            flags.setdefault("adapter", self.adapter)
        flags.setdefault("backend", self.backend)
        return generate(self.path, prompts, **flags)

    def __repr__(self):
        return f"memtune.Model({self.path!r})"


def generate(model: Union[str, os.PathLike, Model], prompts: Union[str, Iterable[Any]], **flags: Any
             ) -> List[Dict[str, Any]]:
    """`memtune generate` on a list of prompts: each a text, a list of chat messages, a list of
    token ids, or a record as `generate --input` reads it. Returns one result per prompt (its
    "text", "token_ids", ...). Flags as keyword arguments: max_new_tokens=32, temperature=0, ..."""
    path = model.path if isinstance(model, Model) else os.fspath(model)
    if isinstance(prompts, str):
        prompts = [prompts]
    scratch = tempfile.mkdtemp(prefix="memtune-")
    try:
        inp, out = os.path.join(scratch, "prompts.jsonl"), os.path.join(scratch, "out.jsonl")
        with open(inp, "w", encoding="utf-8") as f:
            for p in prompts:
                if isinstance(p, str):
                    record = {"prompt": p}
                elif isinstance(p, dict):
                    record = p
                elif p and all(isinstance(t, int) for t in p):
                    record = {"prompt_ids": list(p)}
                else:
                    record = {"messages": list(p)}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        run("generate", "--model", path, "--input", inp, "--output", out, *_flags(flags), capture=True)
        with open(out, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
