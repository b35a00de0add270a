"""Exit stress: does a zeroc training job end with exit code 0, every time?

A user's job trains, calls ``dist.destroy_process_group()`` and returns; torchrun reports the
job failed if any rank dies on the way out (e.g. ``terminate called without an active
exception``, SIGABRT, when a gloo thread or a pending collective is still alive at interpreter
exit). Such a failure is rare, so this script runs the same small job many times.

Two modes:

- worker (``--worker``, started by torchrun): a 2-rank training script. The zoo GPT
  (``tests/models``), ``zeroc.parallelize(model, zero=S)``, ``torch.compile(model,
  backend="zeroc")``, AdamW for ``--steps`` steps; rank 0 prints the loss (mean over ranks),
  then every rank calls ``dist.destroy_process_group()`` and returns normally. With ``--pp``:
  4 ranks, ``pp=2`` and the ``dualpipev`` schedule. ``--inspect`` makes every rank log, after
  the destroy and again at exit (after zeroc's exit handler, before interpreter teardown), what
  is still alive: the destroyed process groups, the native threads (gloo's ``gloo_tcp_loop`` /
  ``pt_gloo_runloop`` live as long as a group) and torch's count of unwaited collectives.
  ``--provoke N`` ends the job with N all-reduces of temporary tensors (a logging pattern)
  right before the destroy, which widens the exit race of a group that outlives
  ``destroy_process_group``.
- driver (the default): launches the worker with ``torchrun --standalone`` (as ``python -m
  torch.distributed.run``), sequentially, ``--runs`` times per ZeRO stage of ``--stages`` (and
  per stage with ``--pp``), records each exit code and the signal / error line of a failed
  run, and prints a table: configuration, runs, exit-0 count, failures with their message.

    python benchmarks/exit_stress.py --runs 30 --stages 2 3
    python benchmarks/exit_stress.py --runs 10 --stages 3 --pp --no-dp
"""

from __future__ import annotations

import argparse
import atexit
import collections
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence

logger = logging.getLogger(__name__)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS_TAG = "exit_stress: loss"
RUN_MARK = "ZEROC_EXIT_STRESS_RUN"
# Lines of a failed run worth reporting, most telling first.
_FAILURE_PATTERNS = (
    re.compile(r"terminate called.*"),
    re.compile(r"Signal \d+ \(SIG\w+\) received by PID \d+"),
    re.compile(r"exitcode\s*:\s*-?\d+.*"),
    re.compile(r"Fatal Python error.*"),
    re.compile(r"\w+(Error|Exception): .*"),
)


# -- worker ------------------------------------------------------------------------------


def native_threads() -> list[str]:
    """Names of this process's threads (Linux ``/proc``; empty elsewhere)."""
    names: list[str] = []
    tasks = sorted(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue
    return names


def report(line: str) -> None:
    """Write one line to stderr in one system call, so that the ranks' lines never interleave."""
    os.write(2, f"exit_stress: {line}\n".encode())


def alive_report(groups: list[weakref.ref]) -> str:
    """What is still alive: the destroyed process groups, native threads, unwaited works."""
    import torch
    from torch._C import _distributed_c10d as c10d

    unwaited = c10d._get_work_registry_size() if hasattr(c10d, "_get_work_registry_size") else -1
    counts = collections.Counter(native_threads())
    threads = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(counts.items()))
    alive = sum(group() is not None for group in groups)
    held = f"{len(groups)} groups freed" if not alive else f"{alive} of {len(groups)} groups ALIVE"
    return f"{held}; threads [{threads}]; unwaited works {unwaited}; torch {torch.__version__}"


