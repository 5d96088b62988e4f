#!/usr/bin/env python3
"""Issue 39, item 3: what ublk would give the userspace mapper, measured
beside it on one kernel. Runs inside scripts/kernel-vm's 6.12 guest
(bench/profile/ublk_guest drives it) against the guest's one-node Ceph.

Contenders, all serving one prefilled image in turn, the order rotated
per round (the OSD ages):
  krbd          the kernel's rbd driver (`rbd device map`): the floor
  mapper        `rbdkit fuse-mapper`: FUSE + loop, the shipped design
  ublk          bench/ublk-rbd: librbd's AIO behind ublk, one queue
  rbd-nbd       Ceph's NBD server (NBD served by a librbd process)
Every userspace server runs librbd write-through (rbd_cache=false), as
krbd writes: a write is answered once RADOS has it.

For each, fio on the raw device (O_DIRECT, libaio) and, per op: the
rate, the userspace server's CPU (all its processes and threads) and the
whole guest's busy CPU (one vCPU, so every layer counts). Under TCG a
time means something only beside another of the same run: read the
ratios. Before the timed runs, a data check: what ublk writes, krbd
reads back, and the other way round.

    ublk_guest.py RBDKIT UBLK_RBD OUT_JSON [--rounds N] [--scale S]
"""
import argparse, hashlib, json, os, signal, subprocess, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import node  # noqa: E402  (bench/node.py: fio, the mapper client, CPU)

MiB = 1 << 20
POOL, IMAGE, SIZE = "rbd", "ublk-bench", 256 * MiB
CONTENDERS = ["krbd", "mapper", "ublk", "rbd-nbd"]
# (workload, block size, queue depth, ops at scale 1)
WORKLOADS = [("randwrite", 4096, 16, 3000), ("randread", 4096, 16, 3000),
             ("seqwrite", 4 * MiB, 16, 48), ("seqread", 4 * MiB, 16, 48)]


def rbd(conf, *a, timeout=600):
    return node.run(["rbd", "-c", conf, *a], timeout=timeout)


