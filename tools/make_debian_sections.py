#!/usr/bin/env python3
"""Builds a text classification dataset (package description -> Debian section) from the apt
metadata of this machine: `train.jsonl` and `eval.jsonl` with one {"text": ..., "label": ...}
object per line.

Input: the stanzas of `apt-cache dumpavail` (run here, or read from --input FILE). apt's
Packages indices carry only the short description plus a Description-md5; the long descriptions
live in the Translation-en indices, which are merged in by that md5: found through
`apt-get indextargets` and decompressed with `apt-helper cat-file`, or given with --translations.
A Docker image usually has `Acquire::Languages "none"`, so fetch them first, e.g. into a private
lists directory that leaves the system's untouched:

  mkdir -p /tmp/aptlists/partial
  apt-get update -o Dir::State::Lists=/tmp/aptlists -o Acquire::Languages=en \\
      -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=
  tools/make_debian_sections.py --apt_opt Dir::State::Lists=/tmp/aptlists \\
      --apt_opt Acquire::Languages=en --apt_opt Dir::Cache::pkgcache= \\
      --apt_opt Dir::Cache::srcpkgcache=

text  = short description + "\\n" + long description (lines unindented, " ." -> empty line,
        runs of blanks collapsed), cut at a word boundary to at most --max_chars characters.
label = the Section with any archive-area prefix removed ("contrib/utils" -> "utils").

Cleaning: one stanza per package (the first in (Package, Version, Section, Description) order);
descriptions mentioning "transitional package" or "dummy package" are dropped, and so is every
package whose final text equals another package's text. The --num_classes most common labels
are kept. Those packages, sorted by name, are shuffled with random.Random(--seed); in that order
each class fills eval up to --eval_per_class, then train up to --train_per_class, so no package
is in both. Each split is shuffled once more by the same generator (classes interleaved) and
written through a temporary file and a rename.

Standard library only; exits non-zero with a message when apt-cache is missing or fails, or
when fewer than --num_classes sections remain."""
import argparse
import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

DROP_PHRASES = ("transitional package", "dummy package")
APT_HELPER = "/usr/lib/apt/apt-helper"


class Failure(Exception):
    pass


def parse_stanzas(text):
    """Yields one dict per RFC822-style stanza: field name (as written) -> list of lines, the
    first being the value after "Name:" (stripped), the rest the raw continuation lines."""
    fields = {}
    last = None
    for line in text.splitlines():
        if not line.strip():
            if fields:
                yield fields
            fields, last = {}, None
        elif line[0] in " \t":
            if last is not None:
                fields[last].append(line)
        else:
            name, sep, value = line.partition(":")
            if not sep:  # not a field line; ignore it rather than guess
                last = None
                continue
            last = name.strip()
            fields[last] = [value.strip()]
    if fields:
        yield fields


def value(stanza, name):
    lines = stanza.get(name)
    return lines[0] if lines else ""


def description_lines(stanza):
    """The description of a stanza as (short, [continuation lines]); Description-en wins over
    Description when both are present (apt-cache show writes Description-en)."""
    for name in ("Description-en", "Description"):
        if name in stanza:
            lines = stanza[name]
            return lines[0], lines[1:]
    return "", []


def tidy_text(short, continuation):
    out = [short]
    for raw in continuation:
        line = raw.strip()
        out.append("" if line == "." else line)
    tidied = []
    for line in out:
        line = re.sub(r"\s+", " ", line).strip()
        if not line and (not tidied or not tidied[-1]):
            continue  # no leading or repeated empty lines
        tidied.append(line)
    while tidied and not tidied[-1]:
        tidied.pop()
    return "\n".join(tidied)


def truncate(text, max_chars):
    if len(text) <= max_chars:
        return text
    cut = text[: max_chars + 1]
    at = max(cut.rfind(" "), cut.rfind("\n"))
    if at < max_chars // 2:  # one enormous word: cut it
        return text[:max_chars].rstrip()
    text = text[:at].rstrip()
    # a cut list leaves a dangling bullet ("...\n*"): drop trailing tokens without a letter/digit
    while True:
        head, _, last = text.rpartition(" " if text.rfind(" ") > text.rfind("\n") else "\n")
        if not head or any(c.isalnum() for c in last):
            return text
        text = head.rstrip()


def clean_label(section):
    return section.strip().split("/")[-1].strip().lower()


def apt_command(tool, apt_opts):
    cmd = [tool]
    for opt in apt_opts:
        cmd += ["-o", opt]
    return cmd


def run_text(cmd, what):
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        raise Failure(f"{what}: cannot run {cmd[0]}: {e}")
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip()
        raise Failure(f"{what}: `{' '.join(cmd)}` exited with status {proc.returncode}"
                      + (f": {err}" if err else ""))
    return proc.stdout.decode("utf-8", "replace")


