//! A Ceph cluster that has gone away (or was never there) costs the
//! provisioner next to no CPU: its connection is shut down, `/readyz` and
//! `rbdkit_cluster_reachable` name it, and once it is back a new claim on
//! it provisions without restarting rbdkit.
use crate::support;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret as K8sSecret;
use kube::api::PostParams;
use kube::Api;
use serde_json::json;

use support::provisioner::{from_json, http_get, wait_readyz, Env};

/// A second throwaway cluster, removed on drop.
struct Second {
    dir: PathBuf,
}

impl Second {
    fn up(name: &str) -> Second {
        let dir = std::env::temp_dir().join(format!("rbdkit-{name}-{}", std::process::id()));
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ceph-test-cluster");
        let out = Command::new(script)
            .args(["up", dir.to_str().unwrap()])
            .output()
            .expect("run ceph-test-cluster");
        assert!(
            out.status.success(),
            "second cluster: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Second { dir }
    }

    fn conf(&self) -> PathBuf {
        self.dir.join("ceph.conf")
    }

    fn conf_value(&self, key: &str) -> String {
        let text = std::fs::read_to_string(self.conf()).expect("read conf");
        text.lines()
            .find_map(|l| {
                let (k, v) = l.split_once('=')?;
                (k.trim().replace('_', " ") == key).then(|| v.trim().to_owned())
            })
            .unwrap_or_else(|| panic!("no {key} in {}", self.conf().display()))
    }

    fn admin_key(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("keyring")).expect("read keyring");
        let mut in_admin = false;
        for line in text.lines() {
            let t = line.trim();
            if t.starts_with('[') {
                in_admin = t == "[client.admin]";
            } else if let (true, Some((k, v))) = (in_admin, t.split_once('=')) {
                if k.trim() == "key" {
                    return v.trim().to_owned();
                }
            }
        }
        panic!("no client.admin key");
    }

