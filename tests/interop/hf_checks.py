"""What the Hugging Face interop tests share: named checks that all run and report (one failing
case does not stop the others), the main that runs a test's per-family checks over --families
with the versions of transformers, PEFT and torch printed first, and from_pretrained's dtype
keyword for the installed transformers."""

import contextlib
import os
import sys

import peft
import torch
import transformers
from packaging.version import Version

import memtune_cli


class Checks:
    def __init__(self):
        self.failures = []
        self.passed = 0

    @contextlib.contextmanager
    def case(self, name):
        try:
            yield
            self.passed += 1
            print(f"ok    {name}", flush=True)
        except Exception as e:  # every failure is reported, the other cases still run
            self.failures.append(name)
            print(f"FAIL  {name}: {type(e).__name__}: {e}", flush=True)


def run_families(*per_family):
    """Parses --memtune, --workdir and --families; runs each per_family(memtune, workdir, family,
    checks) for every family; exits 1 when any check failed."""
    a = memtune_cli.test_arguments(lambda ap: ap.add_argument("--families", default="qwen2,qwen3,llama"))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    transformers.utils.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
    checks = Checks()
    for family in a.families.split(","):
        os.makedirs(os.path.join(a.workdir, family), exist_ok=True)
        for checks_of_family in per_family:
            checks_of_family(a.memtune, a.workdir, family, checks)
    print(f"{checks.passed} passed, {len(checks.failures)} failed")
    for name in checks.failures:
        print(f"  failed: {name}")
    sys.exit(1 if checks.failures else 0)


def dtype_argument(dtype):
    """from_pretrained's dtype keyword: `dtype` from transformers 4.56 on (5 deprecates
    `torch_dtype`), `torch_dtype` before it (4.51 takes no `dtype`)."""
    return {"dtype": dtype} if Version(transformers.__version__).release >= (4, 56) else {"torch_dtype": dtype}


def saved_dtype(config):
    """The dtype a config.json that transformers saved names: `dtype` from 4.56 on, `torch_dtype` before."""
    return config.get("dtype", config.get("torch_dtype"))