def read_file(path):
    if path == "-":
        return sys.stdin.buffer.read().decode("utf-8", "replace")
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")


def dumpavail(apt_opts):
    tool = shutil.which("apt-cache")
    if tool is None:
        raise Failure("apt-cache not found: this needs a Debian/Ubuntu machine with apt, "
                      "or an `apt-cache dumpavail` output given with --input FILE")
    return run_text(apt_command(tool, apt_opts) + ["dumpavail"], "apt-cache dumpavail")


def system_translations(apt_opts):
    """Texts of the English Translation indices apt knows about (empty when none are there)."""
    tool = shutil.which("apt-get")
    if tool is None:
        return []
    listing = run_text(apt_command(tool, apt_opts) + [
        "indextargets", "--format", "$(FILENAME)", "Created-By: Translations", "Language: en"],
        "apt-get indextargets")
    texts = []
    for path in sorted(p for p in listing.splitlines() if p.strip()):
        if not os.path.exists(path):
            continue
        if os.access(APT_HELPER, os.X_OK):
            texts.append(run_text([APT_HELPER, "cat-file", path], "apt-helper cat-file"))
        elif path.endswith((".gz", ".xz", ".bz2")) or "." not in os.path.basename(path):
            import bz2, gzip, lzma
            opener = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}.get(
                os.path.splitext(path)[1], open)
            with opener(path, "rb") as f:
                texts.append(f.read().decode("utf-8", "replace"))
        else:
            print(f"warning: cannot decompress {path} without {APT_HELPER}", file=sys.stderr)
    return texts


def long_descriptions(texts):
    """Description-md5 -> (short, continuation lines) from Translation-style stanzas."""
    table = {}
    for text in texts:
        for st in parse_stanzas(text):
            md5 = value(st, "Description-md5")
            short, cont = description_lines(st)
            if md5 and cont and md5 not in table:
                table[md5] = (short, cont)
    return table


def build_records(stanzas, translations, max_chars):
    stats = collections.Counter()
    best = {}
    for st in stanzas:
        pkg = value(st, "Package")
        if not pkg:
            continue
        stats["stanzas"] += 1
        short, cont = description_lines(st)
        key = (pkg, value(st, "Version"), value(st, "Section"), short)
        if pkg not in best or key < best[pkg][0]:
            best[pkg] = (key, st)
    stats["packages"] = len(best)

    records = []
    for pkg in sorted(best):
        st = best[pkg][1]
        label = clean_label(value(st, "Section"))
        short, cont = description_lines(st)
        if not cont:
            found = translations.get(value(st, "Description-md5"))
            if found:
                short, cont = found
        if not label or not short:
            stats["no section or description"] += 1
            continue
        full = tidy_text(short, cont)
        if any(p in full.lower() for p in DROP_PHRASES):
            stats["transitional/dummy"] += 1
            continue
        records.append({"package": pkg, "text": truncate(full, max_chars), "label": label,
                        "long": bool(cont)})

    by_text = collections.Counter(r["text"] for r in records)
    unique = [r for r in records if by_text[r["text"]] == 1]
    stats["duplicate text"] = len(records) - len(unique)
    stats["with long description"] = sum(r["long"] for r in unique)
    return unique, stats