    /// Stops the monitor (the OSD and mgr keep running, as after a monitor
    /// host failure): nothing answers on the monitor address.
    fn stop_mon(&self) {
        let pidfile = self.dir.join("run/ceph-mon.a.pid");
        let pid = std::fs::read_to_string(&pidfile).expect("mon pid file");
        let pid = pid.trim().to_owned();
        let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            assert!(Instant::now() < deadline, "mon {pid} did not stop");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn start_mon(&self) {
        let status = Command::new("ceph-mon")
            .args(["-c", self.conf().to_str().unwrap(), "-i", "a"])
            .status()
            .expect("start ceph-mon");
        assert!(status.success(), "ceph-mon: {status}");
    }
}

impl Drop for Second {
    fn drop(&mut self) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ceph-test-cluster");
        let _ = Command::new(script)
            .args(["down", self.dir.to_str().unwrap()])
            .status();
    }
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read stat");
    let after = &stat[stat.rfind(')').expect("comm") + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of proc(5); `after` starts at field 3.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let hz = Command::new("getconf").arg("CLK_TCK").output().unwrap();
    let hz: f64 = String::from_utf8_lossy(&hz.stdout).trim().parse().unwrap();
    ticks as f64 / hz
}

fn reachable_metric(metrics: &str, cluster: &str) -> Option<String> {
    let prefix = format!("rbdkit_cluster_reachable{{cluster=\"{cluster}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_gone_away_costs_no_cpu_and_comes_back_on_demand() {
    let mut env = Env::new("dead").await;
    let second = Second::up("second");
    let stopped_id = format!("{}-second", env.cluster_id);
    let dead_id = format!("{}-dead", env.cluster_id);
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();

    let secrets: Api<K8sSecret> = Api::namespaced(env.client.clone(), &env.ns);
    secrets
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "ceph-second"},
                "stringData": {"userID": "admin", "userKey": second.admin_key()},
            })),
        )
        .await
        .unwrap();
    let mons = support::ceph::TestCluster::get()
        .conf_value("mon host")
        .unwrap();
    let config = json!([
        {"clusterID": env.cluster_id, "monitors": [mons], "rbd": {"radosNamespace": env.rbd.name}},
        {"clusterID": stopped_id, "monitors": [second.conf_value("mon host")]},
        {"clusterID": dead_id, "monitors": [format!("127.0.0.1:{dead_port}")]},
    ]);
    std::fs::write(env.config_path(), config.to_string()).unwrap();
    let real = env.storage_class("r", json!({}), json!({})).await;
    let ns = env.ns.clone();
    let on_second = env
        .storage_class(
            "s",
            json!({
                "clusterID": stopped_id,
                "csi.storage.k8s.io/provisioner-secret-name": "ceph-second",
                "csi.storage.k8s.io/provisioner-secret-namespace": ns,
                "csi.storage.k8s.io/controller-expand-secret-name": "ceph-second",
                "csi.storage.k8s.io/node-stage-secret-name": "ceph-second",
            }),
            json!({}),
        )
        .await;
    let on_dead = env
        .storage_class("d", json!({"clusterID": dead_id}), json!({}))
        .await;

    let mut child = env.start_process_with("dead-1", &[("--ceph-health-interval", "2s")]);
    let pid = child.pid();
    let http = child.http_addr().await;

    env.claim(
        "second",
        &on_second,
        "8Mi",
        &["ReadWriteOnce"],
        "Filesystem",
    )
    .await;
    env.claim("real", &real, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_bound("second").await;
    env.wait_bound("real").await;
    // A claim on the dead cluster keeps being retried throughout.
    env.claim("dead", &on_dead, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_event("dead", "ProvisioningFailed", &[&dead_id])
        .await;

    second.stop_mon();
    let body = wait_readyz(http, "/readyz to name both clusters", |b| {
        b.contains(&stopped_id) && b.contains(&dead_id)
    })
    .await;
    assert!(body.starts_with("degraded"), "{body}");
    assert!(!body.contains(&format!("{}, ", env.cluster_id)) && !body.ends_with(&env.cluster_id));

    let (_, metrics) = http_get(http, "/metrics").await;
    assert_eq!(
        reachable_metric(&metrics, &stopped_id).as_deref(),
        Some("0"),
        "{metrics}"
    );
    assert_eq!(
        reachable_metric(&metrics, &dead_id).as_deref(),
        Some("0"),
        "{metrics}"
    );
    assert_eq!(
        reachable_metric(&metrics, &env.cluster_id).as_deref(),
        Some("1"),
        "{metrics}"
    );

    let before = cpu_seconds(pid);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let used = cpu_seconds(pid) - before;
    let share = used / t0.elapsed().as_secs_f64();
    eprintln!("provisioner CPU over {:?} with a stopped and a dead cluster: {used:.2} s ({:.2}% of a core)", t0.elapsed(), share * 100.0);
    assert!(share < 0.05, "{:.1}% of a core", share * 100.0);
    assert!(child.running(), "{}", child.log_tail());

    // The monitor comes back: the same process provisions on it again.
    second.start_mon();
    wait_readyz(http, "/readyz to stop naming the second cluster", |b| {
        !b.contains(&stopped_id) && b.contains(&dead_id)
    })
    .await;
    env.claim("again", &on_second, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_bound("again").await;
    assert_eq!(child.pid(), pid);
    let (_, metrics) = http_get(http, "/metrics").await;
    assert_eq!(
        reachable_metric(&metrics, &stopped_id).as_deref(),
        Some("1"),
        "{metrics}"
    );
    let key = second.admin_key();
    assert!(!child.log_text().contains(&key) && !metrics.contains(&key));

    env.delete_claim("real").await;
    env.delete_claim("dead").await;
    let _ = child.terminate();
}

/// Per thread of `pid`: (tid, comm, utime + stime in ticks).
fn thread_ticks(pid: u32) -> Vec<(u32, String, u64)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for entry in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_owned();
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let ticks = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        let tid = entry.file_name().to_string_lossy().parse().unwrap();
        out.push((tid, comm, ticks));
    }
    out
}

