"""The node data-path group of bench/run: fio through rbdkit's userspace
mapper (`rbdkit fuse-mapper`: a FUSE file plus a loop device), on the raw
device and on ext4 mounted on it, against `rbd bench` on the same image and
against Ceph's own userspace peer, `rbd-fuse`, with a loop device on its
file. See bench/README.md, section 5.

The baseline is `rbd bench --rbd_cache=false`: librbd answering a write once
RADOS has it, as the mapper does (issue 39). Every rate here is the
harness's own: the ops it asked for over the time it measured (fio's job
runtime; for `rbd bench` the wall clock around its process), never a rate
a tool printed.
"""

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# The baseline first: ratios are over it.
BASE = "rbd-bench-wt"
CONTENDERS = [BASE, "rbd-bench", "mapper-block", "mapper-fs", "mapper-pod", "rbd-fuse",
              "mapper-enc", "librbd", "librbd-enc", "mapper-cacher", "mapper-zerocopy",
              "mapper-inline"]
NAMES = {BASE: "rbd bench, cache off", "rbd-bench": "rbd bench, cache on",
         "mapper-block": "mapper, block",
         "mapper-fs": "mapper, ext4 file", "mapper-pod": "mapper, ext4 as a pod gets it",
         "rbd-fuse": "rbd-fuse + loop", "mapper-enc": "mapper, block, LUKS2",
         "librbd": "librbd (rbdkit-bench)", "librbd-enc": "librbd LUKS2 (rbdkit-bench)",
         "mapper-cacher": "mapper, block, rbd_cache=true",
         "mapper-zerocopy": "mapper, block, zero-copy writes",
         "mapper-inline": "mapper, block, rbd_non_blocking_aio=false"}
# Contenders that are *mapper, block* with map options: librbd's
# ObjectCacher, write-through (the default before issue 39 turned the cache
# off); librbd sending the mapper's buffer without a copy; librbd
# submitting on the FUSE thread instead of handing each request to its own.
OPTION_CONTENDERS = {
    "mapper-cacher": ["rbd_cache=true"],
    "mapper-zerocopy": ["rbd_disable_zero_copy_writes=false"],
    "mapper-inline": ["rbd_non_blocking_aio=false"],
}
# The LUKS2 passphrase of the encrypted image (a bench, not a secret).
ENC_PASSPHRASE = "bench-passphrase-of-the-encrypted-image"
# What LUKS2 takes of an image (its header; src/volume/luks.rs DATA_OFFSET).
LUKS2_HEADER = 16 << 20
# What NodeStage runs when the StorageClass gives no mkfsOptions
# (src/node/fs.rs, default_mkfs_options): lazy inode table and journal init.
NODESTAGE_MKFS_EXT4 = ["-m0", "-Enodiscard,lazy_itable_init=1,lazy_journal_init=1"]
# The group's own pool. Its PGs are made after the OSD is told to keep
# objects as page sets (memstore_page_set: 64 KiB pages): memstore's
# default keeps an object as one bufferlist, which every 4 KiB overwrite
# splits, so an image's writes got slower with every random write it had
# taken (issue 39: the OSD's CPU per 4 KiB write rose from 118 to 495 µs
# over one run) and whoever ran later in a session met a slower cluster.
NODE_POOL = "node-bench"
# Images attached at once to measure the mapper's memory per mapped image.
RSS_IMAGES = 8
# Goals (issue 39), each contender against write-through `rbd bench`.
GOALS = {"randwrite": 0.8, "randread": 0.9, "seqwrite": 0.9, "seqread": 0.8}

FIO_TIMEOUT = 300  # s, any one fio run
STEP_TIMEOUT = 60  # s, any one setup step (attach, mount, mkfs, ...)


def log(msg):
    print(f"bench: {msg}", flush=True, file=__import__("sys").stderr)


class NodeError(Exception):
    pass


def run(cmd, timeout=STEP_TIMEOUT, check=True):
    try:
        p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise NodeError(f"{cmd[0]} timed out after {timeout} s") from e
    if check and p.returncode != 0:
        raise NodeError(f"{' '.join(map(str, cmd[:4]))}... exited {p.returncode}: "
                        f"{(p.stderr.strip() or p.stdout.strip())[-400:]}")
    return p.stdout


