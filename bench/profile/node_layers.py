"""Per-layer profile of 4 KiB random writes at depth 16 (issue 39, part 3):
write-through rbd bench, the mapper's block device, a file in ext4 on it.
Usage: node_layers.py CONF RBDKIT_BIN OUTDIR [CASES]

CASES: comma-separated, of rbd-bench-wt,mapper-block,mapper-fs (all by
default). Needs root, a test cluster (scripts/ceph-test-cluster) with a pool
`ps` of page-set objects (`ceph tell osd.* config set memstore_page_set
true` before `ceph osd pool create ps 8`), perf and fio. Writes per-thread
CPU, OSD counters, the loop device's stat (its mean in-flight count comes
from the stat's time_in_queue, not from sampling, which cost 44 us per
write), tracepoints and perf profiles
into OUTDIR; node_layers_summary.py OUTDIR CASES prints them per op
(bench/analysis.md, issue 39)."""
import json, os, re, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import node  # noqa: E402

conf, rbdkit, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
env = dict(os.environ); env.pop("CEPH_ARGS", None)
cdir = Path(conf).parent
HZ = os.sysconf("SC_CLK_TCK")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
WARM, WINDOW, TRACE = 4.0, 8.0, 2.0
cases = sys.argv[4].split(",") if len(sys.argv) > 4 else ["rbd-bench-wt", "mapper-block", "mapper-fs"]


def rbd(*a):
    return subprocess.run(["rbd", "-c", conf, *map(str, a)], check=True, capture_output=True,
                          text=True, env=env).stdout


def osd_perf():
    j = json.loads(subprocess.run(["ceph", "-c", conf, "daemon", "osd.0", "perf", "dump"],
                                  check=True, capture_output=True, text=True, env=env).stdout)
    o = j["osd"]
    return {k: o[k] for k in ("op_w", "op_r", "op_w_latency", "op_r_latency",
                              "op_w_process_latency", "op_before_queue_op_lat")
            if k in o}


def tasks():
    """{(group, comm): cpu seconds} of every thread on the machine."""
    res = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            pst = (p / "stat").read_text()
            pcomm = pst[pst.index("(") + 1:pst.rindex(")")]
            ppid = int(pst.rsplit(")", 1)[1].split()[1])
            for t in (p / "task").iterdir():
                st = (t / "stat").read_text()
                comm = st[st.index("(") + 1:st.rindex(")")]
                f = st.rsplit(")", 1)[1].split()
                cpu = (int(f[11]) + int(f[12])) / HZ
                key = (f"{pcomm}[{p.name}]" if ppid != 2 and int(p.name) != 2 else "kernel",
                       re.sub(r"\d+", "N", comm) if ppid == 2 else comm)
                res[key] = res.get(key, 0) + cpu
        except (OSError, ValueError, IndexError):
            pass
    return res


def trace(dev_major_minor, secs, tag):
    """fuse send/end and block issue/complete, system-wide, for secs."""
    data = out / f"{tag}.trace.data"
    subprocess.run(["perf", "record", "-q", "-o", str(data), "-a",
                    "-e", "block:block_rq_issue", "-e", "block:block_rq_complete",
                    "-e", "fuse:fuse_request_send", "-e", "fuse:fuse_request_end",
                    "--", "sleep", str(secs)], check=True, capture_output=True)
    txt = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,tid,time,event,trace"],
                         check=True, capture_output=True, text=True).stdout
    (out / f"{tag}.trace.txt").write_text(txt)
    return txt


def cpu_profile(secs, tag):
    data = out / f"{tag}.cpu.data"
    subprocess.run(["perf", "record", "-q", "-o", str(data), "-a", "-g", "-F", "499", "--",
                    "sleep", str(secs)], check=True, capture_output=True)
    rep = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--stdio",
                          "--sort", "comm,dso", "-g", "none", "--percent-limit", "0.5"],
                         capture_output=True, text=True).stdout
    (out / f"{tag}.cpu.comm-dso.txt").write_text(rep)
    rep = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--stdio",
                          "--sort", "comm,sym", "-g", "none", "--percent-limit", "0.3"],
                         capture_output=True, text=True).stdout
    (out / f"{tag}.cpu.comm-sym.txt").write_text(rep)


