"""Per-op summary of node_layers.py's output: node_layers_summary.py OUTDIR CASES."""
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
for tag in sys.argv[2].split(","):
    r = json.loads((out / f"{tag}.json").read_text())
    secs = r["secs"]
    o0, o1 = r["osd0"], r["osd1"]
    dw = o1["op_w"] - o0["op_w"]
    lat = lambda k: (o1[k]["sum"] - o0[k]["sum"]) / max(1, (o1[k]["avgcount"] - o0[k]["avgcount"])) * 1e6
    loop_w = inflight = None
    if r["loop_stat0"]:
        s0, s1 = list(map(int, r["loop_stat0"])), list(map(int, r["loop_stat1"]))
        loop_w = s1[4] - s0[4]
        # time_in_queue (ms, weighted by requests in flight) over the window
        inflight = f"{(s1[10] - s0[10]) / (secs * 1e3):.1f}"
    ops = loop_w if loop_w else dw
    print(f"== {tag}: {secs:.1f} s, OSD writes {dw} ({dw / secs:.0f}/s), loop writes {loop_w} "
          f"({(loop_w or 0) / secs:.0f}/s); OSD op_w_latency {lat('op_w_latency'):.0f} us, "
          f"process {lat('op_w_process_latency'):.0f} us; loop in-flight mean "
          f"{inflight}; ops basis {ops}")
    groups = {}
    for k, v in r["cpu"].items():
        g, comm = k.split("|", 1)
        groups.setdefault(g, []).append((v, comm))
    tot = 0
    for g, lst in sorted(groups.items(), key=lambda x: -sum(v for v, _ in x[1])):
        s = sum(v for v, _ in lst)
        if s / secs < 0.01:
            continue
        tot += s
        top = ", ".join(f"{c} {v * 1e6 / ops:.1f}" for v, c in sorted(lst, reverse=True)[:8] if v * 1e6 / ops >= 0.5)
        print(f"  {g:28s} {s / secs * 100:5.1f}% CPU  {s * 1e6 / ops:7.1f} us/op   [{top}]")
    print(f"  total listed {tot / secs * 100:.0f}% CPU, {tot * 1e6 / ops:.1f} us/op")
    # traces
    tf = out / f"{tag}.trace.txt"
    if tf.exists():
        issue, blat, send, flat = {}, [], {}, []
        for ln in tf.read_text().splitlines():
            m = re.search(r"\s(\d+\.\d+):\s+(\S+):\s+(.*)", ln)
            if not m:
                continue
            t, ev, rest = float(m.group(1)), m.group(2), m.group(3)
            if ev.startswith("block:block_rq_issue") or ev.startswith("block:block_rq_complete"):
                mm = re.match(r"(\d+),(\d+) (\S+) .*?(\d+) \+ (\d+)", rest)
                if not mm or mm.group(1) != "7":
                    continue
                key = (mm.group(2), mm.group(4))
                if "issue" in ev:
                    issue[key] = t
                elif key in issue:
                    blat.append(t - issue.pop(key))
            elif ev.startswith("fuse:fuse_request_send"):
                mm = re.search(r"req (\d+) opcode (\d+)", rest)
                if mm and mm.group(2) in ("15", "16"):
                    send[mm.group(1)] = t
            elif ev.startswith("fuse:fuse_request_end"):
                mm = re.search(r"req (\d+)", rest)
                if mm and mm.group(1) in send:
                    flat.append(t - send.pop(mm.group(1)))
        f = lambda xs: f"n={len(xs)} mean {sum(xs) / len(xs) * 1e6:.0f} us" if xs else "n=0"
        print(f"  loop rq issue->complete: {f(blat)}; FUSE READ/WRITE send->end: {f(flat)}")