def proc_cpu_s(pid):
    """User + system seconds of a live process (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def tree_cpu_s(pid):
    """proc_cpu_s of a process and all its live descendants: `rbdkit
    fuse-mapper` is a supervisor whose worker child serves the I/O."""
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int(Path(d, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += proc_cpu_s(p)
        todo += children.get(p, [])
    return total


def tree_rss_kib(pid, field="VmRSS"):
    """A /proc status field (kB) summed over a process and its children."""
    total = 0
    for p in [pid] + [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children")
                      .read_text().split()]:
        try:
            for ln in Path(f"/proc/{p}/status").read_text().splitlines():
                if ln.startswith(field + ":"):
                    total += int(ln.split()[1])
        except OSError:
            pass
    return total


def wait_until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise NodeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def admin_key(conf):
    """client.admin's key from the test cluster's keyring (it travels only
    over the mapper's 0600 socket, never in argv, env or a log)."""
    text = Path(conf).read_text()
    m = re.search(r"^\s*keyring\s*=\s*(\S+)", text, re.M)
    keyring = Path(m.group(1)) if m else Path(conf).parent / "keyring"
    section = None
    for ln in keyring.read_text().splitlines():
        ln = ln.strip()
        if ln.startswith("["):
            section = ln.strip("[]")
        elif section == "client.admin" and ln.startswith("key"):
            return ln.split("=", 1)[1].strip()
    raise NodeError(f"no client.admin key in {keyring}")


def mon_host(conf):
    m = re.search(r"^\s*mon[ _]host\s*=\s*(\S+)", Path(conf).read_text(), re.M)
    if not m:
        raise NodeError(f"no mon host in {conf}")
    return m.group(1)


def fsync_path(path):
    """One untimed flush through the whole stack: for a loop device it
    becomes a FUSE FSYNC and then a librbd flush, which ends librbd's
    write-through-until-flush phase, as `rbd bench` does at open (for
    `rbd-fuse`; the mapper's cache stays write-through)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# The mapper daemon
# --------------------------------------------------------------------------


class Mapper:
    """One `rbdkit fuse-mapper` for the whole group, as on a node; each
    contender run attaches (opens the image) and detaches (closes it)."""

    def __init__(self, binary, conf, workdir):
        self.bin = binary
        self.conf = conf
        self.dir = Path(workdir)
        self.sock = self.dir / "mapper.sock"
        self.state = self.dir / "state"
        self.logf = self.dir / "mapper.log"
        self.p = None
        self.key = admin_key(conf)
        self.mon = mon_host(conf)

    def start(self):
        env = dict(os.environ, RUST_LOG="info")
        env.pop("CEPH_ARGS", None)
        with open(self.logf, "ab") as lf:
            self.p = subprocess.Popen([str(self.bin), "fuse-mapper", "--socket", str(self.sock),
                                       "--state-dir", str(self.state)],
                                      stdin=subprocess.DEVNULL, stdout=lf, stderr=lf, env=env)

        def up():
            if self.p.poll() is not None:
                raise NodeError(f"fuse-mapper exited {self.p.returncode}: "
                                f"{self.logf.read_text()[-600:]}")
            try:
                return self.call({"op": "ping"}, timeout=2)["ok"]
            except OSError:
                return False
        wait_until(up, 30, "fuse-mapper to answer ping")

    def call(self, req, timeout=STEP_TIMEOUT):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(self.sock))
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        if not buf:
            raise NodeError(f"fuse-mapper closed the socket on {req['op']}")
        return json.loads(buf)

    def ok(self, req, timeout=STEP_TIMEOUT):
        r = self.call(req, timeout)
        if not r.get("ok"):
            raise NodeError(f"fuse-mapper {req['op']}: {r.get('error')}")
        return r

    def attach(self, vol, pool, image, passphrase=None, options=None):
        req = {"op": "attach", "volume_id": vol, "monitors": [self.mon], "user": "admin",
               "key": self.key, "pool": pool, "image": image}
        if options:
            req["options"] = options
        if passphrase:
            req["encryption"] = passphrase
        r = self.ok(req, timeout=120)
        return r["device"]

    def detach(self, vol):
        self.ok({"op": "detach", "volume_id": vol})

    def cpu_s(self):
        return tree_cpu_s(self.p.pid) if self.p else 0.0

    def stop(self):
        if not self.p:
            return
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(15)
        self.p = None
        # Whatever a failed run left: its loop devices, then its mount.
        mnt = self.state / "mnt"
        for dev, back in loop_devices():
            if back.startswith(str(mnt)):
                run(["losetup", "-d", dev], check=False)
        run(["umount", "-l", mnt], check=False)


def loop_devices():
    out = run(["losetup", "-l", "-n", "-O", "NAME,BACK-FILE"], check=False)
    rows = []
    for ln in out.splitlines():
        parts = ln.split(None, 1)
        if len(parts) == 2:
            rows.append((parts[0], parts[1].strip()))
    return rows


# --------------------------------------------------------------------------
# fio
# --------------------------------------------------------------------------


def check_timed(who, ops, seconds, min_s):
    """The rate of a run the harness timed: `ops` (what it asked for) over
    `seconds` (what it measured). A full run refuses a run shorter than
    `min_s` (the config's node_min_run_s): its rate would be mostly clock
    granularity and start-up, so the sizes must grow, not the table take
    it. Smoke (min_s 0) takes any positive time: it proves that every
    contender runs, not how fast, and must not fail for a fast machine."""
    if not seconds > 0:
        raise NodeError(f"{who}: no measurable time for {ops} ops ({seconds} s)")
    if seconds < min_s:
        raise NodeError(f"{who}: {ops} ops took {seconds:.2f} s, under the {min_s:g} s a run "
                        "needs to be timed (node_min_run_s); give this workload more ops "
                        "(node_workloads in bench/driver.py)")
    return ops / seconds


def wait_proc(p, timeout, what):
    """Wait for p with a deadline; returns (exit code, CPU seconds of the
    process and its waited-for children, from wait4)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            p.kill()
            os.wait4(p.pid, 0)
            raise NodeError(f"{what} timed out after {timeout} s")
        time.sleep(0.005)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, ru.ru_utime + ru.ru_stime


def fio(target, workload, bs, qd, ops, size, min_s=0.0):
    """One fio run; returns (parsed result, the fio job's CPU seconds)."""
    rw = {"randwrite": "randwrite", "randread": "randread", "seqwrite": "write",
          "seqread": "read"}[workload]
    cmd = ["fio", "--name=node", f"--filename={target}", "--direct=1", "--ioengine=libaio",
           f"--iodepth={qd}", f"--rw={rw}", f"--bs={bs}", f"--size={size}",
           f"--io_size={bs * ops}", "--norandommap", "--randrepeat=0", "--allow_file_create=0",
           "--fallocate=none", "--output-format=json"]
    if workload.endswith("write"):
        cmd.append("--end_fsync=1")  # the final flush is timed, as in rbd bench
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL)
        code, _ = wait_proc(p, FIO_TIMEOUT, f"fio on {target}")
        wall_s = time.perf_counter() - t0
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
    if code != 0:
        raise NodeError(f"fio on {target} exited {code}: {(err.strip() or out.strip())[-400:]}")
    j = json.loads(out[out.index("{"):])
    job = j["jobs"][0]
    side = job["write" if workload.endswith("write") else "read"]
    if job.get("error"):
        raise NodeError(f"fio on {target}: error {job['error']}")
    ops_done = side["total_ios"]
    if ops_done != ops:
        raise NodeError(f"fio on {target}: {ops_done} ops done of {ops}")
    # job_runtime (ms) covers the whole job, the end_fsync included; a run
    # under its millisecond (smoke sizes) falls back to the wall clock
    # around the process, which is never zero.
    runtime_s = (job.get("job_runtime") or side["runtime"]) / 1e3
    timed_s = runtime_s if runtime_s > 0 else wall_s
    iops = check_timed(f"fio on {target}", ops, timed_s, min_s)
    # The job's own CPU (fio reports it as a share of the job's runtime),
    # not fio's start-up, which would swamp short runs.
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * runtime_s
    return {"ops": ops, "iops": iops, "runtime_s": timed_s, "wall_s": wall_s,
            "lat_mean_us": side["clat_ns"]["mean"] / 1e3,
            "lat_p99_us": side["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1e3,
            }, cpu_s


def rbd_bench(conf, env, spec, wl, cache, min_s=0.0):
    """One `rbd bench` on a prefilled image, timed by the harness: the ops
    it was asked for over the wall clock around its process (which adds
    its start, connect, open and close: about 40 ms on the test cluster,
    1-2 % of a full-size run). Its printed rate is not used: it divides by
    a clock that a short run does not tick (`ops/sec: inf`). `cache` sets
    `rbd_cache` explicitly: False is write-through (a write answered once
    RADOS has it, as the mapper answers it), True librbd's default
    write-back cache (after `rbd bench`'s first flush)."""
    workload, bs, qd, ops = wl
    io_type = "write" if workload.endswith("write") else "read"
    # full-seq: op i at block i, as fio's sequential jobs (rbd bench's
    # "seq" instead gives each of its io-threads a separate region).
    pattern = "rand" if workload.startswith("rand") else "full-seq"
    cmd = ["rbd", "-c", conf, "bench", "--io-type", io_type, "--io-size", str(bs),
           "--io-threads", str(qd), "--io-total", str(bs * ops), "--io-pattern", pattern,
           f"--rbd_cache={'true' if cache else 'false'}", spec]
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env)
        code, cpu_s = wait_proc(p, FIO_TIMEOUT, f"rbd bench on {spec}")
        wall_s = time.perf_counter() - t0
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
    if code != 0:
        raise NodeError(f"rbd bench on {spec} exited {code}: "
                        f"{(err.strip() or out.strip())[-400:]}")
    # Only the op count of its summary line, as a check that it did all.
    m = re.search(r"^elapsed:.*\bops:\s*(\d+)", out, re.M)
    if not m or int(m.group(1)) != ops:
        raise NodeError(f"rbd bench on {spec}: did not report {ops} ops done: {out[-300:]!r}")
    iops = check_timed(f"rbd bench on {spec}", ops, wall_s, min_s)
    return {"ops": ops, "iops": iops, "runtime_s": wall_s, "wall_s": wall_s,
            "rbd_cache": cache, "cpu_s": cpu_s}


# --------------------------------------------------------------------------
# The group
# --------------------------------------------------------------------------


def wl_key(wl):
    workload, bs, qd, _ = wl
    size = f"{bs // MiB}M" if bs >= MiB else f"{bs // KiB}K"
    return f"{workload} {size} qd{qd}"


class Node:
    def __init__(self, c, cfg, rbdkit_bin, tag):
        self.c = c  # driver.Contenders: cluster, rbd bench, measured()
        self.cfg = cfg
        self.pool = NODE_POOL
        self.pool_made = False
        self.bin = rbdkit_bin
        self.raw = f"node-raw-{tag}"
        self.enc = f"node-enc-{tag}"
        self.fsimg = f"node-fs-{tag}"
        self.podimg = f"node-pod-{tag}"
        self.podmnt = None
        self.size = cfg["node_image_bytes"]
        self.fs_file_bytes = self.size * 3 // 4
        # The shortest run the full run times (check_timed); 0 in smoke.
        self.min_s = cfg.get("node_min_run_s", 0.0)
        self.work = Path(tempfile.mkdtemp(prefix="rbdkit-bench-node."))
        self.fsmnt = self.work / "ext4"
        self.rfmnt = self.work / "rbd-fuse"
        self.podmnt = self.work / "pod"
        self.fsmnt.mkdir()
        self.rfmnt.mkdir()
        self.podmnt.mkdir()
        self.rss = {}
        self.mapper = Mapper(rbdkit_bin, c.cl.conf, self.work)
        self.passfile = self.work / "luks-passphrase"
        self.passfile.write_text(ENC_PASSPHRASE)

    # -- setup -------------------------------------------------------------

    def make_pool(self):
        """NODE_POOL, its objects page sets (see there)."""
        conf = self.c.cl.conf
        run(["ceph", "-c", conf, "tell", "osd.*", "config", "set", "memstore_page_set", "true"])
        run(["ceph", "-c", conf, "osd", "pool", "create", self.pool, "8"])
        self.pool_made = True
        run(["rbd", "-c", conf, "pool", "init", self.pool], timeout=120)

    def setup(self):
        c, pool = self.c, self.pool
        self.make_pool()
        for img in (self.raw, self.fsimg, self.podimg):
            c.cl.rbd("create", "--size", f"{self.size // MiB}M", f"{pool}/{img}")
        log(f"node: prefilling {self.raw} ({self.size // MiB} MiB)")
        c.cl.rbd("bench", "--io-type", "write", "--io-size", str(4 * MiB), "--io-threads", "16",
                 "--io-total", str(self.size), "--io-pattern", "seq", f"{pool}/{self.raw}")
        self.mapper.start()
        # The encrypted image: rbdkit's LUKS2 header (the per-volume KDF,
        # as a provisioned volume has), its data segment filled through the
        # mapper (encrypted on the way), as the raw image is by rbd bench.
        c.cl.rbd("create", "--size", f"{self.size // MiB}M", f"{pool}/{self.enc}")
        env = dict(os.environ)
        env.pop("CEPH_ARGS", None)
        run([str(self.bin), "image", "-c", c.cl.conf, "encryption", "format", f"{pool}/{self.enc}",
             "--passphrase-file", str(self.passfile), "--pbkdf-time-ms", "0"])
        dev = self.mapper.attach("bench-enc", pool, self.enc, ENC_PASSPHRASE)
        try:
            log(f"node: prefilling {self.enc} through the mapper (LUKS2)")
            run(["fio", "--name=fill", f"--filename={dev}", "--direct=1", "--ioengine=libaio",
                 "--iodepth=16", "--rw=write", f"--bs={4 * MiB}",
                 f"--size={self.size - LUKS2_HEADER}", "--end_fsync=1"], timeout=FIO_TIMEOUT)
        finally:
            self.mapper.detach("bench-enc")
        log(f"node: ext4 on {self.fsimg}, one {self.fs_file_bytes // MiB} MiB file written "
            "through (no unwritten extents)")
        dev = self.mapper.attach("bench-fs", pool, self.fsimg)
        try:
            # Initialise inode tables and journal now, not in a background
            # thread during the runs.
            run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard",
                 dev], timeout=120)
            run(["mount", "-t", "ext4", dev, self.fsmnt])
            try:
                f = self.fsmnt / "bench.dat"
                run(["fio", "--name=fill", f"--filename={f}", "--direct=1", "--ioengine=libaio",
                     "--iodepth=16", "--rw=write", f"--bs={4 * MiB}",
                     f"--size={self.fs_file_bytes}", "--fallocate=none", "--end_fsync=1"],
                    timeout=FIO_TIMEOUT)
            finally:
                run(["umount", self.fsmnt])
        finally:
            self.mapper.detach("bench-fs")
        # As a pod gets it: ext4 as NodeStage makes it (lazy init), mounted
        # with no options, and a file fio lays out itself (fallocated:
        # unwritten extents, written for the first time by the runs).
        log(f"node: ext4 on {self.podimg} as NodeStage makes it; a file fio lays out itself")
        dev = self.mapper.attach("bench-pod", pool, self.podimg)
        try:
            run(["mkfs.ext4", "-q", *NODESTAGE_MKFS_EXT4, dev], timeout=120)
            run(["mount", "-t", "ext4", dev, self.podmnt])
            try:
                run(["fio", "--name=layout", f"--filename={self.podmnt / 'bench.dat'}",
                     f"--size={self.fs_file_bytes}", "--rw=write", "--io_size=4k",
                     "--bs=4k"], timeout=FIO_TIMEOUT)
            finally:
                run(["umount", self.podmnt])
        finally:
            self.mapper.detach("bench-pod")
        self.measure_rss()

    def measure_rss(self):
        """The mapper's resident memory (supervisor + worker) with nothing
        attached and with RSS_IMAGES images attached and read once."""
        pid = self.mapper.p.pid
        imgs = [f"node-rss-{i}-{self.raw}" for i in range(RSS_IMAGES)]
        for img in imgs:
            self.c.cl.rbd("create", "--size", "64M", f"{self.pool}/{img}")
        try:
            # The journal gives idle slots back after 5 s (src/node/fuse_journal.rs).
            time.sleep(12)
            self.rss["idle_kib"] = tree_rss_kib(pid)
            for i, img in enumerate(imgs):
                dev = self.mapper.attach(f"rss-{i}", self.pool, img)
                fio(dev, "randread", 4 * KiB, 16, 256, 64 * MiB)
            self.rss["attached_kib"] = tree_rss_kib(pid)
            self.rss["images"] = RSS_IMAGES
        finally:
            for i, img in enumerate(imgs):
                try:
                    self.mapper.detach(f"rss-{i}")
                except (NodeError, OSError):
                    pass
                try:
                    self.c.cl.rbd("rm", "--no-progress", f"{self.pool}/{img}")
                except Exception:  # noqa: BLE001 - the cluster goes away anyway
                    pass

    def teardown(self):
        for mnt in (self.fsmnt, self.rfmnt, self.podmnt):
            if os.path.ismount(mnt):
                run(["umount", "-l", mnt], check=False)
        if self.mapper.p:
            self.rss["peak_kib"] = tree_rss_kib(self.mapper.p.pid, "VmHWM")
        self.mapper.stop()
        for img in (self.raw, self.fsimg, self.podimg, self.enc):
            try:
                self.c.cl.rbd("rm", "--no-progress", f"{self.pool}/{img}")
            except Exception:  # noqa: BLE001 - the cluster goes away anyway
                pass
        if self.pool_made:
            run(["ceph", "-c", self.c.cl.conf, "osd", "pool", "rm", self.pool, self.pool,
                 "--yes-i-really-really-mean-it"], check=False)
        subprocess.run(["rm", "-rf", str(self.work)], check=False)

    # -- contenders ----------------------------------------------------------

    def mapper_block(self, wl, options=None):
        workload, bs, qd, ops = wl
        dev = self.mapper.attach("bench-raw", self.pool, self.raw, options=options)
        try:
            fsync_path(dev)
            cpu0 = self.mapper.cpu_s()
            res, fio_cpu = fio(dev, workload, bs, qd, ops, self.size, self.min_s)
            res["server_cpu_s"] = self.mapper.cpu_s() - cpu0
        finally:
            self.mapper.detach("bench-raw")
        res["fio_cpu_s"] = fio_cpu
        return res

    def mapper_enc(self, wl):
        workload, bs, qd, ops = wl
        dev = self.mapper.attach("bench-enc", self.pool, self.enc, ENC_PASSPHRASE)
        try:
            fsync_path(dev)
            cpu0 = self.mapper.cpu_s()
            res, fio_cpu = fio(dev, workload, bs, qd, ops, self.size - LUKS2_HEADER, self.min_s)
            res["server_cpu_s"] = self.mapper.cpu_s() - cpu0
        finally:
            self.mapper.detach("bench-enc")
        res["fio_cpu_s"] = fio_cpu
        return res

    def librbd(self, wl, encrypted):
        """rbdkit-bench's data mode in process: librbd with and without its
        own LUKS2 layer (rbd_encryption_load), which no `rbd bench` has."""
        workload, bs, qd, ops = wl
        extra = {"luks-passphrase-file": self.passfile} if encrypted else {}
        out = self.c.lib("rbdkit", "data", pool=self.pool,
                         image=self.enc if encrypted else self.raw,
                         workload=workload, bs=bs, qd=qd, ops=ops, **extra)
        # Its own clock around its I/O (the final flush included).
        out["iops"] = check_timed(f"rbdkit-bench data on {workload}", ops, out["elapsed_s"],
                                  self.min_s)
        out["fio_cpu_s"] = out.get("cpu_s", 0.0)
        out["server_cpu_s"] = 0.0
        return out

    def mapper_fs(self, wl):
        workload, bs, qd, ops = wl
        dev = self.mapper.attach("bench-fs", self.pool, self.fsimg)
        try:
            run(["mount", "-t", "ext4", "-o", "noatime", dev, self.fsmnt])
            try:
                f = self.fsmnt / "bench.dat"
                fsync_path(f)
                cpu0 = self.mapper.cpu_s()
                res, fio_cpu = fio(f, workload, bs, qd, ops, self.fs_file_bytes, self.min_s)
                res["server_cpu_s"] = self.mapper.cpu_s() - cpu0
            finally:
                run(["umount", self.fsmnt])
        finally:
            self.mapper.detach("bench-fs")
        res["fio_cpu_s"] = fio_cpu
        return res

    def mapper_pod(self, wl):
        workload, bs, qd, ops = wl
        dev = self.mapper.attach("bench-pod", self.pool, self.podimg)
        try:
            run(["mount", "-t", "ext4", dev, self.podmnt])
            try:
                f = self.podmnt / "bench.dat"
                cpu0 = self.mapper.cpu_s()
                res, fio_cpu = fio(f, workload, bs, qd, ops, self.fs_file_bytes, self.min_s)
                res["server_cpu_s"] = self.mapper.cpu_s() - cpu0
            finally:
                run(["umount", self.podmnt])
        finally:
            self.mapper.detach("bench-pod")
        res["fio_cpu_s"] = fio_cpu
        return res

    def rbd_fuse(self, wl):
        workload, bs, qd, ops = wl
        env = dict(os.environ)
        env.pop("CEPH_ARGS", None)
        with open(self.work / "rbd-fuse.log", "ab") as lf:
            p = subprocess.Popen(["rbd-fuse", "-f", "-c", self.c.cl.conf, "-p", self.pool,
                                  "-r", self.raw, str(self.rfmnt)],
                                 stdin=subprocess.DEVNULL, stdout=lf, stderr=lf, env=env)
        f = self.rfmnt / self.raw
        dev = None
        try:
            def up():
                if p.poll() is not None:
                    raise NodeError(f"rbd-fuse exited {p.returncode}: "
                                    f"{(self.work / 'rbd-fuse.log').read_text()[-400:]}")
                return os.path.ismount(self.rfmnt) and f.exists()
            wait_until(up, 30, f"rbd-fuse to show {f}")
            dev = run(["losetup", "-f", "--show", "--direct-io=on", f]).strip()
            fsync_path(dev)
            cpu0 = proc_cpu_s(p.pid)
            res, fio_cpu = fio(dev, workload, bs, qd, ops, self.size, self.min_s)
            res["server_cpu_s"] = proc_cpu_s(p.pid) - cpu0
            res["fio_cpu_s"] = fio_cpu
        finally:
            if dev:
                run(["losetup", "-d", dev], check=False)
                # The unbind completes asynchronously; let go of the file first.
                try:
                    wait_until(lambda: all(d != dev for d, _ in loop_devices()), 10,
                               f"{dev} to unbind")
                except NodeError:
                    pass
            if os.path.ismount(self.rfmnt):
                run(["umount", self.rfmnt], check=False)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(15)
        return res

    def one(self, who, wl):
        workload, bs, qd, ops = wl
        if who in (BASE, "rbd-bench"):
            out = rbd_bench(self.c.cl.conf, self.c.env, f"{self.pool}/{self.raw}", wl,
                            cache=who == "rbd-bench", min_s=self.min_s)
            out["fio_cpu_s"] = out["cpu_s"]
            out["server_cpu_s"] = 0.0
            return out
        if who in ("librbd", "librbd-enc"):
            return self.librbd(wl, who == "librbd-enc")
        if who in OPTION_CONTENDERS:
            return self.mapper_block(wl, OPTION_CONTENDERS[who])
        return {"mapper-block": self.mapper_block, "mapper-fs": self.mapper_fs,
                "mapper-pod": self.mapper_pod, "rbd-fuse": self.rbd_fuse,
                "mapper-enc": self.mapper_enc}[who](wl)


