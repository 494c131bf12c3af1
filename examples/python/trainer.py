"""A Hugging Face Trainer script whose only change is its import (README's first Python example).

    python examples/python/trainer.py MODEL_DIR [OUTPUT_DIR]

MODEL_DIR is a Hugging Face model directory with its tokenizer (scripts/demo-model.sh makes the
demo's). It fine-tunes on Debian package descriptions (examples/debian-sections: text -> section)
and evaluates with the user's own metric, which sees argmax ids, never [batch, seq, vocab] logits.
"""

import json
import os
import sys

from memtune import Trainer, TrainingArguments  # was: from transformers import Trainer, TrainingArguments

here = os.path.dirname(os.path.abspath(__file__))
data = os.path.join(here, "..", "debian-sections")
model = sys.argv[1]
output_dir = sys.argv[2] if len(sys.argv) > 2 else "out/python-trainer"

with open(os.path.join(data, "eval.jsonl")) as f:
    eval_records = [json.loads(line) for line in f][:48]


def preprocess_logits_for_metrics(logits, labels):
    return logits.argmax(-1)


def compute_metrics(eval_pred):
    preds, labels = eval_pred
    preds, labels = preds[:, :-1], labels[:, 1:]
    mask = labels != -100
    return {"token_accuracy": float((preds[mask] == labels[mask]).mean())}


args = TrainingArguments(output_dir=output_dir, overwrite_output_dir=True, max_steps=40,
                         per_device_train_batch_size=8, learning_rate=2e-3, logging_steps=10,
                         eval_strategy="steps", eval_steps=20, save_strategy="no", max_length=256)
trainer = Trainer(model=model, args=args, train_dataset=os.path.join(data, "train.jsonl"),
                  eval_dataset=eval_records, compute_metrics=compute_metrics,
                  preprocess_logits_for_metrics=preprocess_logits_for_metrics)
trainer.train()
print(trainer.evaluate())