/// The review's case: the API server and the Ceph cluster both stopped under
/// a running provisioner. Neither the kube watchers, the leader election nor
/// librados may spin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_and_cluster_both_gone_cost_no_cpu() {
    let cp = support::k8s::ControlPlane::start_private();
    let mut env = Env::new_on(&cp, "both").await;
    let second = Second::up("both");
    let id = format!("{}-both", env.cluster_id);
    let secrets: Api<K8sSecret> = Api::namespaced(env.client.clone(), &env.ns);
    secrets
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "ceph-both"},
                "stringData": {"userID": "admin", "userKey": second.admin_key()},
            })),
        )
        .await
        .unwrap();
    let config = json!([{"clusterID": id, "monitors": [second.conf_value("mon host")]}]);
    std::fs::write(env.config_path(), config.to_string()).unwrap();
    let ns = env.ns.clone();
    let class = env
        .storage_class(
            "b",
            json!({
                "clusterID": id,
                "csi.storage.k8s.io/provisioner-secret-name": "ceph-both",
                "csi.storage.k8s.io/provisioner-secret-namespace": ns,
                "csi.storage.k8s.io/controller-expand-secret-name": "ceph-both",
                "csi.storage.k8s.io/node-stage-secret-name": "ceph-both",
            }),
            json!({}),
        )
        .await;
    // Default Ceph timings, as in the review.
    let mut child = env.start_process("both-1");
    let pid = child.pid();
    env.claim("c", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_bound("c").await;
    let names = |t: &[(u32, String, u64)]| t.iter().map(|(_, c, _)| c.clone()).collect::<Vec<_>>();
    eprintln!("threads while connected: {:?}", names(&thread_ticks(pid)));

    // Both gone, with work in flight (as when a test run's teardown stops
    // them under an orphaned provisioner): the whole Ceph cluster, then a
    // claim on it that keeps failing, then the API server.
    drop(second);
    env.claim("p", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_event("p", "ProvisioningFailed", &[&id]).await;
    drop(cp);
    // Let timeouts and backoffs reach their steady state.
    tokio::time::sleep(Duration::from_secs(15)).await;

    let hz = Command::new("getconf").arg("CLK_TCK").output().unwrap();
    let hz: f64 = String::from_utf8_lossy(&hz.stdout).trim().parse().unwrap();
    let before = thread_ticks(pid);
    let cpu0 = cpu_seconds(pid);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(40)).await;
    let cpu = cpu_seconds(pid) - cpu0;
    let secs = t0.elapsed().as_secs_f64();
    let after = thread_ticks(pid);
    let mut per_thread: Vec<(String, f64)> = after
        .iter()
        .map(|(tid, comm, t)| {
            let t0 = before
                .iter()
                .find(|(b, _, _)| b == tid)
                .map_or(0, |(_, _, t)| *t);
            (
                format!("{comm}[{tid}]"),
                (t - t0) as f64 / hz / secs * 100.0,
            )
        })
        .filter(|(_, pct)| *pct > 0.0)
        .collect();
    per_thread.sort_by(|a, b| b.1.total_cmp(&a.1));
    let share = cpu / secs;
    eprintln!(
        "provisioner CPU over {secs:.0} s with API server and cluster gone: {cpu:.2} s \
         ({:.2}% of a core); threads {:?}; busy: {per_thread:?}",
        share * 100.0,
        names(&after)
    );
    assert!(child.running(), "{}", child.log_tail());
    assert!(
        share < 0.05,
        "{:.1}% of a core; per thread: {per_thread:?}\n{}",
        share * 100.0,
        child.log_tail()
    );
    let _ = child.terminate();
}
