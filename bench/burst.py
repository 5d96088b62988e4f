"""The claim-burst group of bench/run (issue 10): N claims created at once
against the provisioner running as its own process with default settings,
on the test control plane (scripts/k8s-test-control-plane) and the bench's
Ceph cluster, side by side with the PV binder's own floor (N pre-made PVs
bound to N claims, no provisioner) in the same session. See bench/README.md,
section 6.
"""

import base64
import http.client
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node import admin_key, mon_host  # noqa: E402 - bench/node.py

REPO = Path(__file__).resolve().parent.parent


def logs_dir(prefix):
    """A temp dir for a section's logs, kept after the bench for reading. In
    a test run (scripts/test) it is registered with the run, whose clean-up
    (scripts/test-reap) removes it, also after a kill -9."""
    d = tempfile.mkdtemp(prefix=prefix)
    run = os.environ.get("RBDKIT_TEST_RUN_DIR")
    if run:
        with open(Path(run, "dirs"), "a") as f:
            f.write(d + "\n")
    return d


CREATORS = 16  # client threads creating / deleting objects
WAIT_S = 900  # bound on any one phase
PROVISIONER = "burst.rbdkit.bench"

# Runs of one round, in this order: the floor before and after rbdkit's two.
RUNS = ["floor", "rbdkit", "rbdkit-lifted", "floor"]
LIFTED = ["--rate-limit", "1000", "--rate-burst", "1000"]
# Goals (issue 10), with default settings.
GOAL_PV_S = 30.0
GOAL_BOUND_VS_FLOOR = 1.2
GOAL_RSS_MIB = 40