def selected_contenders():
    """CONTENDERS, or the baseline and those RBDKIT_BENCH_NODE_CONTENDERS
    names (comma-separated): a development run of a few."""
    want = [w.strip() for w in os.environ.get("RBDKIT_BENCH_NODE_CONTENDERS", "").split(",")
            if w.strip()]
    if not want:
        return CONTENDERS
    bad = [w for w in want if w not in CONTENDERS]
    if bad:
        raise NodeError(f"RBDKIT_BENCH_NODE_CONTENDERS: unknown {', '.join(bad)}; "
                        f"known: {', '.join(CONTENDERS)}")
    return [w for w in CONTENDERS if w == BASE or w in want]


def section_node(c, cfg, errors, tag, rbdkit_bin, rotate, settle):
    node = Node(c, cfg, rbdkit_bin, tag)
    rounds = []
    contenders = CONTENDERS
    try:
        contenders = selected_contenders()
        node.setup()
        for r in range(cfg["node_rounds"]):
            res = {}
            for wl in cfg["node_workloads"]:
                for w in rotate(contenders, r):
                    key = f"{w}|{wl_key(wl)}"
                    log(f"node round {r + 1}/{cfg['node_rounds']}: {wl_key(wl)}: {w}")
                    settle()
                    try:
                        res[key] = c.measured(lambda: node.one(w, wl))
                    except Exception as e:  # noqa: BLE001 - NodeError, the driver's RunError, OSError
                        errors.append(f"node/{w}/{wl_key(wl)}: {e}")
                        res[key] = {"error": str(e)}
            rounds.append(res)
    except (NodeError, OSError) as e:
        errors.append(f"node/setup: {e}")
    finally:
        node.teardown()
    return {"contenders": contenders, "workloads": [wl_key(w) for w in cfg["node_workloads"]],
            "image_bytes": node.size, "fs_file_bytes": node.fs_file_bytes, "rounds": rounds,
            "rss": node.rss}


