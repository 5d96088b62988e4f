"""Records which functions of the release binary `rbdkit provisioner` runs,
and writes them as LLD's symbol ordering file (link/rbdkit.order).

    train.py BINARY CEPH_CONF KUBECONFIG OUT [--claims N] [--premade M]
    train.py --check BINARY ORDER

The provisioner runs twice through a training workload on the given
cluster and control plane: M pre-made PVs bound to claims (a paged LIST at
start-up, PVs of another driver), then N claims created at once, bound, a
quarter of them expanded, all deleted, and /metrics, /healthz and /readyz
read. First under callgrind (valgrind), which names every function that ran
at least once, however rarely; then at full speed with touched-pages.c
preloaded, which records the code pages that ran, to add what callgrind
cannot see: slow paths that need real parallelism and code chosen by CPU
features. scripts/order-functions sets up the cluster and the control plane
and calls this (see link/README.md).

With --check, it fails (exit 1) unless at least 99% of ORDER's functions are
defined in BINARY (else the file is stale: changed code, a new compiler or
new dependency versions changed the names; it names the first missing) and
they lie together at the start of its code (else the build did not use the
file).
"""

import argparse
import hashlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from burst import (Kube, Tracker, create_claims, delete_claims, drop_class,  # noqa: E402
                   drop_floor, drop_namespace, free_port, make_namespace, run_floor,
                   wait_until)
from node import admin_key, mon_host  # noqa: E402

PROVISIONER = "order.rbdkit.io"
WAIT_S = 1800  # everything is some 50 times slower under valgrind


def log(msg):
    print(f"train: {msg}", file=sys.stderr, flush=True)


def http_get(port, path):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", path)
        r = c.getresponse()
        r.read()
        return r.status
    except OSError:
        return None


def expand(kube, ns, name):
    """Raises the claim's request to 2Gi (a merge patch)."""
    conn = kube._conn()
    try:
        conn.request("PATCH", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}",
                     json.dumps({"spec": {"resources": {"requests": {"storage": "2Gi"}}}}),
                     {"Content-Type": "application/merge-patch+json"})
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"expanding {ns}/{name}: {resp.status} {body[:200]!r}")


def pv_bytes(kube, name):
    pv = kube.req("GET", f"/api/v1/persistentvolumes/{name}")
    return pv["spec"]["capacity"]["storage"]


