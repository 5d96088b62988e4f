//! Single writer across nodes: the staging lock.
//!
//! The controller has no attach step (`attachRequired: false`), so nothing
//! but the node plugin itself keeps two nodes from staging one read-write
//! volume. Looking at the image's watchers first and mapping after is a
//! check-then-act race: two NodeStage calls on two nodes both see no
//! watcher, both map, both run mkfs and mount. So NodeStage takes a lock
//! **before it maps** and checks it **again after the map**, before any
//! mkfs or mount:
//!
//! - **What**: a `cls_lock` lock named [`LOCK_NAME`] on the image's header
//!   object (`rbd_header.<id>`), taken with `rados_lock_exclusive` (RWO,
//!   RWOP, single-writer modes) or `rados_lock_shared` with tag
//!   [`SHARED_TAG`] (RWX Block, which may be staged on several nodes). The
//!   OSD takes it atomically, so of two racing nodes exactly one gets it;
//!   it lives on the image's own header, so it goes with the image.
//! - **Whose**: the cookie names the node ([`cookie`]). A repeated stage,
//!   or a stage after `rbdkit csi` restarted (a new librados client, so a
//!   new lock holder entity), finds the lock held under its own cookie and
//!   carries on; unstaging releases it (`rados_unlock`, or
//!   `rados_break_lock` of its own cookie when an earlier client of this
//!   node took it).
//! - **Why not librbd's locks**: the exclusive-lock feature's managed lock
//!   moves between clients by itself and is broken by any client that finds
//!   its owner dead, so it guards I/O, not "staged on one node"; and
//!   `rbd_lock_exclusive` (`rbd lock add`) is the same cls lock
//!   (`rbd_lock`) the managed lock uses, so holding it from the node plugin
//!   stalls every write of a mapper on an image with exclusive-lock
//!   (`tests/library/rbd_image.rs` shows it). A lock of its own name leaves
//!   librbd alone.
//! - **A lock that persists** outlives a crashed holder, which is the point
//!   (a `kill -9` between map and mount must not let another node in), and
//!   the cost: a node that dies with volumes staged keeps their locks. A
//!   lock is broken only when its node is declared dead (the Node's
//!   `node.kubernetes.io/out-of-service` taint) and after the whole node is
//!   fenced: every client from its addresses blocklisted
//!   ([`crate::volume::node_fence`]), so a node that was only cut off
//!   cannot write after another took over, through any client it has or
//!   starts later. The provisioner does that
//!   (`crate::provisioner::out_of_service`, with
//!   [`ImageLock::node_clients`] and [`ImageLock::break_node`]). A missing
//!   watcher is never taken as a sign of death: live nodes leave locks too
//!   (a deferred release), and their other volumes share the clients a
//!   fence would cut.
//!
//! - **Mirrored images**: a peer site's `rbd-mirror` daemon watches the
//!   primary copy it replicates, and a watcher's address does not say whose
//!   it is. [`ImageLock::data_path_watchers`] leaves out this site's own
//!   daemon (by its instance id) and as many unknown watchers as the image
//!   has peer daemons up, never one this node or a fenced node is known
//!   by, so a mirrored primary stages (and a dead node's lock is broken) as
//!   an unmirrored image would. A non-primary copy is refused for
//!   read-write stages ([`MirrorRole::NonPrimary`]).
//!
//! Everything here is blocking and bounded by the connection's timeouts (one
//! OSD operation per lock call, the mon-op timeout for a blocklist entry).

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::rados::{Cluster, IoCtx, ObjectLockers};
use crate::rbd::Image;
use crate::volume::node_fence::addr_ip;

/// The lock's name on the header object.
pub const LOCK_NAME: &str = "rbdkit.stage";
/// The tag of the shared lock (multi-node-writer Block volumes).
pub const SHARED_TAG: &str = "rbdkit.multi-node-block";
/// The header xattr, followed by the node id, listing that node's data-path
/// clients of the image (what to blocklist before its lock is broken).
const CLIENTS_XATTR: &str = "rbdkit.stage.clients.";
const COOKIE_PREFIX: &str = "rbdkit-node ";

/// How a volume is staged, as far as other nodes are concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LockMode {
    /// One node only (read-write single-node and single-writer modes).
    Exclusive,
    /// Any number of nodes (multi-node-multi-writer Block).
    Shared,
}