def busy_jiffies():
    """The guest's busy CPU so far: every /proc/stat cpu field but idle and iowait."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f) - f[3] - f[4]


class Krbd:
    def __init__(self, conf):
        self.conf, self.dev = conf, None

    def map(self):
        self.dev = rbd(self.conf, "device", "map", "-o", "noudev", f"{POOL}/{IMAGE}").strip()
        return self.dev

    def unmap(self):
        rbd(self.conf, "device", "unmap", "-o", "noudev", self.dev)

    def cpu_s(self):
        return 0.0  # in the kernel: counted in the guest's busy CPU only


class RbdNbd:
    def __init__(self, conf):
        self.conf, self.dev = conf, None

    def map(self):
        # Write-through, as every other contender: librbd's cache is on by
        # default and would answer writes before RADOS has them.
        self.dev = node.run(["rbd-nbd", "-c", self.conf, "--rbd_cache=false", "map",
                             f"{POOL}/{IMAGE}"], timeout=120).strip()
        return self.dev

    def pid(self):
        out = node.run(["pgrep", "-f", "rbd-nbd .*map"], check=False).split()
        return int(out[0]) if out else None

    def unmap(self):
        node.run(["rbd-nbd", "unmap", self.dev], timeout=60)

    def cpu_s(self):
        p = self.pid()
        return node.tree_cpu_s(p) if p else 0.0


class Ublk:
    def __init__(self, conf, binary):
        self.conf, self.bin, self.p = conf, binary, None

    def map(self):
        self.p = subprocess.Popen([self.bin, "--conf", self.conf, "--pool", POOL,
                                   "--image", IMAGE, "--depth", "64"],
                                  stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
        dev = self.p.stdout.readline().strip()
        if not dev.startswith("/dev/ublkb"):
            raise node.NodeError(f"ublk-rbd printed {dev!r}, exit {self.p.poll()}")
        node.wait_until(lambda: Path(dev).exists(), 30, dev)
        return dev

    def unmap(self):
        self.p.send_signal(signal.SIGTERM)
        if self.p.wait(60) != 0:
            raise node.NodeError(f"ublk-rbd exited {self.p.returncode}")

    def cpu_s(self):
        return node.proc_cpu_s(self.p.pid)


class FuseMapper:
    def __init__(self, conf, binary, workdir):
        workdir.mkdir(parents=True, exist_ok=True)
        self.m = node.Mapper(binary, conf, workdir)
        self.m.start()

    def map(self):
        return self.m.attach("ublk-bench-vol", POOL, IMAGE)

    def unmap(self):
        self.m.detach("ublk-bench-vol")

    def cpu_s(self):
        return self.m.cpu_s()


def block_io(dev, offset, data=None, length=0):
    """O_DIRECT write of `data` (or read of `length` bytes) at `offset`."""
    import mmap
    fd = os.open(dev, (os.O_WRONLY if data is not None else os.O_RDONLY) | os.O_DIRECT)
    try:
        n = len(data) if data is not None else length
        buf = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT wants
        if data is not None:
            buf.write(data)
            os.pwritev(fd, [buf], offset)
            os.fsync(fd)
            return None
        os.preadv(fd, [buf], offset)
        return bytes(buf)
    finally:
        os.close(fd)


def data_check(a, b, name_a, name_b):
    """What `a` writes, `b` reads back, byte for byte."""
    data = os.urandom(4 * MiB)
    dev = a.map()
    try:
        block_io(dev, 8 * MiB + 4096, data)
    finally:
        a.unmap()
    dev = b.map()
    try:
        back = block_io(dev, 8 * MiB + 4096, length=len(data))
    finally:
        b.unmap()
    if back != data:
        raise node.NodeError(f"written through {name_a}, read through {name_b}: data differ "
                             f"({hashlib.sha256(data).hexdigest()[:12]} != "
                             f"{hashlib.sha256(back).hexdigest()[:12]})")
    node.log(f"data check: {name_a} -> {name_b}: 4 MiB equal")


def measure(c, name, wl, bs, qd, ops):
    dev = c.map()
    try:
        cpu0, busy0 = c.cpu_s(), busy_jiffies()
        res, fio_cpu = node.fio(dev, wl, bs, qd, ops, SIZE)
        cpu1, busy1 = c.cpu_s(), busy_jiffies()
    finally:
        c.unmap()
    hz = os.sysconf("SC_CLK_TCK")
    row = {"contender": name, "workload": wl, "iops": res["iops"], "ops": ops,
           "server_us_per_op": (cpu1 - cpu0) / ops * 1e6,
           "guest_us_per_op": (busy1 - busy0) / hz / ops * 1e6,
           "fio_us_per_op": fio_cpu / ops * 1e6}
    node.log(f"{name} {wl}: {row['iops']:.0f} op/s, server {row['server_us_per_op']:.0f} "
             f"us/op, guest {row['guest_us_per_op']:.0f} us/op")
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rbdkit")
    ap.add_argument("ublk_rbd")
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args()
    conf = os.environ["RBDKIT_TEST_CEPH_CONF"]
    rbd(conf, "create", "--size", f"{SIZE // MiB}M", f"{POOL}/{IMAGE}")
    rbd(conf, "bench", "--io-type", "write", "--io-size", 4 * MiB, "--io-threads", 4,
        "--io-total", SIZE, "--io-pattern", "seq", f"{POOL}/{IMAGE}")
    work = Path("/tmp/ublk-bench")
    cs = {"krbd": Krbd(conf), "ublk": Ublk(conf, a.ublk_rbd), "rbd-nbd": RbdNbd(conf),
          "mapper": FuseMapper(conf, a.rbdkit, work / "mapper")}
    rows = []
    try:
        data_check(cs["ublk"], cs["krbd"], "ublk", "krbd")
        data_check(cs["krbd"], cs["ublk"], "krbd", "ublk")
        for r in range(a.rounds):
            order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
            for wl, bs, qd, ops in WORKLOADS:
                for name in order:
                    row = measure(cs[name], name, wl, bs, qd, max(8, int(ops * a.scale)))
                    rows.append(dict(row, round=r))
    finally:
        cs["mapper"].m.stop()
    Path(a.out).write_text(json.dumps({"kernel": os.uname().release, "rounds": a.rounds,
                                       "scale": a.scale, "rows": rows}, indent=1))


main()
