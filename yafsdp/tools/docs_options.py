"""The option table of docs/api.md and the ``YaFSDP(...)`` signature lines of docs/api.md and the
README, written from the options' one definition (``yafsdp.layout.config.OPTIONS``) and the signature
itself. tests/unit/test_config.py checks that the committed text equals what this writes.

    python -m yafsdp.tools.docs_options          # rewrite them in place
    python -m yafsdp.tools.docs_options --check  # exit 1, naming the file, when one is stale
"""
from __future__ import annotations

import argparse
import inspect
import pathlib
import re
import sys

from ..layout.config import OPTIONS

__all__ = ["signature_line", "option_table", "render", "main"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
BEGIN = "<!-- engine options: written by python -m yafsdp.tools.docs_options; edit yafsdp/layout/config.py -->"
END = "<!-- end of engine options -->"
_SIGNATURE = re.compile(r"^`yafsdp\.YaFSDP\(module, \*.*\)`$", re.M)


def _value(v) -> str:
    return repr(v).replace("'", '"')


def signature_line() -> str:
    """``yafsdp.YaFSDP(module, *, ...)`` with every argument and default, in the signature's order."""
    from ..wrapper.api import YaFSDP

    params = list(inspect.signature(YaFSDP.__init__).parameters.values())[1:]  # not self
    parts = []
    for p in params:
        if p.kind is p.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        parts.append(p.name if p.default is p.empty else f"{p.name}={_value(p.default)}")
    return f"`yafsdp.YaFSDP({', '.join(parts)})`"


def _doc(text: str) -> str:
    """An option's doc as markdown: its names in backticks, its docs/ paths as links (from docs/)."""
    text = re.sub(r"(?<![/\w])(" + "|".join(OPTIONS) + r"|nn\.\w+|torch\.\w+)(?![\w.]*\.md)\b", r"`\1`", text)
    return re.sub(r"docs/([\w-]+\.md)(#[\w-]+)?", lambda m: f"[{m[1]}]({m[1]}{m[2] or ''})", text)


def option_table() -> str:
    """One row per option: its name, default, values (the formats with what their records hold) and doc."""
    from .. import formats

    rows = ["| option | default | values | meaning |", "|---|---|---|---|"]
    for o in OPTIONS.values():
        values = []
        for v in o.choices():
            fmt = formats.get(v) if isinstance(v, str) and o.name in ("gather_dtype", "quantize_frozen") else None
            values.append(f"`{_value(v)}`" + (f" ({fmt.summary})" if fmt is not None else ""))
        kind = ", ".join(values) if values else f"`{o.type}`".replace("|", "\\|")  # a table cell
        rows.append(f"| `{o.name}` | `{_value(o.default)}` | {kind} | {_doc(o.doc)} |")
    return "\n".join(rows)


def render(path: pathlib.Path) -> str:
    """``path``'s text with the generated parts written in (docs/api.md: between the markers)."""
    text = path.read_text()
    if not _SIGNATURE.search(text):
        raise ValueError(f"{path}: no line holding the `yafsdp.YaFSDP(module, *, ...)` signature to rewrite")
    text = _SIGNATURE.sub(lambda m: signature_line(), text, count=1)
    if path.name == "api.md":
        start, end = text.find(BEGIN), text.find(END)
        if start < 0 or end < start:
            raise ValueError(f"{path}: the markers {BEGIN!r} ... {END!r} around the option table are missing")
        text = text[:start + len(BEGIN)] + "\n" + option_table() + "\n" + text[end:]
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m yafsdp.tools.docs_options", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a file is stale")
    a = ap.parse_args(argv)
    stale = []
    for path in (ROOT / "docs" / "api.md", ROOT / "README.md"):
        new = render(path)
        if new != path.read_text():
            stale.append(str(path.relative_to(ROOT)))
            if not a.check:
                path.write_text(new)
    if stale:
        print(("stale: " if a.check else "rewrote: ") + ", ".join(stale)
              + (" (run python -m yafsdp.tools.docs_options)" if a.check else ""))
    return 1 if stale and a.check else 0


if __name__ == "__main__":
    sys.exit(main())
