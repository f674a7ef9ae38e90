"""The package's shape, read from the source with ast: no import cycles, a docstring per module."""
import ast
import glob
import os

from conftest import ROOT

SCRIPTS = ("train.py", "eval.py", "profile.py")


def project_modules():
    """{module name: parsed tree} for utils/**/*.py ('utils.data.crops', 'utils.run' for its
    __init__) and the three scripts ('train')."""
    paths = sorted(glob.glob(os.path.join(ROOT, "utils", "**", "*.py"), recursive=True))
    paths += [os.path.join(ROOT, s) for s in SCRIPTS]
    modules = {}
    for path in paths:
        name = os.path.splitext(os.path.relpath(path, ROOT))[0].replace(os.sep, ".")
        with open(path, encoding="utf-8") as handle:
            modules[name.removesuffix(".__init__")] = ast.parse(handle.read(), filename=path)
    return modules


def imported_modules(name, tree, known):
    """Project modules that `name` imports anywhere in its body (function-level imports too)."""
    package = name if name in PACKAGES else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .x import y` or `from . import x` inside utils/
                base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0], base]))
            # `from utils import data` names a module; `from utils.data import build_data` a function
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


PACKAGES = {"utils", "utils.flags", "utils.data", "utils.data.gpu", "utils.run"}


def import_graph():
    modules = project_modules()
    return {name: imported_modules(name, tree, modules) for name, tree in modules.items()}


def find_cycle(graph):
    """One import cycle as a list of module names (first == last), or None."""
    state = {}  # name -> "open" while on the DFS path, "done" after

    def visit(name, path):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target, path + [target])
                if cycle:
                    return cycle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [name])
            if cycle:
                return cycle
    return None


def test_the_graph_sees_the_imports_it_must_see():
    graph = import_graph()
    assert "utils.data.batches" in graph["utils.data.sources"]  # module level
    assert "utils.ingredients" in graph["utils.precision"]      # function level only (Precision.update_ema)
    assert "utils.data.sources" in graph["train"]              # from a script
    # the batch path leans only on leaves (utils.run.preemption: its loader workers ignore stop signals)
    leaves = {"utils.run.errors", "utils.run.files", "utils.run.preemption", "utils.data.crops", "utils.ingredients"}
    gpu = {name for name in graph if name.startswith("utils.data.gpu")}
    assert not graph["utils.data.batches"] - leaves - gpu, graph["utils.data.batches"]
    assert not graph["utils.ingredients"] - {"utils.run.errors"}, graph["utils.ingredients"]  # --aa's PIL policy: a leaf
    assert not graph["utils.run.preemption"] - {"utils.run.errors"}, graph["utils.run.preemption"]
    # rooms: nothing in utils.data or utils.run reaches up into the flags
    assert not {name for name in graph if name.startswith(("utils.data", "utils.run"))
                and any(t.startswith("utils.flags") for t in graph[name])}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_imports_one_that_imports_it():
    graph = import_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_every_utils_module_says_what_it_is_for():
    missing = [name for name, tree in project_modules().items()
               if name.startswith("utils") and not (ast.get_docstring(tree) or "").strip()]
    assert not missing, f"modules without a docstring: {missing}"
