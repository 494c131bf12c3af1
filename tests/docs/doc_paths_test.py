#!/usr/bin/python3
"""Every repository path README.md and docs/*.md cite exists.

A cited path is a word with a slash whose first component is a top-level entry of the repository
(src/, tests/, scripts/, bench/, docs/, tools/, fuzz/, examples/, cmake/, .ci/, ...), in prose,
in code blocks and in the Layout block alike, with or without a trailing slash. A path whose first
component is not such an entry is not a repository path and is not checked: run outputs (out/,
build/, build-fuzz/), paths relative to src/ (model/config.h), absolute paths, URLs.

A cited path passes when it exists as written (a trailing slash: as a directory). Otherwise, when it
has a pattern, it passes when the pattern matches something: `*` and `?` glob, `{a,b}` expands,
a placeholder (`<target>`, or a word in capitals such as NAME in NAME-DATE.json) matches any name,
and an ellipsis (`...`, `…`) ends the path: what comes before it must exist.

Exits 1 listing every missing path with the file and line that cite it. Before scanning, the check
proves itself on a temporary markdown file that cites one existing and one missing path
(--self-test runs only that).

A style rule of the tests rides along: no test under tests/ takes the largest difference as
std::max(worst, std::abs(a - b)) (or Python's max(worst, abs(a - b))), which keeps `worst` when the
difference is NaN, so a kernel that writes NaN would pass; tests/support/numeric.h and numeric.py
compare instead. It proves itself on known lines first too."""
import argparse
import fnmatch
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A word that may be a path: path characters, and {a,b} groups (commas only inside braces).
WORD = re.compile(r"(?:[A-Za-z0-9_.\-/*?<>…@+~]|\{[^{}\s]*\})+")
TRAILING = ".,;:!?'\"`"
PLACEHOLDER = re.compile(r"<[^<>/]*>|\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*\b")