def log(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


class BurstError(Exception):
    pass


# --------------------------------------------------------------------------
# A minimal API client (the kubeconfig of scripts/k8s-test-control-plane)
# --------------------------------------------------------------------------


class Kube:
    def __init__(self, kubeconfig, tmpdir):
        text = Path(kubeconfig).read_text()

        def field(name):
            m = re.search(rf"^\s*{name}:\s*(\S+)", text, re.M)
            if not m:
                raise BurstError(f"no {name} in {kubeconfig}")
            return m.group(1)

        m = re.match(r"https://([^:/]+):(\d+)", field("server"))
        self.host, self.port = m.group(1), int(m.group(2))
        cert = Path(tmpdir, "client.crt")
        key = Path(tmpdir, "client.key")
        cert.write_bytes(base64.b64decode(field("client-certificate-data")))
        key.touch(mode=0o600)
        key.write_bytes(base64.b64decode(field("client-key-data")))
        self.ctx = ssl.create_default_context(
            cadata=base64.b64decode(field("certificate-authority-data")).decode())
        self.ctx.load_cert_chain(str(cert), str(key))
        self.local = threading.local()

    def _conn(self, timeout=60):
        return http.client.HTTPSConnection(self.host, self.port, context=self.ctx,
                                           timeout=timeout)

    def req(self, method, path, body=None, ok=(200, 201, 202)):
        for attempt in range(3):
            conn = getattr(self.local, "conn", None) or self._conn()
            self.local.conn = conn
            try:
                conn.request(method, path, body=json.dumps(body) if body is not None else None,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt == 2:
                    raise
                continue
            if resp.status not in ok:
                raise BurstError(f"{method} {path}: {resp.status} {data[:300]!r}")
            return json.loads(data) if data else None
        return None

    def watch(self, path, rv, on_event, stop):
        """Calls on_event(type, object, monotonic time) for every event of
        the watch at `path` from resourceVersion `rv`, until stop is set."""
        while not stop.is_set():
            # A quiet spell longer than this ends the watch; it resumes from
            # the last resourceVersion seen (a partly read line is sent again).
            conn = self._conn(timeout=30)
            sep = "&" if "?" in path else "?"
            try:
                conn.request("GET", f"{path}{sep}watch=1&resourceVersion={rv}"
                             "&allowWatchBookmarks=true&timeoutSeconds=600")
                resp = conn.getresponse()
                while not stop.is_set():
                    line = resp.readline()
                    if not line:
                        break
                    ev = json.loads(line)
                    obj = ev["object"]
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if ev["type"] == "ERROR":
                        raise BurstError(f"watch {path}: {obj}")
                    if ev["type"] != "BOOKMARK":
                        on_event(ev["type"], obj, time.monotonic())
            except (OSError, http.client.HTTPException):
                time.sleep(0.2)
            finally:
                conn.close()


def wait_until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise BurstError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def parallel(fn, items):
    with ThreadPoolExecutor(CREATORS) as ex:
        list(ex.map(fn, items))


class Tracker:
    """What the watches saw, with the time each thing first happened."""

    def __init__(self, kube, ns):
        self.ns = ns
        self.lock = threading.Lock()
        self.pv_added = {}
        self.pv_released = {}
        self.pv_gone = {}
        self.bound = {}
        self.stop = threading.Event()
        rv_pv = kube.req("GET", "/api/v1/persistentvolumes?limit=1")["metadata"]["resourceVersion"]
        rv_pvc = kube.req("GET", f"/api/v1/namespaces/{ns}/persistentvolumeclaims?limit=1"
                          )["metadata"]["resourceVersion"]
        self.threads = [
            threading.Thread(target=kube.watch, daemon=True,
                             args=("/api/v1/persistentvolumes", rv_pv, self._pv, self.stop)),
            threading.Thread(target=kube.watch, daemon=True,
                             args=(f"/api/v1/namespaces/{ns}/persistentvolumeclaims", rv_pvc,
                                   self._pvc, self.stop)),
        ]
        for t in self.threads:
            t.start()

    def _pv(self, typ, pv, t):
        ref = (pv.get("spec") or {}).get("claimRef") or {}
        if ref.get("namespace") != self.ns:
            return
        name = pv["metadata"]["name"]
        with self.lock:
            if typ == "ADDED":
                self.pv_added.setdefault(name, t)
            if typ == "DELETED":
                self.pv_gone.setdefault(name, t)
            elif (pv.get("status") or {}).get("phase") == "Released":
                self.pv_released.setdefault(name, t)

    def _pvc(self, typ, pvc, t):
        if typ != "DELETED" and (pvc.get("status") or {}).get("phase") == "Bound":
            with self.lock:
                self.bound.setdefault(pvc["metadata"]["name"], t)

    def count(self, what):
        with self.lock:
            return len(getattr(self, what))

    def last(self, what, since):
        with self.lock:
            return max(getattr(self, what).values()) - since

    def close(self):
        self.stop.set()


# --------------------------------------------------------------------------
# The world of one run
# --------------------------------------------------------------------------


def claim(name, cls):
    return {"metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": cls,
                     "resources": {"requests": {"storage": "1Gi"}}}}


def make_namespace(kube, ns):
    kube.req("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})


def drop_namespace(kube, ns):
    kube.req("DELETE", f"/api/v1/namespaces/{ns}", ok=(200, 202, 404))


def create_claims(kube, ns, cls, n):
    names = [f"c{i:04d}" for i in range(n)]
    t0 = time.monotonic()
    parallel(lambda nm: kube.req("POST", f"/api/v1/namespaces/{ns}/persistentvolumeclaims",
                                 claim(nm, cls)), names)
    return names, t0, time.monotonic() - t0


def delete_claims(kube, ns, names):
    t0 = time.monotonic()
    parallel(lambda nm: kube.req("DELETE", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{nm}",
                                 ok=(200, 202, 404)), names)
    return t0


def floor_pvs(kube, ns, cls, n):
    """N pre-made PVs, each pre-bound (claimRef) to the claim it is for, like
    the PVs a provisioner makes; Retain, so the binder only marks them
    Released when their claims go."""
    def mk(i):
        kube.req("POST", "/api/v1/persistentvolumes", {
            "metadata": {"name": f"{ns}-{i:04d}"},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": cls,
                     "claimRef": {"namespace": ns, "name": f"c{i:04d}"},
                     "csi": {"driver": "floor.bench", "volumeHandle": f"{ns}-{i}"}}})
    parallel(mk, range(n))
    return [f"{ns}-{i:04d}" for i in range(n)]


def drop_pvs(kube, names):
    parallel(lambda nm: kube.req("DELETE", f"/api/v1/persistentvolumes/{nm}", ok=(200, 202, 404)),
             names)


def floor_class(kube, cls):
    kube.req("POST", "/apis/storage.k8s.io/v1/storageclasses", {
        "metadata": {"name": cls}, "provisioner": "kubernetes.io/no-provisioner",
        "volumeBindingMode": "Immediate", "reclaimPolicy": "Retain"})


def drop_class(kube, cls):
    kube.req("DELETE", f"/apis/storage.k8s.io/v1/storageclasses/{cls}", ok=(200, 202, 404))


def run_floor(kube, tag, n, keep=False):
    """The binder alone: N pre-made PVs and N claims; time to all Bound, then
    (claims deleted) to all Released."""
    ns = f"floor-{tag}"
    make_namespace(kube, ns)
    floor_class(kube, ns)
    pvs = floor_pvs(kube, ns, ns, n)
    tr = Tracker(kube, ns)
    try:
        names, t0, create_s = create_claims(kube, ns, ns, n)
        wait_until(lambda: tr.count("bound") >= n, WAIT_S, f"{n} claims Bound (floor)")
        out = {"n": n, "create_s": create_s, "bound_s": tr.last("bound", t0)}
        if keep:
            return out, (ns, pvs)
        t1 = delete_claims(kube, ns, names)
        wait_until(lambda: tr.count("pv_released") >= n, WAIT_S, f"{n} PVs Released (floor)")
        out["released_s"] = tr.last("pv_released", t1)
    finally:
        tr.close()
    drop_floor(kube, (ns, pvs))
    return out, None


def drop_floor(kube, world):
    ns, pvs = world
    drop_namespace(kube, ns)
    drop_pvs(kube, pvs)
    drop_class(kube, ns)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_kib(pid, field):
    m = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) if m else None


