#!/usr/bin/python3
"""docs/architecture.md's table of the vulkan backend's shaders lists every shader the build
embeds, names no shader that does not exist, and no shader is dead.

The build compiles and embeds every src/backend/vulkan/shaders/*.comp (CMakeLists.txt globs them;
cmake/embed_spirv.cmake turns them into the table the backend looks shaders up in by name), and
shaders/coopmat/*.comp where a compiler for cooperative matrices is at hand. The
shader table is the first markdown table under the heading "### The vulkan backend's shaders"; a
shader has a row when its file name (`NAME.comp`, in backticks) is in a row's first cell, and every
`NAME.comp` anywhere in the table must exist. A shader is alive when a C++ source under src/ looks
it up by name: passes "NAME" as the first argument of a function whose first parameter is `shader`
(ctx.dispatch, vulkan_geometry::elementwise, per_row, attention_dispatch, ...: the functions are
found by their declarations, so a new one counts without a change here), or of vulkan_shader, or
sets a dispatch's `.shader = "NAME"`. A name in any other string or in a comment does not count.

Exits 1 listing every problem. Before checking, the check proves itself on a made-up tree whose
page and sources hold one shader of each problem and shaders that pass (--self-test runs only
that)."""
import argparse
import glob
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = "docs/architecture.md"
SHADERS = "src/backend/vulkan/shaders"
HEADING = "### The vulkan backend's shaders"

SHADER_FILE = re.compile(r"`([A-Za-z0-9_]+)\.comp`")
# A function whose first parameter is the shader's name: `F(const char* shader`, `F(std::string_view shader`.
TAKES_SHADER = re.compile(
    r"\b([A-Za-z_][A-Za-z0-9_]*)\((?:const )?(?:char ?\*|std::string_view|std::string ?&) ?shader\b")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def embedded_shaders(root):
    """The names of the shaders the build embeds: every shaders/*.comp and shaders/coopmat/*.comp."""
    files = glob.glob(os.path.join(root, SHADERS, "*.comp")) + glob.glob(os.path.join(root, SHADERS, "coopmat", "*.comp"))
    return sorted(os.path.basename(p)[:-len(".comp")] for p in files)


def shader_table(root):
    """[(line number, names in the first cell, every name in the row)] of the page's shader table;
    None when the page has no table under the heading."""
    with open(os.path.join(root, PAGE), encoding="utf-8") as f:
        lines = f.read().split("\n")
    if HEADING not in lines:
        return None
    rows = []
    for number, line in enumerate(lines[lines.index(HEADING) + 1:], lines.index(HEADING) + 2):
        if line.startswith("|"):
            rows.append((number, line))
        elif rows or line.startswith("#"):
            break
    if len(rows) < 3:  # a header, its separator and at least one row
        return None
    table = []
    for number, line in rows[2:]:
        first = line.strip("|").split("|")[0]
        table.append((number, SHADER_FILE.findall(first), SHADER_FILE.findall(line)))
    return table


def looked_up_shaders(root):
    """The shader names the C++ sources under src/ look up, comments left out."""
    sources = []
    for ext in ("cpp", "h"):
        for path in sorted(glob.glob(os.path.join(root, "src", "**", f"*.{ext}"), recursive=True)):
            with open(path, encoding="utf-8") as f:
                sources.append(COMMENT.sub("", f.read()))
    functions = {"vulkan_shader"} | {name for code in sources for name in TAKES_SHADER.findall(code)}
    lookup = re.compile(r"(?:\b(?:" + "|".join(sorted(functions)) + r")\(|\.shader = )\"([A-Za-z0-9_]+)\"")
    return {name for code in sources for name in lookup.findall(code)}