/// The cookie a node takes the lock with.
pub fn cookie(node_id: &str) -> String {
    format!("{COOKIE_PREFIX}{node_id}")
}

/// The node a cookie names, if it is one of ours.
pub fn node_of(cookie: &str) -> Option<&str> {
    cookie.strip_prefix(COOKIE_PREFIX)
}

/// Where an image stands in RBD mirroring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorRole {
    /// Not mirrored.
    NotMirrored,
    /// The primary copy; `peer_daemons` peer sites' rbd-mirror daemons are
    /// up (each watches the image while it copies it).
    Primary {
        /// Peer sites whose daemon reports the image and is up.
        peer_daemons: usize,
    },
    /// A non-primary copy: read-only until promoted.
    NonPrimary,
}

/// What [`ImageLock::acquire`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// Taken now.
    Taken,
    /// This node held it already (a repeat, or a restart of the plugin).
    Ours,
    /// This node holds it, in the other mode.
    OursInOtherMode,
    /// Others hold it.
    Refused(ObjectLockers),
}

/// The staging lock of one image, with the image open read-only (which
/// registers no watch).
pub struct ImageLock {
    io: IoCtx,
    image: Image,
    oid: String,
    spec: String,
}

impl ImageLock {
    /// The lock of `pool/namespace/image`.
    pub fn open(cluster: &Cluster, pool: &str, namespace: &str, image: &str) -> Result<ImageLock> {
        let io = cluster.ioctx_ns(pool, namespace)?;
        let img = Image::open_read_only(&io, image)?;
        let oid = img.header_oid()?;
        Ok(ImageLock {
            spec: img.spec(),
            io,
            image: img,
            oid,
        })
    }

    /// The header object.
    pub fn oid(&self) -> &str {
        &self.oid
    }

    /// Who holds it.
    pub fn holders(&self) -> Result<ObjectLockers> {
        self.io.lockers(&self.oid, LOCK_NAME)
    }

    /// The addresses watching the image: every client that has it open
    /// read-write (a mapper, a kernel client).
    pub fn watchers(&self) -> Result<Vec<String>> {
        Ok(self.image.watchers()?.into_iter().map(|w| w.addr).collect())
    }

    fn in_mode(h: &ObjectLockers, mode: LockMode) -> bool {
        match mode {
            LockMode::Exclusive => h.exclusive,
            LockMode::Shared => !h.exclusive && h.tag == SHARED_TAG,
        }
    }

    /// The image's place in RBD mirroring (see [`MirrorRole`]). An image
    /// whose mirroring cannot be read (caps, an old cluster) counts as not
    /// mirrored.
    pub fn mirror_role(&self) -> MirrorRole {
        let Ok(info) = self.image.mirror_info() else {
            return MirrorRole::NotMirrored;
        };
        if info.state != crate::rbd::MirrorImageState::Enabled {
            return MirrorRole::NotMirrored;
        }
        if !info.primary {
            return MirrorRole::NonPrimary;
        }
        let daemons = self
            .image
            .mirror_global_status()
            .map(|s| s.peers().filter(|p| p.up).count())
            .unwrap_or(0);
        MirrorRole::Primary {
            peer_daemons: daemons,
        }
    }

    /// The watchers that may be data-path clients. Of a mirrored image,
    /// this site's rbd-mirror daemon (known by its instance id) is left out;
    /// and on a primary every peer site whose daemon is up watches the image
    /// it copies, with an address that does not say whose it is: so up to
    /// that many watchers that are not in `known` are taken for those
    /// daemons and left out too. A watcher in `known` is always kept, and so
    /// is every unknown one when there are more of them than daemons.
    pub fn data_path_watchers(&self, known: &[String]) -> Result<Vec<String>> {
        let all = self.image.watchers()?;
        // Watchers say `v1:` where records may not.
        let is_known = |a: &str| known.iter().any(|k| bare_addr(k) == bare_addr(a));
        if all.iter().all(|w| is_known(&w.addr)) {
            return Ok(all.into_iter().map(|w| w.addr).collect());
        }
        let role = self.mirror_role();
        if role == MirrorRole::NotMirrored {
            return Ok(all.into_iter().map(|w| w.addr).collect());
        }
        // This site's daemon, which held the image while it was a copy (and
        // lets go once it sees the promotion), is known by its instance id.
        let local = self.image.mirror_instance_id().ok();
        let rest: Vec<_> = all
            .into_iter()
            .filter(|w| Some(w.id as u64) != local || is_known(&w.addr))
            .collect();
        let unknown = rest.iter().filter(|w| !is_known(&w.addr)).count();
        match role {
            MirrorRole::Primary { peer_daemons } if unknown <= peer_daemons => Ok(rest
                .into_iter()
                .filter(|w| is_known(&w.addr))
                .map(|w| w.addr)
                .collect()),
            _ => Ok(rest.into_iter().map(|w| w.addr).collect()),
        }
    }

