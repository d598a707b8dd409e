"""Where a kernel's warps wait, from Nsight Compute's source page of one profiled launch (the CSV
that scripts/profile_source.sh writes: `ncu -i REPORT --page source --csv --print-source sass`):
the stall reasons over the whole kernel, then, in address order, every SASS instruction that holds
at least --min-share of the warp samples, with its execution count and its top stall reasons.
Barrier waits, wgmma waits and the stores of an epilogue stand out as single lines.

    python scripts/stall_summary.py src-d128.csv [--min-share 0.003]
"""

import argparse
import collections
import csv


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--min-share", type=float, default=0.003, help="of all warp samples (default 0.3%%)")
    args = parser.parse_args()
    with open(args.csv, errors="replace") as f:
        rows = list(csv.reader(f))
    start = next(i for i, row in enumerate(rows) if "Source" in (c.strip() for c in row))
    head, body = rows[start], [row for row in rows[start + 1:] if len(row) == len(rows[start])]
    samples, executed = head.index("Warp Stall Sampling (All Samples)"), head.index("Instructions Executed")
    reasons = [i for i, name in enumerate(head) if name.startswith("stall_") and "Not Issued" not in name]
    total = sum(number(row[samples]) for row in body) or 1.0
    totals = collections.Counter()
    for row in body:
        for i in reasons:
            totals[head[i][len("stall_"):]] += number(row[i])
    print(f"{int(total)} warp samples over {len(body)} SASS instructions; by reason: " +
          ", ".join(f"{name} {100 * n / total:.1f}%" for name, n in totals.most_common(8)))
    base = int(body[0][0], 16)
    for row in body:
        share = number(row[samples]) / total
        if share < args.min_share:
            continue
        top = sorted(((number(row[i]), head[i][len("stall_"):]) for i in reasons), reverse=True)[:2]
        why = " ".join(f"{name} {100 * n / total:.1f}" for n, name in top if n > 0)
        print(f"{int(row[0], 16) - base:6x} {100 * share:5.2f}% x{row[executed]:>9} {row[1].strip()[:64]:64} {why}")


if __name__ == "__main__":
    main()
