"""The house rules that keep app/ easy to read: short files, short functions, packages whose imports run one way,
private internals of DeepSpeed and torch in one quarantine, collectives in one module."""
import ast
import re
from pathlib import Path

from conftest import REPO

APP = REPO / "app"
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 40  # a longer one needs a "# long: <reason>" comment on its def line


def _sources():
    return sorted(APP.rglob("*.py"))


def test_no_file_is_longer_than_300_lines():
    long = {str(p.relative_to(REPO)): n for p in _sources() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert not long, f"split these files: {long}"


def test_no_function_is_longer_than_40_lines_without_a_reason():
    long = []
    for path in _sources():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and "# long:" not in lines[node.lineno - 1]:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "shorten these functions or say why on the def line: " + ", ".join(long)


def _app_imports(path: Path) -> set:
    """The app modules path imports, as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("app"):
            found |= {node.module} if node.module != "app" else {f"app.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("app")}
    return found


def test_the_training_core_never_imports_the_tools_nor_train():
    for path in _sources():
        if "tools" in path.parts:
            continue
        wrong = {name for name in _app_imports(path) if name.startswith("app.tools") or name == "app.train"}
        assert not wrong, f"{path.relative_to(REPO)} imports {sorted(wrong)}: the core must not reach up"


INTERNALS = APP / "ds" / "internals"
# Modules whose names DeepSpeed may move between versions; its public entry points (deepspeed.initialize,
# deepspeed.zero.Init, zero_to_fp32, ds_to_universal, the op builders) may be used anywhere. Any private module
# of torch (a name starting with an underscore) counts.
PRIVATE = re.compile(r"deepspeed\.runtime\.config|deepspeed\.runtime\.zero\.config|deepspeed\.runtime\.precision_config|"
                     r"deepspeed\.ops\.adam|\btorch(\.\w+)*\._(?!_)\w+|\bfrom torch(\.\w+)* import _(?!_)\w+|c10d\._\w+")


def _private_uses(path: Path) -> list:
    return [m.group(0) for m in PRIVATE.finditer(path.read_text())]


def test_only_the_quarantine_reaches_into_private_modules_of_deepspeed_and_torch():
    wrong = {str(p.relative_to(REPO)): used for p in _sources()
             if INTERNALS not in p.parents and (used := _private_uses(p))}
    assert not wrong, f"move these touch points into app/ds/internals/: {wrong}"


def test_the_private_rule_sees_a_private_module(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("import torch._dynamo\nfrom torch.utils._pytree import tree_map\nfrom torch import _C\n"
                      "store = dist.distributed_c10d._get_default_store()\nimport deepspeed.ops.adam\n"
                      "torch.compile(model)\nprint(torch.__version__)\n")
    assert len(_private_uses(sneaky)) == 5


def _package(dotted: str) -> str:
    """The top-level part of app a module belongs to: its package, or the module itself (train, errors)."""
    return dotted.split(".")[1] if dotted.count(".") else "app"


def _package_arrows() -> dict:
    """{(package, package it imports): [module -> module, ...]} across app/'s top-level packages and modules."""
    arrows = {}
    for path in _sources():
        source = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for target in _app_imports(path):
            if _package(source) != _package(target):
                arrows.setdefault((_package(source), _package(target)), []).append(f"{source} -> {target}")
    return arrows


def _cycle(arrows) -> list:
    """One cycle among the packages ([] if none), found by depth-first search."""
    graph, state = {}, {}
    for source, target in arrows:
        graph.setdefault(source, set()).add(target)

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return []
    return next((found for node in sorted(graph) if node not in state and (found := visit(node, [node]))), [])


def test_no_cycle_between_the_packages_of_app():
    arrows = _package_arrows()
    cycle = _cycle(arrows)
    why = [arrow for a, b in zip(cycle, cycle[1:]) for arrow in arrows[(a, b)]]
    assert not cycle, f"packages import each other in a circle {' -> '.join(cycle)}: {why}"


def test_the_cycle_rule_sees_a_cycle():
    assert _cycle({("core", "data"): [], ("data", "settings"): [], ("settings", "core"): []}) == \
        ["core", "data", "settings", "core"]
    assert _cycle({("core", "data"): [], ("core", "settings"): [], ("data", "settings"): []}) == []


def _module_name(path: Path, root: Path) -> str:
    """A file's dotted module name: app/data/chat.py is app.data.chat, app/data/__init__.py is app.data."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(node, source: str, package: bool, modules: set) -> list:
    """The app modules one import statement names: `from app.data import chat` is app.data.chat where chat is a
    module, else app.data (a name its __init__ defines); relative imports are made absolute first."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "app"]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = source.split(".") if package else source.split(".")[:-1]
        base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
    if base.split(".")[0] != "app":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _module_arrows(root: Path = APP) -> dict:
    """{(module, app module it imports): [file:line import, ...]} for every import under root, in functions too."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    arrows = {}
    for source, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for target in dict.fromkeys(_imported_modules(node, source, path.name == "__init__.py", set(paths))):
                if target != source:
                    where = f"{path.relative_to(root.parent)}:{node.lineno} {ast.unparse(node)}"
                    arrows.setdefault((source, target), []).append(where)
    return arrows


def _circles(arrows) -> list:
    """[(one cycle through a group of modules that import each other, every import inside the group), ...]."""
    graph = {}
    for source, target in arrows:
        graph.setdefault(source, set()).add(target)

    def reach(node) -> set:
        seen, todo = set(), [node]
        while todo:
            new = graph.get(todo.pop(), set()) - seen
            seen |= new
            todo += new
        return seen
    reached = {node: reach(node) for node in graph}
    groups = {frozenset(n for n in reached[node] if node in reached.get(n, ()))
              for node in graph if node in reached[node]}
    found = []
    for group in sorted(groups, key=sorted):
        inside = {pair: lines for pair, lines in sorted(arrows.items()) if set(pair) <= group}
        found.append((_cycle(inside), [line for lines in inside.values() for line in lines]))
    return found


def test_no_circle_between_the_modules_of_app():
    """Modules that import each other break on whichever is imported first; an import inside a function only hides
    the circle until someone moves it up."""
    circles = _circles(_module_arrows())
    why = [f"{' -> '.join(cycle)} ({'; '.join(lines)})" for cycle, lines in circles]
    assert not circles, f"modules import each other in a circle; move what they share below them: {' | '.join(why)}"


def test_the_module_circle_rule_sees_a_circle_however_its_imports_are_written(tmp_path):
    files = {"__init__.py": "", "data/__init__.py": "", "data/chat.py": "def f():\n    from app.data import text\n",
             "data/text.py": "def g():\n    import app.data.chat as chat\n",
             "data/loader.py": "from app.data import chat, Info\nfrom . import text\n",
             "core/__init__.py": "from app.core.step import run\n", "core/step.py": "from app.data import loader\n",
             "core/tasks.py": "from app.core import step\nfrom app import core\n"}
    for name, text in files.items():
        (tmp_path / "app" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "app" / name).write_text(text)
    arrows = _module_arrows(tmp_path / "app")
    assert arrows[("app.data.loader", "app.data")] == ["app/data/loader.py:1 from app.data import chat, Info"]
    assert arrows[("app.data.loader", "app.data.text")] == ["app/data/loader.py:2 from . import text"]
    assert _circles(arrows) == [(["app.data.chat", "app.data.text", "app.data.chat"],
                                 ["app/data/chat.py:2 from app.data import text",
                                  "app/data/text.py:2 import app.data.chat as chat"])]
    (tmp_path / "app" / "data" / "__init__.py").write_text("from app.data.loader import build\n")
    assert [cycle for cycle, _ in _circles(_module_arrows(tmp_path / "app"))] == [
        ["app.data", "app.data.loader", "app.data"], ["app.data.chat", "app.data.text", "app.data.chat"]]


def test_app_is_grouped_in_packages_with_train_errors_redact_and_settings_beside_them():
    loose = sorted(p.name for p in APP.glob("*.py"))
    assert loose == ["__init__.py", "errors.py", "redact.py", "settings.py", "train.py"], loose


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
               "gather_object", "scatter", "scatter_object_list", "barrier", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv", "monitored_barrier"}
# dist.py owns the app's collectives (host group for bookkeeping, device group for tensors); app/ds/internals/
# is where DeepSpeed's internals may need one; commcheck exists to check torch.distributed's own primitives.
MAY_CALL_COLLECTIVES = {"app/distributed/dist.py", "app/tools/commcheck.py"}


def _torch_distributed_names(tree) -> set:
    """Names a module binds to torch.distributed (import torch.distributed as X, from torch import distributed)."""
    names = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return names


def _collective_calls(path: Path) -> list:
    tree = ast.parse(path.read_text())
    names, found = _torch_distributed_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"imports {a.name}" for a in node.names if a.name in COLLECTIVES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES \
                and ast.unparse(node.func.value) in names:
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    return found


def test_collectives_go_through_dist_py():
    """A collective elsewhere could hand a CPU tensor to the device group, which NCCL refuses on 2+ GPUs."""
    wrong = {str(p.relative_to(REPO)): calls for p in _sources() if str(p.relative_to(REPO)) not in MAY_CALL_COLLECTIVES
             and INTERNALS not in p.parents and (calls := _collective_calls(p))}
    assert not wrong, f"call app/distributed/dist.py's helpers instead: {wrong}"


def test_the_collective_rule_sees_a_collective(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("import torch.distributed as d\nfrom torch import distributed\nimport torch\n"
                      "d.all_reduce(x)\ndistributed.barrier()\ntorch.distributed.broadcast(x, 0)\nd.get_rank()\n")
    assert len(_collective_calls(sneaky)) == 3


def unit_test_files(module: Path) -> list:
    """The names a module's unit test file may have: test_<module>.py, or test_<package>_<module>.py where the
    module's name alone says less (tests/unit/test_data_chat.py for app/data/chat.py)."""
    return [f"test_{module.stem}.py", f"test_{module.parent.name}_{module.stem}.py"]


def test_each_module_has_a_unit_test_file_named_after_it():
    """tests/unit mirrors app/ (docs/tests.md): whoever changes a module finds its fast tests by its name."""
    unit = {p.name for p in (REPO / "tests" / "unit").glob("test_*.py")}
    missing = [str(p.relative_to(REPO)) for p in _sources()
               if p.name != "__init__.py" and not unit & set(unit_test_files(p))]
    assert not missing, f"add tests/unit/test_<module>.py for: {missing}"
