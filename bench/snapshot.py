"""The snapshot group of bench/run (issue 11): VolumeSnapshot → readyToUse,
restore claim → Bound and PVC-to-PVC clone → Bound through `rbdkit
provisioner` (its own process, default settings) and the standard
snapshot-controller on the test control plane, side by side with the same
Ceph work done directly through librbd (the Python binding, one connection)
in the same session. See bench/README.md, section 7.
"""

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import burst  # noqa: E402 - bench/burst.py (sys.path set by it and the driver)
from burst import BurstError, Kube, Provisioner, make_namespace, wait_until
from node import admin_key

REPO = Path(__file__).resolve().parent.parent
PROVISIONER = "snap.rbdkit.bench"
SNAP_API = "/apis/snapshot.storage.k8s.io/v1"
WAIT_S = 300  # bound on any one wait
CHUNK = 4 << 20  # the written pattern goes in chunks of this size
FLOOR_SNAP = "s"  # the floor's snapshot on its snapshot image
LAYERING = 1


def log(msg):
    burst.log(msg)


# --------------------------------------------------------------------------
# The pattern written into the source image
# --------------------------------------------------------------------------


def chunk_data(i):
    """Chunk i of the pattern: non-zero bytes that differ per chunk."""
    head = f"chunk {i:08d} ".encode()
    body = bytes((i * 31 + j) % 255 + 1 for j in range(4096 - len(head)))
    return (head + body) * (CHUNK // 4096)


def chunk_offsets(size, written):
    """Offsets of the written chunks: `written` bytes spread evenly over
    an image of `size` bytes."""
    n = max(1, written // CHUNK)
    stride = (size // n) // CHUNK * CHUNK
    return [i * stride for i in range(n)]


def write_pattern(io, image, size, written):
    import rbd
    with rbd.Image(io, image) as img:
        for i, off in enumerate(chunk_offsets(size, written)):
            img.write(chunk_data(i), off)
        img.flush()


def check_pattern(io, image, size, written):
    """Reads the first and the last written chunk of `image` back."""
    import rbd
    offs = chunk_offsets(size, written)
    with rbd.Image(io, image, read_only=True) as img:
        for i in sorted({0, len(offs) - 1}):
            if img.read(offs[i], CHUNK) != chunk_data(i):
                raise BurstError(f"image {image}: chunk {i} at {offs[i]} does not match "
                                 "the source's pattern")


# --------------------------------------------------------------------------
# What the watches saw
# --------------------------------------------------------------------------


class Watches:
    """First time of each (event, name) in namespace `ns`: snapshots and
    their contents, claims and their PVs."""

    def __init__(self, kube, ns):
        self.ns = ns
        self.lock = threading.Lock()
        self.seen = {}
        self.stop = threading.Event()
        paths = [
            (f"{SNAP_API}/namespaces/{ns}/volumesnapshots", self._vs),
            (f"{SNAP_API}/volumesnapshotcontents", self._vsc),
            (f"/api/v1/namespaces/{ns}/persistentvolumeclaims", self._pvc),
            ("/api/v1/persistentvolumes", self._pv),
        ]
        for path, fn in paths:
            rv = kube.req("GET", f"{path}?limit=1")["metadata"]["resourceVersion"]
            threading.Thread(target=kube.watch, args=(path, rv, fn, self.stop),
                             daemon=True).start()

    def _note(self, what, name, t):
        with self.lock:
            self.seen.setdefault((what, name), t)

    def _vs(self, typ, vs, t):
        name = vs["metadata"]["name"]
        if typ == "DELETED":
            self._note("vs-gone", name, t)
        elif (vs.get("status") or {}).get("readyToUse") is True:
            self._note("vs-ready", name, t)

    def _vsc(self, typ, c, t):
        ref = (c.get("spec") or {}).get("volumeSnapshotRef") or {}
        if ref.get("namespace") != self.ns:
            return
        name = ref.get("name")
        if typ == "DELETED":
            self._note("vsc-gone", name, t)
            return
        self._note("vsc-added", name, t)
        if (c.get("status") or {}).get("readyToUse") is True:
            self._note("vsc-ready", name, t)

    def _pvc(self, typ, pvc, t):
        if typ != "DELETED" and (pvc.get("status") or {}).get("phase") == "Bound":
            self._note("bound", pvc["metadata"]["name"], t)

    def _pv(self, typ, pv, t):
        ref = (pv.get("spec") or {}).get("claimRef") or {}
        if ref.get("namespace") != self.ns:
            return
        self._note("pv-gone" if typ == "DELETED" else "pv-added", ref.get("name"), t)

    def at(self, what, name):
        with self.lock:
            return self.seen.get((what, name))

    def wait(self, what, name, timeout=WAIT_S):
        wait_until(lambda: self.at(what, name) is not None, timeout, f"{what} of {name}")
        return self.at(what, name)

    def close(self):
        self.stop.set()


# --------------------------------------------------------------------------
# One round through Kubernetes, one done directly
# --------------------------------------------------------------------------

OP_RE = re.compile(r'^rbdkit_ceph_op_duration_seconds_(sum|count)\{[^}]*operation="([^"]+)"'
                   r'[^}]*\}\s+(\S+)$', re.M)


def ceph_ops(port):
    """The provisioner's Ceph calls so far, from its /metrics:
    {operation: [count, seconds]}."""
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    out = {}
    for kind, op, val in OP_RE.findall(text):
        out.setdefault(op, [0, 0.0])[0 if kind == "count" else 1] = float(val)
    return out


def ops_delta(before, after):
    """Calls and seconds per operation between two ceph_ops() readings."""
    d = {}
    for op, (n, t) in after.items():
        n0, t0 = before.get(op, [0, 0.0])
        if n > n0:
            d[op] = [int(n - n0), t - t0]
    return d


def claim(name, cls, size, source=None):
    spec = {"accessModes": ["ReadWriteOnce"], "storageClassName": cls,
            "resources": {"requests": {"storage": str(size)}}}
    if source:
        spec["dataSource"] = source
    return {"metadata": {"name": name}, "spec": spec}


def image_of(kube, ns, claim_name):
    pvc = kube.req("GET", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{claim_name}")
    pv = kube.req("GET", f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
    return pv["spec"]["csi"]["volumeAttributes"]["imageName"]


def run_rbdkit(kube, w, env, r):
    """Snapshot, restore and clone through the API; times from each
    object's create to its end state, split where the watches can."""
    ns, cls, size = env["ns"], env["ns"], env["size"]
    snap, restore, clone = f"snap-{r}", f"restore-{r}", f"clone-{r}"
    out = {"ceph_ops": {}}
    port = env["port"]
    ops0 = ceph_ops(port)
    t0 = time.monotonic()
    kube.req("POST", f"{SNAP_API}/namespaces/{ns}/volumesnapshots", {
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": {"name": snap},
        "spec": {"volumeSnapshotClassName": env["vsclass"],
                 "source": {"persistentVolumeClaimName": "source"}}})
    ready = w.wait("vs-ready", snap)
    # The watches are separate streams: the content's may lag behind.
    added, content_ready = w.wait("vsc-added", snap), w.wait("vsc-ready", snap)
    out["snapshot_s"] = ready - t0
    out["snapshot_content_s"] = added - t0  # the snapshot-controller
    out["snapshot_driver_s"] = content_ready - added  # rbdkit
    out["snapshot_copy_back_s"] = ready - content_ready  # the snapshot-controller
    ops1 = ceph_ops(port)
    out["ceph_ops"]["snapshot"] = ops_delta(ops0, ops1)

    for name, source in [(restore, {"apiGroup": "snapshot.storage.k8s.io",
                                    "kind": "VolumeSnapshot", "name": snap}),
                         (clone, {"kind": "PersistentVolumeClaim", "name": "source"})]:
        kind = "restore" if name == restore else "clone"
        t0 = time.monotonic()
        kube.req("POST", f"/api/v1/namespaces/{ns}/persistentvolumeclaims",
                 claim(name, cls, size, source))
        bound = w.wait("bound", name)
        pv = w.wait("pv-added", name)
        out[f"{kind}_s"] = bound - t0
        out[f"{kind}_driver_s"] = pv - t0  # rbdkit: claim → PV
        out[f"{kind}_bind_s"] = bound - pv  # the PV binder
        ops2 = ceph_ops(port)
        out["ceph_ops"][kind] = ops_delta(ops1, ops2)
        check_pattern(env["io"], image_of(kube, ns, name), size, env["written"])
        ops1 = ceph_ops(port)

    # Untimed: everything goes again (Delete policies), so rounds are alike.
    for name in (restore, clone):
        kube.req("DELETE", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}",
                 ok=(200, 202, 404))
    for name in (restore, clone):
        w.wait("pv-gone", name)
    kube.req("DELETE", f"{SNAP_API}/namespaces/{ns}/volumesnapshots/{snap}", ok=(200, 202, 404))
    w.wait("vsc-gone", snap)
    return out


def run_floor(env, r):
    """The same Ceph work straight through librbd on one open connection:
    a snapshot image is a snapshot of the source, a clone of it, a
    snapshot of the clone, and the source's snapshot removed (it goes to
    the trash namespace until the clone goes); a restore is a clone of the
    snapshot image's snapshot; a PVC clone is a clone through a temporary
    snapshot of the source."""
    import rbd
    io, src = env["io"], env["source_image"]
    tmp, simg = f"floor-tmp-{r}", f"floor-snap-{r}"
    rimg, cimg = f"floor-restore-{r}", f"floor-clone-{r}"
    out = {}
    with rbd.Image(io, src, read_only=True) as img:
        features = img.features()
    features |= LAYERING

    def clone_through_temp_snap(dst):
        with rbd.Image(io, src) as img:
            img.create_snap(tmp)
        rbd.RBD().clone(io, src, tmp, io, dst, features=features)
        with rbd.Image(io, src) as img:
            img.remove_snap(tmp)

    t0 = time.perf_counter()
    clone_through_temp_snap(simg)
    with rbd.Image(io, simg) as img:
        img.create_snap(FLOOR_SNAP)
    out["snapshot_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    rbd.RBD().clone(io, simg, FLOOR_SNAP, io, rimg, features=features)
    out["restore_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    clone_through_temp_snap(cimg)
    out["clone_s"] = time.perf_counter() - t0

    for name in (rimg, cimg):
        check_pattern(io, name, env["size"], env["written"])
    # Untimed: children first, then the snapshot image.
    rbd.RBD().remove(io, rimg)
    rbd.RBD().remove(io, cimg)
    with rbd.Image(io, simg) as img:
        img.remove_snap(FLOOR_SNAP)
    rbd.RBD().remove(io, simg)
    return out


# --------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------


def setup(kube, env, conf, pool):
    ns = env["ns"]
    make_namespace(kube, ns)
    kube.req("POST", f"/api/v1/namespaces/{ns}/secrets", {
        "metadata": {"name": "ceph"},
        "stringData": {"userID": "admin", "userKey": admin_key(conf)}})
    kube.req("POST", "/apis/storage.k8s.io/v1/storageclasses", {
        "metadata": {"name": ns}, "provisioner": PROVISIONER, "reclaimPolicy": "Delete",
        "parameters": {
            "clusterID": "bench", "pool": pool, "imageFeatures": "layering,exclusive-lock",
            "csi.storage.k8s.io/provisioner-secret-name": "ceph",
            "csi.storage.k8s.io/provisioner-secret-namespace": ns,
            "csi.storage.k8s.io/controller-expand-secret-name": "ceph",
            "csi.storage.k8s.io/controller-expand-secret-namespace": ns}})
    kube.req("POST", f"{SNAP_API}/volumesnapshotclasses", {
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
        "metadata": {"name": ns}, "driver": PROVISIONER, "deletionPolicy": "Delete",
        "parameters": {"csi.storage.k8s.io/snapshotter-secret-name": "ceph",
                       "csi.storage.k8s.io/snapshotter-secret-namespace": ns}})
    env["vsclass"] = ns


def section_snapshot(c, cfg, errors, tag, rbdkit_bin, pool):
    import rados
    size, written, rounds_n = cfg["snapshot_image_bytes"], cfg["snapshot_written_bytes"], \
        cfg["snapshot_rounds"]
    tmpdir = burst.logs_dir("rbdkit-bench-snapshot.")
    sc_script = REPO / "scripts" / "snapshot-controller"
    cp_dir, sc_dir = Path(tmpdir, "cp"), Path(tmpdir, "snapshot-controller")
    out = {"image_bytes": size, "written_bytes": written, "rounds": []}
    started = time.monotonic()
    log("snapshot: starting the test control plane")
    kubeconfig, why = burst.control_plane_up(cp_dir)
    if not kubeconfig:
        errors.append(f"snapshot: control plane did not start: {why}")
        return out
    cluster = prov = w = None
    try:
        sc = subprocess.run([str(sc_script), "up", str(sc_dir), kubeconfig], capture_output=True,
                            text=True, stdin=subprocess.DEVNULL, timeout=600)
        if sc.returncode != 0:
            raise BurstError(f"the snapshot-controller did not start: {sc.stderr[-600:]}")
        kube = Kube(kubeconfig, tmpdir)
        clusters = burst.clusters_config(tmpdir, c.cl.conf)
        cluster = rados.Rados(conffile=c.cl.conf)
        cluster.conf_set("rbd_default_clone_format", "2")
        cluster.connect(timeout=30)
        io = cluster.open_ioctx(pool)
        env = {"ns": f"snap-{tag}", "size": size, "written": written, "io": io}
        setup(kube, env, c.cl.conf, pool)
        prov = Provisioner(rbdkit_bin, kube, kubeconfig, clusters, env["ns"], tmpdir, [],
                           name=PROVISIONER)
        env["port"] = prov.port
        w = Watches(kube, env["ns"])
        kube.req("POST", f"/api/v1/namespaces/{env['ns']}/persistentvolumeclaims",
                 claim("source", env["ns"], size))
        w.wait("bound", "source")
        env["source_image"] = image_of(kube, env["ns"], "source")
        log(f"snapshot: writing {written >> 20} MiB over the {size >> 20} MiB image "
            f"{env['source_image']}")
        t = time.perf_counter()
        write_pattern(io, env["source_image"], size, written)
        out["write_s"] = time.perf_counter() - t
        out["setup_s"] = time.monotonic() - started
        for r in range(rounds_n):
            res = {}
            for who in (["floor", "rbdkit"] if r % 2 == 0 else ["rbdkit", "floor"]):
                log(f"snapshot round {r + 1}/{rounds_n}: {who}")
                try:
                    res[who] = run_floor(env, r) if who == "floor" else \
                        run_rbdkit(kube, w, env, r)
                except Exception as e:  # noqa: BLE001 - any failure is reported
                    errors.append(f"snapshot/{who}: {e}")
                    res[who] = {"error": str(e)}
                log(f"snapshot {who}: {json.dumps(res[who])}")
            out["rounds"].append(res)
        out["peak_rss_kib"] = prov.stop()
        prov = None
    except Exception as e:  # noqa: BLE001 - any failure is reported; cleanup follows
        errors.append(f"snapshot: {e!r}")
    finally:
        if w:
            w.close()
        if prov:
            prov.stop()
        if cluster:
            cluster.shutdown()
        subprocess.run([str(sc_script), "down", str(sc_dir)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        burst.control_plane_down(cp_dir)
        for f in Path(tmpdir).glob("client.*"):
            f.unlink()
    out["elapsed_s"] = time.monotonic() - started
    out["logs"] = tmpdir
    return out


OPS = [("snapshot", "VolumeSnapshot → readyToUse"),
       ("restore", "restore claim (from the VolumeSnapshot) → Bound"),
       ("clone", "PVC-to-PVC clone claim → Bound")]


def summarize(snap, spread, med):
    per, ratios = {}, {}
    ok = [rd for rd in snap["rounds"] if "snapshot_s" in rd.get("rbdkit", {})
          and "snapshot_s" in rd.get("floor", {})]
    for who in ("rbdkit", "floor"):
        keys = {k for rd in ok for k in rd[who] if k.endswith("_s")}
        per[who] = {k: spread([rd[who][k] for rd in ok if k in rd[who]]) for k in sorted(keys)}
    for op, _ in OPS:
        ratios[f"{op} / floor"] = spread([rd["rbdkit"][f"{op}_s"] / rd["floor"][f"{op}_s"]
                                          for rd in ok])
        part = "snapshot_driver_s" if op == "snapshot" else f"{op}_driver_s"
        ratios[f"{op} rbdkit part / floor"] = spread(
            [rd["rbdkit"][part] / rd["floor"][f"{op}_s"] for rd in ok])
    # rbdkit's Ceph calls per operation (its /metrics): medians over rounds.
    calls = {}
    for op, _ in OPS:
        rows = [rd["rbdkit"].get("ceph_ops", {}).get(op) for rd in ok]
        rows = [x for x in rows if x is not None]
        if not rows:
            continue
        names = {n for x in rows for n in x}
        by = {n: [med([x.get(n, [0, 0.0])[0] for x in rows]),
                  med([x.get(n, [0, 0.0])[1] for x in rows])] for n in names}
        calls[op] = {"calls": med([sum(v[0] for v in x.values()) for x in rows]),
                     "seconds": med([sum(v[1] for v in x.values()) for x in rows]),
                     "by_op": dict(sorted(by.items(), key=lambda kv: -kv[1][1]))}
    return {"per": per, "ratios": ratios, "rounds_ok": len(ok), "ceph_calls": calls}


def render(results, summary, cfg, fmt_ratio, fmt_num):
    snap = results.get("snapshot")
    s = summary.get("snapshot")
    if not snap or not s or not s["rounds_ok"]:
        return []
    per, r = s["per"], s["ratios"]
    rk, fl = per["rbdkit"], per["floor"]

    def ms(sp):
        if not sp:
            return "–"
        if sp["n"] == 1:
            return f"{sp['median'] * 1000:.0f} ms"
        return (f"**{sp['median'] * 1000:.0f} ms** ({sp['min'] * 1000:.0f}–"
                f"{sp['max'] * 1000:.0f})")

    def size(b):
        return f"{b >> 30} GiB" if b % (1 << 30) == 0 else f"{b >> 20} MiB"

    L = ["## 6. Snapshots and restores (issue 11)", ""]
    L.append(f"A {size(snap['image_bytes'])} claim with {size(snap['written_bytes'])} written into its "
             f"image ({CHUNK >> 20} MiB chunks of a non-zero pattern, spread evenly over the "
             "image, through librbd), on the test control plane with the standard "
             "snapshot-controller (external-snapshotter v8, default settings) and `rbdkit "
             "provisioner` as its own process with default settings (release build), which "
             "handles the VolumeSnapshotContents itself (no csi-snapshotter sidecar). Per "
             "round: a VolumeSnapshot of the claim, timed from its create to `readyToUse: "
             "true`; a claim restoring it (`dataSource` = the VolumeSnapshot), from its create "
             "to Bound; a PVC-to-PVC clone of the source claim, from its create to Bound. "
             "The restored and cloned images are read back (first and last chunk) and checked "
             "against the pattern, untimed; then everything is deleted and the next round "
             "starts. Times come from watches opened before the round.")
    L.append("")
    L.append("The **floor** is the same Ceph work done directly in the same round, through "
             "librbd (Debian's Python binding, one connection opened beforehand, clone format "
             "2), with nothing else: for a snapshot, a snapshot of the source, a clone of it, "
             "the source's snapshot removed (into the trash namespace while the clone lives) "
             "and a snapshot of the clone: the clone-backed snapshot image rbdkit makes, as "
             "ceph-csi does; for a restore, a clone of that snapshot; for a PVC clone, a "
             "temporary snapshot of the source, a clone of it and the snapshot removed. "
             "rbdkit also opens and checks the images, writes its owner metadata and renames "
             "a temporary clone into place (crash safety). Floor and rbdkit take turns going "
             f"first. {s['rounds_ok']} round(s); median (min–max) when more. "
             f"The machine is a loaded, shared 2-core VM: only the ratios mean much.")
    L.append("")
    L.append("| operation | rbdkit, end to end | rbdkit's own part | Kubernetes' part | "
             "Ceph floor | end to end / floor | rbdkit's part / floor |")
    L.append("|---|---|---|---|---|---|---|")
    parts = {
        "snapshot": ("snapshot_driver_s", ["snapshot_content_s", "snapshot_copy_back_s"],
                     "controller: VolumeSnapshot → content {a}, content ready → ready {b}"),
        "restore": ("restore_driver_s", ["restore_bind_s"], "binder: PV → Bound {a}"),
        "clone": ("clone_driver_s", ["clone_bind_s"], "binder: PV → Bound {a}"),
    }
    for op, label in OPS:
        drv, kparts, kfmt = parts[op]
        kcell = kfmt.format(a=ms(rk.get(kparts[0])),
                            b=ms(rk.get(kparts[1])) if len(kparts) > 1 else "")
        L.append(f"| {label} | {ms(rk.get(f'{op}_s'))} | {ms(rk.get(drv))} | {kcell} | "
                 f"{ms(fl.get(f'{op}_s'))} | {fmt_ratio(r[f'{op} / floor'])} | "
                 f"{fmt_ratio(r[f'{op} rbdkit part / floor'])} |")
    L.append("")
    L.append("*rbdkit's own part*: for the snapshot, from the VolumeSnapshotContent's creation "
             "(by the snapshot-controller) to rbdkit setting its `readyToUse`; for claims, from "
             "the claim's create to rbdkit's PV. *Kubernetes' part*: the rest (the "
             "snapshot-controller making the content and copying its status back; the PV "
             "binder binding the claim to the PV).")
    calls = s.get("ceph_calls") or {}
    if calls:
        L.append("")
        L.append("Where rbdkit's own part goes: its Ceph calls per operation, from the "
                 "provisioner's `rbdkit_ceph_op_duration_seconds` (median over rounds; "
                 "the slowest kinds first, calls × total ms):")
        L.append("")
        L.append("| operation | Ceph calls | their time | rbdkit's part | slowest calls |")
        L.append("|---|---|---|---|---|")
        for op, label in OPS:
            cp = calls.get(op)
            if not cp:
                continue
            drv = "snapshot_driver_s" if op == "snapshot" else f"{op}_driver_s"
            top = ", ".join(f"{n} {v[0]:g}× {v[1] * 1000:.0f}"
                            for n, v in list(cp["by_op"].items())[:4])
            part = rk.get(drv)
            L.append(f"| {label} | {cp['calls']:g} | {cp['seconds'] * 1000:.0f} ms | "
                     f"{part['median'] * 1000:.0f} ms | {top} |" if part else "")
    if snap.get("peak_rss_kib"):
        L.append("")
        L.append(f"Provisioner peak RSS over the section: {snap['peak_rss_kib'] / 1024:.1f} MiB. "
                 f"Writing the {size(snap['written_bytes'])} took "
                 f"{snap.get('write_s', 0):.1f} s (setup, untimed).")
    L.append("")
    return L