# --------------------------------------------------------------------------
# Summary and report
# --------------------------------------------------------------------------


def summarize(node, spread, med, target):
    per, ratios, targets = {}, {}, []
    for wk in node["workloads"]:
        for w in node["contenders"]:
            ok = [rd[f"{w}|{wk}"] for rd in node["rounds"] if "iops" in rd.get(f"{w}|{wk}", {})]
            if ok:
                bs = int(re.search(r" (\d+)([KM]) ", wk).group(1)) * \
                    (MiB if re.search(r" \d+M ", wk) else KiB)
                per[f"{w}|{wk}"] = {
                    "iops": spread([o["iops"] for o in ok]),
                    "mib_s": med([o["iops"] * bs / MiB for o in ok]),
                    "fio_cpu_us_per_op": med([o["fio_cpu_s"] * 1e6 / o["ops"] for o in ok]),
                    "server_cpu_us_per_op": med([o["server_cpu_s"] * 1e6 / o["ops"] for o in ok]),
                    "server_cpu_s_per_gib": med([o["server_cpu_s"] * GiB / (o["ops"] * bs)
                                                 for o in ok]),
                    "cluster_cpu_us_per_op": med([o["cluster_cpu_s"] * 1e6 / o["ops"]
                                                  for o in ok]),
                    "lat_mean_us": med([o["lat_mean_us"] for o in ok if "lat_mean_us" in o]),
                }

        def ratio(a, b):
            vals = []
            for rd in node["rounds"]:
                x, y = rd.get(f"{a}|{wk}", {}), rd.get(f"{b}|{wk}", {})
                if "iops" in x and "iops" in y:
                    vals.append(x["iops"] / y["iops"])
            return spread(vals)

        for w in ["rbd-bench", "mapper-block", "mapper-fs", "mapper-pod", "rbd-fuse", "librbd"]:
            ratios[f"{w} / {BASE}|{wk}"] = ratio(w, BASE)
        ratios[f"mapper-block / rbd-fuse|{wk}"] = ratio("mapper-block", "rbd-fuse")
        ratios[f"mapper-fs / rbd-fuse|{wk}"] = ratio("mapper-fs", "rbd-fuse")
        ratios[f"mapper-cacher / {BASE}|{wk}"] = ratio("mapper-cacher", BASE)
        ratios[f"mapper-block / mapper-cacher|{wk}"] = ratio("mapper-block", "mapper-cacher")
        for w in ("mapper-zerocopy", "mapper-inline"):
            ratios[f"{w} / mapper-block|{wk}"] = ratio(w, "mapper-block")
        ratios[f"mapper-enc / mapper-block|{wk}"] = ratio("mapper-enc", "mapper-block")
        ratios[f"librbd-enc / librbd|{wk}"] = ratio("librbd-enc", "librbd")
        ratios[f"mapper-enc / librbd-enc|{wk}"] = ratio("mapper-enc", "librbd-enc")
    for wk in node["workloads"]:
        goal = GOALS[wk.split()[0]]
        base = "write-through rbd bench"
        targets.append(target(f"node {wk}: mapper block vs {base}",
                              ratios.get(f"mapper-block / {BASE}|{wk}"), goal, "node-ceiling"))
        targets.append(target(f"node {wk}: mapper ext4 file (the pod's view) vs {base}",
                              ratios.get(f"mapper-fs / {BASE}|{wk}"), goal, "node-ceiling-fs"))
        targets.append(target(f"node {wk}: mapper ext4 as NodeStage makes it vs {base}",
                              ratios.get(f"mapper-pod / {BASE}|{wk}"), goal, "node-ceiling-pod"))
        targets.append(target(f"node {wk}: mapper block vs rbd-fuse",
                              ratios.get(f"mapper-block / rbd-fuse|{wk}"), 1.0, "node-rbd-fuse",
                              strict=True))
    return {"per": per, "ratios": ratios}, targets


