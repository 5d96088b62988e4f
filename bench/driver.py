"""Side-by-side benchmark driver for rbdkit (started by bench/run).

Starts a throwaway cluster, builds the contenders, runs every comparison
interleaved round by round, and writes bench/results/latest.json plus the
table in BENCHMARKS.md (or, with --smoke, bench/results/smoke.json only).
Runs under Debian's /usr/bin/python3 so that the rbd/rados modules import.
See bench/README.md.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import node  # noqa: E402 - bench/node.py, next to this file
import burst  # noqa: E402 - bench/burst.py
import snapshot  # noqa: E402 - bench/snapshot.py
import dr  # noqa: E402 - bench/dr.py

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
CACHE = Path(os.environ.get("RBDKIT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rbdkit") / "bench"
POOL = "rbd"
GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

# --------------------------------------------------------------------------
# Configuration: full run and smoke run
# --------------------------------------------------------------------------

FULL = {
    "control_rounds": 5,
    "control_cycles": 10,
    "conc_rounds": 3,
    "conc_levels": [1, 8, 32, 64],
    "conc_images": 128,
    "data_rounds": 4,
    "data_image_bytes": 1 * GiB,
    # (workload, block size, queue depth, ops)
    "data_workloads": [
        ("randwrite", 4 * KiB, 1, 1500),
        ("randwrite", 4 * KiB, 16, 6000),
        ("randwrite", 4 * KiB, 64, 6000),
        ("randread", 4 * KiB, 1, 2000),
        ("randread", 4 * KiB, 16, 12000),
        ("randread", 4 * KiB, 64, 12000),
        ("seqwrite", 64 * KiB, 16, 3072),
        ("seqread", 64 * KiB, 16, 3072),
        ("seqwrite", 4 * MiB, 16, 192),
        ("seqread", 4 * MiB, 16, 192),
    ],
    # The node group (bench/node.py): fio through the userspace mapper.
    # Sized so that the fastest contender, write-through `rbd bench`
    # among them, runs 2-3 s on an idle machine (issue 39: its old 8 k ops
    # ran under a second); a run under node_min_run_s is refused.
    "node_rounds": 3,
    "node_image_bytes": 1 * GiB,
    "node_workloads": [
        ("randwrite", 4 * KiB, 16, 40000),
        ("randread", 4 * KiB, 16, 64000),
        ("seqwrite", 4 * MiB, 16, 768),
        ("seqread", 4 * MiB, 16, 1536),
    ],
    "node_min_run_s": 1.0,
    "memstore": "6G",
    # The claim burst (bench/burst.py): claims per burst, rounds, and the
    # PVs in the caches for the peak-RSS run.
    "burst_claims": 500,
    "burst_rounds": 1,
    "burst_rss_pvs": 1000,
    # Snapshots and restores (bench/snapshot.py): the source claim's size,
    # the bytes written into it, rounds.
    "snapshot_image_bytes": 10 * GiB,
    "snapshot_written_bytes": 1 * GiB,
    "snapshot_rounds": 10,
    # Disaster recovery (bench/dr.py): rounds, cases, the file a pod writes.
    "dr_rounds": 3,
    "dr_cases": ["planned", "site-lost"],
    "dr_file_mib": 64,
}

SMOKE = {
    "control_rounds": 1,
    "control_cycles": 2,
    "conc_rounds": 1,
    "conc_levels": [1, 32],
    "conc_images": 32,
    "data_rounds": 1,
    "data_image_bytes": 64 * MiB,
    "data_workloads": [
        ("randwrite", 4 * KiB, 1, 50),
        ("randwrite", 4 * KiB, 16, 200),
        ("randread", 4 * KiB, 16, 200),
        ("seqwrite", 4 * MiB, 16, 16),
        ("seqread", 4 * MiB, 16, 16),
    ],
    "node_rounds": 1,
    "node_image_bytes": 64 * MiB,
    "node_workloads": [
        ("randwrite", 4 * KiB, 16, 200),
        ("randread", 4 * KiB, 16, 200),
        ("seqwrite", 4 * MiB, 16, 8),
        ("seqread", 4 * MiB, 16, 8),
    ],
    # Smoke proves that every contender runs: any measured time is taken
    # (too short to mean a rate, never refused, never a parsed "inf").
    "node_min_run_s": 0.0,
    "memstore": "2G",
    "burst_claims": 20,
    "burst_rounds": 1,
    "burst_rss_pvs": 40,
    "snapshot_image_bytes": 256 * MiB,
    "snapshot_written_bytes": 16 * MiB,
    "snapshot_rounds": 1,
    "dr_rounds": 1,
    "dr_cases": ["planned"],
    "dr_file_mib": 4,
}

ALL_SECTIONS = ["control", "concurrency", "data", "node", "burst", "snapshot", "dr"]
# Kubernetes and the provisioner, not the Ceph release: not run by default
# inside a scripts/ceph-release root.
K8S_SECTIONS = {"burst", "snapshot", "dr"}
IMAGE_BYTES = 1 * GiB  # control-path images (thin: nothing is written)
RUN_TIMEOUT = 600  # seconds for any one contender process

# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------


def log(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def med(xs):
    return statistics.median(xs) if xs else None


def rotate(items, r):
    """Round r's running order: rotated by r so that no contender always
    runs first, and reversed in odd rounds so that no contender always runs
    right after the same other one (whose after-effects on the cluster it
    would otherwise always inherit)."""
    k = r % len(items)
    order = items[k:] + items[:k]
    return order[::-1] if r % 2 else order


SETTLE_S = 0.3  # pause between contender processes, so one's tail is not the next one's start


def settle():
    time.sleep(SETTLE_S)


class RunError(Exception):
    pass


def parse_rbd_bench(out):
    """(ops/sec, ops) from `rbd bench`'s summary line; ops/sec may be inf."""
    m = re.search(r"elapsed:\s*[\d.]+\s+ops:\s*(\d+)\s+ops/sec:\s*([\w.+-]+)", out)
    if not m:
        raise RunError(f"rbd bench: cannot parse {out[-300:]!r}")
    try:
        return float(m.group(2)), int(m.group(1))
    except ValueError:
        raise RunError(f"rbd bench: cannot parse ops/sec in {out[-300:]!r}") from None