def top_level_entries(root):
    """The repository's top-level names: what git tracks or would track (ignored run outputs such
    as out/ and build/ are not among them); without git, the directory's entries less those the
    root .gitignore names."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, text=True, check=True).stdout.splitlines()
        if listed:
            return {line.split("/", 1)[0] for line in listed if line}
    except (OSError, subprocess.CalledProcessError):
        pass
    ignored = []
    gitignore = os.path.join(root, ".gitignore")
    if os.path.exists(gitignore):
        with open(gitignore, encoding="utf-8") as f:
            ignored = [line.strip().strip("/") for line in f if line.strip().startswith("/")]
    return {name for name in os.listdir(root)
            if name != ".git" and not any(fnmatch.fnmatch(name, pattern) for pattern in ignored)}


def expand_braces(path):
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    out = []
    for alternative in m.group(1).split(","):
        out.extend(expand_braces(path[:m.start()] + alternative + path[m.end():]))
    return out


def exists(root, path):
    """Whether the cited path (relative to root) names something in the repository."""
    def present(p):
        full = os.path.join(root, p)
        return os.path.isdir(full) if p.endswith("/") else os.path.exists(full)

    if present(path):
        return True
    # An ellipsis ends the path: the part before it must exist.
    for mark in ("...", "…"):
        if mark in path:
            head = path[:path.index(mark)]
            head = head[:head.rfind("/") + 1]
            return bool(head) and present(head)
    candidates = expand_braces(path)
    has_pattern = len(candidates) > 1 or any(c in path for c in "*?") or PLACEHOLDER.search(path)
    if not has_pattern:
        return False
    for candidate in candidates:
        pattern = PLACEHOLDER.sub("*", candidate)
        matches = glob.glob(os.path.join(glob.escape(root), pattern), recursive=True)
        if pattern.endswith("/"):
            matches = [m for m in matches if os.path.isdir(m)]
        if matches:
            return True
    return False


def cited_paths(line, entries):
    """The repository paths one line of markdown cites."""
    for m in WORD.finditer(line):
        word = m.group(0).lstrip("(<[")
        while word and word[-1] in TRAILING and not word.endswith(("...", "…")):
            word = word[:-1]
        word = re.sub(r":\d+$", "", word)  # path:line
        if word.startswith("./"):
            word = word[2:]
        if "/" not in word:
            continue
        first = word.split("/", 1)[0]
        if first in entries:
            yield word


def scan(root, files, entries):
    """[(file, line number, path)] for every cited path that does not exist."""
    missing = []
    for name in files:
        with open(name, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                for path in cited_paths(line, entries):
                    if not exists(root, path):
                        missing.append((os.path.relpath(name, root), number, path))
    return missing


def documents(root):
    docs = os.path.join(root, "docs")
    return [os.path.join(root, "README.md")] + sorted(
        os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md"))


def self_test(root, entries):
    """The check on a markdown file with known answers: it must report exactly the missing path,
    on its line."""
    this = os.path.relpath(os.path.abspath(__file__), root)
    lines = [
        "# a page",
        f"This check is `{this}`, next to tests/docs/.",  # exists, with and without a trailing slash
        "It cites src/no_such_folder/missing.cpp, which does not exist.",  # line 3: the one to report
        "Run outputs such as out/demo/run/report.html and build/x are not repository paths.",
        "Patterns: tests/*/, tests/<suite>/, tests/{docs,core}/, tests/... and docs/NAME.md.",
    ]
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "page.md")
        with open(page, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        found = [(number, path) for _, number, path in scan(root, [page], entries)]
    if found != [(3, "src/no_such_folder/missing.cpp")]:
        problems.append(f"expected exactly the missing path on line 3 to be reported, got {found}")
    if "src" not in entries or "out" in entries or "build" in entries:
        problems.append(f"top-level entries should hold src/ and not out/ or build/: {sorted(entries)}")
    if problems:
        sys.exit("doc_paths self-test failed:\n  " + "\n  ".join(problems))
    print("doc_paths self-test: the missing path was reported, the existing ones and run outputs were not")


# The largest difference kept with max(), which drops NaN: C++ std::max(x, std::abs(a - b)) and
# Python max(x, abs(a - b)).
NAN_DROPPING_MAX = re.compile(r"std::max\s*\(\s*\w+\s*,\s*(?:std::)?f?abs\s*\([^;]*-"
                              r"|(?:^|[^\w.])max\(\s*\w+\s*,\s*(?:abs|np\.abs|math\.fabs)\([^)]*-")


def nan_dropping_maxes(lines):
    """(line number, line) of every line that keeps a largest difference with max()."""
    return [(n, line.strip()) for n, line in enumerate(lines, 1) if NAN_DROPPING_MAX.search(line)]


def check_tests_style(root):
    known = ["worst = std::max(worst, std::abs(s - out[i]));",  # 1: reported
             "scale = std::max(scale, std::abs(z[v]));",  # a largest value, not a difference
             "    worst = max(worst, abs(got - want))",  # 3: reported
             "EXPECT_NEAR(g, fd, 2e-3 * std::max(1.0, std::abs(fd)));"]
    if [n for n, _ in nan_dropping_maxes(known)] != [1, 3]:
        sys.exit(f"tests style self-test failed: {nan_dropping_maxes(known)}")
    found = []
    for folder, _, names in os.walk(os.path.join(root, "tests")):
        for name in sorted(names):
            if not name.endswith((".cpp", ".h", ".py")) or name == os.path.basename(__file__):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                found += [(os.path.relpath(path, root), n, line) for n, line in nan_dropping_maxes(f)]
    for path, n, line in found:
        print(f"{path}:{n}: a largest difference kept with max() drops NaN (use tests/support/numeric): {line}",
              file=sys.stderr)
    if found:
        sys.exit(f"{len(found)} NaN-dropping max() in tests/")
    print("tests style: no largest difference kept with max() in tests/")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--self-test", action="store_true", help="only check the check, on a temporary page")
    parser.add_argument("--root", default=ROOT, help="the repository (default: this file's)")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    entries = top_level_entries(root)
    self_test(root, entries)
    if args.self_test:
        return
    files = documents(root)
    missing = scan(root, files, entries)
    for name, number, path in missing:
        print(f"{name}:{number}: {path} does not exist", file=sys.stderr)
    if missing:
        sys.exit(f"{len(missing)} cited path(s) missing in {', '.join(os.path.relpath(f, root) for f in files)}")
    print(f"doc_paths: every repository path cited in {len(files)} files exists")
    check_tests_style(root)


if __name__ == "__main__":
    main()