def images(conf, pool):
    out = subprocess.run(["rbd", "-c", conf, "ls", pool], capture_output=True, text=True,
                         timeout=60, check=True, stdin=subprocess.DEVNULL).stdout
    return set(out.split())


def rss_by_mapping(pid, top=8):
    """The largest resident mappings (KiB), by file or [heap]/[anon], from
    /proc/PID/smaps: where the provisioner's memory is."""
    sizes, name = {}, None
    for ln in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        f = ln.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", ln):
            name = Path(f[5]).name if len(f) > 5 else "[anon]"
        elif f and f[0] == "Rss:":
            sizes[name] = sizes.get(name, 0) + int(f[1])
    return dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:top])


class Provisioner:
    """`rbdkit provisioner` as its own process, default settings plus
    `extra`; its log goes to a file in `tmpdir`."""

    def __init__(self, binary, kube, kubeconfig, clusters, ns, tmpdir, extra, name=PROVISIONER):
        self.port = free_port()
        self.logf = open(Path(tmpdir, f"provisioner-{ns}.log"), "w")
        cmd = [str(binary), "provisioner", "--name", name, "--clusters-config",
               str(clusters), "--kubeconfig", str(kubeconfig), "--http-addr",
               f"127.0.0.1:{self.port}", "--leader-election-namespace", ns, *extra]
        self.p = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        wait_until(self.ready, 60, "the provisioner's /readyz")

    def ready(self):
        if self.p.poll() is not None:
            raise BurstError(f"the provisioner exited {self.p.returncode}; log in "
                             f"{self.logf.name}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            c.request("GET", "/readyz")
            return c.getresponse().status == 200
        except OSError:
            return False

    def stop(self):
        hwm = vm_kib(self.p.pid, "VmHWM")
        try:
            self.mappings = rss_by_mapping(self.p.pid)
            self.threads = len(os.listdir(f"/proc/{self.p.pid}/task"))
        except OSError:
            self.mappings, self.threads = {}, None
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.logf.close()
        return hwm


FLOOR_SRC = REPO / "bench" / "rss-floor.c"
ORDER = REPO / "link" / "rbdkit.order"


def order_coverage(binary):
    """How many of link/rbdkit.order's functions (those the release build
    places first) are defined in `binary`: (found, listed)."""
    listed = {ln.strip() for ln in ORDER.read_text().splitlines()
              if ln.strip() and not ln.startswith("#")}
    out = subprocess.run(["nm", "--defined-only", str(binary)], capture_output=True, text=True,
                         timeout=120, check=True, stdin=subprocess.DEVNULL).stdout
    defined = {f[2] for f in (ln.split() for ln in out.splitlines()) if len(f) == 3}
    return len(listed & defined), len(listed)


def rss_floor(conf, pool, tmpdir, cycles=50):
    """The memory floor of any librbd client: bench/rss-floor.c (a C program
    linking only librados and librbd) connects and runs `cycles`
    create/open/stat/close/remove cycles; its VmRSS and VmHWM in KiB."""
    exe = Path(tmpdir, "rss-floor")
    subprocess.run(["cc", "-O2", "-o", str(exe), str(FLOOR_SRC), "-lrbd", "-lrados"],
                   check=True, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    out = subprocess.run([str(exe), str(conf), pool, str(cycles)], check=True,
                         capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL).stdout
    return json.loads(out)


def run_rbdkit(kube, env, tag, n, extra, with_floor=0):
    """N claims at once through rbdkit; with_floor: first bind that many
    pre-made PVs (left in place) so the caches hold more PVs."""
    ns = f"burst-{tag}"
    make_namespace(kube, ns)
    kube.req("POST", f"/api/v1/namespaces/{ns}/secrets", {
        "metadata": {"name": "ceph"},
        "stringData": {"userID": "admin", "userKey": env["key"]}})
    kube.req("POST", "/apis/storage.k8s.io/v1/storageclasses", {
        "metadata": {"name": ns}, "provisioner": PROVISIONER, "reclaimPolicy": "Delete",
        "parameters": {
            "clusterID": env["cluster_id"], "pool": env["pool"],
            "imageFeatures": "layering,exclusive-lock",
            "csi.storage.k8s.io/provisioner-secret-name": "ceph",
            "csi.storage.k8s.io/provisioner-secret-namespace": ns,
            "csi.storage.k8s.io/controller-expand-secret-name": "ceph",
            "csi.storage.k8s.io/controller-expand-secret-namespace": ns}})
    background = None
    prov = None
    tr = None
    before = images(env["conf"], env["pool"])
    try:
        if with_floor:
            _, background = run_floor(kube, f"{tag}-bg", with_floor, keep=True)
        prov = Provisioner(env["bin"], kube, env["kubeconfig"], env["clusters"], ns,
                           env["tmpdir"], extra)
        rss_idle = vm_kib(prov.p.pid, "VmRSS")
        tr = Tracker(kube, ns)
        names, t0, create_s = create_claims(kube, ns, ns, n)
        wait_until(lambda: tr.count("pv_added") >= n, WAIT_S, f"{n} PVs")
        wait_until(lambda: tr.count("bound") >= n, WAIT_S, f"{n} claims Bound")
        out = {"n": n, "args": extra, "create_s": create_s,
               "last_pv_s": tr.last("pv_added", t0), "bound_s": tr.last("bound", t0),
               "rss_idle_kib": rss_idle, "pvs_cached": n + with_floor}
        made = images(env["conf"], env["pool"]) - before
        if len(made) != n:
            raise BurstError(f"{len(made)} new images for {n} claims")
        t1 = delete_claims(kube, ns, names)
        wait_until(lambda: tr.count("pv_gone") >= n, WAIT_S, f"{n} PVs deleted")
        wait_until(lambda: not (images(env["conf"], env["pool"]) & made), 120, "images removed")
        out["delete_s"] = time.monotonic() - t1
        out["pvs_gone_s"] = tr.last("pv_gone", t1)
        out["released_s"] = tr.last("pv_released", t1) if tr.count("pv_released") else None
        out["peak_rss_kib"] = prov.stop()
        out["rss_at_exit_by_mapping_kib"] = prov.mappings
        out["binary_rss_kib"] = prov.mappings.get(Path(env["bin"]).name)
        if with_floor:
            out["order_found"], out["order_listed"] = order_coverage(env["bin"])
        out["threads"] = prov.threads
        prov = None
        return out
    finally:
        if tr:
            tr.close()
        if prov:
            prov.stop()
        if background:
            drop_floor(kube, background)
        drop_namespace(kube, ns)
        drop_class(kube, ns)


# --------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------


CP_SCRIPT = REPO / "scripts" / "k8s-test-control-plane"


def control_plane_up(cp_dir):
    """Starts a test control plane in cp_dir, stopped by the script's
    watchdog if this process dies. Returns (kubeconfig, None), or
    (None, the end of its stderr)."""
    up = subprocess.run([str(CP_SCRIPT), "up", str(cp_dir)], capture_output=True, text=True,
                        env=dict(os.environ, K8S_TEST_CP_OWNER_PID=str(os.getpid())),
                        stdin=subprocess.DEVNULL)
    m = re.search(r"export KUBECONFIG=(\S+)", up.stdout)
    if up.returncode != 0 or not m:
        return None, up.stderr[-600:]
    return m.group(1), None


def control_plane_down(cp_dir):
    subprocess.run([str(CP_SCRIPT), "down", str(cp_dir)], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def clusters_config(tmpdir, conf):
    """The provisioner's clusters config: one cluster, "bench"."""
    clusters = Path(tmpdir, "config.json")
    clusters.write_text(json.dumps([{"clusterID": "bench", "monitors": [mon_host(conf)]}]))
    return clusters


def section_burst(c, cfg, errors, tag, rbdkit_bin, pool):
    n, rounds_n, n_rss = cfg["burst_claims"], cfg["burst_rounds"], cfg["burst_rss_pvs"]
    tmpdir = logs_dir("rbdkit-bench-burst.")
    cp_dir = Path(tmpdir, "cp")
    log("starting the test control plane")
    kubeconfig, why = control_plane_up(cp_dir)
    if not kubeconfig:
        errors.append(f"burst: control plane did not start: {why}")
        return {"rounds": [], "n": n}
    rounds = []
    try:
        kube = Kube(kubeconfig, tmpdir)
        clusters = clusters_config(tmpdir, c.cl.conf)
        env = {"bin": rbdkit_bin, "kubeconfig": kubeconfig, "clusters": clusters,
               "tmpdir": tmpdir, "conf": c.cl.conf, "pool": pool, "cluster_id": "bench",
               "key": admin_key(c.cl.conf)}
        for r in range(rounds_n):
            res = {}
            for i, w in enumerate(RUNS):
                key = f"{w}#{i}" if w == "floor" else w
                log(f"burst round {r + 1}/{rounds_n}: {w} ({n} claims)")
                try:
                    if w == "floor":
                        res[key], _ = run_floor(kube, f"{tag}-r{r}-{i}", n)
                    else:
                        res[key] = run_rbdkit(kube, env, f"{tag}-r{r}-{i}", n,
                                              LIFTED if w == "rbdkit-lifted" else [])
                except (BurstError, OSError, subprocess.SubprocessError) as e:
                    errors.append(f"burst/{w}: {e}")
                    res[key] = {"error": str(e)}
                log(f"burst {w}: {json.dumps(res[key])}")
            rounds.append(res)
        log(f"burst: peak RSS with {n_rss} PVs in the caches")
        try:
            rss = run_rbdkit(kube, env, f"{tag}-rss", n_rss // 2, [], with_floor=n_rss - n_rss // 2)
        except (BurstError, OSError, subprocess.SubprocessError) as e:
            errors.append(f"burst/rss: {e}")
            rss = {"error": str(e)}
        try:
            rss["floor"] = rss_floor(c.cl.conf, pool, tmpdir)
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            errors.append(f"burst/rss floor: {e}")
        log(f"burst rss: {json.dumps(rss)}")
    finally:
        control_plane_down(cp_dir)
        for f in Path(tmpdir).glob("client.*"):
            f.unlink()
    return {"n": n, "rounds": rounds, "rss": rss, "logs": tmpdir}


def summarize(burst, spread, med, target):
    per, ratios = {}, {}
    fields = ["last_pv_s", "bound_s", "delete_s", "pvs_gone_s", "released_s", "peak_rss_kib",
              "create_s"]
    for w in ["rbdkit", "rbdkit-lifted"]:
        ok = [rd[w] for rd in burst["rounds"] if "bound_s" in rd.get(w, {})]
        if ok:
            per[w] = {f: med([o[f] for o in ok if o.get(f) is not None]) for f in fields}
    floors = [[v for k, v in rd.items() if k.startswith("floor") and "bound_s" in v]
              for rd in burst["rounds"]]
    fl = [x for f in floors for x in f]
    if fl:
        per["floor"] = {"bound_s": med([f["bound_s"] for f in fl]),
                        "released_s": med([f["released_s"] for f in fl if "released_s" in f]),
                        "create_s": med([f["create_s"] for f in fl]), "runs": len(fl)}
    for w in ["rbdkit", "rbdkit-lifted"]:
        b, d = [], []
        for rd, f in zip(burst["rounds"], floors):
            x = rd.get(w, {})
            if "bound_s" in x and f:
                fb = med([y["bound_s"] for y in f])
                b.append(x["bound_s"] / fb)
                fr = [y["released_s"] for y in f if "released_s" in y]
                if fr:
                    d.append(x["delete_s"] / med(fr))
        ratios[f"{w} bound / floor"] = spread(b)
        ratios[f"{w} delete / floor"] = spread(d)
    rss = burst.get("rss", {})
    targets = [
        target(f"burst: {burst['n']}th PV after the first claim (s)",
               spread([rd["rbdkit"]["last_pv_s"] for rd in burst["rounds"]
                       if "last_pv_s" in rd.get("rbdkit", {})]),
               GOAL_PV_S, "burst-pv", le=True, unit=" s"),
        target(f"burst: all {burst['n']} Bound vs the binder's floor",
               ratios["rbdkit bound / floor"], GOAL_BOUND_VS_FLOOR, "burst-bound", le=True),
        target(f"burst: all {burst['n']} deleted vs the binder's floor (all Released)",
               ratios["rbdkit delete / floor"], GOAL_BOUND_VS_FLOOR, "burst-delete", le=True),
        target(f"burst: peak RSS with {rss.get('pvs_cached', '?')} PVs (MiB)",
               spread([rss["peak_rss_kib"] / 1024]) if "peak_rss_kib" in rss else None,
               GOAL_RSS_MIB, "burst-rss", le=True, unit=" MiB"),
    ]
    return {"per": per, "ratios": ratios, "rss": rss}, targets


BEFORE = [
    ("defaults", "272 s", "298 s", "97 s", "64 MiB"),
    ("`--rate-limit 1000 --rate-burst 1000`", "46 s", "154 s", "50 s", "65 MiB"),
]


def render(results, summary, cfg, fmt_ratio, fmt_num):
    burst = results.get("burst")
    s = summary.get("burst")
    if not burst or not s:
        return []
    n = burst["n"]
    per, r = s["per"], s["ratios"]
    L = ["## 5. A burst of claims (issue 10)", ""]
    L.append(f"{n} claims created at once (by {CREATORS} client threads) on the test control "
             "plane (`scripts/k8s-test-control-plane`: etcd, kube-apiserver, "
             "kube-controller-manager with its default client QPS of 20), against "
             "`rbdkit provisioner` as its own process with default settings (release build), "
             "and with the rate limit lifted. Times from the first claim's create; *deleted* is "
             "from the first claim's delete until every PV is gone and every image removed. "
             "The **floor** is the PV binder alone in the same session: "
             f"{n} pre-made PVs, each pre-bound to its claim as a provisioner's PV is, and "
             f"{n} claims, timed the same way to all Bound, and (claims deleted) until all "
             "PVs are Released; it runs before and after rbdkit in every round. Peak RSS is "
             "the provisioner's VmHWM at exit. "
             f"{cfg['burst_rounds']} round(s); median (min–max) when more.")
    L.append("")
    L.append(f"| settings | first claim → {n}th PV | → all {n} Bound | all Bound / floor | "
             "delete all | delete / floor (Released) | peak RSS MiB |")
    L.append("|---|---|---|---|---|---|---|")
    for w, label in [("rbdkit", "defaults"), ("rbdkit-lifted", "`--rate-limit 1000 "
                                                              "--rate-burst 1000`")]:
        p = per.get(w)
        if not p:
            L.append(f"| {label} | failed | | | | | |")
            continue
        L.append(f"| {label} | {fmt_num(p['last_pv_s'])} s | {fmt_num(p['bound_s'])} s | "
                 f"{fmt_ratio(r[f'{w} bound / floor'])} | {fmt_num(p['delete_s'])} s | "
                 f"{fmt_ratio(r[f'{w} delete / floor'])} | {p['peak_rss_kib'] / 1024:.0f} |")
    f = per.get("floor")
    if f:
        L.append(f"| binder floor (no provisioner, {f['runs']} runs) | – | "
                 f"{fmt_num(f['bound_s'])} s | 1 | {fmt_num(f['released_s'])} s (Released) | 1 "
                 "| – |")
    L.append("")
    rss = s.get("rss") or {}
    if "peak_rss_kib" in rss:
        L.append(f"Peak RSS with {rss['pvs_cached']} PVs and as many claims in the caches "
                 f"({rss['n']} provisioned by rbdkit in a burst, "
                 f"{rss['pvs_cached'] - rss['n']} pre-made and bound beforehand): "
                 f"**{rss['peak_rss_kib'] / 1024:.1f} MiB** (VmRSS once ready, before the "
                 f"burst: {rss['rss_idle_kib'] / 1024:.1f} MiB).")
        if rss.get("binary_rss_kib") and rss.get("order_listed"):
            L.append(f"Of it, the binary's own pages: {rss['binary_rss_kib'] / 1024:.1f} MiB, "
                     f"with {rss['order_found']} of the {rss['order_listed']} functions of "
                     "`link/rbdkit.order` placed first (see `link/README.md`).")
        fl = rss.get("floor")
        if fl:
            L.append(f"The floor under it: a C program that links only librados and librbd "
                     f"(`bench/rss-floor.c`) has {fl['loaded_kib'] / 1024:.1f} MiB resident "
                     f"before it does anything, {fl['connected_kib'] / 1024:.1f} MiB once "
                     f"connected and peaks at **{fl['hwm_kib'] / 1024:.1f} MiB** after "
                     f"{fl['cycles']} create/open/stat/close/remove cycles.")
        L.append("")
    L.append("Before (issue 10: the 500-claim burst before these changes, same machine kind, "
             "not side by side with the table above):")
    L.append("")
    L.append("| settings | first claim → 500th PV | → all 500 Bound | delete all | "
             "peak RSS |")
    L.append("|---|---|---|---|---|")
    for row in BEFORE:
        L.append("| " + " | ".join(row) + " |")
    L.append("")
    return L