def worker(args: argparse.Namespace) -> int:
    """One rank of the training job; see the module docstring."""
    import torch
    import torch.distributed as dist

    groups: list[weakref.ref] = []
    if args.inspect:
        # Registered before zeroc is imported, so it runs after zeroc's own atexit handler:
        # what is alive then runs into interpreter teardown.
        atexit.register(lambda: report(
            f"rank {os.environ.get('RANK')} alive at exit: {alive_report(groups)}"))
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from models.gpt import GPT, GPTConfig

    import zeroc

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = 2 if args.pp else 1
    dp = world // pp
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4 if args.pp else 2, n_head=2,
                       d_model=32)
    model = GPT(config)
    zeroc.parallelize(model, zero=args.stage, pp=pp)
    options = {"schedule": "dualpipev"} if args.pp else {}
    compiled = torch.compile(model, backend="zeroc", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    rows = 4
    lo = rank % dp * rows
    for _ in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (rows * dp, config.block_size + 1),
                               generator=data)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        loss = compiled(x[lo:lo + rows], y[lo:lo + rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
    shown = loss.detach().clone()
    dist.all_reduce(shown)
    if rank == 0:
        print(f"{LOSS_TAG} {shown.item() / world:.6f} after {args.steps} steps "
              f"(zero {args.stage}, pp {pp}, {world} ranks)", flush=True)
    if args.provoke:
        # A common logging pattern: all-reduce a temporary (tokens seen) right before the end.
        # The tensor's last reference may then be gloo's worker thread's; if the group outlives
        # destroy_process_group, that thread can free it during interpreter teardown.
        for _ in range(args.provoke):
            dist.all_reduce(torch.tensor([float(args.steps * rows * config.block_size)]))
    groups.extend(weakref.ref(g) for g in dist.distributed_c10d._world.pg_map)
    dist.destroy_process_group()
    if args.inspect:
        report(f"rank {rank} alive after destroy: {alive_report(groups)}")
    return 0


# -- driver ------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """The outcome of one torchrun launch."""

    code: int
    seconds: float
    printed_loss: bool
    message: str


@dataclasses.dataclass
class Tally:
    """Outcomes of one configuration."""

    label: str
    runs: list[Run] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(run.code == 0 for run in self.runs)


def failure_message(code: int, output: str) -> str:
    """The most telling lines of a failed run's output (deduplicated, in order)."""
    found: list[str] = []
    for pattern in _FAILURE_PATTERNS:
        for match in pattern.finditer(output):
            line = match.group(0).strip()
            if line not in found:
                found.append(line)
        if len(found) >= 3:
            break
    return "; ".join(found[:3]) if found else f"exit code {code}, no error line"


def launch(stage: int, pp: bool, args: argparse.Namespace) -> Run:
    """Run the worker once under torchrun; return its exit code and what went wrong."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "4" if pp else "2",
        os.path.abspath(__file__), "--worker", "--stage", str(stage), "--steps", str(args.steps),
    ] + (["--pp"] if pp else []) + (["--inspect"] if args.inspect else []) + (
        ["--provoke", str(args.provoke)] if args.provoke else [])
    # A mark in the environment of every process of this run, to stop exactly those if it hangs.
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", **{RUN_MARK: marker})
    start = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        stop_run(process, marker)
        try:
            stdout, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stdout = ""
        return Run(124, time.monotonic() - start, LOSS_TAG in (stdout or ""),
                   f"timed out after {args.timeout} s")
    code = process.returncode
    output = stdout + stderr
    if args.inspect:
        for line in output.splitlines():
            if "alive after destroy" in line or "alive at exit" in line:
                logger.info("  %s", line)
    message = "" if code == 0 else failure_message(code, output)
    if code != 0 and args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        name = f"zero{stage}{'_pp' if pp else ''}_{time.time():.0f}.log"
        with open(os.path.join(args.log_dir, name), "w") as log:
            log.write(output)
        message += f" (log: {os.path.join(args.log_dir, name)})"
    return Run(code, time.monotonic() - start, LOSS_TAG in stdout, message)


def stop_run(process: subprocess.Popen, marker: str) -> None:
    """Stop a hung run: torchrun (which stops its ranks), then any rank still carrying ``marker``.

    torchrun starts every rank in a session of its own, so a signal to torchrun's process group
    does not reach them; they are found by the mark in their environment instead.
    """
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    needle = f"{RUN_MARK}={marker}".encode()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()] if os.path.isdir("/proc") else []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if needle not in environ.read().split(b"\0"):
                    continue
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def table(tallies: Sequence[Tally]) -> str:
    """The summary table: configuration, runs, exit 0, failures and their messages."""
    header = ("configuration", "runs", "exit 0", "printed loss", "failures")
    rows = []
    for tally in tallies:
        failures = collections.Counter(
            f"code {run.code}: {run.message}" for run in tally.runs if run.code != 0)
        text = "; ".join(f"{n}x {m}" for m, n in failures.items()) or "-"
        rows.append((tally.label, str(len(tally.runs)), str(tally.ok),
                     str(sum(run.printed_loss for run in tally.runs)), text))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
    lines = []
    for row in (header, *rows):
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join(cells + [row[-1]]))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> int:
    """Launch the worker ``--runs`` times per configuration; print the table."""
    configs = [] if args.no_dp else [(stage, False) for stage in args.stages]
    if args.pp:
        configs += [(stage, True) for stage in args.stages]
    tallies = []
    for stage, pp in configs:
        label = f"zero {stage}, " + ("4 ranks pp=2 dualpipev" if pp else "2 ranks")
        tally = Tally(label)
        tallies.append(tally)
        for index in range(args.runs):
            run = launch(stage, pp, args)
            tally.runs.append(run)
            logger.info("%s: run %d/%d exit %d in %.1f s%s", label, index + 1, args.runs,
                        run.code, run.seconds, f" ({run.message})" if run.code else "")
    print(table(tallies))
    return 0 if all(t.ok == len(t.runs) for t in tallies) else 1


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30, help="launches per configuration")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=(0, 1, 2, 3),
                        help="ZeRO stages to run (default: 2 3)")
    parser.add_argument("--pp", action="store_true",
                        help="also run 4 ranks with pp=2 and dualpipev (worker: be that job)")
    parser.add_argument("--no-dp", action="store_true",
                        help="with --pp: skip the 2-rank data-parallel configurations")
    parser.add_argument("--steps", type=int, default=15, help="training steps per run")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds before a run counts as hung (default 300)")
    parser.add_argument("--inspect", action="store_true",
                        help="log what every rank still has alive after destroy_process_group")
    parser.add_argument("--provoke", type=int, default=0, metavar="N",
                        help="end the job with N all-reduces of temporary tensors right before "
                        "destroy_process_group (widens the exit race; default 0)")
    parser.add_argument("--log-dir", default=None, help="keep the output of failed runs here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.steps < 1:
        parser.error("--runs and --steps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
