"""A benchmark's step times on slow links: how much of its communication the step hides.

Runs a benchmark command once per link rate and prints, per configuration: the median step
(ms) at each rate, its ratio to the torch baseline at that rate, and for every shaped rate the
communication the step exposes, ``exposed = step at the rate - step unshaped``, against the
time the link needs for the bytes the step moves, ``wire = bytes per step / rate``:
``hidden % = 100 * (1 - exposed / wire)`` (100: all of it overlapped with compute; 0: the step
grew by the whole transfer time; shown clamped to [0, 100], the JSON keeps the raw value).

``plain`` runs the command as it is; any other rate (tc's units: ``10gbit``, ``2500mbit``,
``1gbit``, ``100mbit``) runs it under ``slowlink --rate RATE -- CMD`` (``--slowlink``;
a private network namespace whose loopback is a token bucket of RATE, so every gloo rank on
127.0.0.1 shares one RATE link). The bytes are therefore all ranks' together:
``pipeline_vs_torch.py``'s ``mb_moved_per_step_total`` (``--bytes max`` takes the largest
rank's instead). ``zero_vs_fsdp2.py`` reports no bytes: its step ratios are shown and hidden %
is skipped. ``{json}`` in the command is replaced by a fresh path per run, whose
``results`` (or ``medians``) are read. ``--repeats R`` runs the rates round-robin R times (so
load falls on every rate alike) and reports medians; each inner run may use ``--repeats 1``.
Baselines: ``torch_<schedule>`` for ``zeroc*_<schedule>``, ``fsdp2`` for zero_vs_fsdp2's
configurations, or ``--baseline NAME`` for all.

    python benchmarks/slow_link.py --rates plain,10gbit,1gbit --repeats 3 -- \\
        python benchmarks/pipeline_vs_torch.py --world 2 --dp 2 --repeats 1 --json {json}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from tabulate import tabulate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOWLINK = os.path.normpath(os.path.join(REPO, "..", "shared", "tools", "slowlink"))
PLAIN = "plain"
# tc's rate units, in bits per second per unit.
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def bits_per_second(rate: str) -> float:
    """``10gbit`` -> 1e10; raise ``ValueError`` for what tc's units do not spell."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate.strip().lower())
    if not match or match.group(2) not in UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"rate {rate!r}: expected a positive number and one of {list(UNITS)}, "
                         f"e.g. 10gbit, 1gbit, 500mbit, or {PLAIN!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def read_results(payload: dict[str, Any], bytes_key: str) -> dict[str, dict[str, Any]]:
    """Per configuration: step ms, MB moved per step (None where not reported), its kind."""
    if "results" in payload:  # pipeline_vs_torch.py
        return {name: {"step_ms": r.get("step_median_ms"), "mb": r.get(bytes_key),
                       "kind": name} for name, r in payload["results"].items()}
    if "medians" in payload:  # zero_vs_fsdp2.py
        return {name: {"step_ms": s["medians"].get("step_ms"), "mb": None,
                       "kind": s.get("kind", name)} for name, s in payload["medians"].items()}
    raise ValueError(f"neither 'results' nor 'medians' in the JSON (keys: {list(payload)})")


def baseline_of(config: str, kind: str, configs: dict[str, Any], chosen: str | None) -> str | None:
    """The configuration ``config``'s step is divided by, or None if there is none."""
    if chosen:
        return chosen if chosen in configs else None
    if "_" in config and config.split("_", 1)[0].startswith("zeroc"):
        candidate = "torch_" + config.split("_", 1)[1]
        if candidate in configs:
            return candidate
    if kind.startswith("torch_") or config.startswith("torch_"):
        return config
    return next((c for c, r in configs.items() if r["kind"] == "fsdp2"), None)


