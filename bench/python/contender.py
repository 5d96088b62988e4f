"""The official Python binding's contender (Debian's python3-rbd/python3-rados).

Run with Debian's own interpreter, /usr/bin/python3 (the binding is built for it).
Same command line and JSON output as bench/rbdkit-bench (see bench/README.md):

    contender.py control     --conf C --pool P --prefix X --cycles N --size B
    contender.py concurrency --conf C --pool P --prefix X --threads T --images M --size B
    contender.py data        --conf C --pool P --image I --workload W --bs B --qd Q --ops N

Data mode uses the binding's aio_write/aio_read/aio_flush with at most qd
requests in flight; completions arrive on librbd's callback thread.
"""

import json
import sys
import threading
import time

import rados
import rbd

MASK = (1 << 64) - 1


def splitmix64(x):
    """Same offset hash as every other contender."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def pattern(n):
    """The bytes every write sends: a fixed non-zero pattern."""
    return bytes((i * 31) % 251 + 1 for i in range(n))


def parse(argv):
    if not argv:
        sys.exit("usage: contender.py control|concurrency|data --conf C ...")
    mode, rest = argv[0], argv[1:]
    if len(rest) % 2:
        sys.exit("options come in --key value pairs")
    opts = {}
    for k, v in zip(rest[::2], rest[1::2]):
        if not k.startswith("--"):
            sys.exit(f"expected --option, got {k!r}")
        opts[k[2:]] = v
    return mode, opts


def cycle(ioctx, name, size):
    """create -> open -> stat -> resize -> close -> remove; ms per op."""
    t = []
    clock = time.perf_counter()

    def lap():
        nonlocal clock
        now = time.perf_counter()
        t.append((now - clock) * 1e3)
        clock = now

    rbd.RBD().create(ioctx, name, size)
    lap()
    image = rbd.Image(ioctx, name)
    lap()
    info = image.stat()
    lap()
    image.resize(info["size"] * 2)
    lap()
    image.close()
    lap()
    rbd.RBD().remove(ioctx, name)
    lap()
    return t


OPS = ["create", "open", "stat", "resize", "close", "remove"]


def control(opts, ioctx, out):
    cycles, size, prefix = int(opts["cycles"]), int(opts["size"]), opts["prefix"]
    times = {op: [] for op in OPS + ["cycle"]}
    for i in range(cycles + 1):
        t = cycle(ioctx, f"{prefix}-{i}", size)
        if i == 0:
            continue  # warm-up
        for op, ms in zip(OPS, t):
            times[op].append(ms)
        times["cycle"].append(sum(t))
    out["ops_ms"] = times


def phase(threads, count, op):
    """Run op(0..count) on `threads` threads; wall seconds."""
    lock = threading.Lock()
    state = {"next": 0, "error": None}

    def worker():
        while True:
            with lock:
                i = state["next"]
                if i >= count:
                    return
                state["next"] = i + 1
            try:
                op(i)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    state["error"] = state["error"] or e
                    state["next"] = count
                return

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t
    if state["error"] is not None:
        raise state["error"]
    return elapsed


def concurrency(opts, ioctx, out):
    threads, images = int(opts["threads"]), int(opts["images"])
    size, prefix = int(opts["size"]), opts["prefix"]
    r = rbd.RBD()
    out["threads"] = threads
    out["images"] = images
    out["create_s"] = phase(threads, images, lambda i: r.create(ioctx, f"{prefix}-{i}", size))
    out["remove_s"] = phase(threads, images, lambda i: r.remove(ioctx, f"{prefix}-{i}"))


def data(opts, ioctx, out):
    kinds = {"seqwrite": (True, False), "seqread": (False, False),
             "randwrite": (True, True), "randread": (False, True)}
    write, rand = kinds[opts["workload"]]
    bs, qd, ops = int(opts["bs"]), max(1, int(opts["qd"])), int(opts["ops"])
    image = rbd.Image(ioctx, opts["image"])
    image.flush()  # as rbd bench does first: puts librbd's cache in write-back mode
    blocks = image.size() // bs
    buf = pattern(bs)
    cond = threading.Condition()
    state = {"inflight": 0, "done": 0, "error": None}

    def finished(completion, *_data):
        ret = completion.get_return_value()
        with cond:
            if ret < 0 and state["error"] is None:
                state["error"] = OSError(-ret, "rbd aio failed")
            state["inflight"] -= 1
            state["done"] += 1
            cond.notify()

    t = time.perf_counter()
    for i in range(ops):
        with cond:
            while state["inflight"] >= qd:
                cond.wait()
            if state["error"] is not None:
                break
            state["inflight"] += 1
        block = splitmix64(i) % blocks if rand else i % blocks
        if write:
            image.aio_write(buf, block * bs, finished)
        else:
            image.aio_read(block * bs, bs, finished)
    with cond:
        while state["inflight"] > 0:
            cond.wait()
    if write and state["error"] is None:
        flushed = threading.Event()
        image.aio_flush(lambda c: flushed.set())
        flushed.wait()
    elapsed = time.perf_counter() - t
    image.close()
    if state["error"] is not None:
        raise state["error"]
    out.update(engine="aio", workload=opts["workload"], bs=bs, qd=qd, ops=ops,
               elapsed_s=elapsed, iops=ops / elapsed, mib_s=ops * bs / elapsed / 2**20)


def main():
    mode, opts = parse(sys.argv[1:])
    start = time.perf_counter()
    cluster = rados.Rados(conffile=opts["conf"])
    cluster.connect()
    ioctx = cluster.open_ioctx(opts["pool"])
    out = {"contender": "python", "mode": mode,
           "connect_ms": (time.perf_counter() - start) * 1e3}
    try:
        {"control": control, "concurrency": concurrency, "data": data}[mode](opts, ioctx, out)
    finally:
        ioctx.close()
        cluster.shutdown()
    out["total_s"] = time.perf_counter() - start
    print(json.dumps(out))


if __name__ == "__main__":
    main()
