"""Launch zeroc's demo many times per layout and count native crashes (heap corruption hunt).

Each launch is ``python -m zeroc demo --nproc N ...`` in a fresh process tree (optionally
under ``shared/tools/slowlink``, which must then wrap this whole script so every launch shares
the shaped link), with a wall-clock limit. A launch ends ``ok`` (exit 0), ``crash`` (a rank
killed by SIGSEGV, SIGABRT, SIGBUS or SIGILL, or glibc's ``malloc(): ...`` / ``free(): ...``
/ ``double free`` / ``corrupted`` messages in its output), ``timeout`` or ``failed`` (any other
exit). ``--malloc-check`` runs the launches with ``MALLOC_CHECK_=3`` and
``MALLOC_PERTURB_=165`` (glibc 2.34 and later read ``MALLOC_CHECK_`` only with
``libc_malloc_debug.so`` preloaded, which this script does where the library exists), so glibc
checks every free and fills freed memory, which turns a late write into a freed buffer into a
crash or a wrong loss. Every launch runs with Python's fault handler on, so a crash's log shows
each thread's Python stack at the signal: where the process was when the heap broke. The demo
prints the loss next to eager's; a launch whose last step's zeroc loss differs from eager's by
more than 1e-4 counts as ``wrong``.

    ../shared/tools/slowlink --rate 1gbit -- \\
        python benchmarks/crash_stress.py --launches 50 --layouts zero1,zero2,zero3,pp2dp2

prints one row per layout: launches, ok, crash, wrong, timeout, failed, median seconds; the
first crash's output is kept under ``--keep DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from tabulate import tabulate

LAYOUTS = {
    "zero1": ["--nproc", "2", "--zero", "1"],
    "zero2": ["--nproc", "2", "--zero", "2"],
    "zero3": ["--nproc", "2", "--zero", "3"],
    "pp2dp2": ["--nproc", "4", "--pp", "2", "--zero", "3", "--schedule", "dualpipev"],
}
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL}
HEAP_WORDS = re.compile(
    r"malloc\(\)|free\(\)|double free|corrupted|tcache|Segmentation fault|Fatal Python error")
# The demo's per-step line: the step, zeroc's loss, eager's loss.
LOSS_LINE = re.compile(r"^\s*(\d+)\s+([0-9.]+)\s+([0-9.]+)", re.MULTILINE)


def classify(code: int, output: str) -> str:
    """``ok``, ``crash``, ``wrong`` or ``failed`` for one finished launch."""
    if -code in {int(s) for s in CRASH_SIGNALS} or HEAP_WORDS.search(output) or (
            "exited with code -6" in output or "killed by SIG" in output):
        return "crash"
    if code != 0:
        return "failed"
    steps = LOSS_LINE.findall(output)
    if steps and abs(float(steps[-1][1]) - float(steps[-1][2])) > 1e-4:
        return "wrong"
    return "ok"


def _malloc_debug_library() -> str | None:
    """glibc's malloc checker (``MALLOC_CHECK_`` is a no-op without it since glibc 2.34)."""
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64",
                   "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu"):
        path = os.path.join(folder, "libc_malloc_debug.so.0")
        if os.path.exists(path):
            return path
    return None


def launch(layout: str, args: argparse.Namespace) -> tuple[str, float, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONFAULTHANDLER"] = "1"  # a crash prints every thread's Python stack
    if args.malloc_check:
        env.update(MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
        debug = _malloc_debug_library()
        if debug:
            env["LD_PRELOAD"] = ":".join(filter(None, [debug, env.get("LD_PRELOAD", "")]))
    command = [sys.executable, "-m", "zeroc", "demo", "--device", "cpu", "--steps",
               str(args.steps), "--width", str(args.width), "--layers", str(args.layers),
               *LAYOUTS[layout]]
    began = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.timeout, start_new_session=True)
    except subprocess.TimeoutExpired as expired:
        out = (expired.stdout or "") + (expired.stderr or "")
        return "timeout", time.monotonic() - began, str(out)
    output = done.stdout + done.stderr
    return classify(done.returncode, output), time.monotonic() - began, output


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=50, help="launches per layout")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--malloc-check", action="store_true")
    parser.add_argument("--keep", default="crash_stress_out", help="where a crash's output goes")
    parser.add_argument("--json", help="also write the counts here")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: {unknown} not known; known: {list(LAYOUTS)}")
    counts = {name: {"ok": 0, "crash": 0, "wrong": 0, "timeout": 0, "failed": 0, "s": []}
              for name in layouts}
    for index in range(args.launches):  # interleaved, so load falls on every layout alike
        for name in layouts:
            outcome, seconds, output = launch(name, args)
            counts[name][outcome] += 1
            counts[name]["s"].append(seconds)
            if outcome != "ok":
                os.makedirs(args.keep, exist_ok=True)
                with open(os.path.join(args.keep, f"{name}-{index}-{outcome}.log"), "w") as f:
                    f.write(output)
            print(f"{name} #{index + 1}: {outcome} in {seconds:.1f} s", flush=True)
    rows = [[name, len(c["s"]), c["ok"], c["crash"], c["wrong"], c["timeout"], c["failed"],
             f"{statistics.median(c['s']):.1f}"] for name, c in counts.items()]
    print(tabulate(rows, headers=["layout", "launches", "ok", "crash", "wrong", "timeout",
                                  "failed", "median s"]))
    payload = {"counts": counts, "args": vars(args)}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return payload


if __name__ == "__main__":
    main()
