#!/usr/bin/env python3
"""Import cycles between the modules of each crate of the workspace.

A module here is a source file (`src/a.rs` or `src/a/mod.rs` is `a`, `src/a/b.rs` is `a::b`);
module A depends on module B when A's non-test code names `crate::B...` (or `super::...`
resolving to B, or a child module's item). Prints each strongly connected component of more
than one module (a cycle) with one edge path through it, and exits 1 if there is any.

    python3 scripts/import-cycles.py [crates/NAME ...]
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def modules(src):
    """Module path (tuple) of each source file under `src`."""
    out = {}
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        if parts in (["lib"], ["main"]):
            parts = []
        elif parts[-1] == "mod":
            parts = parts[:-1]
        if "bin" in parts[:1] or "tests" in parts[:1]:
            continue
        out[tuple(parts)] = f
    return out


def strip_tests(text):
    """The file without its `#[cfg(test)]` items (a test module may use anything)."""
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([a-z]+\))?\s+)?mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def strip_comments(text):
    """The text without comments (doc links name modules without depending on them) and strings."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return re.sub(r"//[^\n]*", "", text)


def expand_uses(text):
    """Every `crate::...`/`super::...` path the text names, `use` groups expanded."""
    paths = []
    for m in re.finditer(r"\buse\s+((?:crate|super|self)::[^;]+);", text, re.S):
        stack = [("", m.group(1))]
        while stack:
            prefix, body = stack.pop()
            body = body.strip()
            brace = body.find("{")
            if brace < 0:
                for item in body.split(","):
                    item = item.strip().split(" as ")[0].strip()
                    if item:
                        paths.append(prefix + item)
                continue
            head = body[:brace]
            inner = body[brace + 1 : body.rindex("}")]
            depth, start, parts = 0, 0, []
            for k, ch in enumerate(inner):
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                elif ch == "," and depth == 0:
                    parts.append(inner[start:k])
                    start = k + 1
            parts.append(inner[start:])
            for p in parts:
                if p.strip():
                    stack.append((prefix + head, p.strip()))
    text = re.sub(r"\buse\s+[^;]+;", "", text)
    paths += re.findall(r"\b((?:crate|super)(?:::\w+)+)", text)
    return paths


def resolve(path, here, mods):
    """The module a `crate::`/`super::` path lands in (the longest module prefix)."""
    segs = path.split("::")
    if segs[0] == "crate":
        base, rest = (), segs[1:]
    elif segs[0] == "self":
        base, rest = here, segs[1:]
    else:
        base = here
        while segs and segs[0] == "super":
            base = base[:-1]
            segs = segs[1:]
        rest = segs
    full = base + tuple(rest)
    for n in range(len(full), -1, -1):
        if full[:n] in mods:
            return full[:n]
    return None


def sccs(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) or "crate"


def main():
    crates = [pathlib.Path(a) for a in sys.argv[1:]] or sorted((ROOT / "crates").iterdir())
    found = 0
    for crate in crates:
        src = (crate if crate.is_absolute() else ROOT / crate) / "src"
        if not src.is_dir():
            continue
        mods = modules(src)
        graph = {}
        for m, f in mods.items():
            deps = set()
            for p in expand_uses(strip_tests(strip_comments(f.read_text()))):
                t = resolve(p, m, mods)
                # A module naming its own descendants, or the crate root's re-exports, is no
                # dependency between siblings.
                if t is None or t == m or t == () or t[: len(m)] == m or m[: len(t)] == t:
                    continue
                deps.add(t)
            graph[m] = deps
        for comp in sccs(graph):
            if len(comp) < 2:
                continue
            found += 1
            members = set(comp)
            edges = sorted(f"{name(a)} -> {name(b)}" for a in comp for b in graph[a] if b in members)
            print(f"{crate.name}: cycle among {', '.join(sorted(name(c) for c in comp))}")
            for e in edges:
                print(f"    {e}")
    print(f"{found} import cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