def run_once(command: list[str], rate: str, args: argparse.Namespace, log_dir: str,
             label: str) -> dict[str, dict[str, Any]] | None:
    """Run ``command`` at ``rate``; its results, or None (the log's tail printed) if it failed."""
    handle, path = tempfile.mkstemp(prefix=f"{label}-", suffix=".json", dir=log_dir)
    os.close(handle)
    os.remove(path)  # the benchmark writes it; an empty leftover would look like a result
    argv = [part.replace("{json}", path) for part in command]
    if rate != PLAIN:
        argv = [args.slowlink, "--rate", rate, "--burst", args.burst, "--", *argv]
    log = os.path.join(log_dir, f"{label}.log")
    begin = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=args.cwd,
                                  timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = f"timed out after {args.timeout:.0f} s"
    wall = time.perf_counter() - begin
    if code != 0 or not os.path.exists(path):
        with open(log) as out:
            tail = "".join(out.readlines()[-30:])
        print(f"  {label}: FAILED (exit {code}, {wall:.0f} s; log {log}):\n{tail}",
              file=sys.stderr, flush=True)
        return None
    with open(path) as handle_json:
        results = read_results(json.load(handle_json), args.bytes_key)
    steps = ", ".join(f"{c} {fmt(r['step_ms'])}" for c, r in results.items())
    print(f"  {label}: {wall:.0f} s; step ms: {steps}", flush=True)
    return results