def render_option_contenders(L, node, r, fmt_ratio):
    """The map-option contenders' table, or a line saying the run had none
    (a run older than them, or one that selected others)."""
    keys = [f"{c} / mapper-block|{wk}" for c in ("mapper-zerocopy", "mapper-inline")
            for wk in node["workloads"]]
    if not any(r.get(k) for k in keys):
        L.append("How requests reach librbd (issue 39): the map-option contenders (zero-copy "
                 "writes, `rbd_non_blocking_aio=false`) were not in this run; "
                 "`bench/analysis.md` has their last measurement.")
        L.append("")
        return
    L.append("How requests reach librbd (issue 39): *mapper, block* with the map option "
             "`rbd_disable_zero_copy_writes=false` (librbd sends the mapper's buffer, which the "
             "request owns until it completes, instead of copying it) and with "
             "`rbd_non_blocking_aio=false` (librbd submits on the FUSE thread instead of "
             "handing each request to its own thread). Ratios over *mapper, block* per round, "
             "median (min–max):")
    L.append("")
    L.append("| workload | zero-copy writes / mapper, block | "
             "rbd_non_blocking_aio=false / mapper, block |")
    L.append("|---|---|---|")
    for wk in node["workloads"]:
        L.append(f"| {wk} | {fmt_ratio(r.get(f'mapper-zerocopy / mapper-block|{wk}'))} | "
                 f"{fmt_ratio(r.get(f'mapper-inline / mapper-block|{wk}'))} |")
    L.append("")


