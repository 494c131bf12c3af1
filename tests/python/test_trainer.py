"""memtune's Python package: Trainer's API over the engine, against transformers' own Trainer.

    MEMTUNE_TOKENIZER_DIR=... PYTHONPATH=build/python python -m pytest tests/python

A small Qwen2-shaped model made by memtune (Qwen2.5's vocabulary and tokenizer) is evaluated by
transformers.Trainer and by memtune.Trainer on the same pre-tokenized data with the same user
functions (token accuracy through preprocess_logits_for_metrics, perplexity from label
log-probs, a two-word classifier at the answer's first position, and Trainer's per-batch
protocol): the same metric values. Then training with callbacks, LoRA, the errors a user meets,
plan() and generate().
"""

import json
import math
import os
import shutil
import signal

import numpy as np
import pytest

import memtune

VOCAB = 151936
LABEL_WORDS = [9454, 2753]  # "Yes", "No" in Qwen2.5's vocabulary


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    tokenizer = os.environ.get("MEMTUNE_TOKENIZER_DIR")
    if not tokenizer:
        if os.environ.get("MEMTUNE_REQUIRE_ALL_TESTS") == "1":
            pytest.fail("MEMTUNE_TOKENIZER_DIR is not set (scripts/prepare-tokenizer.sh prints it)")
        pytest.skip("MEMTUNE_TOKENIZER_DIR is not set")
    d = str(tmp_path_factory.mktemp("model") / "m")
    memtune.run("init-model", "--preset", "tiny", "--out", d, "--seed", "3", "--set", f"vocab_size={VOCAB}",
                "--set", "hidden_size=64", "--set", "intermediate_size=128", "--set", "num_hidden_layers=2",
                "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2", capture=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer, name), d)
    # Trained a little (by the CLI), so its predictions are right often enough for the metrics to
    # tell implementations apart.
    data = os.path.join(d, "train.jsonl")
    with open(data, "w") as f:
        for r in records(64, seed=11):
            f.write(json.dumps(r) + "\n")
    trained = str(tmp_path_factory.mktemp("model") / "trained")
    memtune.run("train", "--model_name_or_path", d, "--train_file", data, "--output_dir", trained,
                "--tuner_type", "full", "--max_steps", "40", "--learning_rate", "1e-2", "--warmup_steps", "4",
                "--per_device_train_batch_size", "8", "--save_strategy", "no", "--logging_steps", "40",
                capture=True)
    return trained


def records(n, seed):
    """Pre-tokenized examples: a prompt whose labels are -100, then an answer that starts with a
    label word (the prompt's first id's parity) and goes on in a chain a model can learn; lengths
    differ so batches are padded."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(100, 5000, size=int(rng.integers(4, 12))).tolist()
        chain = [int(rng.integers(100, 150))]
        for _ in range(int(rng.integers(2, 8))):
            chain.append(100 + (chain[-1] * 7 + 3) % 50)
        answer = [LABEL_WORDS[prompt[0] % 2]] + chain
        out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return out


# The user's own functions, written for transformers.Trainer (torch in preprocess, numpy after).
def argmax_logits(logits, labels):
    return logits.argmax(dim=-1)


def token_accuracy(eval_pred):
    preds, labels = eval_pred
    preds, labels = preds[:, :-1], labels[:, 1:]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


def label_word_logits(logits, labels):
    return logits[..., LABEL_WORDS]


def classify_first_answer_token(eval_pred):
    scores, labels = eval_pred
    hits = total = 0
    for s, l in zip(scores, labels):
        t = int(np.argmax(l != -100))  # the answer's first token: its prediction is made at t - 1
        want = LABEL_WORDS.index(int(l[t]))
        hits += int(np.argmax(s[t - 1]) == want)
        total += 1
    return {"label_accuracy": hits / total}


class BatchAccuracy:
    """Trainer's batch_eval_metrics protocol: counts per batch, the result at compute_result."""

    def __init__(self):
        self.hits = self.total = 0

    def __call__(self, eval_pred, compute_result):
        preds, labels = eval_pred
        preds, labels = preds[:, :-1], labels[:, 1:]
        mask = labels != -100
        self.hits += int((preds[mask] == labels[mask]).sum())
        self.total += int(mask.sum())
        if compute_result:
            result = {"accuracy": self.hits / self.total}
            self.hits = self.total = 0
            return result
        return {}


