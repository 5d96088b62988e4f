//! Fencing a whole node: every Ceph client from its addresses, now and
//! later, for every volume.
//!
//! A node that is cut off may still write: its mapper's clients, a worker
//! restarted since it mapped (a new client instance), its kernel client.
//! Blocklisting the instances one knows of misses the ones one does not,
//! so a node is fenced by address: `osd blocklist add IP:0/0`, which every
//! OSD applies to any client from that IP whatever its port and nonce
//! (`OSDMap::is_blocklisted`), on every Ceph release rbdkit supports, and
//! which `mon 'profile rbd'` may add. Entries last [`FENCE_EXPIRY_SECS`]
//! (five years): a fence ends when it is lifted ([`unfence`]), never by
//! itself while the partition it guards against may still heal.
//!
//! An address that a monitor, an OSD or a manager listens on, or that this
//! client comes from, is never fenced ([`check_fenceable`]): blocklisting
//! it would cut the cluster off from itself, or leave nobody to lift the
//! fence. Such a node (a hyperconverged one, with an OSD on it) must be
//! fenced by hand; the error says so.
//!
//! A network is fenced by CIDR block (csi-addons' NetworkFence): `osd
//! blocklist range add` per block ([`fence_ranges`]), after the same
//! check, and a refusal of blocks wider than [`MIN_PREFIX_V4`] /
//! [`MIN_PREFIX_V6`] (no node pool needs more in one entry, and `0.0.0.0/0`
//! would fence the world).

use std::net::IpAddr;

use crate::rados::{Cidr, Cluster};
use crate::volume::ops::VolumeError;

/// The shortest IPv4 prefix fenced in one entry (a /16).
pub const MIN_PREFIX_V4: u8 = 16;
/// The shortest IPv6 prefix fenced in one entry.
pub const MIN_PREFIX_V6: u8 = 48;

/// How long a node's fence lasts unless lifted: five years.
pub const FENCE_EXPIRY_SECS: u32 = 5 * 365 * 24 * 3600;

/// The IP of a Ceph address as librados and the monitors print them:
/// `10.0.0.1:0/3411598412`, `v2:10.0.0.1:3300/0`, `[fd00::1]:6789/0`, or a
/// bare IP. `None` for anything else and for an unspecified address
/// (`0.0.0.0`, `::`).
pub fn addr_ip(addr: &str) -> Option<IpAddr> {
    let a = addr.trim();
    let a = ["v1:", "v2:", "any:"]
        .iter()
        .find_map(|p| a.strip_prefix(p))
        .unwrap_or(a);
    let a = a.split('/').next()?;
    let host = if let Some(rest) = a.strip_prefix('[') {
        rest.split(']').next()?
    } else if a.matches(':').count() == 1 {
        a.split(':').next()?
    } else {
        a
    };
    let ip: IpAddr = host.parse().ok()?;
    (!ip.is_unspecified()).then_some(ip)
}

/// The blocklist entry that fences every client from `ip`.
pub fn ip_entry(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}:0/0"),
        IpAddr::V6(v6) => format!("[{v6}]:0/0"),
    }
}

/// The cluster's own addresses, each with whose it is: monitors (`mon
/// dump`), OSDs (`osd dump`: public, cluster and heartbeat addresses),
/// managers (`mgr dump`, where the user may read it) and this client.
pub fn protected_addresses(cluster: &Cluster) -> Result<Vec<(String, IpAddr)>, VolumeError> {
    let mut out = Vec::new();
    for a in json_addrs(&dump(cluster, "mon dump")?["mons"], "name", "monitor") {
        out.push(a);
    }
    for a in json_addrs(&dump(cluster, "osd dump")?["osds"], "osd", "osd.") {
        out.push(a);
    }
    // `mgr dump` needs a mgr read cap that `profile rbd` lacks: managers
    // on hosts of their own are spared only when the user may read it.
    if let Ok(m) = dump(cluster, "mgr dump") {
        let mut all = vec![m.clone()];
        all.extend(m["standbys"].as_array().cloned().unwrap_or_default());
        for a in json_addrs(&serde_json::Value::Array(all), "name", "manager") {
            out.push(a);
        }
    }
    let me = cluster.addrs().map_err(VolumeError::Ceph)?;
    out.extend(
        me.split(',')
            .filter_map(addr_ip)
            .map(|ip| ("this client".to_owned(), ip)),
    );
    Ok(out)
}

