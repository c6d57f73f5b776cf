"""The project's own text, checked: it speaks of the code in the code's terms (no mention of how the work on
it was organised: numbered tickets, their rounds of merges, working sessions, a lent GPU's allotment); every file, folder, link or ``yafsdp.x.y`` module that README.md, docs/ and
benchmarks/ name exists, and every repo path the code's comments and messages name, so a reader who follows
a path finds it; docs/testing.md maps every test file; the README states no test count that could drift.

[Note: what counts as process language]
A reader of this repository has the code, its docs and its results, nothing else: "issue 26 item 4 asks"
or "before wave 2" point at a conversation they cannot see. The patterns below are the phrasings that did
that; a fact from another project (an upstream bug's URL or number, "pytorch #147168") is not one of them,
and neither is a pytest session or a variable that happens to be called ``session``. Say what the code does
and why instead ("the goal: load at half the files' read speed, because ..."); a dated measurement keeps
its date and commit. In a dated result (benchmarks/results/) the fenced blocks are a run's output as it was
printed then, and are left as they are.
"""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Where the project speaks: its docs, benchmarks (scripts and results), examples, package and tests.
TEXT_DIRS = ("docs", "benchmarks", "examples", "yafsdp", "tests", ".ci")
TEXT_SUFFIXES = {".md", ".py", ".sh", ".cu", ".cpp", ".h", ".toml", ".txt"}
SKIP_PARTS = {"__pycache__", "data", "build", ".torchao", ".triton"}  # examples/data: public-domain corpora

PROCESS = [
    (r"\bissues? ?#?\d+", "a ticket by number ('issue 24')"),
    (r"\bissues \d+\s*(?:[-–,]|and)\s*\d+", "tickets by number"),
    (r"\b(?:pre-?)?waves? ?-?\d", "a round of merges ('wave 2')"),
    (r"\bwave\b", "a round of merges ('the wave')"),
    (r"\b(?:this|a|the|one|other|each|every|four|five|seven|helper|GPU) sessions?\b(?![-_])",
     "a working session"),
    (r"\bsession's\b", "a working session"),
    (r"\b(?:the|a|our) tracker\b", "the ticket tracker"),
    (r"\bdevice (?:time|budget)\b|\btime budget\b", "a lent GPU's allotment"),
    (r"\blent\b|\bloan\b|\bowed\b", "a lent GPU, work owed"),
    (r"\bthe lead\b|\bengineers?'?s?\b|\b(?:other|another) helpers?'?s?\b", "the people working on it"),
    (r"\bthe issue(?:'s)?\b(?! order)", "a ticket"),  # "the issue order": when work is issued
    (r"\bredesign(?: II)?\b", "a round of work"),
]
PROCESS_RE = [(re.compile(p, re.IGNORECASE), why) for p, why in PROCESS]


def _text_files():
    yield ROOT / "README.md"
    yield ROOT / "pyproject.toml"
    for top in TEXT_DIRS:
        for p in sorted((ROOT / top).rglob("*")):
            rel = p.relative_to(ROOT)
            if p.is_file() and p.suffix in TEXT_SUFFIXES and not SKIP_PARTS & set(rel.parts):
                yield p


def _process_language(paths, root=ROOT) -> list[str]:
    found = []
    for path in paths:
        if path.resolve() == pathlib.Path(__file__).resolve():
            continue  # this file names the patterns
        printed, in_fence = "results" in path.relative_to(root).parts, False
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith("```"):
                in_fence = not in_fence
            if printed and in_fence:
                continue  # a dated run's output, as printed
            for rx, why in PROCESS_RE:
                m = rx.search(line)
                if m:
                    found.append(f"{path.relative_to(root)}:{n}: {m.group(0)!r} ({why}): {line.strip()[:120]}")
                    break
    return found


def test_the_project_speaks_of_the_code_not_of_its_process():
    """See [Note: what counts as process language]."""
    found = _process_language(_text_files())
    assert not found, ("process language (say what the code does and why instead):\n" + "\n".join(found))


def test_the_process_check_finds_what_it_is_for(tmp_path):
    """The patterns catch the phrasings they are for, and leave upstream facts and pytest's session alone."""
    bad = ["The goals (issue 24): load >= half", "before wave 2 (`bf61747`)", "see issues 21-30",
           "no GPU this session", "15 minutes of device time", "a design decision for the lead",
           "Issue 26 item 4 says", "the issue's quiet figures", "on a lent GPU"]
    good = ["pytorch #147168 (upstream)", "https://github.com/pytorch/pytorch/issues/147168",
            "once per test session", "session_losses.append(loss)", "a session-scoped fixture",
            "the plan's 2-GPU figure", "the loss window of this run"]
    f = tmp_path / "t.md"
    f.write_text("\n".join(bad + good) + "\n")
    found = _process_language([f], root=tmp_path)
    assert [int(x.split(":")[1]) for x in found] == list(range(1, len(bad) + 1)), found
    # a dated result's printed output is kept as printed; its prose is checked
    r = tmp_path / "benchmarks" / "results" / "r.md"
    r.parent.mkdir(parents=True)
    r.write_text("as issue 24 asks\n```\ngoals (issue 24):\n```\n")
    assert [x.split(":")[1] for x in _process_language([r], root=tmp_path)] == ["1"]


# ---------------------------------------------------------------------------------------- named paths

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
# A path may hold a placeholder (`gpu_<date>/`) or a brace list (`{fp32,bf16}`): it must match some file.
REPO_PATH = re.compile(r"(?<![\w./-])((?:yafsdp|tests|examples|benchmarks|docs|csrc|\.ci)/"
                       r"(?![A-Z]{2})(?:[\w.*/<>{}-]|,(?=[^{}\s]*\}))*[\w*/>}])")  # not "yafsdp/DDP", a ratio
