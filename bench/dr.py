"""The disaster-recovery group of bench/run (issue 28): failover time and
replication lag of a claim mirrored between two Ceph clusters through
VolumeReplications served by `rbdkit provisioner`, measured by
tests/it/mirror_dr.rs against two real clusters with an rbd-mirror daemon
each way, the test control plane and the test node, side by side in the
same run with the same Ceph steps done directly through librbd (the
floors). See bench/README.md, section 8.

Each round runs the test binary once per case (`planned`: A demoted, then B
promoted; `site-lost`: all of A's daemons stopped, B force-promoted) with
RBDKIT_DR_FLOORS=1 and reads the one `DR-MEASURE` JSON line each prints.
"""

import json
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST = "mirror_dr::a_claim_fails_over_to_the_peer_site_and_back_planned_and_after_a_site_loss"
CASES = ["planned", "site-lost"]
RUN_TIMEOUT = 1800


def log(msg):
    print(f"bench: {msg}", flush=True, file=__import__("sys").stderr)


def test_binary():
    """Builds the `it` test binary (debug, as the suite runs it) with
    scripts/it-binary; its path. A failed build raises with cargo's
    messages."""
    out = subprocess.run([str(REPO / "scripts" / "it-binary")], cwd=REPO, capture_output=True,
                         text=True, timeout=RUN_TIMEOUT)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/it-binary failed: {out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def failure_excerpt(stderr):
    """What says why a run failed: each panic's message (the backtrace after
    it left out), then the end of the output (the logs the test prints)."""
    lines = stderr.splitlines()
    keep = []
    for i, line in enumerate(lines):
        if "panicked at" in line:
            for msg in lines[i:i + 30]:
                if msg.startswith("stack backtrace:"):
                    break
                keep.append(msg)
    return "\n".join(keep + ["--- end of the output ---", stderr[-1500:]])


def run_case(binary, case, file_mib):
    env = dict(os.environ, RBDKIT_DR_FLOORS="1", RBDKIT_DR_FILE_MIB=str(file_mib),
               RBDKIT_DR_CASES=case)
    t = time.perf_counter()
    p = subprocess.run([binary, "--exact", TEST, "--nocapture", "--test-threads", "1"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    elapsed = time.perf_counter() - t
    for line in (p.stderr + p.stdout).splitlines():
        if line.startswith("DR-MEASURE "):
            m = json.loads(line[len("DR-MEASURE "):])
            m["test_s"] = elapsed
            if p.returncode != 0:
                raise RuntimeError(f"{case}: the test failed after measuring:\n"
                                   f"{failure_excerpt(p.stderr)}")
            return m
    raise RuntimeError(f"{case}: no DR-MEASURE line (exit {p.returncode}):\n"
                       f"{failure_excerpt(p.stderr)}")


def section_dr(cfg, errors):
    binary = test_binary()
    rounds = []
    for r in range(cfg["dr_rounds"]):
        rd = {}
        for case in cfg["dr_cases"]:
            log(f"dr round {r + 1}/{cfg['dr_rounds']}: {case}")
            try:
                rd[case] = run_case(binary, case, cfg["dr_file_mib"])
            except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as e:
                errors.append(f"dr/{case}: {e}")
        rounds.append(rd)
    return {"rounds": rounds, "file_mib": cfg["dr_file_mib"]}


# The figures, in order, and their floors.
FIGURES = [
    ("replication_lag_s", "lag_floor_s", "replication lag of one mirror snapshot"),
    ("promoted_s", "promote_floor_s", "failover request → B's VolumeReplication Primary"),
    ("failover_read_s", None, "failover request → a pod on B has read the data"),
]


def summarize(dr, spread, med):
    per, ratios = {}, {}
    for case in CASES:
        ok = [rd[case] for rd in dr["rounds"] if case in rd]
        if not ok:
            continue
        per[case] = {k: spread([m[k] for m in ok if k in m])
                     for k in sorted({k for m in ok for k in m if k.endswith("_s")})}
        for fig, floor, _ in FIGURES:
            if floor:
                xs = [m[fig] / m[floor] for m in ok if m.get(floor)]
                if xs:
                    ratios[f"{case}|{fig}"] = spread(xs)
    return {"per": per, "ratios": ratios}


def render(results, summary, cfg, fmt_ratio, fmt_num):
    dr = results.get("dr")
    s = summary.get("dr")
    if not dr or not s or not s["per"]:
        return []

    def secs(sp):
        if not sp:
            return "–"
        if sp["n"] == 1:
            return f"{sp['median']:.1f} s"
        return f"{sp['median']:.1f} s ({sp['min']:.1f}–{sp['max']:.1f})"

    L = ["## 8. Disaster recovery: failover time and replication lag (issue 28)", ""]
    L.append(
        f"One claim mirrored between two clusters (snapshot-based RBD mirroring, an rbd-mirror "
        f"daemon each way, on this one machine) through VolumeReplications served by the "
        f"provisioner; a pod on the test node wrote a {dr['file_mib']} MiB file. "
        f"`planned`: A's VolumeReplication set to secondary, B's to primary; `site-lost`: all "
        f"of A's daemons stopped, B's set to primary (force-promoted). Floors, in the same run: "
        f"the lag floor is one librbd client reading the file's size on A and writing it to B; "
        f"the promotion floor is the same mirror steps on another image done directly with the "
        f"library (demote on A and promote on B once the demotion arrived, or B's force "
        f"promotion). Median (min–max) over {len(dr['rounds'])} round(s).")
    L.append("")
    L.append("| case | figure | rbdkit | floor | rbdkit / floor |")
    L.append("|---|---|---|---|---|")
    for case in CASES:
        per = s["per"].get(case)
        if not per:
            continue
        for fig, floor, what in FIGURES:
            ratio = s["ratios"].get(f"{case}|{fig}")
            L.append(f"| {case} | {what} | {secs(per.get(fig))} | "
                     f"{secs(per.get(floor)) if floor else '–'} | "
                     f"{fmt_ratio(ratio) if ratio else '–'} |")
    L.append("")
    return L
