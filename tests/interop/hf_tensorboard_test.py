#!/usr/bin/env python3
"""`memtune train --report_to tensorboard` read back by TensorBoard itself, against what Hugging
Face's TensorBoardCallback writes for the same log. Run with the pinned Hugging Face environment's
python (tensorboard, torch, transformers):

    PYTHON tests/interop/hf_tensorboard_test.py --memtune BIN --workdir DIR

On a tiny model (`memtune init-model --preset tiny`, the byte-level tokenizer of
tests/support/byte_tokenizer.py) and a few text lines, with --logging_steps 1 and evaluation every 2 steps:
  1. --report_to tensorboard without --logging_dir: one event file in Hugging Face's default
     logging_dir, output_dir/runs/<%b%d_%H-%M-%S>_<hostname> (a time during the run), named
     events.out.tfevents.<unix seconds>.<hostname>.<pid>.0; TensorBoard's record reader reads every
     record to the end of the file (length and data CRC-32C checked) and the first event is
     file_version brain.Event:2 (a copy with one byte flipped must fail that reader).
  2. The scalars, read with TensorBoard's EventAccumulator, equal those of a reference directory
     that transformers' own TensorBoardCallback.on_log writes (through torch's SummaryWriter) from
     memtune's log (trainer_state.json's log_history, the same records as log.jsonl): the same
     tags (train/loss, eval/loss, ...), the same steps, the same float32 values, nothing more
     (the comparison first shows it fails on a changed value and on an extra tag).
  3. The same from a --config file (`report_to: [wandb, tensorboard]`, `logging_dir: DIR`: a note
     names wandb), with --report_to all, and under `mpirun -np 2` (only rank 0 writes).
  4. --report_to none, a config's `report_to: none`, --report_to wandb and no --report_to at all
     write no event file; an unknown name (and none beside another name) fails before any work,
     naming the value and the valid names.
"""
import json
import pathlib
import re
import shutil
import socket
import sys
import time
from datetime import datetime

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "support"))
import memtune_cli  # noqa: E402
from byte_tokenizer import write_tokenizer  # noqa: E402
from numeric import assert_close, check  # noqa: E402

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.compat.proto import event_pb2  # noqa: E402
from tensorboard.compat.tensorflow_stub import errors as tb_errors  # noqa: E402
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tb_records  # noqa: E402

TEXTS = [f"colour {i} is {w}" for i, w in enumerate(
    ["red", "green", "blue", "cyan", "amber", "teal", "gold", "plum", "grey", "pink", "navy", "lime",
     "rose", "sand", "jade", "ruby"])]
EVAL_TEXTS = ["colour 16 is mint", "colour 17 is gold", "colour 18 is teal", "colour 19 is red"]


def run(cmd, **kwargs):
    return memtune_cli.run(cmd, check=False, **kwargs)


def event_files(directory):
    return sorted(p for p in pathlib.Path(directory).rglob("*") if p.name.startswith("events.out.tfevents"))


def read_records(path):
    """Every record of an event file through TensorBoard's own TFRecord reader, which checks the
    masked CRC-32C of each length and each event; raises on a bad one."""
    reader = tb_records.PyRecordReader_New(str(path).encode(), 0, b"", None)
    records = []
    while True:
        try:
            reader.GetNext()
        except tb_errors.OutOfRangeError:
            return records
        records.append(reader.record())


def check_event_file(path):
    records = read_records(path)
    framed = sum(8 + 4 + len(r) + 4 for r in records)
    check(framed == path.stat().st_size,
          f"{path}: the records read ({framed} bytes) are not the whole file ({path.stat().st_size} bytes)")
    first = event_pb2.Event.FromString(records[0])
    check(first.file_version == "brain.Event:2", f"{path}: first event is not file_version brain.Event:2: {first}")
    check(len(records) > 1, f"{path}: no event after the file_version one")
    # The reader's check can fail: one flipped byte in a copy of the last event's data.
    broken = path.parent.parent / ("corrupt-" + path.name)
    data = bytearray(path.read_bytes())
    data[-6] ^= 0x01
    broken.write_bytes(bytes(data))
    try:
        read_records(broken)
        failed = False
    except tb_errors.DataLossError:
        failed = True
    finally:
        broken.unlink()
    check(failed, f"{path}: TensorBoard's reader accepted a copy with a flipped byte")


