"""The package's layout: subpackages by role, no import cycle (function-level imports count), no
module over the size a reader takes in at one sitting, the documented import paths unchanged, and
docs/design.md's module table naming every module once."""
import ast
import pathlib
import re

import yafsdp

ROOT = pathlib.Path(yafsdp.__file__).parent
# A module holds one role (a class and its helpers); this is the length past which a role is doing two
# things, not a cap to cut a class at (a class stays in one file: test_no_class_cut_across_modules).
MAX_LINES = 800


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom, files) -> list[str]:
    """The yafsdp modules ``from X import a, b`` loads: X.a and X.b where they are modules, else X."""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if all(a.name in ("_C", "_C_cuda") for a in node.names):
        return []  # the compiled extension (loaded at kernels' import, inside a try)
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in files]
    if node.level and node.module is None and target != "yafsdp" and target in files:
        # ``from . import x`` inside a subpackage names the subpackage itself (its __init__ first): when
        # that __init__ imports this module back, it is a cycle even though x is a leaf
        return subs + [target]
    return subs or ([target] if target in files else [])


def _imports():
    """Per yafsdp module: the yafsdp modules it imports at module level, and those imported inside functions."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    top, deferred = {}, {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = _resolve(mod, is_pkg, node, files)
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name in files]
            else:
                continue
            (deferred if id(node) in inner else top).setdefault(mod, set()).update(n for n in names if n != mod)
    return files, top, deferred


def _path(graph, start, goal) -> list[str] | None:
    """A chain of imports from ``start`` to ``goal``, or None."""
    seen, todo = {start}, [(start, [start])]
    while todo:
        m, chain = todo.pop()
        for n in sorted(graph.get(m, ())):
            if n == goal:
                return chain + [n]
            if n not in seen:
                seen.add(n)
                todo.append((n, chain + [n]))
    return None


def test_no_import_cycle():
    """No module reaches itself through imports, counting those inside functions: a function-level
    import that holds a cycle apart is still a cycle (the ones this test found: api <-> plan, runtime <-> hsdp,
    kernels <-> nf4, hf <-> hf_stream, orig_params <-> runtime, checkpoint <-> checkpoint.background)."""
    files, top, deferred = _imports()
    graph = {m: top.get(m, set()) | deferred.get(m, set()) for m in files}
    cycles = {m: _path(graph, m, m) for m in files}
    assert not {m: c for m, c in cycles.items() if c}, cycles


def test_every_import_names_a_module_that_exists():
    """Each ``from .x import y`` / ``import yafsdp.x`` inside the package, function-level ones included (which
    only fail when the function runs), names a module of the current layout."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    missing = []
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                target = (".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                          if node.level else node.module or "")
                if target.split(".")[0] == "yafsdp" and target not in files:
                    missing.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {target}")
            elif isinstance(node, ast.Import):
                missing += [f"{path.relative_to(ROOT.parent)}:{node.lineno}: {a.name}" for a in node.names
                            if a.name.split(".")[0] == "yafsdp" and a.name not in files]
    assert not missing, missing


def test_the_detector_sees_a_function_level_cycle(tmp_path, monkeypatch):
    """The check above is not vacuous: two modules importing each other, one inside a function."""
    pkg = tmp_path / "yafsdp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n")
    (pkg / "b.py").write_text("def g():\n    from .a import g\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    files, top, deferred = _imports()
    assert top["yafsdp.a"] == {"yafsdp.b"} and deferred["yafsdp.b"] == {"yafsdp.a"}
    graph = {m: top.get(m, set()) | deferred.get(m, set()) for m in files}
    assert _path(graph, "yafsdp.a", "yafsdp.a") == ["yafsdp.a", "yafsdp.b", "yafsdp.a"]


# The rooms below the wrapper, and the rooms each may import (itself always): imports point one way,
# from the facade down to the kernels (docs/design.md, "Modules"). ``tools`` below the engine means
# ``tools.trace`` only (profiler ranges); ``plan`` reads the layout and the placement's rules.
ROOMS = {
    "formats": {"kernels"},
    "comm": {"kernels", "tools.trace"},
    "layout": {"kernels", "formats", "comm"},
    "engine": {"kernels", "formats", "comm", "layout", "tools.trace"},
    "optim": {"kernels", "formats", "comm", "layout", "engine", "tools.trace"},
    "plan": {"kernels", "formats", "comm", "layout", "engine.placement", "integrations", "tools"},
}


def _room_violations(files, top, deferred):
    bad = []
    for m in sorted(files):
        parts = m.split(".")
        if len(parts) < 2 or parts[1] not in ROOMS:
            continue
        allowed = ROOMS[parts[1]] | {parts[1]}
        for n in sorted(top.get(m, set()) | deferred.get(m, set())):
            rest = n.split(".")[1:]
            if rest and not any(".".join(rest[:len(a.split("."))]) == a for a in allowed):
                bad.append(f"{m} imports {n}")
    return bad


def test_rooms_import_downwards_only():
    """No room imports a room above it (engine never the wrapper or the optimizer seams, the layout never
    the engine, the plan never the runtime): each can be read, and tested, without what builds on it."""
    assert not _room_violations(*_imports())


def test_the_room_check_sees_an_upward_import():
    files = {"yafsdp.layout.units": None, "yafsdp.engine.runtime": None, "yafsdp.plan.build": None}
    top = {"yafsdp.layout.units": {"yafsdp.engine.runtime"}}
    deferred = {"yafsdp.plan.build": {"yafsdp.engine.runtime"}}
    assert _room_violations(files, top, deferred) == ["yafsdp.layout.units imports yafsdp.engine.runtime",
                                                      "yafsdp.plan.build imports yafsdp.engine.runtime"]


def test_kernels_and_formats_are_leaves():
    """The kernels import no yafsdp module but their own twins; the formats import none inside functions."""
    files, top, deferred = _imports()
    mine = ["yafsdp.kernels", "yafsdp.kernels.twins"] + sorted(m for m in files if m.startswith("yafsdp.formats"))
    for m in mine:
        assert not deferred.get(m), (m, deferred[m])
    assert "yafsdp.kernels" in top["yafsdp.formats.nf4_codec"]
    assert top.get("yafsdp.kernels") == {"yafsdp.kernels.twins"} and not top.get("yafsdp.kernels.twins")


def test_runtime_reads_every_allocated_tensor_by_name():
    """``Runtime`` declares one property per field of alloc's ``Storage`` (rt.master, rt.grad_buffers, ...)."""
    from yafsdp.engine.alloc import STORAGE_FIELDS
    from yafsdp.engine.runtime import Runtime

    assert all(isinstance(getattr(Runtime, f, None), property) for f in STORAGE_FIELDS), STORAGE_FIELDS


def _cut_classes(paths) -> list[str]:
    """Classes cut in two: a base class with no ``__init__`` (a mixin) that exactly one class subclasses,
    from another module -- one class's methods split across files to keep a module short."""
    defined, subclasses = {}, {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                has_init = any(isinstance(f, ast.FunctionDef) and f.name == "__init__" for f in node.body)
                defined[node.name] = (path, has_init)
                for b in node.bases:
                    name = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
                    if name:
                        subclasses.setdefault(name, []).append((node.name, path))
    cut = []
    for base, subs in subclasses.items():
        if base in defined and len(subs) == 1 and not defined[base][1] and subs[0][1] != defined[base][0]:
            cut.append(f"{base} ({defined[base][0].name}) is only {subs[0][0]}'s ({subs[0][1].name})")
    return cut


def test_no_class_cut_across_modules():
    """One class, one file: a class is not split into a mixin in one module and the class in another
    (``Runtime`` and its backward, ``YaFSDP`` and its methods, the Trainer and its watchdog once were)."""
    assert not _cut_classes(list(ROOT.rglob("*.py")))


def test_the_cut_class_check_sees_a_mixin(tmp_path):
    (tmp_path / "a.py").write_text("class Methods:\n    def f(self):\n        pass\n")
    (tmp_path / "b.py").write_text("from a import Methods\nclass Engine(Methods):\n    def __init__(self):\n        pass\n")
    assert _cut_classes([tmp_path / "a.py", tmp_path / "b.py"]) == ["Methods (a.py) is only Engine's (b.py)"]


def test_no_module_over_the_limit():
    sizes = {_module_name(p): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert not {m: n for m, n in sizes.items() if n > MAX_LINES}, f"modules over {MAX_LINES} lines"


def test_the_documented_import_paths():
    """What the README and docs show keeps working; the short paths are the modules themselves."""
    import yafsdp.adapters
    import yafsdp.checkpoint
    import yafsdp.hf
    import yafsdp.init
    import yafsdp.presets
    from yafsdp.adapters import export_merged, save_adapter  # noqa: F401
    from yafsdp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: F401
    from yafsdp.hf import export_hf, load_hf_weights  # noqa: F401
    from yafsdp.init import meta_parameters  # noqa: F401
    from yafsdp.integrations import hf
    from yafsdp.plan.cli import main  # noqa: F401 (python -m yafsdp plan)
    from yafsdp.trainer import YaFSDPSFTTrainer, YaFSDPTrainer, with_yafsdp  # noqa: F401

    assert yafsdp.YaFSDP.__module__ == "yafsdp.wrapper.api" and yafsdp.FusedAdamW.__module__ == "yafsdp.optim.adamw"
    assert yafsdp.hf is hf and yafsdp.hf.export_hf is hf.export_hf
    for short in ("ema", "shards", "adapters", "export", "hf", "init", "peft_load", "trainer", "measure", "presets",
                  "streamcheck", "trace"):
        mod = __import__(f"yafsdp.{short}", fromlist=["_"])
        assert mod is getattr(yafsdp, short) and mod.__name__.endswith("." + short), short


def test_design_md_names_every_module_once():
    table = (ROOT.parent / "docs" / "design.md").read_text()
    named = re.findall(r"^(yafsdp/\S+\.py)\s", table, flags=re.M)
    files = sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py"))
    assert sorted(named) == files, (sorted(set(files) - set(named)), sorted(set(named) - set(files)))


def test_no_record_stream_and_no_device_wide_sync_in_the_engine():
    """Two rules of the buffer design, read from the source: no ``Tensor.record_stream`` (buffers are
    preallocated and ordered by events; record_stream is what makes FSDP2 over-allocate, pytorch #147168)
    and no device-wide ``torch.cuda.synchronize`` outside the tools (the engine orders its streams by
    events; offload's host waits are on its own event and stream, in comm/cuda.py)."""
    calls = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "record_stream":
                calls.append(f"{rel}:{node.lineno}: record_stream")
            if (isinstance(node, ast.Attribute) and node.attr == "synchronize" and rel.parts[1] != "tools"
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "cuda"):
                calls.append(f"{rel}:{node.lineno}: torch.cuda.synchronize")
    assert not calls, calls
