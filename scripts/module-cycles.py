#!/usr/bin/env python3
"""Import circles between the modules of each crate (scripts/test.sh runs it).

Reads every path in a crate's production code, not only `use` lines: `use`
trees, inline `crate::`/`super::`/`self::` paths, and names a module
re-exports (`use`/`pub use`) followed to the module that defines them.
Comments, string literals and `#[cfg(test)]` items are left out (tests may
reach anywhere). An edge between a module and its own ancestor or
descendant does not count: that is Rust's `mod` tree, not a circle.

Every strongly connected set of two or more modules is a circle. It fails
on a circle that no line of scripts/module-cycles.allow covers (a line
covers a circle whose modules are all on it), and on an allow-list line no
circle needs any more, so the list only shrinks.

  scripts/module-cycles.py            check the workspace
  scripts/module-cycles.py --explain  also print the edges of each circle
  scripts/module-cycles.py --count DIR  only count the circles of the tree at DIR
  scripts/module-cycles.py --self-test  check the reader on a made-up crate
"""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ALLOW = os.path.join(ROOT, "scripts", "module-cycles.allow")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


TOKEN = re.compile(
    r"//[^\n]*"  # line comment
    r"|/\*(?:[^*]|\*(?!/))*\*/"  # block comment (not nested: enough here)
    r'|\b[bc]?r(#*)"(?:.|\n)*?"\1'  # raw string
    r'|\b[bc]?"(?:[^"\\]|\\.|\n)*"'  # string
    r'|(?<![\w\\])"(?:[^"\\]|\\.|\n)*"'
    r"|'(?:\\(?:x..|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'",  # char literal
    re.S,
)


def strip(text):
    """Blank out comments and literals, keeping line numbers."""
    return TOKEN.sub(lambda m: "\n" * m.group(0).count("\n") or " ", text)


def block_end(text, start):
    """Index after the brace block opening at or after `start`."""
    depth, j = 0, text.index("{", start)
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return len(text)


def drop_test_items(text):
    """Blank `#[cfg(test)]` items: a `mod x;` line or a braced item."""
    out, pos = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]", text):
        if m.start() < pos:
            continue
        rest = text[m.end() :]
        semi, brace = rest.find(";"), rest.find("{")
        if semi >= 0 and (brace < 0 or semi < brace):
            end = m.end() + semi + 1
        else:
            end = block_end(text, m.end())
        out.append(text[pos : m.start()])
        out.append("\n" * text.count("\n", m.start(), end))
        pos = end
    out.append(text[pos:])
    return "".join(out)


def use_trees(text):
    """Yield (line, [segments]) for each leaf of every `use` tree."""
    for m in re.finditer(r"\buse\s+([^;]*);", text):
        line = text.count("\n", 0, m.start()) + 1
        for path in expand(re.sub(r"\s+", "", m.group(1))):
            yield line, path


def expand(tree):
    """`a::{b,c::{d}}` -> [[a,b],[a,c,d]] (an `as` rename keeps its source)."""
    tree = re.sub(r"as(" + IDENT + ")$", "", tree)
    if "{" not in tree:
        segs = [s for s in re.sub(r"as" + IDENT + "$", "", tree).split("::") if s]
        return [segs]
    head, body = tree.split("{", 1)
    body = body[: body.rindex("}")]
    prefix = [s for s in head.split("::") if s]
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    leaves = []
    for p in parts:
        if not p:
            continue
        for sub in expand(p):
            leaves.append(prefix + ([] if sub == ["self"] else sub))
    return leaves