def write_jsonl_atomic(path, rows):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for r in rows:
                f.write(json.dumps({"text": r["text"], "label": r["label"]},
                                   ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def majority(rows):
    if not rows:
        return 0.0, ""
    label, n = sorted(collections.Counter(r["label"] for r in rows).items(),
                      key=lambda kv: (-kv[1], kv[0]))[0]
    return n / len(rows), label


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", metavar="FILE",
                   help="`apt-cache dumpavail` (or Packages/`apt-cache show`) output to read "
                        "instead of running apt-cache; '-' reads standard input")
    p.add_argument("--translations", metavar="FILE", action="append", default=[],
                   help="uncompressed Translation-en file(s) with the long descriptions "
                        "(repeatable; default: the ones apt has, unless --input is given)")
    p.add_argument("--no_translations", "--no-translations", action="store_true",
                   help="do not look up long descriptions in apt's Translation indices")
    p.add_argument("--apt_opt", "--apt-opt", metavar="NAME=VALUE", action="append", default=[],
                   help="passed to apt-cache/apt-get as `-o NAME=VALUE` (repeatable)")
    p.add_argument("--out", default="examples/debian-sections", help="output directory")
    p.add_argument("--num_classes", "--num-classes", type=int, default=12,
                   help="keep this many most common sections (default 12)")
    p.add_argument("--train_per_class", "--train-per-class", type=int, default=300,
                   help="at most this many train examples per class (default 300)")
    p.add_argument("--eval_per_class", "--eval-per-class", type=int, default=40,
                   help="at most this many eval examples per class, filled first (default 40)")
    p.add_argument("--max_chars", "--max-chars", type=int, default=600,
                   help="cut each text at a word boundary to at most this many characters")
    p.add_argument("--min_long_fraction", "--min-long-fraction", type=float, default=0.5,
                   help="fail when fewer kept packages than this have a long description "
                        "(0 allows short descriptions only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split shuffle (default 0)")
    args = p.parse_args(argv)

    try:
        if args.num_classes < 1 or args.train_per_class < 0 or args.eval_per_class < 0:
            raise Failure("--num_classes must be >= 1 and the per-class caps >= 0")
        if args.max_chars < 20:
            raise Failure("--max_chars must be at least 20")
        source = read_file(args.input) if args.input else dumpavail(args.apt_opt)
        stanzas = list(parse_stanzas(source))
        if not stanzas:
            raise Failure("no package stanzas in " + (args.input or "`apt-cache dumpavail`"))
        trans_texts = [read_file(t) for t in args.translations]
        if not args.translations and not args.input and not args.no_translations:
            trans_texts = system_translations(args.apt_opt)
        translations = long_descriptions(trans_texts)

        records, stats = build_records(stanzas, translations, args.max_chars)
        long_fraction = stats["with long description"] / max(1, len(records))
        if long_fraction < args.min_long_fraction:
            raise Failure(
                f"only {long_fraction:.1%} of the packages have a long description "
                f"({len(translations)} from Translation indices). apt has no English "
                "Translation indices here (Acquire::Languages \"none\"?); fetch them as in "
                "--help, give them with --translations, or pass --min_long_fraction 0")

        counts = collections.Counter(r["label"] for r in records)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if len(ranked) < args.num_classes:
            raise Failure(f"only {len(ranked)} sections after cleaning, need "
                          f"{args.num_classes}: the apt lists look incomplete (run apt-get "
                          "update, or lower --num_classes)")
        classes = [label for label, _ in ranked[: args.num_classes]]
        keep = set(classes)

        pool = sorted((r for r in records if r["label"] in keep), key=lambda r: r["package"])
        rng = random.Random(args.seed)
        rng.shuffle(pool)
        train, evals = [], []
        n_train, n_eval = collections.Counter(), collections.Counter()
        for r in pool:
            if n_eval[r["label"]] < args.eval_per_class:
                evals.append(r)
                n_eval[r["label"]] += 1
            elif n_train[r["label"]] < args.train_per_class:
                train.append(r)
                n_train[r["label"]] += 1
        # Frequent classes fill their eval quota first, so the fill order is not mixed by
        # class; shuffle each split again so that any prefix of a file is mixed.
        rng.shuffle(train)
        rng.shuffle(evals)

        os.makedirs(args.out, exist_ok=True)
        train_path = os.path.join(args.out, "train.jsonl")
        eval_path = os.path.join(args.out, "eval.jsonl")
        write_jsonl_atomic(train_path, train)
        write_jsonl_atomic(eval_path, evals)
    except Failure as e:
        print(f"make_debian_sections: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"make_debian_sections: error: {e}", file=sys.stderr)
        return 1

    print(f"stanzas {stats['stanzas']}, packages {stats['packages']}, long descriptions "
          f"from Translation indices {len(translations)}")
    print(f"dropped: transitional/dummy {stats['transitional/dummy']}, duplicate text "
          f"{stats['duplicate text']}, no section or description "
          f"{stats['no section or description']}; kept {len(records)} in {len(counts)} sections "
          f"({stats['with long description']} with a long description)")
    print(f"{'label':<14}{'available':>10}{'train':>8}{'eval':>7}")
    short = []
    for label in classes:
        print(f"{label:<14}{counts[label]:>10}{n_train[label]:>8}{n_eval[label]:>7}")
        if n_train[label] < args.train_per_class or n_eval[label] < args.eval_per_class:
            short.append(label)
    print(f"{'total':<14}{sum(counts[c] for c in classes):>10}{len(train):>8}{len(evals):>7}")
    for name, rows, path in (("train", train, train_path), ("eval", evals, eval_path)):
        frac, label = majority(rows)
        print(f"{name}: {len(rows)} examples, {os.path.getsize(path)} bytes -> {path}; "
              f"majority baseline {frac:.4f} ({label})")
    if short:
        m = min(counts[c] for c in classes)
        total = args.train_per_class + args.eval_per_class
        e = min(args.eval_per_class, m * args.eval_per_class // max(1, total))
        print("warning: below the per-class caps: " + ", ".join(short) + "; for equal counts "
              f"use e.g. --train_per_class {min(args.train_per_class, m - e)} "
              f"--eval_per_class {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