fn dump(cluster: &Cluster, prefix: &str) -> Result<serde_json::Value, VolumeError> {
    let cmd = serde_json::json!({"prefix": prefix, "format": "json"}).to_string();
    let reply = cluster.mon_command(&cmd, &[]).map_err(VolumeError::Ceph)?;
    serde_json::from_slice(&reply.output).map_err(|e| VolumeError::Refused {
        why: format!("cannot read the monitors' answer to {prefix:?}: {e}"),
    })
}

/// Every address string found under `list`'s entries (any key ending in
/// `addr` or `addrs`, nested address vectors too), named by `name_key`.
fn json_addrs(list: &serde_json::Value, name_key: &str, kind: &str) -> Vec<(String, IpAddr)> {
    fn walk(v: &serde_json::Value, found: &mut Vec<IpAddr>) {
        match v {
            serde_json::Value::String(s) => found.extend(addr_ip(s)),
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, found)),
            serde_json::Value::Object(o) => o
                .iter()
                .filter(|(k, _)| k.ends_with("addr") || k.ends_with("addrs") || *k == "addrvec")
                .for_each(|(_, x)| walk(x, found)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for e in list.as_array().into_iter().flatten() {
        let name = match &e[name_key] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => n.to_string(),
            _ => "?".into(),
        };
        let who = if kind.ends_with('.') {
            format!("{kind}{name}")
        } else {
            format!("{kind} {name}")
        };
        let mut ips = Vec::new();
        walk(e, &mut ips);
        ips.sort();
        ips.dedup();
        out.extend(ips.into_iter().map(|ip| (who.clone(), ip)));
    }
    out
}

/// Refuses, naming each, an address in `ips` that one of `protected`
/// uses. Pure: the addresses come from [`protected_addresses`].
pub fn check_fenceable(
    node: &str,
    ips: &[IpAddr],
    protected: &[(String, IpAddr)],
) -> Result<(), VolumeError> {
    let hits: Vec<String> = ips
        .iter()
        .flat_map(|ip| {
            protected
                .iter()
                .filter(move |(_, p)| p == ip)
                .map(move |(who, _)| format!("{ip} is {who}'s"))
        })
        .collect();
    if hits.is_empty() {
        return Ok(());
    }
    Err(VolumeError::Refused {
        why: format!(
            "node {node} is not fenced: {}; blocklisting that address would cut the cluster off \
             from itself. Fence the node's clients by hand (osd blocklist add IP:PORT/NONCE of \
             each) and break its staging locks",
            hits.join(", ")
        ),
    })
}

/// Fences every client from each of `ips` ([`ip_entry`], for
/// [`FENCE_EXPIRY_SECS`]), then waits for the OSD map that lists them, so
/// that what this client does next is ordered after the fence.
pub fn fence(cluster: &Cluster, ips: &[IpAddr]) -> Result<(), VolumeError> {
    for ip in ips {
        cluster
            .blocklist_add(&ip_entry(*ip), FENCE_EXPIRY_SECS)
            .map_err(VolumeError::Ceph)?;
    }
    cluster.wait_for_latest_osdmap().map_err(VolumeError::Ceph)
}

/// Lifts the fence of each of `ips` (an entry already gone is fine).
pub fn unfence(cluster: &Cluster, ips: &[IpAddr]) -> Result<(), VolumeError> {
    for ip in ips {
        cluster
            .blocklist_rm(&ip_entry(*ip))
            .map_err(VolumeError::Ceph)?;
    }
    Ok(())
}