class Crate:
    def __init__(self, name, src):
        self.name, self.src = name, src
        self.files = {}  # module tuple -> file path
        self.texts = {}
        root = "lib.rs" if os.path.exists(os.path.join(src, "lib.rs")) else "main.rs"
        self.load((), os.path.join(src, root), src)

    def load(self, module, path, dir_):
        if not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            text = drop_test_items(strip(f.read()))
        self.files[module], self.texts[module] = path, text
        for m in re.finditer(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;", text, re.M):
            name = m.group(1)
            child = module + (name,)
            flat, nested = os.path.join(dir_, name + ".rs"), os.path.join(dir_, name, "mod.rs")
            if os.path.exists(nested):
                self.load(child, nested, os.path.join(dir_, name))
            else:
                self.load(child, flat, os.path.join(dir_, name))

    def absolute(self, module, segs):
        """Absolute segments of a path written in `module`, or None."""
        if not segs:
            return None
        head = segs[0]
        if head == "crate":
            return list(segs[1:])
        if head in ("self", "super"):
            base = list(module)
            i = 0
            while i < len(segs) and segs[i] in ("self", "super"):
                if segs[i] == "super":
                    if not base:
                        return None
                    base.pop()
                i += 1
            return base + list(segs[i:])
        if module + (head,) in self.files:
            return list(module) + list(segs)
        return None

    def imports(self, module):
        """name -> absolute segments of what `module`'s `use` brings in."""
        names = {}
        for _, segs in use_trees(self.texts[module]):
            path = self.absolute(module, segs)
            if path is None:
                # From another crate (`pub use crust_fs::FsType`): no edge.
                if segs and segs[-1] not in ("*", "self"):
                    names[segs[-1]] = None
            elif path[-1] != "*":
                names[path[-1]] = path
        return names

    def target(self, path, depth=0):
        """The module a path resolves to (following re-exports)."""
        k = len(path)
        while k and tuple(path[:k]) not in self.files:
            k -= 1
        module = tuple(path[:k])
        if k < len(path) and depth < 8:
            imported = self.cached_imports(module)
            if path[k] in imported:
                via = imported[path[k]]
                if via is None:
                    return None
                return self.target(via + list(path[k + 1 :]), depth + 1)
        return module

    def cached_imports(self, module):
        if not hasattr(self, "_imports"):
            self._imports = {}
        if module not in self._imports:
            self._imports[module] = self.imports(module)
        return self._imports[module]

    def edges(self):
        """{(from, to): (file, line)} between modules not in one line of descent."""
        found = {}
        for module, text in self.texts.items():
            paths = list(use_trees(text))
            # Inline paths: every `crate::…`, `super::…`, `self::…` chain.
            for m in re.finditer(r"(?<![\w:])((?:crate|super|self)(?:::" + IDENT + ")+)", text):
                line = text.count("\n", 0, m.start()) + 1
                paths.append((line, m.group(1).split("::")))
            for line, segs in paths:
                path = self.absolute(module, segs)
                if path is None:
                    continue
                if path and path[-1] == "*":
                    path = path[:-1]
                to = self.target(path)
                if to is None or to[: len(module)] == module or module[: len(to)] == to:
                    continue
                found.setdefault((module, to), (self.files[module], line))
        return found


def sccs(nodes, edges):
    """Tarjan's strongly connected components with two or more members."""
    graph = {n: [] for n in nodes}
    for a, b in edges:
        graph[a].append(b)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
            if len(comp) > 1:
                out.append(comp)

    for n in sorted(nodes):
        if n not in index:
            visit(n)
    return out


def name(module):
    return "::".join(module) or "crate"


def read_allow():
    allow = []
    with open(ALLOW, encoding="utf-8") as f:
        for no, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if "#" not in raw:
                sys.exit(f"{ALLOW}:{no}: every allowed circle needs a reason after '#'")
            crate, _, mods = line.partition(":")
            allow.append((no, crate.strip(), set(mods.split())))
    return allow


def count(root):
    total = 0
    crates_dir = os.path.join(root, "crates")
    for crate_name in sorted(os.listdir(crates_dir)):
        src = os.path.join(crates_dir, crate_name, "src")
        if os.path.isdir(src):
            crate = Crate(crate_name, src)
            for comp in sccs(crate.files.keys(), crate.edges().keys()):
                total += 1
                print(f"{crate_name}: {' '.join(sorted(name(m) for m in comp))}")
    print(f"module-cycles: {total} circle(s)")


SELF_TEST = {
    # Circle a <-> b through an inline path and a `use` tree.
    "lib.rs": "mod a;\nmod b;\nmod c;\nmod d;\nmod e;\nmod n;\npub use e::Thing;\n",
    "a.rs": "pub fn f() { crate::b::g() }\n",
    "b.rs": "use crate::{a::{self, f}};\npub fn g() {}\n",
    # c -> d only in a comment, a string and a test item: no circle.
    "c.rs": "// crate::d::x\nconst S: &str = \"crate::d::x\";\n"
    "#[cfg(test)]\nmod tests { use crate::d::x; }\npub fn y() {}\n",
    "d.rs": "pub fn x() { crate::c::y() }\n",
    # d -> e through the root's re-export; e -> d back: a circle.
    "e.rs": "pub struct Thing;\nfn z() { super::d::x() }\n",
    # Siblings n::p <-> n::q through `super::`; n -> n::p (parent) does not count.
    "n/mod.rs": "mod p;\nmod q;\nuse p::h;\n",
    "n/p.rs": "pub fn h() { super::q::k() }\n",
    "n/q.rs": "pub fn k() { super::p::h() }\n",
}


def self_test():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for rel, text in SELF_TEST.items():
            path = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(tmp, "d.rs"), "a", encoding="utf-8") as f:
            f.write("fn w(_: crate::Thing) {}\n")
        crate = Crate("self-test", tmp)
        found = sorted(sorted(name(m) for m in c) for c in sccs(crate.files.keys(), crate.edges().keys()))
    want = [["a", "b"], ["d", "e"], ["n::p", "n::q"]]
    if found != want:
        sys.exit(f"module-cycles self-test: found {found}, want {want}")
    print("module-cycles self-test: ok")


def main():
    if sys.argv[1:2] == ["--self-test"]:
        return self_test()
    if sys.argv[1:2] == ["--count"]:
        return count(sys.argv[2])
    explain = "--explain" in sys.argv[1:]
    allow = read_allow()
    used, failed, total = set(), False, 0
    crates_dir = os.path.join(ROOT, "crates")
    for crate_name in sorted(os.listdir(crates_dir)):
        src = os.path.join(crates_dir, crate_name, "src")
        if not os.path.isdir(src):
            continue
        crate = Crate(crate_name, src)
        edges = crate.edges()
        for comp in sccs(crate.files.keys(), edges.keys()):
            total += 1
            members = {name(m) for m in comp}
            covering = [a for a in allow if a[1] == crate_name and members <= a[2]]
            used.update(a[0] for a in covering)
            verdict = "allowed" if covering else "NEW"
            failed |= not covering
            print(f"{verdict}: {crate_name}: {' '.join(sorted(members))}")
            if explain or not covering:
                for (a, b), (path, line) in sorted(edges.items()):
                    if a in comp and b in comp:
                        rel = os.path.relpath(path, ROOT)
                        print(f"    {name(a)} -> {name(b)}  ({rel}:{line})")
    for no, crate_name, mods in allow:
        if no not in used:
            failed = True
            print(f"stale: {ALLOW}:{no} ({crate_name}: {' '.join(sorted(mods))}) covers no circle now: remove it")
    print(f"module-cycles: {total} circle(s)")
    if failed:
        print("module-cycles: a circle not on the allow-list, or a stale line (see above)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
