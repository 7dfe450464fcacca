"""The house rules that keep app/ easy to read: short files, short functions, one-way imports."""
import ast
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


def test_only_ds_internals_reaches_into_deepspeed_private_modules():
    # The modules whose names DeepSpeed may move between versions; public entry points (deepspeed.initialize,
    # deepspeed.zero.Init, zero_to_fp32, ds_to_universal, the op builders) may be used anywhere.
    private = ("deepspeed.runtime.config", "deepspeed.runtime.zero.config", "deepspeed.runtime.precision_config",
               "deepspeed.ops.adam")
    for path in _sources():
        if path.name == "ds_internals.py":
            continue
        text = path.read_text()
        used = [name for name in private if name in text]
        assert not used, f"{path.relative_to(REPO)} uses {used}: move that touch point into app/ds_internals.py"
