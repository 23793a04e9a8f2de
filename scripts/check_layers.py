#!/usr/bin/env python3
"""Checks that Conveyor's folders only include downward, and that no files include each other
in a loop. Run by ctest (layering/includes); prints the folder graph with --graph.

    scripts/check_layers.py [--graph] [REPO]

The allowed edges are the layer map of docs/ARCHITECTURE.md, one line per folder: a file in
FOLDER may include its own folder's headers and those of the folders listed for it. A folder
is named by its path up to the first level that is itself a layer (kernels/cpu, stage/cuda,
coordinator/rest). Exit status 1 and one line per offending include, naming file and line.
"""
import os
import re
import sys
from collections import defaultdict

# Each layer and what it may include besides itself: other layers, or single headers of one
# (the stage interface, which the backends below the stage layer implement). Keep in step
# with docs/ARCHITECTURE.md.
ALLOWED = {
    "common": set(),
    "kernels/cpu": {"common"},
    "kernels/cuda": {"common"},
    "model": {"common"},
    "protocol": {"common"},
    "transport": {"common"},
    "stage/cpu": {"common", "model", "kernels/cpu", "stage/stage_backend.h"},
    "stage/cuda": {"common", "model", "kernels/cuda", "stage/stage_backend.h"},
    "stage": {"common", "model", "protocol", "kernels/cpu", "stage/cpu", "stage/cuda"},
    "stage_worker": {"common", "model", "protocol", "stage", "transport"},
    "coordinator": {"common", "model", "protocol", "transport"},
    "coordinator/rest": {"common", "model", "coordinator"},
    "cli": {"common", "model", "stage", "coordinator", "coordinator/rest"},
}
# A program's main (FOLDER/*_main.cc) stands on top of its folder: it may also include the
# layers inside it (the coordinator daemon's main wires the REST layer to the core).
LAYERS = sorted(ALLOWED, key=len, reverse=True)  # longest first: stage/cuda before stage
SOURCE_DIRS = sorted({layer.split("/")[0] for layer in ALLOWED})
SUFFIXES = (".h", ".cc", ".cu", ".cuh", ".inc")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(path):
    for layer in LAYERS:
        if path == layer or path.startswith(layer + "/"):
            return layer
    return None


def allowed(path, here, target, there):
    rules = ALLOWED[here]
    if there in rules or target in rules:
        return True
    return path.endswith("_main.cc") and there.startswith(here + "/")


def sources(repo):
    for top in SOURCE_DIRS:
        for root, _, files in os.walk(os.path.join(repo, top)):
            for f in files:
                if f.endswith(SUFFIXES):
                    yield os.path.relpath(os.path.join(root, f), repo)


def includes(repo, path):
    with open(os.path.join(repo, path), encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if m:
                yield number, m.group(1)


def main(argv):
    show_graph = "--graph" in argv
    args = [a for a in argv if not a.startswith("--")]
    repo = os.path.abspath(args[0] if args else os.path.join(os.path.dirname(__file__), ".."))
    problems = []
    edges = defaultdict(int)  # (from layer, to layer) -> includes
    file_edges = defaultdict(set)
    files = sorted(sources(repo))
    for path in files:
        here = layer_of(path)
        for number, target in includes(repo, path):
            if not os.path.exists(os.path.join(repo, target)):
                continue  # a system or generated header, or one relative to the file
            there = layer_of(target)
            if there is None:
                continue
            file_edges[path].add(target)
            if there != here:
                edges[(here, there)] += 1
            if here is not None and there != here and not allowed(path, here, target, there):
                problems.append(f"{path}:{number}: {here}/ may not include {target} ({there}/ is not below it)")

    # File-level cycles (a header including a header that includes it back, at any depth).
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(file_edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                problems.append("include cycle: " + " -> ".join(cycle))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for path in files:
        if path not in state:
            visit(path)

    if show_graph:
        print("folder include graph (includes per edge):")
        for (a, b), n in sorted(edges.items()):
            mark = "" if a is not None and (b in ALLOWED.get(a, set()) or any(
                r.startswith(b + "/") for r in ALLOWED.get(a, set()))) else "   <- not allowed"
            print(f"  {a or '?'} -> {b}: {n}{mark}")
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} layering problem(s); the allowed edges are in {os.path.relpath(__file__, repo)} "
              "and docs/ARCHITECTURE.md")
        return 1
    if not show_graph:
        print(f"layers: {len(files)} files, every include points down, no include cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