def run_proc(cmd, env=None, timeout=RUN_TIMEOUT):
    """Run one process; return (stdout, wall seconds, peak RSS KiB, CPU seconds).

    Peak RSS and CPU time (user + system) come from wait4() on that very
    process, so each contender's figures are its own."""
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env)
        timer = threading.Timer(timeout, lambda: os.kill(p.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
    if p.returncode != 0:
        tail = (err.strip() or out.strip())[-600:]
        raise RunError(f"{' '.join(map(str, cmd[:3]))}... exited {p.returncode}: {tail}")
    return out, wall, ru.ru_maxrss, ru.ru_utime + ru.ru_stime


def run_json(cmd, env=None):
    out, wall, rss, cpu = run_proc(cmd, env)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        raise RunError(f"{cmd[0]}: no JSON on stdout: {out[-300:]}")
    res = json.loads(lines[-1])
    res["peak_rss_kib"] = rss
    res["wall_s"] = wall
    res["cpu_s"] = cpu
    return res


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw).stdout


# --------------------------------------------------------------------------
# Building the contenders
# --------------------------------------------------------------------------


def build_rbdkit(smoke):
    """rbdkit-bench: release for a full run; for smoke the debug build, whose
    dependencies the test run has already built (smoke proves every
    contender runs, not how fast)."""
    return cargo_built(smoke, "rbdkit-bench", ["-p", "rbdkit-bench"])


def build_mapper(smoke):
    """The `rbdkit` binary for the node group's `rbdkit fuse-mapper`: release
    for a full run; for smoke the debug build CI already has from the tests."""
    return cargo_built(smoke, "rbdkit", ["--bin", "rbdkit"])


def cargo_built(smoke, name, args):
    """The binary `name` after `cargo build ARGS` (release unless smoke).
    With RBDKIT_BENCH_PREBUILT=1 the run takes the binary a build already
    made (debug for smoke, release otherwise), without cargo: scripts/test
    runs the smoke beside a `cargo test`, which holds the target dir's lock
    meanwhile; a full run can take a release build made elsewhere (point
    CARGO_TARGET_DIR at it) on a machine where another build holds cargo."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    binary = target / ("debug" if smoke else "release") / name
    if os.environ.get("RBDKIT_BENCH_PREBUILT") == "1":
        if not binary.is_file():
            raise OSError(f"RBDKIT_BENCH_PREBUILT=1 but {binary} was not built "
                          f"(cargo build {'' if smoke else '--release '}--workspace "
                          "--all-targets makes it)")
        log(f"using the prebuilt {binary}")
        return binary
    profile = [] if smoke else ["--release"]
    log(f"building {name} (cargo build {' '.join(profile + args)})")
    subprocess.run(["cargo", "build", *profile, *args], cwd=REPO, check=True, stdout=sys.stderr)
    return binary


def build_goceph():
    src = BENCH / "go-ceph"
    h = hashlib.sha256()
    for f in sorted(src.glob("*.go")) + [src / "go.mod", src / "go.sum"]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(sh(["go", "version"]).encode())
    # Built against this release's headers (scripts/ceph-release sets it).
    release = os.environ.get("RBDKIT_CEPH_RELEASE", "pacific")
    out = CACHE / f"goceph-bench-{release}-{h.hexdigest()[:16]}"
    if out.exists():
        log(f"go-ceph contender is up to date ({out.name})")
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    log("building the go-ceph contender (go build -tags pacific)")
    tmp = out.with_suffix(".tmp")
    env = dict(os.environ, CGO_ENABLED="1")
    subprocess.run(["go", "build", "-buildvcs=false", "-tags", "pacific", "-o", str(tmp), "."],
                   cwd=src, env=env, check=True, stdout=sys.stderr)
    for old in CACHE.glob(f"goceph-bench-{release}-*"):
        if old != tmp:
            old.unlink()
    tmp.rename(out)
    return out


# --------------------------------------------------------------------------
# The throwaway cluster
# --------------------------------------------------------------------------


class Cluster:
    def __init__(self, memstore):
        self.dir = tempfile.mkdtemp(prefix="rbdkit-bench-cluster.")
        self.memstore = memstore
        self.conf = None

    def __enter__(self):
        env = dict(os.environ, CEPH_TEST_MEMSTORE_BYTES=self.memstore)
        log(f"starting a throwaway cluster in {self.dir} (memstore {self.memstore})")
        t = time.perf_counter()
        try:
            out = sh([str(REPO / "scripts/ceph-test-cluster"), "up", self.dir], env=env)
        except subprocess.CalledProcessError as e:
            self._down()
            raise RunError(f"cluster did not start: {e.stderr[-800:]}") from e
        m = re.search(r"CEPH_CONF=(\S+)", out)
        if not m:
            self._down()
            raise RunError(f"unexpected output from ceph-test-cluster: {out!r}")
        self.conf = m.group(1)
        log(f"cluster up in {time.perf_counter() - t:.1f} s")
        return self

    def _down(self):
        subprocess.run([str(REPO / "scripts/ceph-test-cluster"), "down", self.dir],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc):
        log("stopping the cluster")
        self._down()
        return False

    def cpu_seconds(self):
        """CPU time (user + system) used so far by this cluster's daemons."""
        total = 0
        for f in Path(self.dir, "run").glob("*.pid"):
            try:
                stat = Path(f"/proc/{int(f.read_text())}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, ValueError, IndexError):
                pass
        return total / os.sysconf("SC_CLK_TCK")

    def rbd(self, *args):
        return run_proc(["rbd", "-c", self.conf, *map(str, args)])


# --------------------------------------------------------------------------
# Contenders
# --------------------------------------------------------------------------


class Contenders:
    def __init__(self, cluster, rbdkit_bin, goceph_bin):
        self.cl = cluster
        self.env = dict(os.environ)
        self.env.pop("CEPH_ARGS", None)
        base = ["--conf", cluster.conf, "--pool", POOL]
        self.cmds = {
            "rbdkit": [str(rbdkit_bin)],
            "go-ceph": [str(goceph_bin)],
            "python": ["/usr/bin/python3", str(BENCH / "python" / "contender.py")],
        }
        self.base = base

    def lib(self, who, mode, pool=POOL, **opts):
        cmd = list(self.cmds[who]) + [mode, "--conf", self.cl.conf, "--pool", pool]
        for k, v in opts.items():
            cmd += [f"--{k}", str(v)]
        return run_json(cmd, self.env)

    # The rbd CLI, one process per operation, as old provisioners did.
    def cli_cycle(self, name, size):
        spec = f"{POOL}/{name}"
        steps = [
            ("create", ["create", "--size", f"{size // MiB}M", spec]),
            ("open+stat", ["info", spec]),
            ("resize", ["resize", "--size", f"{2 * size // MiB}M", spec]),
            ("remove", ["rm", "--no-progress", spec]),
        ]
        times, rss = {}, 0
        for op, args in steps:
            _, wall, r, cpu = run_proc(["rbd", "-c", self.cl.conf, *args], self.env)
            times[op] = wall * 1e3
            rss = max(rss, r)
            self.cli_cpu += cpu
        return times, rss

    def cli_control(self, prefix, cycles, size):
        ops = {}
        rss = 0
        self.cli_cpu = 0.0
        for i in range(cycles + 1):
            t, r = self.cli_cycle(f"{prefix}-{i}", size)
            rss = max(rss, r)
            if i == 0:
                continue  # warm-up, like the in-process contenders
            for op, ms in t.items():
                ops.setdefault(op, []).append(ms)
            ops.setdefault("cycle", []).append(sum(t.values()))
        return {"contender": "rbd-cli", "mode": "control", "ops_ms": ops, "peak_rss_kib": rss,
                "cpu_s": self.cli_cpu}

    def rbd_bench(self, image, workload, bs, qd, ops):
        io_type = "write" if workload.endswith("write") else "read"
        # full-seq: op i at block i, like the other contenders (rbd bench's
        # "seq" instead gives each of its io-threads a separate region).
        pattern = "rand" if workload.startswith("rand") else "full-seq"
        # rbd bench divides by its own coarse clock: a run shorter than a
        # tick prints "ops/sec: inf" (seen in smoke runs of 50 ops on an idle
        # machine). Such a run is too short to time, not a failure: run it
        # again with ten times the ops, up to three times.
        for _ in range(4):
            out, wall, rss, cpu = run_proc(["rbd", "-c", self.cl.conf, "bench", "--io-type", io_type,
                                       "--io-size", str(bs), "--io-threads", str(qd),
                                       "--io-total", str(bs * ops), "--io-pattern", pattern,
                                       f"{POOL}/{image}"], self.env)
            iops, done = parse_rbd_bench(out)
            if math.isfinite(iops) and iops > 0:
                break
            ops *= 10
        else:
            raise RunError(f"rbd bench: no finite ops/sec at {ops // 10} ops: {out[-300:]!r}")
        return {"contender": "rbd-bench", "workload": workload, "bs": bs, "qd": qd,
                "ops": done, "iops": iops, "mib_s": iops * bs / MiB,
                "peak_rss_kib": rss, "cpu_s": cpu}

    def measured(self, fn):
        """Run fn() and add the cluster daemons' CPU seconds spent meanwhile."""
        before = self.cl.cpu_seconds()
        out = fn()
        out["cluster_cpu_s"] = self.cl.cpu_seconds() - before
        return out


# --------------------------------------------------------------------------
# The three comparisons
# --------------------------------------------------------------------------


def section_control(c, cfg, errors, tag):
    who = ["rbdkit", "rbd-cli", "python", "go-ceph"]
    rounds = []
    for r in range(cfg["control_rounds"]):
        res = {}
        for w in rotate(who, r):
            prefix = f"ctl-{tag}-{w}-r{r}"
            log(f"control round {r + 1}/{cfg['control_rounds']}: {w}")
            settle()
            try:
                if w == "rbd-cli":
                    res[w] = c.measured(lambda: c.cli_control(prefix, cfg["control_cycles"],
                                                              IMAGE_BYTES))
                else:
                    res[w] = c.measured(lambda: c.lib(w, "control", prefix=prefix,
                                                      cycles=cfg["control_cycles"],
                                                      size=IMAGE_BYTES))
            except RunError as e:
                errors.append(f"control/{w}: {e}")
                res[w] = {"error": str(e)}
        rounds.append(res)
    return {"contenders": who, "rounds": rounds}


def section_concurrency(c, cfg, errors, tag):
    who = ["rbdkit", "go-ceph", "python"]
    rounds = []
    for r in range(cfg["conc_rounds"]):
        res = {}
        for n in cfg["conc_levels"]:
            for w in rotate(who, r):
                log(f"concurrency round {r + 1}/{cfg['conc_rounds']}: {w} x{n}")
                settle()
                try:
                    out = c.measured(lambda: c.lib(
                        w, "concurrency", prefix=f"conc-{tag}-{w}-r{r}-c{n}", threads=n,
                        images=cfg["conc_images"], size=IMAGE_BYTES))
                    out["images_per_s"] = out["images"] / (out["create_s"] + out["remove_s"])
                    out["creates_per_s"] = out["images"] / out["create_s"]
                    out["removes_per_s"] = out["images"] / out["remove_s"]
                except RunError as e:
                    errors.append(f"concurrency/{w}/{n}: {e}")
                    out = {"error": str(e)}
                res[f"{w}@{n}"] = out
        rounds.append(res)
    return {"contenders": who, "levels": cfg["conc_levels"], "rounds": rounds}


def wl_key(wl):
    workload, bs, qd, _ = wl
    size = f"{bs // MiB}M" if bs >= MiB else f"{bs // KiB}K"
    return f"{workload} {size} qd{qd}"


def section_data(c, cfg, errors, tag, pending):
    who = ["rbd-bench", "rbdkit-aio", "rbdkit-sync", "go-ceph", "python"]
    image = f"data-{tag}"
    size = cfg["data_image_bytes"]
    c.cl.rbd("create", "--size", f"{size // MiB}M", f"{POOL}/{image}")
    # Fill the image once, untimed, so that every read hits real objects
    # and every write overwrites existing ones, for every contender alike.
    log(f"prefilling {image} ({size // MiB} MiB)")
    c.cl.rbd("bench", "--io-type", "write", "--io-size", str(4 * MiB), "--io-threads", "16",
             "--io-total", str(size), "--io-pattern", "seq", f"{POOL}/{image}")
    rounds = []
    for r in range(cfg["data_rounds"]):
        res = {}
        for wl in cfg["data_workloads"]:
            workload, bs, qd, ops = wl
            for w in rotate(who, r):
                key = f"{w}|{wl_key(wl)}"
                if w == "rbdkit-aio" and pending:
                    res[key] = {"pending": pending}
                    continue
                log(f"data round {r + 1}/{cfg['data_rounds']}: {wl_key(wl)}: {w}")
                settle()
                try:
                    if w == "rbd-bench":
                        out = c.measured(lambda: c.rbd_bench(image, workload, bs, qd, ops))
                    else:
                        lib, engine = {"rbdkit-aio": ("rbdkit", "aio"),
                                       "rbdkit-sync": ("rbdkit", "sync"),
                                       "go-ceph": ("go-ceph", None),
                                       "python": ("python", None)}[w]
                        extra = {"engine": engine} if engine else {}
                        out = c.measured(lambda: c.lib(lib, "data", image=image,
                                                       workload=workload, bs=bs, qd=qd,
                                                       ops=ops, **extra))
                except RunError as e:
                    errors.append(f"data/{w}/{wl_key(wl)}: {e}")
                    out = {"error": str(e)}
                res[key] = out
        rounds.append(res)
    c.cl.rbd("rm", "--no-progress", f"{POOL}/{image}")
    return {"contenders": who, "workloads": [wl_key(w) for w in cfg["data_workloads"]],
            "rounds": rounds}


# --------------------------------------------------------------------------
# Summaries: ratios over rounds, targets
# --------------------------------------------------------------------------


def spread(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": med(xs), "max": max(xs), "n": len(xs)}


def summarize(results):
    s = {}
    targets = []

    ctl = results.get("control")
    if ctl:
        per = {}
        for w in ctl["contenders"]:
            ok = [rd[w] for rd in ctl["rounds"] if "ops_ms" in rd.get(w, {})]
            if not ok:
                continue
            ops = {}
            for op in ok[0]["ops_ms"]:
                ops[op] = med([x for rd in ok for x in rd["ops_ms"][op]])
            per[w] = {
                "ops_median_ms": ops,
                "cycle_median_by_round": [med(rd["ops_ms"]["cycle"]) for rd in ok],
                "connect_ms": med([rd["connect_ms"] for rd in ok if "connect_ms" in rd]),
                "peak_rss_kib": med([rd["peak_rss_kib"] for rd in ok]),
                # Whole process (start, connect, warm-up included) per cycle run.
                "cpu_ms_per_cycle": med([rd["cpu_s"] * 1e3 / (len(rd["ops_ms"]["cycle"]) + 1)
                                         for rd in ok]),
                "cluster_cpu_ms_per_cycle": med([rd["cluster_cpu_s"] * 1e3 /
                                                 (len(rd["ops_ms"]["cycle"]) + 1) for rd in ok]),
            }
        ratios = {}
        for other in ["python", "rbd-cli", "go-ceph"]:
            vals = []
            for rd in ctl["rounds"]:
                a, b = rd.get("rbdkit", {}), rd.get(other, {})
                if "ops_ms" in a and "ops_ms" in b:
                    vals.append(med(b["ops_ms"]["cycle"]) / med(a["ops_ms"]["cycle"]))
            ratios[other] = spread(vals)
        s["control"] = {"per": per, "speedup_vs": ratios}
        targets.append(target("control cycle vs Python binding", ratios.get("python"), 0.98,
                              "control-python"))
        targets.append(target("control cycle vs rbd CLI", ratios.get("rbd-cli"), 5.0,
                              "control-cli"))
        targets.append(target("control cycle vs go-ceph", ratios.get("go-ceph"), 1.0,
                              "control-goceph", strict=True))

    conc = results.get("concurrency")
    if conc:
        per = {}
        for w in conc["contenders"]:
            for n in conc["levels"]:
                k = f"{w}@{n}"
                ok = [rd[k] for rd in conc["rounds"] if "images_per_s" in rd.get(k, {})]
                if ok:
                    per[k] = {
                        "images_per_s": spread([o["images_per_s"] for o in ok]),
                        "creates_per_s": med([o["creates_per_s"] for o in ok]),
                        "removes_per_s": med([o["removes_per_s"] for o in ok]),
                        "peak_rss_kib": med([o["peak_rss_kib"] for o in ok]),
                        "cpu_ms_per_image": med([o["cpu_s"] * 1e3 / o["images"] for o in ok]),
                        "cluster_cpu_ms_per_image": med([o["cluster_cpu_s"] * 1e3 / o["images"]
                                                         for o in ok]),
                        # Share of all cores busy in client + cluster during the run.
                        "machine_busy": med([(o["cpu_s"] + o["cluster_cpu_s"]) /
                                             o["wall_s"] / (os.cpu_count() or 1) for o in ok]),
                    }

        def ratio(ka, kb):
            vals = []
            for rd in conc["rounds"]:
                a, b = rd.get(ka, {}), rd.get(kb, {})
                if "images_per_s" in a and "images_per_s" in b:
                    vals.append(a["images_per_s"] / b["images_per_s"])
            return spread(vals)

        ratios = {}
        for n in conc["levels"]:
            ratios[f"rbdkit@{n} / rbdkit@1"] = ratio(f"rbdkit@{n}", "rbdkit@1")
            ratios[f"python@{n} / python@1"] = ratio(f"python@{n}", "python@1")
            ratios[f"go-ceph@{n} / go-ceph@1"] = ratio(f"go-ceph@{n}", "go-ceph@1")
            ratios[f"rbdkit / python @{n}"] = ratio(f"rbdkit@{n}", f"python@{n}")
            ratios[f"rbdkit / go-ceph @{n}"] = ratio(f"rbdkit@{n}", f"go-ceph@{n}")
        s["concurrency"] = {"per": per, "ratios": ratios}
        if 32 in conc["levels"]:
            targets.append(target("concurrency 32 vs rbdkit sequential",
                                  ratios["rbdkit@32 / rbdkit@1"], 3.0, "conc-self"))
            targets.append(target("concurrency 32 vs Python binding at 32",
                                  ratios["rbdkit / python @32"], 1.0, "conc-python"))
        for n in conc["levels"]:
            targets.append(target(f"concurrency {n} vs go-ceph", ratios[f"rbdkit / go-ceph @{n}"],
                                  1.0, "conc-goceph", strict=True))

    data = results.get("data")
    if data:
        per, ratios = {}, {}
        for wk in data["workloads"]:
            for w in data["contenders"]:
                ok = [rd[f"{w}|{wk}"] for rd in data["rounds"] if "iops" in rd.get(f"{w}|{wk}", {})]
                if ok:
                    per[f"{w}|{wk}"] = {
                        "iops": spread([o["iops"] for o in ok]),
                        "mib_s": med([o["mib_s"] for o in ok]),
                        "cpu_us_per_op": med([o["cpu_s"] * 1e6 / o["ops"] for o in ok]),
                        "cluster_cpu_us_per_op": med([o["cluster_cpu_s"] * 1e6 / o["ops"]
                                                      for o in ok]),
                        "peak_rss_kib": med([o["peak_rss_kib"] for o in ok]),
                    }
                if w == "rbd-bench":
                    continue
                vals, vals_go = [], []
                for rd in data["rounds"]:
                    a, ref = rd.get(f"{w}|{wk}", {}), rd.get(f"rbd-bench|{wk}", {})
                    if "iops" in a and "iops" in ref:
                        vals.append(a["iops"] / ref["iops"])
                ratios[f"{w} / rbd-bench|{wk}"] = spread(vals)
                if w.startswith("rbdkit"):
                    for rd in data["rounds"]:
                        a, g = rd.get(f"{w}|{wk}", {}), rd.get(f"go-ceph|{wk}", {})
                        if "iops" in a and "iops" in g:
                            vals_go.append(a["iops"] / g["iops"])
                    ratios[f"{w} / go-ceph|{wk}"] = spread(vals_go)
        s["data"] = {"per": per, "ratios": ratios}
        pending = any("pending" in rd.get(f"rbdkit-aio|{wk}", {})
                      for rd in data["rounds"] for wk in data["workloads"])
        for wk in data["workloads"]:
            targets.append(target(f"data {wk}: rbdkit AIO vs rbd bench",
                                  ratios.get(f"rbdkit-aio / rbd-bench|{wk}"), 0.95, "data-ceiling",
                                  pending=pending))
            targets.append(target(f"data {wk}: rbdkit AIO vs go-ceph",
                                  ratios.get(f"rbdkit-aio / go-ceph|{wk}"), 1.0, "data-goceph",
                                  strict=True, pending=pending))
            targets.append(target(f"data {wk}: rbdkit blocking vs go-ceph",
                                  ratios.get(f"rbdkit-sync / go-ceph|{wk}"), 1.0,
                                  "data-goceph-sync", strict=True))
    if results.get("node"):
        s["node"], node_targets = node.summarize(results["node"], spread, med, target)
        targets += node_targets
    if results.get("burst"):
        s["burst"], burst_targets = burst.summarize(results["burst"], spread, med, target)
        targets += burst_targets
    if results.get("snapshot"):
        s["snapshot"] = snapshot.summarize(results["snapshot"], spread, med)
    if results.get("dr"):
        s["dr"] = dr.summarize(results["dr"], spread, med)
    s["targets"] = targets
    return s


def target(name, sp, goal, tid, strict=False, pending=False, le=False, unit="×"):
    """le: the goal is an upper bound (a time or a size), in `unit`."""
    if sp is None:
        verdict = "pending" if pending else "no data"
    else:
        if le:
            ok = sp["median"] <= goal
        else:
            ok = sp["median"] > goal if strict else sp["median"] >= goal
        verdict = "met" if ok else "missed"
    return {"name": name, "id": tid, "goal": goal, "strict": strict, "ratio": sp,
            "verdict": verdict, "le": le, "unit": unit}


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def fmt_ratio(sp, unit="×"):
    if not sp:
        return "–"
    if sp["n"] == 1:
        return f"{sp['median']:.2f}{unit}"
    return f"**{sp['median']:.2f}{unit}** ({sp['min']:.2f}–{sp['max']:.2f})"


def fmt_num(x, digits=1):
    if x is None:
        return "–"
    if x >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def mib(kib):
    return "–" if kib is None else f"{kib / 1024:.0f}"


def machine_info():
    def first(cmd):
        try:
            return sh(cmd).strip().splitlines()[0]
        except Exception:  # noqa: BLE001 - informational only
            return "?"

    cpu = "?"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, AttributeError):
        pass
    goceph = "?"
    m = re.search(r"github.com/ceph/go-ceph (\S+)", (BENCH / "go-ceph/go.mod").read_text())
    if m:
        goceph = m.group(1)
    try:
        commit = sh(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]).strip()
    except Exception:  # noqa: BLE001
        commit = "?"
    return {
        "nproc": os.cpu_count(),
        "memory": mem,
        "cpu": cpu,
        "kernel": platform.release(),
        "os": first(["sh", "-c", ". /etc/os-release && echo \"$PRETTY_NAME\""]),
        "ceph": first(["ceph", "--version"]),
        "rustc": first(["rustc", "--version"]),
        "go": first(["go", "version"]),
        "go_ceph": goceph + " (-tags pacific)",
        "python": first(["/usr/bin/python3", "--version"]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


DATA_NAMES = {"rbd-bench": "rbd bench", "rbdkit-aio": "rbdkit AIO",
              "rbdkit-sync": "rbdkit blocking", "go-ceph": "go-ceph", "python": "Python aio"}

VERDICT_MARK = {"met": "✅ met", "missed": "❌ missed", "pending": "⏳ pending",
                "no data": "– no data"}


def render(results, summary, cfg, mode):
    m = results["machine"]
    L = []
    L.append("# Benchmarks")
    L.append("")
    L.append("Side-by-side numbers for issue 5: rbdkit against the tools it replaces, all run "
             "in one session against one throwaway cluster (`scripts/ceph-test-cluster`, one "
             "memstore OSD), interleaved round by round. Ratios are per round, then "
             "**median** (min–max) over the rounds. Generated by `bench/run`; "
             "how and why in [bench/README.md](bench/README.md).")
    L.append("")
    # Sections run on their own (--merge) add their time.
    total_s = results["elapsed_s"] + sum(r["elapsed_s"] for r in results.get("runs", {}).values())
    L.append("Reproduce: `bench/run` (full run, about "
             f"{total_s / 60:.0f} minutes) · CI: `bench/run --smoke`")
    L.append("")
    L.append(f"Machine: {m['nproc']} cores ({m['cpu']}), {m['memory']} RAM, {m['os']}, "
             f"kernel {m['kernel']}; {m['ceph']}; go-ceph {m['go_ceph']} with {m['go']}; "
             f"{m['python']}; {m['rustc']}. Commit {m['commit']}, {m['date']}.")
    for sec, run in results.get("runs", {}).items():
        rm = run["machine"]
        L.append("")
        L.append(f"The *{sec}* section was run on its own (`bench/run --only {sec} --merge`, "
                 f"{run['elapsed_s'] / 60:.0f} minutes): commit {rm['commit']}, {rm['date']}, "
                 f"kernel {rm['kernel']}; the other sections are from the run above.")
    if mode == "smoke":
        L.append("")
        L.append("**Smoke run: too short to mean anything; it only proves that every contender "
                 "runs.**")
    L.append("")

    L.append("## Targets")
    L.append("")
    L.append("| target | ratio (median, min–max) | goal | verdict |")
    L.append("|---|---|---|---|")
    for t in summary["targets"]:
        unit, le = t.get("unit", "×"), t.get("le", False)
        goal = (f"≤ {t['goal']:g}{unit}" if le else
                f"> {t['goal']:g}{unit}" if t["strict"] else f"≥ {t['goal']:g}{unit}")
        verdict = VERDICT_MARK[t["verdict"]]
        sp = t["ratio"]
        reaches = bool(sp) and (sp["min"] <= t["goal"] if le else sp["max"] >= t["goal"])
        if t["verdict"] == "missed" and reaches:
            verdict += " (range reaches the goal)"
        L.append(f"| {t['name']} | {fmt_ratio(t['ratio'], unit)} | {goal} | {verdict} |")
    L.append("")
    L.append("Ratios are rbdkit's speed over the other's: above 1 means rbdkit is faster. "
             "Why each missed target is missed is in *Analysis* below.")
    L.append("")

    ctl = summary.get("control")
    if ctl:
        L.append("## 1. Control path, one image at a time")
        L.append("")
        L.append(f"create (1 GiB) → open → stat → resize (2 GiB) → close → remove, "
                 f"{cfg['control_cycles']} cycles per process after one warm-up cycle, "
                 f"{cfg['control_rounds']} rounds. Milliseconds, median over all cycles. "
                 "The `rbd` CLI runs one process per step (`create`, `info`, `resize`, `rm`), "
                 "so its open+stat+close is one `rbd info` and its resize opens and closes "
                 "the image itself. Peak RSS: the largest process (for the CLI, the largest "
                 "single `rbd` process).")
        L.append("")
        L.append("| contender | cycle | create | open | stat | resize | close | remove | "
                 "connect (once) | peak RSS MiB | client CPU ms/cycle | cluster CPU ms/cycle "
                 "| rbdkit speed-up |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for w in ["rbdkit", "python", "go-ceph", "rbd-cli"]:
            p = ctl["per"].get(w)
            if not p:
                L.append(f"| {w} | failed | | | | | | | | | | | |")
                continue
            o = p["ops_median_ms"]
            if w == "rbd-cli":
                cells = [o.get("create"), None, o.get("open+stat"), o.get("resize"), None,
                         o.get("remove")]
                opens = ["", "(in info)", " (rbd info)", "", "(in info)", ""]
            else:
                cells = [o.get(k) for k in ["create", "open", "stat", "resize", "close",
                                            "remove"]]
                opens = [""] * 6
            row = [f"{fmt_num(x, 2) if x is not None else ''}{s}" for x, s in zip(cells, opens)]
            conn = fmt_num(p["connect_ms"]) if p["connect_ms"] is not None else "per call"
            sp = "—" if w == "rbdkit" else fmt_ratio(ctl["speedup_vs"].get(w))
            L.append(f"| {w} | **{fmt_num(o['cycle'], 1)}** | " + " | ".join(row) +
                     f" | {conn} | {mib(p['peak_rss_kib'])} | {fmt_num(p['cpu_ms_per_cycle'])} "
                     f"| {fmt_num(p['cluster_cpu_ms_per_cycle'])} | {sp} |")
        L.append("")
        L.append("CPU columns: user + system time of the contender's process(es) (start-up, "
                 "connect and warm-up included, divided over the cycles run) and of the "
                 "cluster's daemons meanwhile; a profile in numbers of where each cycle's work "
                 "is done.")
        L.append("")

    conc = summary.get("concurrency")
    if conc:
        res = results["concurrency"]
        L.append("## 2. Control path under concurrency")
        L.append("")
        L.append(f"{cfg['conc_images']} images created (1 GiB, thin) and then removed by N "
                 "workers sharing one connection and one ioctx (threads for rbdkit and Python, "
                 "goroutines for go-ceph), "
                 f"{cfg['conc_rounds']} rounds. Images per second = images / (create phase + "
                 "remove phase); median (min–max).")
        L.append("")
        L.append("| N | rbdkit img/s | go-ceph img/s | Python img/s | rbdkit vs own N=1 | "
                 "Python vs own N=1 | rbdkit / go-ceph | rbdkit / Python | peak RSS MiB "
                 "(rbdkit / go-ceph / Python) |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for n in res["levels"]:
            def ips(w):
                p = conc["per"].get(f"{w}@{n}")
                return fmt_ratio(p["images_per_s"], "") if p else "failed"

            def rss(w):
                p = conc["per"].get(f"{w}@{n}")
                return mib(p["peak_rss_kib"]) if p else "–"

            r = conc["ratios"]
            L.append(f"| {n} | {ips('rbdkit')} | {ips('go-ceph')} | {ips('python')} | "
                     f"{fmt_ratio(r[f'rbdkit@{n} / rbdkit@1'])} | "
                     f"{fmt_ratio(r[f'python@{n} / python@1'])} | "
                     f"{fmt_ratio(r[f'rbdkit / go-ceph @{n}'])} | "
                     f"{fmt_ratio(r[f'rbdkit / python @{n}'])} | "
                     f"{rss('rbdkit')} / {rss('go-ceph')} / {rss('python')} |")
        L.append("")
        L.append("Creates/s and removes/s separately (medians):")
        L.append("")
        L.append("| N | rbdkit create/s | rbdkit remove/s | go-ceph create/s | go-ceph remove/s "
                 "| Python create/s | Python remove/s |")
        L.append("|---|---|---|---|---|---|---|")
        for n in res["levels"]:
            cells = []
            for w in ["rbdkit", "go-ceph", "python"]:
                p = conc["per"].get(f"{w}@{n}")
                cells += [fmt_num(p["creates_per_s"]), fmt_num(p["removes_per_s"])] if p \
                    else ["–", "–"]
            L.append(f"| {n} | " + " | ".join(cells) + " |")
        L.append("")
        L.append("Where the time goes (medians): CPU ms per image in the contender process and "
                 "in the cluster's daemons, and how busy the whole machine was "
                 f"({os.cpu_count()} cores = 100 %):")
        L.append("")
        L.append("| N | rbdkit client / cluster | go-ceph client / cluster | "
                 "Python client / cluster | machine busy (rbdkit / go-ceph / Python) |")
        L.append("|---|---|---|---|---|")
        for n in res["levels"]:
            cells, busy = [], []
            for w in ["rbdkit", "go-ceph", "python"]:
                p = conc["per"].get(f"{w}@{n}")
                if p:
                    cells.append(f"{fmt_num(p['cpu_ms_per_image'], 2)} / "
                                 f"{fmt_num(p['cluster_cpu_ms_per_image'], 2)}")
                    busy.append(f"{p['machine_busy'] * 100:.0f} %")
                else:
                    cells.append("–")
                    busy.append("–")
            L.append(f"| {n} | " + " | ".join(cells) + " | " + " / ".join(busy) + " |")
        L.append("")

    data = summary.get("data")
    if data:
        res = results["data"]
        L.append("## 3. Data path")
        L.append("")
        L.append(f"One {cfg['data_image_bytes'] // MiB} MiB image, prefilled once, shared by all "
                 f"contenders; each workload is a fresh process that opens the image, flushes "
                 f"it once untimed (as `rbd bench` does: it turns on write-back caching), "
                 f"runs, flushes (writes) and closes; {cfg['data_rounds']} rounds. `rbd bench` "
                 "(C++ librbd, its `--io-threads` is the queue depth) is the ceiling: columns "
                 "are each contender's throughput over `rbd bench`'s in the same round. "
                 "*rbdkit AIO* keeps qd futures in flight from one thread; *rbdkit blocking* "
                 "and *go-ceph* (synchronous only) get depth from qd threads/goroutines, each "
                 "with one blocking call in flight; Python uses `aio_write`/`aio_read`.")
        L.append("")
        L.append("| workload | rbd bench IOPS (MiB/s) | rbdkit AIO | rbdkit blocking | go-ceph | "
                 "Python aio | rbdkit AIO / go-ceph | rbdkit blocking / go-ceph |")
        L.append("|---|---|---|---|---|---|---|---|")
        pending = any("pending" in v for rd in res["rounds"] for v in rd.values())
        for wk in res["workloads"]:
            ref = data["per"].get(f"rbd-bench|{wk}")
            refs = (f"{fmt_num(ref['iops']['median'], 0)} ({fmt_num(ref['mib_s'])})"
                    if ref else "failed")
            r = data["ratios"]

            def cell(key):
                sp = r.get(key)
                if sp:
                    return fmt_ratio(sp)
                return "pending" if (pending and "rbdkit-aio" in key) else "–"

            L.append(f"| {wk} | {refs} | {cell(f'rbdkit-aio / rbd-bench|{wk}')} | "
                     f"{cell(f'rbdkit-sync / rbd-bench|{wk}')} | "
                     f"{cell(f'go-ceph / rbd-bench|{wk}')} | "
                     f"{cell(f'python / rbd-bench|{wk}')} | "
                     f"{cell(f'rbdkit-aio / go-ceph|{wk}')} | "
                     f"{cell(f'rbdkit-sync / go-ceph|{wk}')} |")
        L.append("")
        L.append("Client CPU µs per op (user + system of the contender process, open/close "
                 "included) / cluster daemons' CPU µs per op, medians:")
        L.append("")
        L.append("| workload | " + " | ".join(DATA_NAMES[w] for w in res["contenders"]) + " |")
        L.append("|---|" + "---|" * len(res["contenders"]))
        for wk in res["workloads"]:
            cells = []
            for w in res["contenders"]:
                p = data["per"].get(f"{w}|{wk}")
                cells.append(f"{fmt_num(p['cpu_us_per_op'])} / "
                             f"{fmt_num(p['cluster_cpu_us_per_op'])}" if p else "–")
            L.append(f"| {wk} | " + " | ".join(cells) + " |")
        L.append("")

    L += node.render(results, summary, cfg, fmt_ratio, fmt_num)
    L += burst.render(results, summary, cfg, fmt_ratio, fmt_num)
    L += snapshot.render(results, summary, cfg, fmt_ratio, fmt_num)
    L += dr.render(results, summary, cfg, fmt_ratio, fmt_num)

    if results.get("errors"):
        L.append("## Failures in this run")
        L.append("")
        for e in results["errors"]:
            L.append(f"- `{e[:300]}`")
        L.append("")

    analysis = BENCH / "analysis.md"
    if mode == "full" and analysis.exists():
        L.append(analysis.read_text().rstrip())
        L.append("")
    # The cross-release comparison, kept by bench/releases.py.
    releases = RESULTS / "releases.md"
    if mode == "full" and releases.exists():
        L.append(releases.read_text().rstrip())
        L.append("")
    return "\n".join(L)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(prog="bench/run", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny run for CI: proves every contender runs, writes nothing permanent")
    # Inside a scripts/ceph-release root the burst (Kubernetes and the
    # provisioner, not the Ceph release) is not part of the default run.
    in_root = os.environ.get("RBDKIT_CEPH_RELEASE", "pacific") != "pacific"
    default_sections = [x for x in ALL_SECTIONS if not (in_root and x in K8S_SECTIONS)]
    ap.add_argument("--only", default=",".join(default_sections),
                    help="comma-separated sections to run (default: all; in a ceph-release "
                         "root all but burst, snapshot and dr)")
    ap.add_argument("--no-write", action="store_true",
                    help="full run, but print the table instead of writing BENCHMARKS.md")
    ap.add_argument("--render", action="store_true",
                    help="run nothing: rewrite BENCHMARKS.md from bench/results/latest.json "
                         "(e.g. after editing bench/analysis.md)")
    ap.add_argument("--merge", action="store_true",
                    help="full run of the --only sections, folded into bench/results/latest.json "
                         "(replacing those sections, keeping the others) and BENCHMARKS.md")
    args = ap.parse_args()
    if args.merge and (args.smoke or args.no_write):
        ap.error("--merge is for full runs that write")
    if args.render:
        results = json.loads((RESULTS / "latest.json").read_text())
        summary = summarize(results)
        (REPO / "BENCHMARKS.md").write_text(
            render(results, summary, results["config"], results["mode"]) + "\n")
        log("rewrote BENCHMARKS.md from bench/results/latest.json")
        return 0
    cfg = dict(SMOKE if args.smoke else FULL)
    mode = "smoke" if args.smoke else "full"
    sections = [s for s in args.only.split(",") if s]
    for s in sections:
        if s not in ALL_SECTIONS:
            ap.error(f"unknown section {s!r}")

    # SIGTERM (CI's timeout, a kill) must still take the cluster down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    start = time.perf_counter()
    rbdkit_bin = goceph_bin = mapper_bin = provisioner_bin = None
    try:
        if set(sections) & {"control", "concurrency", "data"}:
            rbdkit_bin = build_rbdkit(args.smoke)
            goceph_bin = build_goceph()
        elif "node" in sections:
            # The node group's librbd contenders (plain and LUKS2).
            rbdkit_bin = build_rbdkit(args.smoke)
        if "node" in sections:
            mapper_bin = build_mapper(args.smoke)
        # The dr group runs the test suite's own binary (bench/dr.py).
        if set(sections) & (K8S_SECTIONS - {"dr"}):
            provisioner_bin = build_mapper(args.smoke)
    except (subprocess.CalledProcessError, OSError) as e:
        log(f"building the contenders failed: {e}")
        return 2
    pending = None
    errors = []
    tag = f"{os.getpid()}"
    results = {"mode": mode, "config": {k: v for k, v in cfg.items()}, "errors": errors}
    memstore = os.environ.get("CEPH_TEST_MEMSTORE_BYTES", cfg["memstore"])
    with Cluster(memstore) as cl:
        c = Contenders(cl, rbdkit_bin, goceph_bin)
        if "control" in sections:
            results["control"] = section_control(c, cfg, errors, tag)
        if "concurrency" in sections:
            results["concurrency"] = section_concurrency(c, cfg, errors, tag)
        if "data" in sections:
            results["data"] = section_data(c, cfg, errors, tag, pending)
        if "node" in sections:
            results["node"] = node.section_node(c, cfg, errors, tag, mapper_bin, rotate, settle)
        if "burst" in sections:
            results["burst"] = burst.section_burst(c, cfg, errors, tag, provisioner_bin, POOL)
        if "snapshot" in sections:
            results["snapshot"] = snapshot.section_snapshot(c, cfg, errors, tag, provisioner_bin,
                                                            POOL)
        if "dr" in sections:
            # Two clusters, a control plane and a node of the test suite's own.
            results["dr"] = dr.section_dr(cfg, errors)
    results["machine"] = machine_info()
    results["elapsed_s"] = time.perf_counter() - start
    summary = summarize(results)
    results["summary"] = summary
    table = render(results, summary, cfg, mode)

    RESULTS.mkdir(exist_ok=True)
    if mode == "smoke":
        release = os.environ.get("RBDKIT_CEPH_RELEASE", "pacific")
        name = "smoke.json" if release == "pacific" else f"smoke-{release}.json"
        (RESULTS / name).write_text(json.dumps(results, indent=1) + "\n")
        print(table)
    elif args.merge:
        merged = json.loads((RESULTS / "latest.json").read_text())
        merged["errors"] = [e for e in merged.get("errors", [])
                            if e.split("/", 1)[0] not in sections] + errors
        for sec in sections:
            merged[sec] = results[sec]
            merged.setdefault("runs", {})[sec] = {
                "machine": results["machine"], "elapsed_s": results["elapsed_s"]}
        merged["config"].update({k: v for k, v in cfg.items()
                                 if any(k.startswith(f"{sec}_") for sec in sections)})
        merged["summary"] = summarize(merged)
        (RESULTS / "latest.json").write_text(json.dumps(merged, indent=1) + "\n")
        (REPO / "BENCHMARKS.md").write_text(
            render(merged, merged["summary"], merged["config"], merged["mode"]) + "\n")
        log(f"merged {','.join(sections)} into bench/results/latest.json and BENCHMARKS.md")
    elif args.no_write or sections != ALL_SECTIONS:
        (RESULTS / "partial.json").write_text(json.dumps(results, indent=1) + "\n")
        print(table)
    else:
        (RESULTS / "latest.json").write_text(json.dumps(results, indent=1) + "\n")
        (REPO / "BENCHMARKS.md").write_text(table + "\n")
        log("wrote BENCHMARKS.md and bench/results/latest.json")
    log(f"done in {results['elapsed_s']:.0f} s")
    if errors:
        log(f"{len(errors)} contender run(s) failed:")
        for e in errors:
            log(f"  {e[:400]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
