"""What ``zeroc.calibrate()`` measures of the link between gloo ranks, against the link's rate.

Starts ``--world`` gloo ranks on this machine (``zeroc.cli.launch.run_ranks``); each calls
``zeroc.calibrate(force=True)`` into a fresh cache directory, so nothing measured before (on
another link) is reused. Printed per measured kind (p2p, all-gather, reduce-scatter,
all-reduce): the fitted latency and bandwidth (``bytes_per_s``: the kind's message bytes per
second, as the profile keeps it) and the link rate it implies, ``wire``: the bytes that cross
the link per second. Under ``slowlink`` every rank's traffic shares one loopback of the given
rate, so ``wire`` counts all ranks' bytes: a p2p message once; a ring all-gather or
reduce-scatter of ``n`` bytes on ``W`` ranks ``(W - 1) * n``; an all-reduce twice that (gloo
runs zeroc's reduce-scatter as an all-reduce: the profile says which op ran). With
``--rate`` the table adds ``wire / rate``: how close the calibration comes to the link.

    python benchmarks/calibrate_link.py --world 2 --json calibrate_plain.json
    ../shared/tools/slowlink --rate 1gbit -- \\
        python benchmarks/calibrate_link.py --world 2 --rate 1gbit --json calibrate_1g.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from slow_link import bits_per_second  # benchmarks/ is this script's directory
from tabulate import tabulate

from zeroc.cli.launch import run_ranks


def wire_factor(kind: str, op: str, world: int) -> float:
    """Bytes crossing a shared link per message byte of ``kind`` (module docstring)."""
    if kind in ("send", "recv"):
        return 1.0
    if kind == "all_reduce" or "all_reduce" in op:
        return 2.0 * (world - 1)
    return float(world - 1)


def _calibrate(rank: int, world: int, seconds: float) -> dict | None:
    import zeroc

    with tempfile.TemporaryDirectory() as cache:
        profile = zeroc.calibrate(cache_dir=cache, seconds=seconds, force=True)
    if rank != 0:
        return None
    return {"collectives": profile.collectives, "intra_node_bytes_per_s":
            profile.intra_node_bytes_per_s, "note": profile.collectives_note}


def rows(measured: dict, world: int, rate: float | None) -> list[dict]:
    """One row per (kind, group) fit: latency, bytes/s, wire bytes/s, wire / rate."""
    out = []
    for kind, groups in sorted(measured["collectives"].items()):
        if kind == "recv":
            continue  # the same fit as "send": one p2p measurement
        for label, fit in sorted(groups.items()):
            size = int(label.split(":")[0])
            wire = fit["bytes_per_s"] * wire_factor(kind, fit["op"], size)
            out.append({"kind": "p2p" if kind == "send" else kind, "group": label,
                        "op": fit["op"], "latency_us": fit["latency_s"] * 1e6,
                        "bytes_per_s": fit["bytes_per_s"], "wire_bytes_per_s": wire,
                        "wire_over_rate": wire / rate if rate else None})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks (2 to 8)")
    parser.add_argument("--rate", help="the link's rate in tc's units (1gbit, 10gbit)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="zeroc.calibrate's seconds per measurement (default its own)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the ranks")
    parser.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = parser.parse_args(argv)
    if not 2 <= args.world <= 8:
        parser.error(f"--world {args.world}: give 2 to 8 ranks")
    try:
        rate = bits_per_second(args.rate) / 8 if args.rate else None
    except ValueError as error:
        parser.error(str(error))
    measured = run_ranks(_calibrate, args.world, args.seconds, timeout=args.timeout)[0]
    table = rows(measured, args.world, rate)
    headers = ["kind", "group", "op", "latency (us)", "MB/s", "wire MB/s"]
    body = [[r["kind"], r["group"], r["op"].split(" (")[0], f"{r['latency_us']:.0f}",
             f"{r['bytes_per_s'] / 1e6:.1f}", f"{r['wire_bytes_per_s'] / 1e6:.1f}"]
            for r in table]
    if rate:
        headers.append(f"wire / {args.rate}")
        for line, r in zip(body, table, strict=True):
            line.append(f"{r['wire_over_rate']:.2f}")
    print(tabulate(body, headers=headers))
    print(f"profile link (ring model of the all-gather): "
          f"{measured['intra_node_bytes_per_s'] / 1e6:.1f} MB/s; {measured['note']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"world": args.world, "rate": args.rate, "rate_bytes_per_s": rate,
                       "rows": table, "link_bytes_per_s": measured["intra_node_bytes_per_s"]},
                      handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