    /// Takes the lock for `node_id` in `mode`, or says who has it.
    pub fn acquire(&self, mode: LockMode, node_id: &str) -> Result<Acquired> {
        let cookie = cookie(node_id);
        let description = format!("staged on node {node_id} by rbdkit");
        for _ in 0..3 {
            let r = match mode {
                LockMode::Exclusive => {
                    self.io
                        .lock_exclusive(&self.oid, LOCK_NAME, &cookie, &description)
                }
                LockMode::Shared => {
                    self.io
                        .lock_shared(&self.oid, LOCK_NAME, &cookie, SHARED_TAG, &description)
                }
            };
            match r {
                Ok(()) => return Ok(Acquired::Taken),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => return Ok(Acquired::Ours),
                Err(e) if e.kind() == ErrorKind::Busy => {}
                Err(e) => return Err(e),
            }
            let h = self.holders()?;
            if h.lockers.is_empty() {
                continue; // released in between: try again
            }
            let mine = h.lockers.iter().filter(|l| l.cookie == cookie).count();
            if mine == h.lockers.len() {
                return Ok(if Self::in_mode(&h, mode) {
                    Acquired::Ours
                } else {
                    Acquired::OursInOtherMode
                });
            }
            return Ok(Acquired::Refused(h));
        }
        Err(
            Error::from_errno(libc::EBUSY, "rados_lock_exclusive", self.spec.clone())
                .detail("the staging lock kept changing hands; try again"),
        )
    }

    /// Whether `node_id` holds the lock in `mode` now.
    pub fn holds(&self, mode: LockMode, node_id: &str) -> Result<bool> {
        let h = self.holders()?;
        let cookie = cookie(node_id);
        Ok(Self::in_mode(&h, mode) && h.lockers.iter().any(|l| l.cookie == cookie))
    }

