#!/usr/bin/env python3
"""The table of ublk_guest.py's runs: per workload and contender, the
median over rounds of the rate and of the CPU per op, and the rate as a
ratio over the FUSE + loop mapper and over krbd.

    ublk_guest_summary.py UBLK_JSON
"""
import json, statistics, sys

NAMES = {"krbd": "krbd", "mapper": "mapper (FUSE + loop)", "ublk": "ublk-rbd",
         "rbd-nbd": "rbd-nbd"}
WL = {"randwrite": "4K random write", "randread": "4K random read",
      "seqwrite": "4M sequential write", "seqread": "4M sequential read"}


def main():
    j = json.load(open(sys.argv[1]))
    med = {}
    for wl in WL:
        for c in NAMES:
            rs = [r for r in j["rows"] if r["workload"] == wl and r["contender"] == c]
            if rs:
                med[wl, c] = {k: statistics.median(r[k] for r in rs)
                              for k in ("iops", "server_us_per_op", "guest_us_per_op")}
    print(f"kernel {j['kernel']}, {j['rounds']} rounds, scale {j['scale']} (TCG: ratios only)\n")
    print("| workload | contender | op/s | × mapper | × krbd | server CPU µs/op | guest CPU µs/op |")
    print("|---|---|---|---|---|---|---|")
    for wl, wname in WL.items():
        for c, cname in NAMES.items():
            m = med.get((wl, c))
            if not m:
                continue
            base, krbd = med.get((wl, "mapper")), med.get((wl, "krbd"))
            rm = f"{m['iops'] / base['iops']:.2f}×" if base else "–"
            rk = f"{m['iops'] / krbd['iops']:.2f}×" if krbd else "–"
            srv = "–" if c == "krbd" else f"{m['server_us_per_op']:,.0f}"
            print(f"| {wname} | {cname} | {m['iops']:,.1f} | {rm} | {rk} | {srv} | "
                  f"{m['guest_us_per_op']:,.0f} |")


main()
