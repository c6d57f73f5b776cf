"""Command-line tools: ``python -m yafsdp <command> [flags]``.

    python -m yafsdp plan --preset llama3-8b --world-size 64 --batch 1 --seq 8192 --checkpointing
    python -m yafsdp plan --help

[Note: CLI entry point]
Each tool runs from a module nobody imports (this one, or ``yafsdp/plan/__main__.py`` for the
spelling ``python -m yafsdp.plan``), so runpy never executes an already-imported module a second
time and has nothing to warn about.
"""
from __future__ import annotations

import sys

COMMANDS = {"plan": "per-rank memory plan of a preset model, on the meta device (yafsdp.plan)"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = ["usage: python -m yafsdp <command> [flags]   (python -m yafsdp <command> --help)", "commands:"]
        lines += [f"  {name:<6} {what}" for name, what in COMMANDS.items()]
        if argv and argv[0] not in ("-h", "--help"):
            print(f"python -m yafsdp: unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}",
                  file=sys.stderr)
            print("\n".join(lines), file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    from . import plan

    plan.main(argv[1:], prog="python -m yafsdp plan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