MODULE = re.compile(r"(?<![\w./-])(yafsdp(?:\.\w+)+)(?![\w.]| <)")  # "yafsdp.gather <unit>": a trace label
# Names that look like this repository's but are another's, or a fact about a fixed bug.
NOT_OURS = {
    "tests/assets": "torchtitan's own test assets, in a torchtitan checkout",
    "yafsdp.kernels._C_cuda": "the wrong name a fixed bug looked the CUDA extension up by (gpu_2026-11-26)",
}
TEST_FILE = re.compile(r"(?<![\w./-])((?:test|bench)_\w+\.py)\b")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def _exists(rel: str) -> bool:
    rel = re.sub(r"<[^>]*>", "*", rel.rstrip("/."))
    brace = re.search(r"\{([^{}]*)\}", rel)
    if brace:
        return all(_exists(rel[:brace.start()] + alt + rel[brace.end():]) for alt in brace.group(1).split(","))
    return any(ROOT.glob(rel)) if "*" in rel else (ROOT / rel).exists()


def _module_names(path: pathlib.Path) -> set[str]:
    """The names a module defines or imports at its top level (its public attributes)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _module_resolves(dotted: str) -> bool:
    """``yafsdp.a.b.c``: the longest prefix that is a module file or package, and the next name one of its
    top-level names (a class, function, constant or re-export); deeper attributes are not followed."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        if i < len(parts) and parts[i] == "py" and (base.with_suffix(".py")).exists():
            return True  # a file name written with its suffix ("yafsdp/x.py" as text)
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.exists():
                return i == len(parts) or parts[i] in _module_names(f)
        if i >= 2 and f'"{".".join(parts[:i])}"' in (ROOT / "setup.py").read_text():
            return True  # a compiled extension setup.py builds (yafsdp._C; yafsdp._C_cuda only with CUDA)
    return False


def _named(text: str):
    """(line, kind, name) for every repo path, dotted module, test/benchmark file and relative link in a doc."""
    in_fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
        for m in REPO_PATH.finditer(line):
            yield n, "path", m.group(1)
        for m in MODULE.finditer(line):
            yield n, "module", m.group(1)
        for m in TEST_FILE.finditer(line):
            yield n, "file", m.group(1)
        if not in_fence:
            for m in LINK.finditer(line):
                if not re.match(r"[a-z]+:", m.group(1)):
                    yield n, "link", m.group(1)


def _missing(doc: pathlib.Path, text: str | None = None) -> list[str]:
    """What ``doc`` (its text, or ``text`` as if it were the doc's) names that does not exist."""
    out = []
    basenames = {p.name for top in ("tests", "benchmarks") for p in (ROOT / top).rglob("*.py")}
    for n, kind, name in _named(doc.read_text() if text is None else text):
        if name in NOT_OURS:
            continue
        if kind == "path":
            ok = _exists(name)
        elif kind == "module":
            ok = _module_resolves(name)
        elif kind == "file":
            ok = name in basenames
        else:
            ok = (doc.parent / name).resolve().exists()
        if not ok:
            out.append(f"{doc.relative_to(ROOT)}:{n}: {kind} {name!r} does not exist")
    return out


def test_every_path_the_docs_name_exists():
    missing = [m for doc in DOCS for m in _missing(doc)]
    assert not missing, "\n".join(missing)


def test_every_repo_path_the_code_names_exists():
    """Comments, docstrings and messages that name a file of this repository (``tests/unit/test_nf4.py``) name one
    that exists (dotted names are not checked here: the code names ``torch.ops.yafsdp.*`` ops that way)."""
    missing = []
    for path in _text_files():
        if path.suffix == ".md" or path.name == pathlib.Path(__file__).name:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            missing += [f"{path.relative_to(ROOT)}:{n}: {m.group(1)!r} does not exist" for m in REPO_PATH.finditer(line)
                        if m.group(1) not in NOT_OURS and not _exists(m.group(1))]
    assert not missing, "\n".join(missing)


def test_the_path_check_finds_a_stale_path():
    """The check is not vacuous: it finds the kinds of stale names it is for, and accepts real ones."""
    text = ("`yafsdp/runtime.py`, `yafsdp.fp8`, `tests/test_parity.py`, `test_habits_old.py`, [x](nowhere.md)\n"
            "`yafsdp/layout/flat.py`, `yafsdp.layout.flat.FlatLayout`, `yafsdp.YaFSDP`, [y](design.md#top), `tests/unit/`\n")
    found = _missing(ROOT / "docs" / "probe.md", text)
    assert [f.split(": ", 1)[1].split()[0] for f in found] == ["path", "path", "module", "file", "link"], found
    assert all(":1:" in f for f in found), found


def test_every_test_file_is_in_the_map():
    """docs/testing.md's "Where a test goes" names every test file, so a newcomer finds a subject's file there."""
    text = (ROOT / "docs" / "testing.md").read_text()
    text = text[text.index("### Where a test goes"):]
    unnamed = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*/test_*.py") if f"`{p.name}`" not in text)
    assert not unnamed, f"test files missing from docs/testing.md's map: {unnamed}"


def test_the_readme_does_not_state_a_test_count_that_can_drift():
    """docs/testing.md is where the suite's size is described; the README links to it instead of repeating a
    number that the next test added would make wrong."""
    assert not re.search(r"\b\d[\d,]* tests\b", (ROOT / "README.md").read_text())
