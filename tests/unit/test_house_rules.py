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
