"""The layers of issue 11: who may import whom, who reads the token, who failed.

docs/design.rst and ARCHITECTURE.md name the layers; import-linter's contracts
(pyproject.toml, ``lint-imports`` in CI) check the subpackages. This file checks
that those contracts hold and bite, and the rules the linter cannot see, by
reading every import statement (lazy ones too).
"""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import pdiffcopy
from conftest import random_bytes, run_cli, start_server
from pdiffcopy.errors import AuthenticationFailed, RemoteError, RemoteProtocolError, UsageError

#: Module -> modules it must never import, at the top or inside a function.
#: The engine (filejob, treesync) never starts a server nor reads a token; the
#: server never imports its launcher back (the old cycle); the HTTP client
#: takes its protocol constants from the core, not from the server's leases;
#: the batch codec (core) does not import the file system helpers. Full
#: names, so that they follow the modules into their layers (import-linter's
#: contracts then say the rest).
FORBIDDEN = {
    "pdiffcopy.engine.filejob": {
        "pdiffcopy.server.service",
        "pdiffcopy.server.app",
        "pdiffcopy.cli.command",
        "pdiffcopy.cli.treecli",
    },
    "pdiffcopy.engine.treesync": {
        "pdiffcopy.server.service",
        "pdiffcopy.server.app",
        "pdiffcopy.cli.command",
        "pdiffcopy.cli.treecli",
        "pdiffcopy.transport.remote",
    },
    "pdiffcopy.server.app": {
        "pdiffcopy.server.service",
        "pdiffcopy.cli.command",
        "pdiffcopy.transport.remote",
    },
    "pdiffcopy.transport.remote": {
        "pdiffcopy.server.leasetable",
        "pdiffcopy.server.app",
        "pdiffcopy.server.service",
        "pdiffcopy.cli.command",
    },
    "pdiffcopy.transport.httpclient": {
        "pdiffcopy.server.leasetable",
        "pdiffcopy.server.app",
        "pdiffcopy.server.service",
        "pdiffcopy.cli.command",
    },
    "pdiffcopy.core.treewire": {
        "pdiffcopy.local.confinement",
    },
}


def imported_modules(name: str):
    """Every ``pdiffcopy`` module (full name) that module ``name`` imports, anywhere in its file."""
    tree = ast.parse(Path(importlib.util.find_spec(name).origin).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdiffcopy"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # (from PACKAGE import MODULE)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pdiffcopy."))
    return found


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_a_layer_does_not_import_what_it_must_not(module):
    assert not imported_modules(module) & FORBIDDEN[module]


#: Calls that look at this machine's file system by name: the engine asks its endpoints instead
#: (a remote endpoint's location is a URL, and a confined one's is not a path to open).
FILE_SYSTEM_CALLS = ("os.path.", "os.stat(", "os.lstat(", "os.listdir(", "os.scandir(", "open(")


def test_the_engine_never_looks_at_the_file_system_by_name():
    engine = Path(pdiffcopy.__file__).parent / "engine"
    found = [(module.name, call) for module in sorted(engine.glob("*.py"))
             for call in FILE_SYSTEM_CALLS if call in module.read_text().replace("os.fdopen(", "")]
    assert found == []


def test_the_engine_makes_no_platform_calls():
    # libc (prctl, fadvise...) is local/'s: the engine gets what it needs handed in (a worker's start hook).
    engine = Path(pdiffcopy.__file__).parent / "engine"
    assert [module.name for module in sorted(engine.glob("*.py"))
            if "ctypes" in module.read_text() or "prctl" in module.read_text()] == []


def test_the_package_has_no_test_hooks():
    # A test changes what it runs against (a proxy, a slow link, the library's parameters), never
    # the program through a variable only tests set.
    package = Path(pdiffcopy.__file__).parent
    assert [str(module.relative_to(package)) for module in sorted(package.rglob("*.py"))
            if "PDIFFCOPY_TEST" in module.read_text()] == []


def test_the_server_imports_without_its_launcher():
    code = "import sys, pdiffcopy.server.app; assert 'pdiffcopy.server.service' not in sys.modules, sorted(sys.modules)"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr


def test_a_servers_400_is_a_remote_protocol_error_not_bad_usage(tmp_path):
    """A server that refuses a request as malformed: not bad usage (1) but peers that disagree (2)."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.img").write_bytes(random_bytes(64 * 1024))
    running = start_server(root, tmp_path / "server.log")  # the default methods: sm3 is refused with a 400
    try:
        completed = run_cli("-m", "sm3", "--no-progress", running.url("a.img"), str(tmp_path / "copy.img"))
        assert completed.returncode == RemoteProtocolError.exit_code == 2, completed.stderr
        lines = completed.stderr.strip().splitlines()
        assert len(lines) == 1 and "does not accept the hash method 'sm3'" in lines[0], completed.stderr
        with pytest.raises(RemoteProtocolError) as raised:
            pdiffcopy.sync(running.url("a.img"), str(tmp_path / "copy.img"), hash_method="sm3")
        assert isinstance(raised.value, RemoteError) and not isinstance(raised.value, UsageError)
    finally:
        running.stop()
    assert not (tmp_path / "copy.img").exists()


def test_the_library_takes_the_token_and_never_reads_the_environment(token_server, tmp_path, monkeypatch):
    (tmp_path / "source.img").write_bytes(random_bytes(4096))
    monkeypatch.setenv("PDIFFCOPY_TOKEN", token_server.token)
    with pytest.raises(AuthenticationFailed):
        pdiffcopy.sync(str(tmp_path / "source.img"), token_server.url("layers-token.img"))
    result = pdiffcopy.sync(str(tmp_path / "source.img"), token_server.url("layers-token.img"),
                            token=token_server.token)
    assert result.size == 4096


def test_sync_tree_takes_paths_and_urls_from_the_top_level(server, tmp_path):
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.bin").write_bytes(random_bytes(10_000))
    (source / "b.txt").write_text("hello\n")
    result = pdiffcopy.sync_tree(f"{source}/", str(tmp_path / "dst"), concurrency=2)
    assert (tmp_path / "dst" / "sub" / "a.bin").read_bytes() == (source / "sub" / "a.bin").read_bytes()
    assert result.files_copied == 2 and not result.failures
    pushed = pdiffcopy.sync_tree(f"{source}/", server.url("layers-tree"), concurrency=2)
    assert pushed.files_copied == 2 and (server.root / "layers-tree" / "b.txt").read_text() == "hello\n"
    with pytest.raises(UsageError, match="both"):
        pdiffcopy.sync_tree(server.url("layers-tree") + "/", server.url("layers-tree2"))



def modules_a_string_passes(argv, value: str, until: str):
    """The package's modules whose functions are handed ``value`` (alone, or in a list) while the
    command line runs ``argv``, in order of first call, until a function of ``until`` is called."""
    from pdiffcopy.cli.command import main

    passed = []

    def carries(argument) -> bool:
        return argument == value or isinstance(argument, (list, tuple)) and value in argument

    def watch(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("pdiffcopy") or (passed and passed[-1] == until):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if module == until or module not in passed and any(carries(frame.f_locals.get(name)) for name in names):
            passed.append(module)

    sys.setprofile(watch)
    try:
        status = main(argv)
    finally:
        sys.setprofile(None)
    assert status == 0
    return passed


def test_a_pulled_location_passes_at_most_ten_modules_before_the_engine(server, tmp_path):
    # Issue 33's measure: on a5d9ac4 the location passed 18 modules (calling back up 16 times).
    (server.root / "layers-path.img").write_bytes(random_bytes(100_000))
    url = server.url("layers-path.img")
    passed = modules_a_string_passes([url, str(tmp_path / "copy.img")], url, until="pdiffcopy.engine.filejob")
    assert passed[-1] == "pdiffcopy.engine.filejob", passed
    assert len(passed) - 1 <= 10, passed
    assert (tmp_path / "copy.img").read_bytes() == (server.root / "layers-path.img").read_bytes()
def run_lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts (pyproject.toml) over the package found in ``package_parent``."""
    script = Path(sys.executable).with_name("lint-imports")
    command = [str(script)] if script.exists() else ["lint-imports"]
    repository = Path(pdiffcopy.__file__).resolve().parent.parent
    return subprocess.run(command + ["--config", str(repository / "pyproject.toml"), "--no-cache"],
                          cwd=package_parent, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(package_parent)},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def lint_imports_available():
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip("import-linter is not installed (pip install 'pdiffcopy[test]')")


def test_the_import_contracts_hold(lint_imports_available):
    result = run_lint_imports(Path(pdiffcopy.__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_import_contracts_catch_the_command_line_going_around_the_api(lint_imports_available, tmp_path):
    """The command line reaches the engine through pdiffcopy.api only: a lazy import around it is caught."""
    import shutil

    shutil.copytree(Path(pdiffcopy.__file__).resolve().parent, tmp_path / "pdiffcopy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    reports = tmp_path / "pdiffcopy" / "cli" / "reports.py"
    around = "\n\ndef _around():\n    from pdiffcopy.engine.filejob import Progress  # noqa\n"
    reports.write_text(reports.read_text() + around)
    result = run_lint_imports(tmp_path)
    assert result.returncode != 0
    assert "pdiffcopy.cli.reports -> pdiffcopy.engine.filejob" in result.stdout


def test_the_import_contracts_catch_a_core_module_importing_the_transport(lint_imports_available, tmp_path):
    import shutil

    shutil.copytree(Path(pdiffcopy.__file__).resolve().parent, tmp_path / "pdiffcopy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    blocks = tmp_path / "pdiffcopy" / "core" / "blocks.py"
    blocks.write_text(blocks.read_text() + "\nfrom pdiffcopy.transport.remote import RemoteFile  # noqa\n")
    result = run_lint_imports(tmp_path)
    assert result.returncode != 0
    assert "pdiffcopy.core.blocks -> pdiffcopy.transport.remote" in result.stdout



def package_modules():
    """Every module of the package, by full name (subpackages' __init__ by the package's name)."""
    root = Path(pdiffcopy.__file__).parent
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph():
    """Module -> the package's modules it imports, lazily or not (names that are not modules dropped)."""
    modules = set(package_modules())
    return {name: {other for other in imported_modules(name) if other in modules and other != name}
            for name in modules}


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back_through_others():
    # The package's __init__ re-exports the public API lazily (PEP 562); every other
    # import, at the top or inside a function, counts.
    graph = import_graph()
    graph["pdiffcopy"] = set()
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