def problems(root):
    """[(kind, shader, message)] for each shader the table leaves out, each one it names that does
    not exist, and each dead shader; kind is "no row", "no file" or "dead"."""
    shaders = embedded_shaders(root)
    table = shader_table(root)
    if table is None:
        return [("no table", "", f"{PAGE} has no table under \"{HEADING}\"")]
    found = []
    with_rows = {name for _, first, _ in table for name in first}
    for name in shaders:
        if name not in with_rows:
            found.append(("no row", name, f"{PAGE}: the shader table has no row for {SHADERS}/{name}.comp"))
    reported = set()
    for number, _, named in table:
        for name in named:
            if name not in shaders and name not in reported:
                reported.add(name)
                found.append(("no file", name, f"{PAGE}:{number}: the shader table names {name}.comp, which is not "
                                               f"in {SHADERS}/"))
    looked_up = looked_up_shaders(root)
    for name in shaders:
        if name not in looked_up:
            found.append(("dead", name, f"{SHADERS}/{name}.comp is compiled and embedded but no source under src/ "
                                        f"dispatches it by name: remove it, or dispatch it"))
    return found


def self_test():
    """The check on a made-up tree with known answers: exactly one shader without a row, one
    named that does not exist and one dead shader are reported, and nothing else."""
    page = [
        "# Architecture",
        "## Another section",
        "| Shader | Tiling | Grid |",  # not the shader table: listing `unlisted.comp` here gives it no row
        "|---|---|---|",
        "| `unlisted.comp` | elsewhere | 1 |",
        HEADING,
        "",
        "Prose before the table.",
        "",
        "| Shader | Tiling | Grid |",
        "|---|---|---|",
        "| `listed.comp` | a row of its own | rows |",
        # A name in another cell (`unlisted.comp`) gives that shader no row.
        "| `paired.comp`, `dead.comp` | a row shared by two; reads `unlisted.comp`'s output | rows |",
        "| `ghost.comp` | a shader that does not exist | 1 |",  # line 14
        "",
        "Prose after the table names `unlisted.comp`, which still has no row.",
    ]
    sources = {
        "src/backend/vulkan/context.h": "void dispatch(std::string_view shader, const Push& push);",
        "src/backend/vulkan/geometry.h": "\n".join([
            "VulkanDispatch tiled(const char* shader, int64_t n);",
            'inline VulkanDispatch pair() { return {.shader = "paired", .x = 1}; }',
        ]),
        "src/backend/vulkan/backend.cpp": "\n".join([
            'ctx().dispatch(vulkan_geometry::tiled("listed", n), push);',
            'ctx().dispatch("unlisted", push);',
            '// tiled("dead", n): a comment is not a lookup',
            'log("dead");',
            'untiled("dead", n);',
        ]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for rel, text in [(PAGE, "\n".join(page) + "\n")] + list(sources.items()):
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
            with open(os.path.join(tmp, rel), "w", encoding="utf-8") as f:
                f.write(text + "\n")
        os.makedirs(os.path.join(tmp, SHADERS))
        for name in ("listed", "paired", "unlisted", "dead"):
            with open(os.path.join(tmp, SHADERS, f"{name}.comp"), "w", encoding="utf-8") as f:
                f.write("#version 460\nvoid main() {}\n")
        found = problems(tmp)
    got = sorted((kind, name) for kind, name, _ in found)
    expected = sorted([("no row", "unlisted"), ("no file", "ghost"), ("dead", "dead")])
    errors = []
    if got != expected:
        errors.append(f"expected exactly {expected}, got {got}")
    if not any(message.startswith(f"{PAGE}:14: ") for kind, _, message in found if kind == "no file"):
        errors.append(f"the missing shader should be reported on its line (14): {[m for _, _, m in found]}")
    if errors:
        sys.exit("shader_table self-test failed:\n  " + "\n  ".join(errors))
    print("shader_table self-test: the shader without a row, the missing one and the dead one were reported, "
          "the others were not")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--self-test", action="store_true", help="only check the check, on a made-up tree")
    parser.add_argument("--root", default=ROOT, help="the repository (default: this file's)")
    args = parser.parse_args()
    self_test()
    if args.self_test:
        return
    root = os.path.abspath(args.root)
    shaders = embedded_shaders(root)
    if not shaders:
        sys.exit(f"no {SHADERS}/*.comp under {root}")
    found = problems(root)
    for _, _, message in found:
        print(message, file=sys.stderr)
    if found:
        sys.exit(f"{len(found)} problem(s) between {SHADERS}/ and {PAGE}'s shader table")
    print(f"shader_table: the {len(shaders)} shaders in {SHADERS}/ each have a row in {PAGE}'s table, which "
          f"names no other, and each is dispatched by name")


if __name__ == "__main__":
    main()