def workload(kube, ns, cls, lease_ns, a, cmd, slow, env, log_path, clusters, pages=None):
    """Runs the provisioner (`cmd` + its arguments) through the training
    workload: claims of class `cls` in namespace `ns`; returns how many claims it expanded. With
    `pages` (a list), first appends the (start, end) file offsets of the
    executable's code pages that ran, read from /proc/PID/maps (see
    touched-pages.c)."""
    port = free_port()
    logf = open(log_path, "w")
    cmd = cmd + ["provisioner", "--name", PROVISIONER, "--clusters-config", str(clusters),
                 "--kubeconfig", a.kubeconfig, "--http-addr", f"127.0.0.1:{port}",
                 "--leader-election-namespace", lease_ns] + slow
    prov = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, **env))
    tr = None
    try:
        wait_until(lambda: http_get(port, "/readyz") == 200 or prov.poll() is not None, WAIT_S,
                   "the provisioner's /readyz")
        if prov.poll() is not None:
            raise RuntimeError(f"the provisioner exited {prov.returncode}; see {log_path}")
        tr = Tracker(kube, ns)
        names, t0, _ = create_claims(kube, ns, cls, a.claims)
        wait_until(lambda: tr.count("bound") >= a.claims, WAIT_S, f"{a.claims} claims Bound")
        log(f"{a.claims} claims Bound in {time.monotonic() - t0:.0f} s")
        for path in ("/metrics", "/healthz", "/readyz"):
            http_get(port, path)
        grown = names[: max(1, a.claims // 4)]
        for name in grown:
            expand(kube, ns, name)
        pvs = [kube.req("GET", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{n}")
               ["spec"]["volumeName"] for n in grown]
        wait_until(lambda: all(pv_bytes(kube, p) == "2Gi" for p in pvs), WAIT_S,
                   f"{len(grown)} PVs expanded")
        log(f"{len(grown)} claims expanded")
        delete_claims(kube, ns, names)
        wait_until(lambda: tr.count("pv_gone") >= a.claims, WAIT_S, f"{a.claims} PVs deleted")
        log(f"{a.claims} claims deleted")
        http_get(port, "/metrics")
        if pages is not None:
            pages += code_pages_run(prov.pid, a.binary)
        prov.send_signal(signal.SIGTERM)
        prov.wait(timeout=WAIT_S)
        return len(grown)
    finally:
        if prov.poll() is None:
            prov.kill()
            prov.wait()
        logf.close()
        if tr:
            tr.close()


def code_pages_run(pid, binary):
    """(start, end) file offsets of the executable's mappings that are
    executable: under touched-pages.so, the code pages that ran."""
    target = os.path.realpath(binary)
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split()
        if len(f) >= 6 and f[1] == "r-xp" and os.path.realpath(f[5]) == target:
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            off = int(f[2], 16)
            out.append((off, off + hi - lo))
    if len(out) < 2:
        raise RuntimeError("touched-pages.so did not take effect: the executable's code "
                           "is one mapping")
    return out


def functions_on(pages, binary, known):
    """Functions of `binary` not in `known` that overlap the code pages
    `pages` (file offsets), in address order."""
    text = next(ln.split() for ln in subprocess.run(
        ["readelf", "-SW", binary], check=True, capture_output=True, text=True
    ).stdout.replace("[ ", "[").splitlines() if " .text " in ln)
    # [Nr] Name Type Address Off Size: address - offset maps file to memory.
    delta = int(text[3], 16) - int(text[4], 16)
    ranges = sorted((lo + delta, hi + delta) for lo, hi in pages)
    out = []
    for addr, size, name in sorted(function_symbols(binary)):
        if name in known:
            continue
        if any(lo < addr + max(size, 1) and addr < hi for lo, hi in ranges):
            out.append(name)
            known.add(name)
    return out


def functions_of(callgrind_out, binary):
    """Every function of `binary` that callgrind saw run, in the order of
    its output, without recursion suffixes ('2)."""
    seen, names, obj = set(), [], None
    target = os.path.realpath(binary)
    with open(callgrind_out, errors="replace") as f:
        for line in f:
            if line.startswith("ob="):
                obj = os.path.realpath(line[3:].strip())
            elif line.startswith("fn=") and obj == target:
                name = re.sub(r"'\d+$", "", line[3:].strip())
                if name and not name.startswith("0x") and name not in seen:
                    seen.add(name)
                    names.append(name)
    return names


def function_symbols(binary):
    """(address, size, name) of every function defined in `binary`."""
    out = subprocess.run(["nm", "-S", "--defined-only", binary], check=True,
                         capture_output=True, text=True).stdout
    return [(int(f[0], 16), int(f[1], 16), f[3]) for f in (ln.split() for ln in out.splitlines())
            if len(f) == 4 and f[2] in "tTwW"]


def defined_functions(binary):
    return {name for _, _, name in function_symbols(binary)}


def check(binary, order):
    listed = {ln.strip() for ln in Path(order).read_text().splitlines()
              if ln.strip() and not ln.startswith("#")}
    syms = function_symbols(binary)
    found = [(a, size) for a, size, name in syms if name in listed]
    names = {name for _, _, name in syms} & listed
    print(f"order-functions: {len(names)} of {len(listed)} ordered functions are in {binary}",
          file=sys.stderr)
    # 31 missing of 3103 (1%) cost 1.1 MiB of resident code (bench/analysis.md).
    if len(names) * 100 < len(listed) * 99:
        missing = sorted(listed - names)
        for name in missing[:10]:
            print(f"order-functions: missing {name}", file=sys.stderr)
        if len(missing) > 10:
            print(f"order-functions: ... and {len(missing) - 10} more", file=sys.stderr)
        print("order-functions: link/rbdkit.order is stale (changed code, a new compiler or new "
              "dependency versions): run scripts/order-functions and commit the file",
              file=sys.stderr)
        return 1
    lo = min(a for a, _ in found)
    hi = max(a + size for a, size in found)
    stray = sum(size for a, size, name in syms if name not in listed and lo <= a < hi)
    print(f"order-functions: they span {(hi - lo) / 2**20:.2f} MiB, of which "
          f"{stray / 2**10:.0f} KiB of other functions", file=sys.stderr)
    if stray * 50 > hi - lo:
        print("order-functions: the binary is not laid out by link/rbdkit.order (a debug build, "
              "or not linked by LLD? see link/README.md)", file=sys.stderr)
        return 1
    return 0


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2], sys.argv[3]))
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("ceph_conf")
    ap.add_argument("kubeconfig")
    ap.add_argument("out")
    ap.add_argument("--claims", type=int, default=120)
    ap.add_argument("--premade", type=int, default=250)
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="rbdkit-train.")
    kube = Kube(a.kubeconfig, tmp)
    clusters = Path(tmp, "config.json")
    clusters.write_text(json.dumps([{"clusterID": "train", "monitors": [mon_host(a.ceph_conf)]}]))
    # Unique: the test control plane runs no namespace controller, so a
    # deleted namespace stays terminating.
    ns = f"train-{os.getpid()}"
    make_namespace(kube, ns)
    kube.req("POST", f"/api/v1/namespaces/{ns}/secrets", {
        "metadata": {"name": "ceph"},
        "stringData": {"userID": "admin", "userKey": admin_key(a.ceph_conf)}})
    kube.req("POST", "/apis/storage.k8s.io/v1/storageclasses", {
        "metadata": {"name": ns}, "provisioner": PROVISIONER, "reclaimPolicy": "Delete",
        "allowVolumeExpansion": True,
        "parameters": {
            "clusterID": "train", "pool": "rbd", "imageFeatures": "layering,exclusive-lock",
            "csi.storage.k8s.io/provisioner-secret-name": "ceph",
            "csi.storage.k8s.io/provisioner-secret-namespace": ns,
            "csi.storage.k8s.io/controller-expand-secret-name": "ceph",
            "csi.storage.k8s.io/controller-expand-secret-namespace": ns}})
    premade = None
    if a.premade:
        log(f"{a.premade} pre-made PVs")
        _, premade = run_floor(kube, "train-premade", a.premade, keep=True)

    tmpdir = Path(tmp)
    try:
        cg_out = tmpdir / "callgrind.out"
        # Timeouts widened for valgrind; the lease still has to outlast an
        # operation (see --ceph-op-timeout).
        valgrind = ["valgrind", "--tool=callgrind", "--demangle=no", "--dump-instr=no",
                    "--compress-strings=no", "--compress-pos=no",
                    f"--callgrind-out-file={cg_out}"]
        slow = ["--ceph-op-timeout", "60s", "--ceph-connect-timeout", "60s",
                "--lease-duration", "120s", "--renew-deadline", "100s", "--retry-period", "10s"]
        log("pass 1: the provisioner under callgrind")
        grown = workload(kube, ns, ns, ns, a, valgrind + [a.binary], slow, {}, tmpdir / "pass1.log",
                         clusters)
        # Pass 2, at full speed on the real CPU, in a namespace (claims and
        # lease) of its own.
        ns2 = f"{ns}-pass2"
        make_namespace(kube, ns2)
        shim = tmpdir / "touched-pages.so"
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(shim),
                        str(REPO / "link" / "touched-pages.c")], check=True)
        log("pass 2: the provisioner at full speed, recording the code pages it runs")
        pages = []
        workload(kube, ns2, ns, ns2, a, [a.binary], [], {"LD_PRELOAD": str(shim)},
                 tmpdir / "pass2.log", clusters, pages)
        drop_namespace(kube, ns2)
    finally:
        if premade:
            drop_floor(kube, premade)
        drop_namespace(kube, ns)
        drop_class(kube, ns)
        for f in tmpdir.glob("client.*"):
            f.unlink()

    names = functions_of(cg_out, a.binary)
    defined = defined_functions(a.binary)
    kept = [n for n in names if n in defined]
    extra = functions_on(pages, a.binary, set(kept))
    ran = sum(hi - lo for lo, hi in pages) // 4096
    log(f"pass 1: {len(kept)} functions; pass 2: {ran} code pages ran, "
        f"{len(extra)} more functions on them")
    kept += extra
    if len(kept) < 1000:
        raise SystemExit(f"train: only {len(kept)} functions recorded; see {tmpdir}/pass1.log")
    rustc = subprocess.run(["rustc", "-V"], capture_output=True, text=True).stdout.strip()
    lock = hashlib.sha256((REPO / "Cargo.lock").read_bytes()).hexdigest()[:16]
    header = [
        "# The functions `rbdkit provisioner` runs, first in the release binary's",
        "# code (see link/README.md). Generated by scripts/order-functions; do not edit.",
        f"# {len(kept)} functions; {rustc}; Cargo.lock sha256 {lock}",
        f"# training: {a.premade} pre-made PVs, {a.claims} claims provisioned, "
        f"{grown} expanded, all deleted; under callgrind, then at full speed",
    ]
    Path(a.out).write_text("\n".join(header + kept) + "\n")
    log(f"wrote {a.out}: {len(kept)} functions")


if __name__ == "__main__":
    main()
