"""clawray's modules import downwards only (issue #25): the layer order of docs/architecture.md, checked
on every import statement in clawray/ (module-level and lazy ones alike), and no import cycle."""

from __future__ import annotations

import ast
import importlib
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "clawray")

#: Layer of each module or package (the longest matching prefix wins), bottom first; a module may
#: import its own layer and the ones below. Keep in step with docs/architecture.md.
LAYERS = {
    # 0: no clawray imports but these
    "clawray": 0,
    "clawray.types": 0,
    "clawray.file_modes": 0,
    "clawray.console": 0,
    "clawray.records": 0,
    "clawray.client_rules": 0,
    "clawray.interrupt": 0,
    "clawray.ray_env": 0,
    "clawray.chat": 0,
    "clawray.step_metrics": 0,
    "clawray.openclaw": 0,
    # 1: the RL itself, and the config schema that names its algorithms
    "clawray.algos": 1,
    "clawray.config": 1,
    "clawray.promotion": 1,
    "clawray.reply_compare": 1,
    "clawray.canary": 1,
    # 2: building blocks that know the config and the algorithms, not Ray's actors
    "clawray.engines": 2,
    "clawray.envs": 2,
    "clawray.serve.protocol": 2,
    "clawray.serve.reply": 2,
    "clawray.serve.routing": 2,
    "clawray.serve.guard": 2,
    "clawray.serve.splice": 2,
    "clawray.serve.instance": 2,
    "clawray.checkpoint": 2,
    "clawray.run_lock": 2,
    "clawray.placement": 2,
    "clawray.metrics_log": 2,
    "clawray.session_book": 2,
    "clawray.model_folders": 2,
    "clawray.report": 2,
    # 3: what the actors are made of
    "clawray.weight_sync": 3,
    "clawray.journal": 3,
    "clawray.recovery": 3,
    "clawray.evaluation": 3,
    "clawray.premise": 3,
    "clawray.monitor": 3,
    "clawray.mismatch_probe": 3,
    "clawray.gate": 3,
    "clawray.step_sync": 3,
    "clawray.run_actors": 3,
    "clawray.run_stats": 3,
    "clawray.resume": 3,
    "clawray.closing": 3,
    "clawray.batching": 3,
    "clawray.traffic": 3,
    # 4: the Ray actors
    "clawray.actors": 4,
    # 5: the Serve deployment
    "clawray.serve": 5,
    "clawray.serve.app": 5,
    # 6: what wires a run
    "clawray.driver": 6,
    "clawray.build": 6,
    "clawray.serving": 6,
    # 7: the command line
    "clawray.cli": 7,
}


def layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise KeyError(f"{module} has no layer in LAYERS: add it (and to docs/architecture.md)")


def modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def imports(path: str, module: str) -> set[str]:
    """The clawray modules ``module`` imports (``from clawray.x import y`` counts ``clawray.x.y`` when
    that is a module, else ``clawray.x``)."""
    known = modules()
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "clawray":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "clawray")
    found.discard(module)
    return found


def graph() -> dict[str, set[str]]:
    return {m: imports(p, m) for m, p in modules().items()}


def test_every_module_has_a_layer():
    for module in modules():
        layer(module)


def test_no_import_runs_up_the_layers():
    upward = [
        f"{src} (layer {layer(src)}) imports {dst} (layer {layer(dst)})"
        for src, dsts in graph().items()
        for dst in sorted(dsts)
        if layer(dst) > layer(src) and not dst.startswith(src + ".")  # a package may import its modules
    ]
    assert upward == []


def test_no_import_cycle():
    g = graph()
    # a package's __init__ importing its own modules is how Python packages work, not a cycle
    edges = {m: {d for d in ds if not d.startswith(m + ".")} for m, ds in g.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d) :] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("src, dst", [("clawray.ray_env", "clawray.serve.guard"), ("clawray.algos", "clawray.actors")])
def test_the_check_catches_an_upward_import(src, dst):
    assert layer(dst) > layer(src)


def test_the_proxy_callback_named_by_ray_env_is_the_guard():
    """ray_env names the HeaderGuard by its import path (it used to import the constant from
    serve/guard.py, the one import that ran up the layers)."""
    from clawray.ray_env import PROXY_CALLBACK_ENV

    module, _, name = PROXY_CALLBACK_ENV["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"].rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_no_module_imports_another_modules_private_names():
    """Issue #25: what one module uses of another is public (``from clawray.x import _y`` is a
    back-door; the weight-sync transports shared ``_Abort``, ``_numel``, ``_reason``...)."""
    private = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "clawray":
                bad = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                private += [f"{module} imports {name} from {node.module}" for name in bad]
    assert private == []