def near_ties(model_dir, data, among=None, margin=1e-4):
    """Target positions whose top two logits (over the vocabulary, or over `among`) differ by less
    than `margin` relative to their scale, by transformers' forward; and how many positions count
    (every target, or with `among` one per sequence: the answer's first)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ties = count = 0
    with torch.no_grad():
        for r in data:
            logits = model(torch.tensor([r["input_ids"]])).logits[0]
            labels = r["labels"]
            rows = [t - 1 for t in range(1, len(labels)) if labels[t] != -100]
            if among is not None:
                rows = rows[:1]
                logits = logits[:, among]
            for t in rows:
                top = torch.topk(logits[t], 2).values
                ties += int(float(top[0] - top[1]) <= margin * max(1.0, float(top[0].abs())))
                count += 1
    return ties, count


def hf_evaluate(model_dir, data, compute_metrics, preprocess, batch_eval_metrics=False, tmp=None):
    import torch
    import transformers

    def collate(batch):
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long)
        labels = torch.full((len(batch), n), -100, dtype=torch.long)
        mask = torch.zeros(len(batch), n, dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
            labels[i, : len(b["labels"])] = torch.tensor(b["labels"])
            mask[i, : len(b["input_ids"])] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                              attn_implementation="eager")
    args = transformers.TrainingArguments(output_dir=str(tmp), per_device_eval_batch_size=4, report_to="none",
                                          batch_eval_metrics=batch_eval_metrics, use_cpu=True,
                                          remove_unused_columns=False, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=data, data_collator=collate,
                                   compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess)
    return trainer.evaluate()


def memtune_evaluate(model_dir, data, compute_metrics, preprocess=None, batch_eval_metrics=False, **kw):
    args = memtune.TrainingArguments(output_dir="unused", per_device_eval_batch_size=4,
                                     batch_eval_metrics=batch_eval_metrics)
    trainer = memtune.Trainer(model=model_dir, args=args, eval_dataset=data, compute_metrics=compute_metrics,
                              preprocess_logits_for_metrics=preprocess, **kw)
    return trainer.evaluate()


@pytest.mark.parametrize("case", ["token_accuracy", "perplexity", "classification", "batch_eval_metrics"])
def test_the_users_own_metrics_give_transformers_values(model_dir, tmp_path, case):
    data = records(12, seed=1)
    if case == "token_accuracy":
        hf = hf_evaluate(model_dir, data, token_accuracy, argmax_logits, tmp=tmp_path)
        mt = memtune_evaluate(model_dir, data, token_accuracy, argmax_logits)
        key = "eval_accuracy"
    elif case == "perplexity":
        import torch

        def label_logprob(logits, labels):  # transformers' side: the next token's log-prob
            lp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
            nxt = labels[:, 1:].clamp(min=0)
            out = torch.full(labels.shape, -100.0)
            out[:, :-1] = lp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
            return out

        def perplexity(eval_pred):
            logprob, labels = eval_pred
            mask = labels[:, 1:] != -100
            return {"perplexity": float(np.exp(-logprob[:, :-1][mask].mean()))}

        hf = hf_evaluate(model_dir, data, perplexity, label_logprob, tmp=tmp_path)
        mt = memtune_evaluate(model_dir, data, perplexity, predictions="label_logprob")
        key = "eval_perplexity"
        # memtune's eval_loss is the token mean over the eval set (Trainer's, a mean of batch means,
        # differs), so the user's perplexity of the label log-probs is exp(eval_loss).
        assert mt[key] == pytest.approx(math.exp(mt["eval_loss"]), rel=1e-5)
    elif case == "classification":
        hf = hf_evaluate(model_dir, data, classify_first_answer_token, label_word_logits, tmp=tmp_path)
        mt = memtune_evaluate(model_dir, data, classify_first_answer_token, label_word_logits)
        key = "eval_label_accuracy"
    else:
        hf = hf_evaluate(model_dir, data, BatchAccuracy(), argmax_logits, batch_eval_metrics=True, tmp=tmp_path)
        mt = memtune_evaluate(model_dir, data, BatchAccuracy(), batch_eval_metrics=True)
        key = "eval_accuracy"
        assert mt[key] == memtune_evaluate(model_dir, data, token_accuracy)[key]
    if case == "perplexity":
        assert mt[key] == pytest.approx(hf[key], rel=1e-5), (mt, hf)
    else:
        # Counts agree exactly, except at rows whose best two candidates are within float32
        # rounding of each other, where two correct implementations may pick either.
        ties, count = near_ties(model_dir, data, LABEL_WORDS if case == "classification" else None)
        assert abs(mt[key] - hf[key]) * count <= ties + 1e-9, (mt, hf, ties)
    assert 0 < mt[key]


def test_predict_lays_out_predictions_as_trainer(model_dir):
    data = records(6, seed=2)
    trainer = memtune.Trainer(model=model_dir, args=memtune.TrainingArguments(per_device_eval_batch_size=4),
                              predictions=("top_k", 3))
    out = trainer.predict(data)
    longest = max(len(r["input_ids"]) for r in data)
    assert out.predictions.shape == (6, longest, 3, 2)
    assert out.label_ids.shape == (6, longest)
    for i, r in enumerate(data):
        labels = np.array(r["labels"])
        np.testing.assert_array_equal(out.label_ids[i, : len(labels)], labels)
        has_target = np.append(labels[1:] != -100, False)
        assert (out.predictions[i, : len(labels)][~has_target] == -100).all()
        top = out.predictions[i, : len(labels)][has_target]
        assert (np.diff(top[:, :, 1], axis=1) <= 0).all()  # log-probs best first
        assert (top[:, :, 1] < 0).all()
    assert "test_loss" in out.metrics and "test_runtime" in out.metrics


class Recorder(memtune.TrainerCallback):
    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("step", state.global_step))
        if self.stop_at and state.global_step >= self.stop_at:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kw):
        self.events.append(("log", dict(logs)))

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self.events.append(("evaluate", dict(metrics)))

    def on_save(self, args, state, control, **kw):
        self.events.append(("save", kw["checkpoint"]))


def test_train_with_evaluation_callbacks_and_checkpoints(model_dir, tmp_path):
    out = str(tmp_path / "run")
    args = memtune.TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                                     logging_steps=1, eval_strategy="steps", eval_steps=2, save_steps=2,
                                     disable_tqdm=True, metric_for_best_model="accuracy")
    recorder = Recorder()
    trainer = memtune.Trainer(model=model_dir, args=args, train_dataset=records(16, seed=3),
                              eval_dataset=records(8, seed=4), compute_metrics=token_accuracy,
                              preprocess_logits_for_metrics=argmax_logits, callbacks=[recorder])
    result = trainer.train()
    assert result.global_step == 4 and math.isfinite(result.training_loss)
    assert [e[1] for e in recorder.events if e[0] == "step"] == [1, 2, 3, 4]
    evals = [e[1] for e in recorder.events if e[0] == "evaluate"]
    assert len(evals) == 2 and all(0 <= m["eval_accuracy"] <= 1 for m in evals)
    assert [os.path.basename(e[1]) for e in recorder.events if e[0] == "save"] == ["checkpoint-2", "checkpoint-4"]
    losses = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4]
    assert trainer.state.best_metric == max(m["eval_accuracy"] for m in evals)
    # evaluate() after train() evaluates the trained model: the last evaluation's value again.
    assert trainer.evaluate()["eval_accuracy"] == pytest.approx(evals[-1]["eval_accuracy"], abs=1e-12)
    saved = str(tmp_path / "saved")
    trainer.save_model(saved)
    assert os.path.isfile(os.path.join(saved, "model.safetensors"))
    assert os.path.isfile(os.path.join(saved, "tokenizer.json"))


def test_lora_resume_and_should_training_stop(model_dir, tmp_path):
    out = str(tmp_path / "lora")
    args = {"output_dir": out, "max_steps": 4, "per_device_train_batch_size": 4, "logging_steps": 1,
            "save_steps": 2, "learning_rate": 1e-3, "disable_tqdm": True}
    trainer = memtune.Trainer(model=model_dir, args=args, train_dataset=records(16, seed=5),
                              peft_config={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                              callbacks=[Recorder(stop_at=2)])
    assert trainer.train().global_step == 2
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4
    again = memtune.Trainer(model=model_dir, args=args, train_dataset=records(16, seed=5),
                            peft_config={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    assert again.train(resume_from_checkpoint=True).global_step == 4
    assert [r["step"] for r in again.state.log_history if "loss" in r] == [1, 2, 3, 4]


def test_bad_input_raises_naming_it_and_writes_nothing(model_dir, tmp_path):
    out = tmp_path / "never"
    no_targets = [{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}] * 4
    with pytest.raises(memtune.MemtuneError, match="no example with a trainable token"):
        memtune.Trainer(model=model_dir, args=memtune.TrainingArguments(output_dir=str(out), disable_tqdm=True),
                        train_dataset=no_targets).train()
    assert not out.exists()
    with pytest.raises(memtune.MemtuneError, match="no_such_argument"):
        memtune.Trainer(model=model_dir, args={"output_dir": str(out), "no_such_argument": 1},
                        train_dataset=records(4, seed=6)).train()
    assert not out.exists()
    with pytest.raises(TypeError, match="args"):
        memtune.Trainer(model=model_dir, args=3)
    with pytest.raises(TypeError, match=r"train_dataset\[0\]"):
        memtune.Trainer(model=model_dir, args={"output_dir": str(out)}, train_dataset=[[1, 2]]).train()
    with pytest.raises(FileNotFoundError, match="model"):
        memtune.Trainer(model=str(tmp_path / "nothing"))

    def failing(eval_pred):
        raise ZeroDivisionError("the user's metric failed")

    with pytest.raises(ZeroDivisionError, match="the user's metric failed") as raised:
        memtune_evaluate(model_dir, records(4, seed=7), failing)
    assert any(entry.name == "failing" for entry in raised.traceback)

    kept = []

    def keeps_chunk(logits, labels):  # the chunk is the engine's memory, reused after the call
        kept.append(logits)
        return logits.argmax(-1)

    with pytest.raises(memtune.MemtuneError, match="kept a reference"):
        memtune_evaluate(model_dir, records(4, seed=7), token_accuracy, keeps_chunk)


def test_transformers_training_arguments_are_accepted(model_dir, tmp_path):
    import transformers

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=4,
                                          logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                                          disable_tqdm=True)
    trainer = memtune.Trainer(model=model_dir, args=args, train_dataset=records(8, seed=8))
    assert trainer.train().global_step == 2


def test_plan_and_generate(model_dir):
    bill = memtune.plan(model_name_or_path=model_dir, per_device_train_batch_size=2, max_length=64, tuner_type="full")
    assert isinstance(bill, dict) and bill
    text = json.dumps(bill)
    assert "peak" in text
    # What compute_metrics' default protocol keeps: an int64 prediction and label per position.
    assert bill["python_eval_predictions_bytes_accumulated"] == 16 * 1000 * 64  # --eval_sequences 1000
    assert bill["hf_eval_logits_bytes_accumulated"] == 4 * 1000 * 64 * VOCAB
    out = memtune.Model(model_dir).generate([[9707, 11, 1879]], max_new_tokens=5, temperature=0, ignore_eos=True)
    assert len(out) == 1 and len(out[0]["token_ids"]) == 5
    again = memtune.generate(model_dir, [[9707, 11, 1879]], max_new_tokens=5, temperature=0, ignore_eos=True)
    assert again[0]["token_ids"] == out[0]["token_ids"]


class Raiser(memtune.TrainerCallback):
    def __init__(self, at, what):
        self.at, self.what = at, what

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            if self.what == "sigint":
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the terminal sends it
            else:
                raise RuntimeError(f"the user's callback failed at step {state.global_step}")


@pytest.mark.parametrize("what", ["sigint", "exception"])
def test_ctrl_c_and_a_failing_callback_stop_training_cleanly(model_dir, tmp_path, what):
    out = tmp_path / "stopped"
    args = memtune.TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=4,
                                     logging_steps=1, save_steps=2, disable_tqdm=True)
    trainer = memtune.Trainer(model=model_dir, args=args, train_dataset=records(16, seed=9),
                              callbacks=[Raiser(3, what)])
    expected = KeyboardInterrupt if what == "sigint" else RuntimeError
    with pytest.raises(expected) as raised:
        trainer.train()
    names = sorted(p.name for p in out.iterdir())
    assert not any(n.startswith("tmp-checkpoint") for n in names), names
    assert not (out / "model.safetensors").exists()  # no final model for an unfinished run
    if what == "sigint":
        # Training's own handler saw it: the step ended, a checkpoint was saved to resume from.
        assert "checkpoint-3" in names and (out / "checkpoint-3" / "trainer_state.json").exists()
        assert "resume_from_checkpoint" in str(raised.value)
    else:
        assert "checkpoint-2" in names and "checkpoint-3" not in names
        assert any(entry.name == "on_step_end" for entry in raised.traceback)


def test_a_mixture_of_experts_trains_lora_on_its_experts(tmp_path):
    """Qwen3-MoE through Trainer's API: LoRA on every expert's projections (PEFT's module names),
    transformers' auxiliary loss on, evaluation with the user's own metric."""
    tokenizer = os.environ.get("MEMTUNE_TOKENIZER_DIR")
    if not tokenizer:
        if os.environ.get("MEMTUNE_REQUIRE_ALL_TESTS") == "1":
            pytest.fail("MEMTUNE_TOKENIZER_DIR is not set (scripts/prepare-tokenizer.sh prints it)")
        pytest.skip("MEMTUNE_TOKENIZER_DIR is not set")
    d = str(tmp_path / "moe")
    memtune.run("init-model", "--preset", "tiny-qwen3-moe", "--out", d, "--seed", "4", "--set", f"vocab_size={VOCAB}",
                "--set", "output_router_logits=true", "--set", "router_aux_loss_coef=0.05", capture=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer, name), d)
    out = str(tmp_path / "run")
    args = memtune.TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                                     logging_steps=1, save_strategy="no", disable_tqdm=True)
    trainer = memtune.Trainer(model=d, args=args, train_dataset=records(12, seed=6), eval_dataset=records(4, seed=7),
                              compute_metrics=token_accuracy, preprocess_logits_for_metrics=argmax_logits,
                              peft_config={"r": 4, "lora_alpha": 8,
                                           "target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"]})
    result = trainer.train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)
    metrics = trainer.evaluate()
    assert 0 <= metrics["eval_accuracy"] <= 1 and math.isfinite(metrics["eval_loss"])
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert sorted(json.load(f)["target_modules"]) == ["down_proj", "gate_proj", "q_proj", "up_proj"]
    from safetensors.numpy import load_file
    names = load_file(os.path.join(out, "adapter_model.safetensors")).keys()
    assert any(".mlp.experts.7.down_proj.lora_B." in n for n in names)
