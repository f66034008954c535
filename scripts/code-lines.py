#!/usr/bin/env python3
"""Lines of non-test code in each Rust source file of the workspace's crates.

A code line is one with something left on it once comments (`//`, `///`, `/* */`, nested) are
taken out; blank lines do not count, a string literal's lines do. A `#[cfg(test)] mod NAME { ... }`
is left out whole, and so are the `tests/`, `benches/` and `examples/` directories.

    python3 scripts/code-lines.py [--top N] [--max N] [crates/NAME ...]

Prints the files with the most code lines (`--top`, 20 by default), then every file over `--max`
(850 by default), and exits 1 if there is one (`crates/baton/tests/layout.rs` runs it).
"""
import argparse
import importlib.util
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# `strip_tests` (a `#[cfg(test)] mod` left out whole) is import-cycles.py's.
_spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import-cycles.py")
IMPORT_CYCLES = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(IMPORT_CYCLES)
IDENT = re.compile(r"[A-Za-z0-9_]")
RAW_STRING = re.compile(r'(?:b|c)?r(#*)"')


def blank_comments(text):
    """The text with comments blanked and string contents replaced by `s`, newlines kept."""
    out, i, n = [], 0, len(text)

    def keep_lines(s, fill):
        return "".join(ch if ch == "\n" else fill for ch in s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(keep_lines(text[i:j], " "))
            i = j
        elif c in "rbc" and (i == 0 or not IDENT.match(text[i - 1])) and RAW_STRING.match(text, i):
            m = RAW_STRING.match(text, i)
            close = '"' + m.group(1)
            j = text.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append(keep_lines(text[i:j], "s"))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(keep_lines(text[i:j], "s"))
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}', '\'') or a lifetime ('a, 'static).
            if text.startswith("\\", i + 1):
                j = text.find("'", i + 3)
                j = n if j < 0 else j + 1
            elif i + 2 < n and text[i + 2] == "'":
                j = i + 3
            else:
                j = i + 1
            out.append(text[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def code_lines(path):
    code = IMPORT_CYCLES.strip_tests(blank_comments(path.read_text()))
    return sum(1 for line in code.splitlines() if line.strip())


def sources(crate):
    src = crate / "src"
    return sorted(src.rglob("*.rs")) if src.is_dir() else []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--max", type=int, default=850)
    ap.add_argument("crates", nargs="*")
    args = ap.parse_args()
    crates = [pathlib.Path(a) for a in args.crates] or sorted((ROOT / "crates").iterdir())
    counts = []
    for crate in crates:
        crate = crate if crate.is_absolute() else ROOT / crate
        for f in sources(crate):
            counts.append((code_lines(f), f.relative_to(ROOT)))
    counts.sort(key=lambda c: (-c[0], str(c[1])))
    for n, f in counts[: args.top]:
        print(f"{n:6} {f}")
    over = [(n, f) for n, f in counts if n > args.max]
    for n, f in over:
        print(f"over {args.max}: {f} ({n} code lines)")
    print(f"{len(over)} file(s) over {args.max} code lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
