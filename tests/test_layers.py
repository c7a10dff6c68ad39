"""Which module may import which: cloud_adapters never imports spotguard, the core never imports the
demo harness, and the emulators (aiohttp) load only where one runs."""

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports() -> dict[str, set[str]]:
    """{module: every module it imports}, function-level (lazy) and TYPE_CHECKING imports included."""
    graph = {}
    for package in ("spotguard", "cloud_adapters"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    found.add(node.module)
                    found.update(f"{node.module}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
            graph[name] = found
    return graph


def importers_of(prefix: str) -> set[str]:
    return {m for m, found in imports().items() if any(i == prefix or i.startswith(prefix + ".") for i in found)}


def test_no_module_imports_itself_through_others():
    """Import circles among modules. spotguard's package `__init__`s re-export its API (`spotguard.goodput`
    reads `spotguard.__version__`), so edges into them are left out; cloud_adapters, the layer below,
    has no circle even through its `__init__`s: a module there that imported its own package would
    run half-initialised."""
    graph = imports()
    packages = {m for m in graph if (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    edges = {
        m: {i for i in found if i in graph and i != m and (i not in packages or i.startswith("cloud_adapters"))}
        for m, found in graph.items()
    }
    graphlib.TopologicalSorter(edges).prepare()  # CycleError names the circle


def test_cloud_adapters_never_imports_spotguard():
    assert not {m for m in importers_of("spotguard") if m.startswith("cloud_adapters")}


def test_only_the_cli_and_the_demo_itself_import_the_demo_harness():
    assert importers_of("spotguard.demo") <= {"spotguard.cli"} | {
        m for m in imports() if m.startswith("spotguard.demo")
    }


def test_the_guard_and_the_cli_load_no_emulator():
    code = (
        "import sys, spotguard.guard, spotguard.cli; "
        "print(sorted(m for m in sys.modules if m == 'aiohttp' or m.endswith('emulator')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_checkpoint_layer_never_imports_the_guards_modules():
    """spotguard.checkpoint stands on cloud_adapters and the store helpers (spotguard.job.kvstore, itself a
    leaf); the guard, its coordination, timeline and ledger build on it, never the other way."""
    graph = imports()
    allowed = ("spotguard.checkpoint", "spotguard.job.kvstore")
    upward = {
        (module, found)
        for module, names in graph.items()
        if module.startswith("spotguard.checkpoint")
        for found in names
        if found.startswith("spotguard") and not found.startswith(allowed) and found != "spotguard"  # its version
    }
    assert not upward
    assert not {i for i in graph["spotguard.job.kvstore"] if i.startswith("spotguard")}


def test_the_packages_below_the_guard_never_import_it():
    """job/ (the store, the agreement) stands under health/ (silent failures), and neither knows the guard,
    its options, its ledger or the other one above it."""
    graph = imports()
    guard_and_up = ("spotguard.guard", "spotguard.goodput", "spotguard.options", "spotguard.ending")
    above = {"spotguard.job": (*guard_and_up, "spotguard.health"), "spotguard.health": guard_and_up}
    upward = {
        (module, found)
        for package, banned in above.items()
        for module, names in graph.items()
        if module.startswith(package)
        for found in names
        if found.startswith(banned)
    }
    assert not upward


def test_spotguard_checkpoint_exports_only_its_public_names():
    import spotguard
    import spotguard.checkpoint

    assert set(spotguard.checkpoint.__all__) - {"state_digest"} <= set(spotguard.__all__)


def test_names_spotguard_checkpoint_exported_before_still_import_with_a_warning():
    import warnings

    from spotguard.checkpoint.layout import step_dir_name

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from spotguard.checkpoint import step_dir_name as moved
    assert moved is step_dir_name
    assert any(issubclass(w.category, DeprecationWarning) and "spotguard.checkpoint.layout" in str(w.message)
               for w in caught)  # fmt: skip


def test_the_snapshot_tier_stands_on_the_checkpoint_layer_only():
    """spotguard.snapshots uses the checkpoint layer, the store helpers and the cadence (a leaf); the
    guard builds on it, never the other way."""
    allowed = ("spotguard.snapshots", "spotguard.checkpoint", "spotguard.job.kvstore", "spotguard.cadence")
    upward = {
        (module, found)
        for module, names in imports().items()
        if module.startswith("spotguard.snapshots")
        for found in names
        if found.startswith("spotguard") and not found.startswith(allowed)
    }
    assert not upward
    assert not {i for i in imports()["spotguard.cadence"] if i.startswith("spotguard")}