    /// Releases what `node_id` holds (every client of it that took it) and
    /// its record of data-path clients. Nothing held is fine.
    pub fn release(&self, node_id: &str) -> Result<()> {
        let cookie = cookie(node_id);
        let me = format!("client.{}", self.io.cluster().instance_id());
        for l in self.holders()?.lockers {
            if l.cookie != cookie {
                continue;
            }
            let r = if l.client == me {
                self.io.unlock(&self.oid, LOCK_NAME, &cookie)
            } else {
                // Taken by an earlier client of this node (before a restart
                // of the plugin); that client is gone or idle.
                self.io.break_lock(&self.oid, LOCK_NAME, &l.client, &cookie)
            };
            match r {
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        self.forget_clients(node_id)
    }

    /// Records `clients` (watcher addresses) as `node_id`'s data-path
    /// clients of the image, for [`ImageLock::node_clients`] (what fencing
    /// the node blocklists).
    pub fn record_clients(&self, node_id: &str, clients: &[String]) -> Result<()> {
        let value = serde_json::to_vec(clients).unwrap_or_default();
        self.io
            .xattr_set(&self.oid, &format!("{CLIENTS_XATTR}{node_id}"), &value)
    }

    /// The data-path clients `node_id` recorded (none if it recorded none).
    pub fn recorded_clients(&self, node_id: &str) -> Result<Vec<String>> {
        match self
            .io
            .xattr_get(&self.oid, &format!("{CLIENTS_XATTR}{node_id}"))
        {
            Ok(v) => Ok(serde_json::from_slice(&v).unwrap_or_default()),
            Err(e) if is_missing(&e) => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    fn forget_clients(&self, node_id: &str) -> Result<()> {
        match self
            .io
            .xattr_remove(&self.oid, &format!("{CLIENTS_XATTR}{node_id}"))
        {
            Err(e) if !is_missing(&e) => Err(e),
            _ => Ok(()),
        }
    }

    /// Every client address that `node_id` is known by on this image: the
    /// lock holders under its cookie and the data-path clients it recorded
    /// ([`ImageLock::record_clients`]). Their IPs are what fencing that
    /// node blocklists ([`crate::volume::node_fence`]).
    pub fn node_clients(&self, node_id: &str) -> Result<Vec<String>> {
        let cookie = cookie(node_id);
        let mut out: Vec<String> = self
            .holders()?
            .lockers
            .into_iter()
            .filter(|l| l.cookie == cookie)
            .map(|l| l.addr)
            .collect();
        out.extend(self.recorded_clients(node_id)?);
        out.retain(|a| !a.is_empty());
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Breaks every lock `node_id` holds on the image and forgets its
    /// recorded clients, once the node is fenced: `fenced` are the IPs
    /// blocklisted. A watcher from any other address means someone else
    /// has the image open: then nothing is broken (`Busy`, naming it).
    /// Returns how many locks were broken.
    pub fn break_node(&self, node_id: &str, fenced: &[IpAddr]) -> Result<usize> {
        let from_fenced = |w: &String| addr_ip(w).is_some_and(|ip| fenced.contains(&ip));
        let mut live: Vec<String> = self.watchers()?;
        live.retain(|w| !from_fenced(w));
        if !live.is_empty() {
            // Peer sites' rbd-mirror daemons on a mirrored primary are no
            // users of the image.
            let known: Vec<String> = self.watchers()?.into_iter().filter(from_fenced).collect();
            live = self.data_path_watchers(&known)?;
            live.retain(|w| !from_fenced(w));
        }
        if !live.is_empty() {
            return Err(Error::with_kind(
                ErrorKind::Busy,
                libc::EBUSY,
                "rados_break_lock",
                self.spec.clone(),
                format!(
                    "{} still watch the image from outside node {node_id}'s fenced \
                     addresses: it is in use, the lock is not broken",
                    live.join(", ")
                ),
            ));
        }
        let cookie = cookie(node_id);
        let mut broken = 0;
        for l in self.holders()?.lockers {
            if l.cookie != cookie {
                continue;
            }
            match self
                .io
                .break_lock(&self.oid, LOCK_NAME, &l.client, &l.cookie)
            {
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
                Err(_) => {}
                Ok(()) => broken += 1,
            }
        }
        self.forget_clients(node_id)?;
        Ok(broken)
    }
}

/// The header xattr, followed by the node id, asking that node to reclaim
/// the image's free space (its value: the request's id).
const RECLAIM_REQUEST_XATTR: &str = "rbdkit.reclaim.request.";
/// The header xattr, followed by the node id, with that node's answer
/// ([`ReclaimDone`]).
const RECLAIM_DONE_XATTR: &str = "rbdkit.reclaim.done.";

/// A node's answer to a space reclaim request
/// ([`ImageLock::request_reclaim`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimDone {
    /// The request's id.
    pub id: String,
    /// Whether it was done.
    pub ok: bool,
    /// What was done, or why not.
    pub message: String,
    /// Bytes the filesystem trimmed (as `fstrim` counts them: the free
    /// space it discarded, not all of it newly freed).
    pub trimmed: u64,
}

/// The reclaim request for `node_id` on the image whose header object is
/// `oid` (see [`ImageLock::oid`]), if any: one xattr read, for a node that
/// looks often and knows the header already.
pub fn reclaim_request_at(io: &IoCtx, oid: &str, node_id: &str) -> Result<Option<String>> {
    match io.xattr_get(oid, &format!("{RECLAIM_REQUEST_XATTR}{node_id}")) {
        Ok(v) => Ok(Some(String::from_utf8_lossy(&v).into_owned())),
        Err(e) if is_missing(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `node_id`'s latest answer to a reclaim request on the image whose
/// header object is `oid`, if any (an unreadable one is none).
pub fn reclaim_done_at(io: &IoCtx, oid: &str, node_id: &str) -> Result<Option<ReclaimDone>> {
    match io.xattr_get(oid, &format!("{RECLAIM_DONE_XATTR}{node_id}")) {
        Ok(v) => Ok(serde_json::from_slice(&v).ok()),
        Err(e) if is_missing(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Records `node_id`'s answer, then takes its request away if it is still
/// the one answered, so a node looking for requests reads one missing
/// xattr per image in the steady state. (A request made anew between the
/// two is taken away too; its maker, seeing no answer with its id and no
/// request, asks again.)
pub fn answer_reclaim_at(io: &IoCtx, oid: &str, node_id: &str, done: &ReclaimDone) -> Result<()> {
    let value = serde_json::to_vec(done).unwrap_or_default();
    io.xattr_set(oid, &format!("{RECLAIM_DONE_XATTR}{node_id}"), &value)?;
    if reclaim_request_at(io, oid, node_id)?.as_deref() == Some(done.id.as_str()) {
        match io.xattr_remove(oid, &format!("{RECLAIM_REQUEST_XATTR}{node_id}")) {
            Err(e) if !is_missing(&e) => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

impl ImageLock {
    /// Asks `node_id` to reclaim the image's free space (request `id`;
    /// asking again with the same id changes nothing). The node plugin
    /// answers with [`answer_reclaim_at`].
    pub fn request_reclaim(&self, node_id: &str, id: &str) -> Result<()> {
        self.io.xattr_set(
            &self.oid,
            &format!("{RECLAIM_REQUEST_XATTR}{node_id}"),
            id.as_bytes(),
        )
    }

    /// The reclaim request for `node_id`, if any.
    pub fn reclaim_request(&self, node_id: &str) -> Result<Option<String>> {
        reclaim_request_at(&self.io, &self.oid, node_id)
    }

    /// `node_id`'s latest answer, if any (an unreadable one is none).
    pub fn reclaim_done(&self, node_id: &str) -> Result<Option<ReclaimDone>> {
        reclaim_done_at(&self.io, &self.oid, node_id)
    }

    /// The nodes holding the staging lock (by cookie), sorted, and whether
    /// it is held exclusively.
    pub fn staged_on(&self) -> Result<(Vec<String>, bool)> {
        let h = self.holders()?;
        let mut nodes: Vec<String> = h
            .lockers
            .iter()
            .filter_map(|l| node_of(&l.cookie).map(str::to_owned))
            .collect();
        nodes.sort();
        nodes.dedup();
        Ok((nodes, h.exclusive))
    }
}

/// An address without its messenger prefix (`v1:`, `v2:`, `any:`), as
/// records and blocklists write it.
pub fn bare_addr(addr: &str) -> &str {
    ["v1:", "v2:", "any:"]
        .iter()
        .find_map(|p| addr.strip_prefix(p))
        .unwrap_or(addr)
}

/// A missing xattr: `ENODATA` (or `ENOENT` from an older OSD).
fn is_missing(e: &Error) -> bool {
    e.errno() == libc::ENODATA || e.kind() == ErrorKind::NotFound
}

/// The holders of a lock, for messages: `node X (client.N at ADDR)`.
pub fn describe(h: &ObjectLockers) -> String {
    h.lockers
        .iter()
        .map(|l| match node_of(&l.cookie) {
            Some(n) => format!("node {n} ({} at {})", l.client, l.addr),
            None => format!("{} at {} (cookie {:?})", l.client, l.addr, l.cookie),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rados::ObjectLocker;

    #[test]
    fn cookies_name_the_node() {
        assert_eq!(node_of(&cookie("worker-1")), Some("worker-1"));
        assert_eq!(node_of("auto 1234"), None);
        let h = ObjectLockers {
            exclusive: true,
            tag: String::new(),
            lockers: vec![
                ObjectLocker {
                    client: "client.41".into(),
                    cookie: cookie("a"),
                    addr: "10.0.0.1:0/7".into(),
                },
                ObjectLocker {
                    client: "client.42".into(),
                    cookie: "manual".into(),
                    addr: "10.0.0.2:0/8".into(),
                },
            ],
        };
        assert_eq!(
            describe(&h),
            "node a (client.41 at 10.0.0.1:0/7), client.42 at 10.0.0.2:0/8 (cookie \"manual\")"
        );
    }
}
