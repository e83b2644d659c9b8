"""The shape of clawray's code (issue #25's figures): lines per module, the longest classes and
functions, functions over the 80-line limit, components that take the Driver (``driver: Any``) and
imports of another module's private (``_``) names.

Usage: ``python bench/code_shape.py [--top N]``; counts physical lines (docstrings and comments
included) of ``clawray/``; a function's length is its ``def`` line to its last line.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "clawray")
LIMITS = {"function": 80, "clawray/driver.py": 500, "Driver": 400, "clawray/serve/app.py": 600}


def shapes() -> tuple[dict[str, int], list[tuple[int, str]], list[tuple[int, str]], list[str]]:
    """``(lines per file, [(lines, class)], [(lines, function)], [file:line of a driver parameter])``."""
    files, classes, functions, takes_driver = {}, [], [], []
    for folder, _, names in os.walk(ROOT):
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.dirname(ROOT))
            text = open(path).read()
            files[rel] = text.count("\n")
            for node in ast.walk(ast.parse(text)):
                size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.ClassDef):
                    classes.append((size, f"{rel}:{node.name}"))
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions.append((size, f"{rel}:{node.lineno} {node.name}"))
                    if rel != "clawray/driver.py" and any(a.arg == "driver" for a in node.args.args):
                        takes_driver.append(f"{rel}:{node.lineno} {node.name}")
    return files, sorted(classes, reverse=True), sorted(functions, reverse=True), takes_driver


def private_imports() -> list[str]:
    """``"file:line name from module"`` of every ``from clawray.x import _name``."""
    out = []
    for folder, _, names in os.walk(ROOT):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("clawray"):
                        out += [
                            f"{rel}:{node.lineno} {a.name} from {node.module}"
                            for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")
                        ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    files, classes, functions, takes_driver = shapes()
    print(f"clawray/: {len(files)} files, {sum(files.values())} lines")
    print(
        f"\nlargest files (limits: driver.py {LIMITS['clawray/driver.py']}, serve/app.py {LIMITS['clawray/serve/app.py']})"
    )
    for rel, n in sorted(files.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {n:6d}  {rel}")
    print(f"\nlargest classes (limit: Driver {LIMITS['Driver']})")
    for n, name in classes[: args.top]:
        print(f"  {n:6d}  {name}")
    over = [f for f in functions if f[0] > LIMITS["function"]]
    print(f"\nlongest functions ({len(over)} over {LIMITS['function']} lines)")
    for n, name in functions[: args.top]:
        print(f"  {n:6d}  {name}")
    private = private_imports()
    print(f"\nimports of another module's private names: {len(private)}")
    for line in private:
        print(f"          {line}")
    print(f"\nfunctions outside driver.py that take the driver: {len(takes_driver)}")
    for name in takes_driver:
        print(f"          {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