def render(results, summary, cfg, fmt_ratio, fmt_num):
    node = results.get("node")
    s = summary.get("node")
    if not node or not s:
        return []
    L = []
    L.append("## 4. Node data path: fio through the userspace mapper")
    L.append("")
    min_s = cfg.get("node_min_run_s", 0)
    sizes = ", ".join(f"{wl_key(w)} {w[3]:,} ops" for w in cfg.get("node_workloads", []))
    L.append(f"One {node['image_bytes'] // MiB} MiB image, prefilled once with `rbd bench`, "
             "shared by `rbd bench`, the mapper's block device and `rbd-fuse`; the ext4 case "
             f"uses a second image of the same size holding one fully written "
             f"{node['fs_file_bytes'] // MiB} MiB file. **Baseline: `rbd bench "
             "--rbd_cache=false`**, librbd write-through: a write is answered once RADOS has "
             "it, as the mapper answers it (librbd's cache off, its default since issue 39); `rbd bench` "
             "with librbd's default cache (`--rbd_cache=true`, write-back once its first flush "
             "has ended the write-through-until-flush phase) is a separate row. Every rate is "
             "the harness's own: the ops it asked for over the time it measured (fio's "
             "job runtime; for `rbd bench` the wall clock around its process, start-up and "
             "connect included: about 40 ms), never a rate a tool printed; each workload "
             f"is sized so that a run lasts seconds ({sizes}) and a run shorter than "
             f"{min_s:g} s is refused as too short to time. fio 3.33 with `--direct=1 "
             "--ioengine=libaio` (writes with `--end_fsync=1`, timed) on: *mapper, block*: "
             "`/dev/loopN` of `rbdkit fuse-mapper` (attach, one untimed fsync, fio, detach); "
             "*mapper, ext4 file* (the pod's view of a volume its workload has written): a "
             "file in ext4 mounted on that device; *rbd-fuse + loop*: "
             "`rbd-fuse` (Ceph 16.2, libfuse 2, as shipped) with `losetup --direct-io=on` on its "
             "image file, whose librbd cache is write-back after the untimed fsync; "
             "*librbd (rbdkit-bench)*: `rbdkit-bench data`, rbdkit's AIO in process on the "
             "prefilled image (librbd's default cache, write-back after its untimed flush). "
             "*mapper, ext4 as a pod gets it*: a third image with "
             "ext4 made as NodeStage makes it (`mkfs.ext4 -m0 -Enodiscard,lazy_itable_init=1,"
             "lazy_journal_init=1`), mounted with no options (as NodeStage mounts ext4), "
             "holding a file fio laid out itself (fallocated: its extents are unwritten until "
             f"the runs write them). {cfg['node_rounds']} rounds, contenders interleaved. "
             "Columns: throughput over write-through `rbd bench`'s in the same round, median "
             "(min–max).")
    L.append("")
    L.append("| workload | rbd bench, cache off: IOPS (MiB/s) | rbd bench, cache on | "
             "mapper, block | mapper, ext4 file | mapper, ext4 as a pod gets it | "
             "rbd-fuse + loop | librbd (rbdkit-bench) | mapper block / rbd-fuse |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    r = s["ratios"]
    for wk in node["workloads"]:
        ref = s["per"].get(f"{BASE}|{wk}")
        refs = f"{fmt_num(ref['iops']['median'], 0)} ({fmt_num(ref['mib_s'])})" if ref \
            else "failed"
        cells = [fmt_ratio(r.get(f"{w} / {BASE}|{wk}"))
                 for w in ["rbd-bench", "mapper-block", "mapper-fs", "mapper-pod", "rbd-fuse",
                           "librbd"]]
        L.append(f"| {wk} | {refs} | " + " | ".join(cells) +
                 f" | {fmt_ratio(r.get(f'mapper-block / rbd-fuse|{wk}'))} |")
    L.append("")
    L.append("The mapper's librbd cache (issue 39): *mapper, block* runs with `rbd_cache=false`, "
             "the default since issue 39; *mapper, block, rbd_cache=true* is the same device "
             "with the map option `rbd_cache=true`: librbd's ObjectCacher, write-through, the "
             "default before. Ratios per round, median (min–max):")
    L.append("")
    L.append("| workload | cache off / write-through `rbd bench` | ObjectCacher / "
             "write-through `rbd bench` | cache off / ObjectCacher |")
    L.append("|---|---|---|---|")
    for wk in node["workloads"]:
        L.append(f"| {wk} | {fmt_ratio(r.get(f'mapper-block / {BASE}|{wk}'))} | "
                 f"{fmt_ratio(r.get(f'mapper-cacher / {BASE}|{wk}'))} | "
                 f"{fmt_ratio(r.get(f'mapper-block / mapper-cacher|{wk}'))} |")
    L.append("")
    render_option_contenders(L, node, r, fmt_ratio)
    L.append("Absolute medians of this run (IOPS, MiB/s, fio's mean completion latency):")
    L.append("")
    L.append("| workload | " + " | ".join(NAMES[w] for w in node["contenders"]) + " |")
    L.append("|---|" + "---|" * len(node["contenders"]))
    for wk in node["workloads"]:
        cells = []
        for w in node["contenders"]:
            p = s["per"].get(f"{w}|{wk}")
            if not p:
                cells.append("–")
                continue
            lat = f", {fmt_num(p['lat_mean_us'])} µs" if p.get("lat_mean_us") else ""
            cells.append(f"{fmt_num(p['iops']['median'], 0)} ({fmt_num(p['mib_s'])}{lat})")
        L.append(f"| {wk} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("CPU µs per op, medians: the fio job (for `rbd bench`: the whole process) / the userspace "
             "server (`rbdkit fuse-mapper` with its worker process, or `rbd-fuse`; all threads) / the cluster's daemons. "
             "Kernel work in the loop and FUSE layers that runs in kernel threads is in none of "
             "them.")
    L.append("")
    L.append("| workload | " + " | ".join(NAMES[w] for w in node["contenders"]) + " |")
    L.append("|---|" + "---|" * len(node["contenders"]))
    for wk in node["workloads"]:
        cells = []
        for w in node["contenders"]:
            p = s["per"].get(f"{w}|{wk}")
            cells.append("–" if not p else
                         f"{fmt_num(p['fio_cpu_us_per_op'])} / "
                         f"{fmt_num(p['server_cpu_us_per_op'])} / "
                         f"{fmt_num(p['cluster_cpu_us_per_op'])}")
        L.append(f"| {wk} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("The userspace server's CPU seconds per GiB moved, medians (all its threads; "
             "kernel threads not counted):")
    L.append("")
    servers = [w for w in node["contenders"]
               if w not in (BASE, "rbd-bench", "librbd", "librbd-enc")]
    L.append("| workload | " + " | ".join(NAMES[w] for w in servers) + " |")
    L.append("|---|" + "---|" * len(servers))
    for wk in node["workloads"]:
        cells = []
        for w in servers:
            p = s["per"].get(f"{w}|{wk}")
            cells.append("–" if not p or "server_cpu_s_per_gib" not in p
                         else fmt_num(p["server_cpu_s_per_gib"]))
        L.append(f"| {wk} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("Encryption (issue 26): a fourth image of the same size with rbdkit's LUKS2 header "
             "(aes-xts-plain64, 512-bit key, 4096-byte sectors), filled through the mapper. "
             "*mapper, block, LUKS2*: its `/dev/loopN` (rbdkit-fuse decrypts in its data path); "
             "*librbd*, *librbd LUKS2*: `rbdkit-bench data` in process on the raw image, and on "
             "the encrypted one after `rbd_encryption_load` (librbd's own LUKS2 layer: no "
             "release's `rbd bench` can load encryption). Ratios per round, median (min–max):")
    L.append("")
    L.append("| workload | mapper LUKS2 / mapper plain | librbd LUKS2 / librbd plain | "
             "mapper LUKS2 / librbd LUKS2 |")
    L.append("|---|---|---|---|")
    for wk in node["workloads"]:
        L.append(f"| {wk} | {fmt_ratio(r.get(f'mapper-enc / mapper-block|{wk}'))} | "
                 f"{fmt_ratio(r.get(f'librbd-enc / librbd|{wk}'))} | "
                 f"{fmt_ratio(r.get(f'mapper-enc / librbd-enc|{wk}'))} |")
    L.append("")
    rss = node.get("rss") or {}
    if rss.get("attached_kib"):
        per = (rss["attached_kib"] - rss["idle_kib"]) / rss["images"] / 1024
        L.append(f"The mapper's resident memory (supervisor + worker, VmRSS): "
                 f"{fmt_num(rss['idle_kib'] / 1024)} MiB with no image attached, "
                 f"{fmt_num(rss['attached_kib'] / 1024)} MiB with {rss['images']} images "
                 f"attached and read (4 KiB, depth 16): **{fmt_num(per)} MiB per mapped image**; "
                 f"peak over the whole run (VmHWM) {fmt_num(rss.get('peak_kib', 0) / 1024)} MiB.")
        L.append("")
    return L