def scalars(directory):
    """{tag: [(step, value), ...]} as TensorBoard loads them, every event kept."""
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def hugging_face_reference(log_history, directory):
    """What transformers' TensorBoardCallback writes for these log records (each record without
    its "step", which the Trainer passes as state.global_step)."""
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations.integration_utils import TensorBoardCallback
    from transformers.trainer_callback import TrainerControl, TrainerState
    writer = SummaryWriter(log_dir=str(directory))
    callback = TensorBoardCallback(tb_writer=writer)
    for record in log_history:
        logs = {k: v for k, v in record.items() if k != "step"}
        callback.on_log(None, TrainerState(global_step=record["step"], is_world_process_zero=True), TrainerControl(),
                        logs=logs)
    writer.close()
    return scalars(directory)


def compare(got, want, what):
    check(set(got) == set(want), lambda: f"{what}: tags differ: memtune only {sorted(set(got) - set(want))}, "
                                         f"Hugging Face only {sorted(set(want) - set(got))}")
    for tag in sorted(want):
        check([s for s, _ in got[tag]] == [s for s, _ in want[tag]],
              lambda: f"{what}: {tag}: steps {[s for s, _ in got[tag]]}, Hugging Face {[s for s, _ in want[tag]]}")
        assert_close([v for _, v in got[tag]], [v for _, v in want[tag]], what=f"{what}: {tag}")


def check_comparison_fails(want):
    """compare() rejects a changed value, a NaN and an extra tag."""
    tag = sorted(want)[0]
    for changed in ({**want, tag: [(want[tag][0][0], want[tag][0][1] * 1.001 + 1e-6)] + want[tag][1:]},
                    {**want, tag: [(want[tag][0][0], float("nan"))] + want[tag][1:]},
                    {**want, "train/invented": [(1, 0.0)]}):
        try:
            compare(changed, want, "self-check")
            failed = False
        except AssertionError:
            failed = True
        check(failed, "the comparison accepted a changed log")


