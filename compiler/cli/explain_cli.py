"""``python -m zeroc explain FILE.py:FACTORY --world W ...``: plan a job from the command line.

``FACTORY()`` (a function in ``FILE.py``) returns ``(model, example_inputs)``: the model,
ideally built on the meta device, and its inputs at one data-parallel replica's batch (a
tuple, or a dict of keyword inputs). The plan of a ``--world``-rank job is printed
(``zeroc.explain(model, inputs, world=...)``; ``--full``: every row of every table), and written
as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from typing import Any

__all__ = ["load_factory", "run_explain"]


def load_factory(spec: str) -> Any:
    """The callable named by ``path/to/file.py:name``: only that file is imported from where
    it lies. Its directory is appended to ``sys.path`` (after the installed packages), so the
    factory's own sibling modules import and a file there named like a package zeroc imports
    later (``filelock.py``) does not replace it. Its module is importable by its file name
    afterwards, so a child process (``zeroc.tune``'s planner) can unpickle its classes; a file
    named like a module that exists elsewhere is refused (rename it)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"factory {spec!r} is not allowed: write path/to/file.py:function")
    if not os.path.isfile(path):
        raise ValueError(f"factory {spec!r}: no file {path!r}")
    path = os.path.abspath(path)
    module_name = os.path.splitext(os.path.basename(path))[0]
    taken = _module_origin(module_name)
    if taken is not None and taken != path:
        raise ValueError(f"factory {spec!r}: its module name {module_name!r} is also {taken}; "
                         "rename the file so that it does not replace that module")
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.append(directory)
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"factory {spec!r}: {path} has no function {name!r}")
    return factory


def _module_origin(name: str) -> str | None:
    """Where the module ``name`` would be imported from now (a file, or ``"built in"``), or
    None when there is none (or the name is not a plain module name)."""
    if not name.isidentifier():
        return None
    loaded = sys.modules.get(name)
    if loaded is not None:
        return os.path.abspath(loaded.__file__) if getattr(loaded, "__file__", None) \
            else "built in"
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if found is None:
        return None
    if found.has_location and found.origin:
        return os.path.abspath(found.origin)
    places = list(found.submodule_search_locations or ())
    return f"the package directory {places[0]}" if places else "built in"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zeroc explain",
        description="Plan a W-rank zeroc job on this machine, with fake tensors and a fake "
                    "process group (no cluster needed), and print the plan.")
    parser.add_argument("factory", help="path/to/file.py:function returning (model, "
                        "example_inputs); build the model on the meta device for large ones")
    parser.add_argument("--world", type=int, required=True, help="number of ranks to plan")
    parser.add_argument("--pp", type=int, default=1, help="pipeline positions (divides --world)")
    parser.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="device planned for (cuda needs a CUDA build of torch)")
    parser.add_argument("--hardware", default=None,
                        help="hardware profile: a100-80gb, h100-sxm, h200 (checked)")
    parser.add_argument("--schedule", default=None,
                        help="pipeline schedule (gpipe, 1f1b, zb1p, dualpipe, dualpipev)")
    parser.add_argument("--microbatches", type=int, default=None, help="micro-batches per step")
    parser.add_argument("--options", default="{}", metavar="JSON",
                        help="other zeroc compile options as JSON, e.g. '{\"bucket_mb\": 50}'")
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON here")
    parser.add_argument("--trace", metavar="PATH",
                        help="also write the planned schedule (simulated with the plan's stage "
                             "costs) as a Chrome/Perfetto trace here (pipelines only)")
    parser.add_argument("--full", action="store_true",
                        help="print every row of every table and every option (str(plan.full()))")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def run_explain(argv: list[str]) -> int:
    """Parse ``argv``, plan, print; the exit code."""
    args = _parser().parse_args(argv)
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        for name in ("zeroc.world.world_plan", "zeroc.world.fake_world"):
            logging.getLogger(name).setLevel(logging.INFO)
    import zeroc

    options = json.loads(args.options)
    if args.schedule:
        options["schedule"] = args.schedule
    if args.microbatches:
        options["microbatches"] = args.microbatches
    started = time.perf_counter()
    try:
        factory = load_factory(args.factory)
    except ValueError as error:
        print(f"python -m zeroc explain: {error}", file=sys.stderr)
        return 2
    model, example_inputs = factory()
    plan = zeroc.explain(model, example_inputs, world=args.world, pp=args.pp, zero=args.zero,
                         device=args.device, hardware=args.hardware, options=options)
    print(plan.full() if args.full else plan)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(plan.to_json())
    if args.trace:
        if plan.pipeline is None:
            print("python -m zeroc explain: --trace needs a pipeline (--pp > 1)",
                  file=sys.stderr)
            return 2
        from zeroc.runtime.plan.chrome_trace import write_planned_trace

        write_planned_trace(plan.pipeline, args.trace)
    print(f"planned {args.world} ranks in {time.perf_counter() - started:.1f} s",
          file=sys.stderr)
    return 0
