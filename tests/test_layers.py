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
                if isinstance(node, ast.ImportFrom):
                    assert node.level == 0 and node.module, f"{path}: a relative import, which this graph would miss"
                    found.add(node.module)
                    found.update(f"{node.module}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
            graph[name] = found
    return graph


def importers_of(prefix: str) -> set[str]:
    return {m for m, found in imports().items() if any(i == prefix or i.startswith(prefix + ".") for i in found)}


def test_no_module_imports_itself_through_others():
    """Import circles among modules. spotguard's package `__init__`s re-export its API (`spotguard.goodput.recorder`
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


# The layers, lowest first. A module imports its own package and the layers below its own, never a
# sibling package of its layer nor anything above: the folders draw the flow (docs/DESIGN.md, Layout).
LAYERS = (
    ("cloud_adapters",),  # the clouds: knows nothing of torch or spotguard
    ("spotguard.goodput.cadence", "spotguard.goodput.timeline"),  # leaves: the cadence's arithmetic, the timeline
    ("spotguard.job",),  # the ranks of one job: the store, topology, broadcast, agreement, where they meet
    ("spotguard.checkpoint",),  # a save and a resume (ordered inside: CHECKPOINT_LAYERS)
    ("spotguard.ending", "spotguard.health", "spotguard.snapshots"),  # how a process ends; silent failures; memory
    ("spotguard.options",),  # the Guard's typed settings
    ("spotguard.goodput", "spotguard.watcher", "spotguard.data"),
    ("spotguard.wiring",),  # the Guard's rooms
    ("spotguard.guard",),  # the facade
    ("spotguard.integrations", "spotguard.inprocess", "spotguard.demo", "spotguard.ledger_records"),
    ("spotguard.cli", "spotguard"),  # the command line; the package's lazy exports (its __init__ alone)
)
# Inside checkpoint/, the same rule: the records and collectives, what a step is made of, the bytes'
# plumbing, then the paths (the save path drives the moves to the object store), then the facade.
_C = "spotguard.checkpoint"
CHECKPOINT_LAYERS = (
    (f"{_C}.rooted",),  # the byte-level gather and scatter, under the Comm that uses them
    (f"{_C}.errors", f"{_C}.outcome", f"{_C}.state", f"{_C}.comm"),
    (f"{_C}.format",),
    (f"{_C}.io",),
    (f"{_C}.catalog", f"{_C}.resume", f"{_C}.moves"),
    (f"{_C}.save",),
    (f"{_C}.checkpointer", _C),
)


def place(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> tuple[int, str] | None:
    """(layer, package) of a module or an imported name: the longest prefix in `layers` (the root
    package's `__init__` only by its own name)."""
    found = [(len(prefix), layer, prefix) for layer, prefixes in enumerate(layers) for prefix in prefixes
             if module == prefix or (prefix != layers[-1][-1] and module.startswith(prefix + "."))]  # fmt: skip
    return max(found)[1:] if found else None


def upward(layers: tuple[tuple[str, ...], ...], within: str = "") -> set[tuple[str, str]]:
    """(module, name) for every import of a sibling package or of a layer above the module's own."""
    wrong = set()
    for module, names in imports().items():
        if not module.startswith(within):
            continue
        layer, package = place(module, layers)
        for name in names:
            where = place(name, layers)
            if name in ("spotguard", "spotguard.__version__") or (within and not name.startswith(within)):
                continue  # the version, read from the package's __init__; outside the package ordered
            if where is not None and where[1] != package and where[0] >= layer:
                wrong.add((module, name))
    return wrong


def test_every_module_has_a_layer():
    """A new top-level module or package must be given its place in LAYERS (and in DESIGN's layout)."""
    assert not {m for m in imports() if place(m) is None}
    assert not {m for m in imports() if m.startswith(_C + ".") and place(m, CHECKPOINT_LAYERS) is None}


def test_the_leaves_import_nothing_of_spotguard():
    graph = imports()
    assert not {(leaf, i) for leaf in LAYERS[1] for i in graph[leaf] if i.startswith("spotguard")}


def test_no_module_imports_a_sibling_package_or_a_layer_above_its_own():
    """job/ never imports checkpoint/; health/ and snapshots/ never the goodput side (but its leaves), the
    options or the guard; nothing below the guard's rooms imports them."""
    assert not upward(LAYERS)


def test_inside_checkpoint_the_folders_are_one_direction_too():
    """format/ never imports a path; io/ never the paths; resume/ and moves/ never save/."""
    assert not upward(CHECKPOINT_LAYERS, within=_C + ".")


def test_the_layers_are_those_the_design_page_draws():
    """The design page's layout names every package (as a folder) and module of LAYERS."""
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    missing = set()
    for prefix in [p for layer in LAYERS[1:] + CHECKPOINT_LAYERS for p in layer if p not in ("spotguard", _C)]:
        path = ROOT / prefix.replace(".", "/")
        name = f"{path.name}/" if path.is_dir() else f"{path.name}.py"
        if f" {name}" not in design:
            missing.add(prefix)
    assert not missing


def test_spotguard_checkpoint_exports_only_its_public_names():
    import spotguard
    import spotguard.checkpoint

    assert set(spotguard.checkpoint.__all__) - {"state_digest"} <= set(spotguard.__all__)


def test_names_spotguard_checkpoint_exported_before_still_import_with_a_warning():
    import warnings

    from spotguard.checkpoint.format.layout import step_dir_name

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from spotguard.checkpoint import step_dir_name as moved
    assert moved is step_dir_name
    assert any(issubclass(w.category, DeprecationWarning) and "spotguard.checkpoint.format.layout" in str(w.message)
               for w in caught)  # fmt: skip


def test_the_paths_the_guides_named_before_the_checkpoint_folders_still_work_with_a_warning():
    import warnings

    import spotguard.checkpoint
    import spotguard.checkpoint.resume
    from spotguard.checkpoint.io import bounce
    from spotguard.checkpoint.resume.newest import RESUME_TIMEOUT_S
    from spotguard.checkpoint.save import retention
    from spotguard.goodput import records

    sys.modules.pop("spotguard.ledger_records", None)  # its warning comes as it is imported
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert spotguard.checkpoint.bounce is bounce
        assert spotguard.checkpoint.retention.RETENTION_TIMEOUT_S == retention.RETENTION_TIMEOUT_S
        assert spotguard.checkpoint.resume.RESUME_TIMEOUT_S == RESUME_TIMEOUT_S
        import spotguard.ledger_records as former

        assert former.Resume is records.Resume
    said = {str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)}
    for new in ("io.bounce", "save.retention", "resume.newest", "goodput.records"):
        assert any(new in s for s in said), (new, said)