class Case:
    def __init__(self, memtune, work, model, train, eval_file):
        self.memtune, self.work, self.model, self.train_file, self.eval_file = memtune, work, model, train, eval_file

    def train_cmd(self, name, *extra, steps=4):
        return [self.memtune, "train", "--model_name_or_path", self.model, "--train_file", self.train_file,
                "--output_dir", self.work / name, "--tuner_type", "full", "--learning_rate", "1e-3",
                "--per_device_train_batch_size", "4", "--max_steps", str(steps), "--logging_steps", "1",
                "--eval_file", self.eval_file, "--eval_strategy", "steps", "--eval_steps", "2",
                "--save_strategy", "no", "--max_length", "64", *extra]

    def train(self, name, *extra, steps=4, launcher=()):
        r = run([*launcher, *self.train_cmd(name, *extra, steps=steps)])
        check(r.returncode == 0, lambda: f"{name}: memtune train failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r, self.work / name

    def check_matches_log(self, name, out, logging_dir):
        """The event file in logging_dir against Hugging Face's callback fed memtune's own log."""
        files = event_files(logging_dir)
        check(len(files) == 1, f"{name}: expected one event file in {logging_dir}, found {files}")
        check_event_file(files[0])
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
        check(history == lines, f"{name}: trainer_state.json's log_history differs from log.jsonl")
        want = hugging_face_reference(history, self.work / "hf_reference" / name)
        got = scalars(logging_dir)
        compare(got, want, name)
        return files[0], got, want


def main():
    args = memtune_cli.test_arguments()
    work = pathlib.Path(args.workdir).resolve()
    model = work / "model"
    r = run([args.memtune, "init-model", "--preset", "tiny", "--seed", "1", "--out", model])
    check(r.returncode == 0, lambda: f"init-model failed:\n{r.stdout}\n{r.stderr}")
    write_tokenizer(str(model))
    train, eval_file = work / "train.jsonl", work / "eval.jsonl"
    train.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    eval_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in EVAL_TEXTS))
    case = Case(args.memtune, work, model, train, eval_file)
    host = socket.gethostname()

    # 1-2. The default logging_dir, the file, and the scalars against Hugging Face's callback.
    before = time.time()
    r, out = case.train("default_dir", "--report_to", "tensorboard")
    after = time.time()
    runs = sorted((out / "runs").iterdir()) if (out / "runs").is_dir() else []
    check(len(runs) == 1, f"expected one directory in {out / 'runs'}, found {runs}")
    hf_names = {datetime.fromtimestamp(t).strftime("%b%d_%H-%M-%S") + "_" + host
                for t in range(int(before), int(after) + 1)}
    check(runs[0].name in hf_names,
          f"default logging_dir {runs[0].name} is not output_dir/runs/<%b%d_%H-%M-%S>_{host} of a time during the run "
          f"({sorted(hf_names)})")
    event_file, got, want = case.check_matches_log("default_dir", out, runs[0])
    check(str(event_file) in r.stdout, f"the run does not say where it writes the event file:\n{r.stdout}")
    m = re.fullmatch(r"events\.out\.tfevents\.(\d{10})\." + re.escape(host) + r"\.(\d+)\.0", event_file.name)
    check(m is not None, f"event file name {event_file.name} is not events.out.tfevents.<10 digits>.{host}.<pid>.0")
    check(int(before) <= int(m.group(1)) <= after, f"{event_file.name}: time {m.group(1)} not during the run")
    for tag, steps in [("train/loss", [1, 2, 3, 4]), ("train/learning_rate", [1, 2, 3, 4]),
                       ("train/grad_norm", [1, 2, 3, 4]), ("train/tokens_per_second", [1, 2, 3, 4]),
                       ("train/memory_rss_bytes", [1, 2, 3, 4]), ("eval/loss", [2, 4]),
                       ("train/epoch", [1, 2, 2, 3, 4, 4])]:
        check([s for s, _ in got.get(tag, [])] == steps, lambda: f"{tag}: steps {got.get(tag)}, expected {steps}")
    check("train/step" not in got and "train/phase_clock" not in got, f"unexpected tags: {sorted(got)}")
    check_comparison_fails(want)

    # 3. A config file with a list and an explicit logging_dir; --report_to all; mpirun.
    config = work / "report.yaml"
    config.write_text(f"report_to: [wandb, tensorboard]\nlogging_dir: {work / 'tb_config'}\n")
    r, out = case.train("config", "--config", config)
    note = [line for line in (r.stdout + r.stderr).splitlines() if "--report_to" in line and "wandb" in line]
    check(len(note) == 1 and note[0].startswith("memtune: note:") and "wandb is not written" in note[0],
          f"expected one note naming wandb:\n{r.stdout}\n{r.stderr}")
    check(not (out / "runs").exists(), "an explicit logging_dir still made output_dir/runs")
    case.check_matches_log("config", out, work / "tb_config")

    r, out = case.train("all", "--report_to", "all", "--logging_dir", work / "tb_all", steps=2)
    case.check_matches_log("all", out, work / "tb_all")

    mpirun = shutil.which("mpirun")
    check(mpirun is not None, "mpirun not found (Open MPI is one of memtune's dependencies)")
    r, out = case.train("mpi", "--report_to", "tensorboard", "--logging_dir", work / "tb_mpi",
                        launcher=(mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2"))
    first_log = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    check(first_log.get("world_size") == 2, f"the mpirun run did not train on 2 ranks: {first_log}")
    case.check_matches_log("mpi", out, work / "tb_mpi")  # exactly one event file: rank 0's

    # 4. No event file without tensorboard; unknown names refused before any work.
    none_config = work / "none.yaml"
    none_config.write_text("report_to: none\n")
    for name, extra in [("none", ["--report_to", "none"]), ("none_config", ["--config", none_config]),
                        ("not_given", []), ("wandb_only", ["--report_to", "wandb"])]:
        r, out = case.train(name, *extra, steps=1)
        check(event_files(out) == [] and not (out / "runs").exists(),
              f"{name}: event files written: {event_files(out)}")
        if name == "wandb_only":
            check("memtune: note: --report_to wandb: memtune writes tensorboard event files only; wandb is not written"
                  in r.stdout + r.stderr, f"wandb_only: no note:\n{r.stdout}\n{r.stderr}")

    for name, extra, named in [("unknown", ["--report_to", "tensorbord"], "tensorbord"),
                               ("unknown_in_list", ["--report_to", "wandb,tensorboardx"], "tensorboardx"),
                               ("none_and_more", ["--report_to", "none", "tensorboard"], "none")]:
        r = run(case.train_cmd(name, *extra))
        text = r.stdout + r.stderr
        check(r.returncode != 0, f"{name}: --report_to {extra[1:]} was accepted:\n{text}")
        check(named in text and "tensorboard" in text and "error" in text,
              f"{name}: the error does not name {named!r} and the valid names:\n{text}")
        check(not (work / name).exists(), f"{name}: refused, but output_dir {work / name} was made")
    print("tensorboard: every check passed")


if __name__ == "__main__":
    main()
