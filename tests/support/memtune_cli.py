"""What the Python tests that drive the memtune binary share: the arguments each takes
(--memtune BIN --workdir DIR, the directory made fresh) and one way to run a command."""

import argparse
import os
import shutil
import subprocess


def test_arguments(extra=None):
    """Parses --memtune and --workdir (plus what `extra(parser)` adds); empties the workdir."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--memtune", required=True, help="the memtune binary")
    ap.add_argument("--workdir", required=True, help="a scratch directory, emptied first")
    if extra:
        extra(ap)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    return args


def run(cmd, check=True, timeout=300, **kwargs):
    """Runs cmd (its items turned into strings) and returns the CompletedProcess; with check, a
    non-zero exit raises RuntimeError carrying the command and its output."""
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p