def fmt(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals, or n/a."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def median(values: list[float | None]) -> float | None:
    """Median of the values that are not None, or None."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: dict[str, list[dict | None]], rates: list[str], baseline: str | None
              ) -> dict[str, dict[str, Any]]:
    """Per configuration and rate: median step, ratio to its baseline, exposed, wire, hidden."""
    configs: dict[str, dict[str, Any]] = {}
    for rate in rates:
        for results in runs[rate]:
            for name, r in (results or {}).items():
                configs.setdefault(name, {"kind": r["kind"]})
    table: dict[str, dict[str, Any]] = {}
    for name in configs:
        row: dict[str, Any] = {"per_rate": {}}
        for rate in rates:
            done = [r[name] for r in runs[rate] if r and name in r]
            row["per_rate"][rate] = {"step_ms": median([d["step_ms"] for d in done]),
                                     "step_ms_per_repeat": [d["step_ms"] for d in done],
                                     "mb": median([d["mb"] for d in done])}
        row["baseline"] = baseline_of(name, configs[name]["kind"], configs, baseline)
        table[name] = row
    plain = rates[0] if PLAIN not in rates else PLAIN
    for row in table.values():
        base = table.get(row["baseline"]) if row["baseline"] else None
        unshaped = row["per_rate"][plain]["step_ms"]
        for rate, cell in row["per_rate"].items():
            theirs = base["per_rate"][rate]["step_ms"] if base else None
            cell["ratio"] = (cell["step_ms"] / theirs
                             if cell["step_ms"] is not None and theirs else None)
            if rate == plain or PLAIN not in rates:
                continue
            mb = cell["mb"] if cell["mb"] is not None else row["per_rate"][plain]["mb"]
            if cell["step_ms"] is None or unshaped is None:
                continue
            cell["exposed_ms"] = cell["step_ms"] - unshaped
            if mb:
                cell["wire_ms"] = 1000 * mb * 1e6 * 8 / bits_per_second(rate)
                cell["hidden_pct"] = 100 * (1 - cell["exposed_ms"] / cell["wire_ms"])
    return table


def hidden_text(value: float | None) -> str:
    """Hidden % clamped to [0, 100] for display, ``*`` marking a clamped value."""
    if value is None:
        return "n/a"
    shown = min(100.0, max(0.0, value))
    return f"{shown:.0f}" + ("*" if shown != value else "")


def report(table: dict[str, dict[str, Any]], rates: list[str]) -> str:
    """The step table (ms and ratio per link) and, where bytes are known, the hidden table."""
    rows = [[name, row["baseline"] or "n/a"]
            + [fmt(row["per_rate"][r]["step_ms"]) for r in rates]
            + [fmt(row["per_rate"][r]["ratio"], 2) + "x"
               if row["per_rate"][r]["ratio"] is not None else "n/a" for r in rates]
            for name, row in table.items()]
    text = tabulate(rows, disable_numparse=True, headers=[
        "config", "baseline", *[f"step ms {r}" for r in rates],
        *[f"vs baseline {r}" for r in rates]])
    shaped = [r for r in rates if r != PLAIN]
    if PLAIN not in rates or not shaped:
        return text + f"\n\n(no exposed communication: it needs {PLAIN!r} and a shaped rate)"
    if not any(row["per_rate"][PLAIN]["mb"] for row in table.values()):
        return text + "\n\n(the benchmark reports no bytes moved: hidden % skipped)"
    rows = []
    for name, row in table.items():
        cells = [name, fmt(row["per_rate"][PLAIN]["mb"], 3)]
        for rate in shaped:
            cell = row["per_rate"][rate]
            cells += [fmt(cell.get("exposed_ms")), fmt(cell.get("wire_ms")),
                      hidden_text(cell.get("hidden_pct"))]
        rows.append(cells)
    headers = ["config", "MB moved/step"]
    for rate in shaped:
        headers += [f"exposed ms {rate}", f"bytes/rate ms {rate}", f"hidden % {rate}"]
    return (text + "\n\n" + tabulate(rows, disable_numparse=True, headers=headers)
            + "\n(exposed = step at the rate - step plain; hidden % = 100 * (1 - exposed / "
              "(bytes/rate)), * = clamped to [0, 100] for display)")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Options before ``--``, and the benchmark command after it."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        command, own = [], argv
    else:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        usage="%(prog)s [options] -- BENCHMARK COMMAND ... --json {json} ...")
    parser.add_argument("--rates", default=f"{PLAIN},10gbit,1gbit",
                        help=f"comma-separated link rates in tc's units; {PLAIN!r} = unshaped")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over the rates (round-robin); medians are reported")
    parser.add_argument("--slowlink", default=SLOWLINK, help="the slowlink script")
    parser.add_argument("--burst", default="1mb", help="slowlink's token-bucket burst")
    parser.add_argument("--baseline", help="configuration every other one is divided by")
    parser.add_argument("--bytes", choices=("total", "max"), default="total",
                        help="bytes per step: all ranks' (a shared link) or the largest rank's")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per inner run")
    parser.add_argument("--cwd", default=REPO, help="where the command runs (the repo root)")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON here")
    args = parser.parse_args(own)
    if not command:
        parser.error("no benchmark command: put it after '--'")
    if not any("{json}" in part for part in command):
        parser.error("the command must contain {json} (e.g. '--json {json}'): the results are "
                     "read from there")
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not args.rates or len(set(args.rates)) != len(args.rates):
        parser.error(f"--rates: {args.rates} must name distinct rates")
    for rate in args.rates:
        if rate != PLAIN:
            try:
                bits_per_second(rate)
            except ValueError as error:
                parser.error(f"--rates: {error}")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    if any(r != PLAIN for r in args.rates) and not os.access(args.slowlink, os.X_OK):
        parser.error(f"--slowlink {args.slowlink}: not an executable file (shaped rates need "
                     "it)")
    args.bytes_key = "mb_moved_per_step_total" if args.bytes == "total" else "mb_moved_per_step"
    return args, command


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the command at every rate, R rounds; print the tables; return them."""
    args, command = parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="slow-link-")
    print(f"{' '.join(command)}\nrates {args.rates}, {args.repeats} round(s); logs in {log_dir}",
          flush=True)
    runs: dict[str, list[dict | None]] = {rate: [] for rate in args.rates}
    for repeat in range(args.repeats):
        for rate in args.rates:
            label = f"r{repeat + 1}-{rate}"
            runs[rate].append(run_once(command, rate, args, log_dir, label))
    if not any(any(r) for r in runs.values()):
        sys.exit("slow_link: every run failed (see the logs above)")
    table = summarize(runs, args.rates, args.baseline)
    print(f"\nMedians over {args.repeats} round(s):\n{report(table, args.rates)}")
    payload = {"command": command, "rates": args.rates, "repeats": args.repeats,
               "bytes": args.bytes, "configs": table}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return payload


if __name__ == "__main__":
    main()
