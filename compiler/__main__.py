"""``python -m zeroc <command>``: ``demo`` trains a small GPT with zeroc and prints its plan;
``explain`` plans a job for a world that is not there (``zeroc.cli.explain_cli``); ``tune``
chooses a layout and options (``zeroc.cli.tune_cli``).

``python -m`` puts the current directory first on ``sys.path``; the commands move it last, so
a file there named like a package zeroc imports later (``filelock.py``) does not replace it,
while the user's own modules there still import.
"""

from __future__ import annotations

import os
import sys

COMMANDS = ("demo", "explain", "tune")


def _current_directory_last() -> None:
    here = os.getcwd()
    found = [p for p in sys.path if p in ("", ".", here)]
    sys.path[:] = [p for p in sys.path if p not in found] + found


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m zeroc {{{','.join(COMMANDS)}}} [options]\n"
              "  demo     train the zoo GPT with zeroc; print the loss per step and the plan\n"
              "  explain  plan a W-rank job on this machine (FILE.py:FACTORY --world W ...)\n"
              "  tune     choose a layout and options (FILE.py:FACTORY --nproc N --budget S)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    _current_directory_last()
    if command == "demo":
        from zeroc.cli.demo import run_demo

        return run_demo(rest)
    if command == "explain":
        from zeroc.cli.explain_cli import run_explain

        return run_explain(rest)
    if command == "tune":
        from zeroc.cli.tune_cli import run_tune

        return run_tune(rest)
    print(f"python -m zeroc: unknown command {command!r}; known: {list(COMMANDS)}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # before a command's own handler (its imports): one line
        print(f"python -m zeroc {' '.join(sys.argv[1:2])}: interrupted", file=sys.stderr)
        sys.exit(130)