/// Parses the CIDR blocks of a request (sorted, no duplicates); the error
/// names each bad one.
pub fn parse_cidrs(cidrs: &[String]) -> Result<Vec<Cidr>, VolumeError> {
    if cidrs.is_empty() {
        return Err(VolumeError::Refused {
            why: "no CIDR block to fence is given".into(),
        });
    }
    let (ok, bad): (Vec<_>, Vec<_>) = cidrs
        .iter()
        .map(|c| Cidr::parse(c))
        .partition(|r| r.is_ok());
    if !bad.is_empty() {
        let why: Vec<String> = bad
            .into_iter()
            .filter_map(|r| r.err())
            .map(|e| e.to_string())
            .collect();
        return Err(VolumeError::Refused {
            why: why.join("; "),
        });
    }
    let mut out: Vec<Cidr> = ok.into_iter().filter_map(Result::ok).collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// Refuses, naming each, a block wider than the minimum prefix or holding
/// an address of `protected` ([`protected_addresses`]).
pub fn check_cidrs(cidrs: &[Cidr], protected: &[(String, IpAddr)]) -> Result<(), VolumeError> {
    let mut why = Vec::new();
    for c in cidrs {
        let min = match c.ip() {
            IpAddr::V4(_) => MIN_PREFIX_V4,
            IpAddr::V6(_) => MIN_PREFIX_V6,
        };
        if c.prefix_len() < min {
            why.push(format!(
                "{c} is wider than /{min} (split it into blocks of /{min} or narrower)"
            ));
            continue;
        }
        let hits: Vec<String> = protected
            .iter()
            .filter(|(_, ip)| c.contains(*ip))
            .map(|(who, ip)| format!("{who}'s {ip}"))
            .collect();
        if !hits.is_empty() {
            why.push(format!(
                "{c} holds {}: fencing it would cut the cluster off from itself",
                hits.join(", ")
            ));
        }
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(VolumeError::Refused {
            why: format!("not fenced: {}", why.join("; ")),
        })
    }
}

/// Fences every client in each of `cidrs` for [`FENCE_EXPIRY_SECS`], then
/// waits for the OSD map that lists them.
pub fn fence_ranges(cluster: &Cluster, cidrs: &[Cidr]) -> Result<(), VolumeError> {
    for c in cidrs {
        cluster
            .blocklist_range_add(c, FENCE_EXPIRY_SECS)
            .map_err(VolumeError::Ceph)?;
    }
    cluster.wait_for_latest_osdmap().map_err(VolumeError::Ceph)
}

/// Lifts the fence of each of `cidrs` (a block not fenced is fine).
pub fn unfence_ranges(cluster: &Cluster, cidrs: &[Cidr]) -> Result<(), VolumeError> {
    for c in cidrs {
        cluster.blocklist_range_rm(c).map_err(VolumeError::Ceph)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_read_in_every_form_ceph_prints() {
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        let v6: IpAddr = "fd00::1".parse().unwrap();
        for a in ["10.0.0.1:0/3411598412", "v2:10.0.0.1:3300/0", "10.0.0.1"] {
            assert_eq!(addr_ip(a), Some(v4), "{a}");
        }
        for a in ["[fd00::1]:6789/0", "v2:[fd00::1]:3300/0", "fd00::1"] {
            assert_eq!(addr_ip(a), Some(v6), "{a}");
        }
        assert_eq!(addr_ip("0.0.0.0:0/0"), None);
        assert_eq!(addr_ip("client.4123"), None);
        assert_eq!(ip_entry(v4), "10.0.0.1:0/0");
        assert_eq!(ip_entry(v6), "[fd00::1]:0/0");
    }

    #[test]
    fn the_cluster_is_never_fenced() {
        let mons = serde_json::json!([{"name": "a", "public_addrs": {"addrvec": [
            {"type": "v2", "addr": "10.0.0.1:3300", "nonce": 0},
            {"type": "v1", "addr": "10.0.0.1:6789", "nonce": 0}]}, "addr": "10.0.0.1:6789/0"}]);
        let osds = serde_json::json!([{"osd": 3, "public_addr": "10.0.0.5:6800/12",
            "cluster_addr": "10.1.0.5:6801/12", "heartbeat_back_addr": "10.1.0.5:6802/12"}]);
        let mut p = json_addrs(&mons, "name", "monitor");
        p.extend(json_addrs(&osds, "osd", "osd."));
        assert_eq!(
            p.iter()
                .map(|(w, ip)| format!("{w} {ip}"))
                .collect::<Vec<_>>(),
            ["monitor a 10.0.0.1", "osd.3 10.0.0.5", "osd.3 10.1.0.5"]
        );
        let node: IpAddr = "10.0.0.9".parse().unwrap();
        assert!(check_fenceable("n1", &[node], &p).is_ok());
        let e = check_fenceable("n1", &[node, "10.1.0.5".parse().unwrap()], &p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("node n1 is not fenced: 10.1.0.5 is osd.3's"),
            "{e}"
        );
    }
}