def measure(tag, start_load, dev=None):
    """Start the load, let it warm, then: CPU per thread, OSD counters and
    the loop device's stat over WINDOW s, a tracepoint capture, a CPU profile."""
    p = start_load()
    try:
        time.sleep(WARM)
        t0, o0, c0 = time.perf_counter(), osd_perf(), tasks()
        stat0 = Path(f"/sys/block/{Path(dev).name}/stat").read_text().split() if dev else None
        time.sleep(WINDOW)
        t1, o1, c1 = time.perf_counter(), osd_perf(), tasks()
        stat1 = Path(f"/sys/block/{Path(dev).name}/stat").read_text().split() if dev else None
        trace(None, TRACE, tag)
        cpu_profile(3, tag)
        if p.poll() is not None:
            raise SystemExit(f"{tag}: the load ended before the measurements did")
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    secs = t1 - t0
    res = {"tag": tag, "secs": secs, "osd0": o0, "osd1": o1,
           "cpu": {f"{k[0]}|{k[1]}": c1.get(k, 0) - v for k, v in c0.items() if c1.get(k, 0) - v > 0},
           "loop_stat0": stat0, "loop_stat1": stat1}
    (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
    return res


def fio_load(target, size, secs=60):
    def start():
        return subprocess.Popen(["fio", "--name=prof", f"--filename={target}", "--direct=1",
                                 "--ioengine=libaio", "--iodepth=16", "--rw=randwrite", "--bs=4k",
                                 f"--size={size}", "--time_based", f"--runtime={secs}",
                                 "--norandommap", "--randrepeat=0", "--allow_file_create=0",
                                 "--output-format=json", f"--output={out / 'fio.json'}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return start


def main():
    for img in ("prof-raw", "prof-fs"):
        rbd("create", "--size", "1024M", f"ps/{img}")
    rbd("bench", "--io-type", "write", "--io-size", 4 * MiB, "--io-threads", 16,
        "--io-total", GiB, "--io-pattern", "seq", "ps/prof-raw")
    m = node.Mapper(rbdkit, conf, out / "mapper")
    (out / "mapper").mkdir(exist_ok=True)
    m.start()
    (out / "pids").write_text(f"supervisor {m.p.pid}\n")
    fsmnt = out / "ext4"
    fsmnt.mkdir(exist_ok=True)
    try:
        for tag in cases:
            if tag == "rbd-bench-wt":
                measure(tag, lambda: subprocess.Popen(
                    ["rbd", "-c", conf, "bench", "--io-type", "write", "--io-size", "4096",
                     "--io-threads", "16", "--io-total", str(4096 * 400000), "--io-pattern",
                     "rand", "--rbd_cache=false", "ps/prof-raw"], env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            elif tag == "mapper-block":
                dev = m.attach("prof-raw", "ps", "prof-raw")
                try:
                    node.fsync_path(dev)
                    measure(tag, fio_load(dev, GiB), dev)
                finally:
                    m.detach("prof-raw")
            elif tag == "mapper-fs":
                dev = m.attach("prof-fs", "ps", "prof-fs")
                try:
                    node.run(["mkfs.ext4", "-q", *node.NODESTAGE_MKFS_EXT4, dev], timeout=120)
                    node.run(["mount", "-t", "ext4", dev, fsmnt])
                    try:
                        f = fsmnt / "bench.dat"
                        node.run(["fio", "--name=fill", f"--filename={f}", "--direct=1",
                                  "--ioengine=libaio", "--iodepth=16", "--rw=write", "--bs=4M",
                                  "--size=768M", "--fallocate=none", "--end_fsync=1"],
                                 timeout=300)
                        measure(tag, fio_load(f, 768 * MiB), dev)
                    finally:
                        node.run(["umount", fsmnt])
                finally:
                    m.detach("prof-fs")
    finally:
        m.stop()


main()
