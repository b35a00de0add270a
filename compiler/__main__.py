"""``python -m zeroc <command>``: ``demo`` trains a small GPT with zeroc and prints its plan."""

from __future__ import annotations

import sys

COMMANDS = ("demo",)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m zeroc {{{','.join(COMMANDS)}}} [options]\n"
              "  demo   train the zoo GPT with zeroc; print the loss per step and the plan")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from zeroc.demo import run_demo

        return run_demo(rest)
    print(f"python -m zeroc: unknown command {command!r}; known: {list(COMMANDS)}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
