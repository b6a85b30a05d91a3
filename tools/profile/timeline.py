#!/usr/bin/env python3
"""Merge the RUCX_PROFILE files of a ping-pong's processes and print where an iteration's time goes.

    RUCX_PROFILE=/tmp/tl rucx-perftest --local -m cuda -t tag_lat -s 8 -n 2000
    python3 tools/profile/timeline.py /tmp/tl.*

Every file is one process (PREFIX.PID, lines `ns thread point arg`, the monotonic clock shared by
the host's processes). The records of all files are merged in time and cut into iterations at
each record of the anchor point (default `perftest.client.iter`, marked by the perftest client
at the start of every round trip). Iterations whose sequence of points is the most frequent one
are lined up, and for each step the median time since the previous step and since the
iteration's start is printed, so a step that costs more than it should stands out. The process
that marks the anchor is `C`, the others `S` (or their pids, when there are more than two).
"""
import argparse
import collections
import statistics
import sys

AM_NAMES = {1: "WIREUP", 2: "EAGER_SHORT", 3: "EAGER_ONE", 4: "EAGER_FIRST", 5: "EAGER_MIDDLE",
            6: "RTS", 7: "ATS", 8: "RTR", 9: "DATA", 10: "FIN", 11: "USER", 12: "PULL", 13: "FRAG",
            14: "FRAG_ACK", 15: "EAGER_SYNC", 16: "STREAM_DATA", 17: "ABORT", 18: "KEEPALIVE",
            22: "USER_RTS", 23: "STAGING_OFFER"}


def read(path):
    pid = path.rsplit(".", 1)[-1]
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                print(f"{path}: {line.strip()}", file=sys.stderr)
                continue
            ns, tid, point, arg = line.rstrip("\n").split("\t")
            out.append((int(ns), pid, point, int(arg)))
    return pid, out


def label(role, point, arg):
    if point in ("am.send", "am.recv"):
        return f"{role} {point} {AM_NAMES.get(arg, arg)}"
    return f"{role} {point}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--anchor", default="perftest.client.iter")
    ap.add_argument("--skip", type=int, default=100, help="iterations to leave out first (warm-up)")
    a = ap.parse_args()
    recs, pids = [], []
    for p in a.files:
        pid, r = read(p)
        pids.append(pid)
        recs.extend(r)
    recs.sort()
    anchor_pids = {pid for _, pid, point, _ in recs if point == a.anchor}
    if not anchor_pids:
        sys.exit(f"no record of the anchor point {a.anchor!r} in {len(a.files)} files")
    if len(pids) == 2:
        role = {p: ("C" if p in anchor_pids else "S") for p in pids}
    else:
        role = {p: p for p in pids}
    cycles, cur = [], None
    for ns, pid, point, arg in recs:
        if point == a.anchor:
            if cur:
                cycles.append(cur)
            cur = []
        if cur is not None:
            cur.append((ns, label(role[pid], point, arg)))
    cycles = cycles[a.skip:]
    if not cycles:
        sys.exit("no complete iteration after the warm-up")
    lengths = [c[-1][0] - c[0][0] for c in cycles]
    sigs = collections.Counter(tuple(l for _, l in c) for c in cycles)
    sig, count = sigs.most_common(1)[0]
    same = [c for c in cycles if tuple(l for _, l in c) == sig]
    print(f"{len(cycles)} iterations; the most frequent sequence of points: {count} "
          f"({100.0 * count / len(cycles):.1f}%), {len(sigs)} sequences in all")
    print(f"round trip to the last point, median: all {statistics.median(lengths) / 1e3:.2f} us, "
          f"those {statistics.median([c[-1][0] - c[0][0] for c in same]) / 1e3:.2f} us")
    print(f"{'step':<44} {'since previous (us)':>20} {'since start (us)':>17}")
    for i, l in enumerate(sig):
        d = statistics.median([c[i][0] - c[i - 1][0] for c in same]) if i else 0
        t = statistics.median([c[i][0] - c[0][0] for c in same])
        print(f"{l:<44} {d / 1e3:>20.2f} {t / 1e3:>17.2f}")


if __name__ == "__main__":
    main()
