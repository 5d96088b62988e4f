//! The OSD blocklist by address range: fencing every client whose IP is in
//! a CIDR block (`osd blocklist range add`, Ceph 16.2.11, 17.2.1 and
//! later), and lifting it.
//!
//! These are monitor commands ([`Cluster::mon_command`]), each bounded by
//! the connection's mon-op timeout. Adding and removing a range needs mon
//! cap `allow command "osd blocklist"` (`profile rbd` allows only `osd
//! blocklist add` of a single address).

use std::fmt;
use std::net::IpAddr;

use crate::error::{Error, ErrorKind, Result};
use crate::rados::Cluster;

/// A CIDR block (`10.0.0.0/24`, `fd00::/64`) as the range blocklist takes
/// it. The prefix length is required: a bare address would reach the
/// monitors as `/0`, every address there is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    ip: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `ADDRESS/PREFIX`. The address is an IPv4 or IPv6 address as
    /// Rust's parser reads it (no leading zeros, no zone); host bits may be
    /// set (the monitors mask them, as `contains` does). Errors name the
    /// input and what is wrong with it.
    pub fn parse(text: &str) -> Result<Cidr> {
        let bad = |why: &str| {
            Err(Error::invalid(
                "osd blocklist range",
                text,
                format!("not a CIDR block: {why}"),
            ))
        };
        let t = text.trim();
        let Some((addr, prefix)) = t.split_once('/') else {
            return bad("no /prefix length (a single address is ADDRESS/32, or /128 for IPv6)");
        };
        let addr = addr.trim_start_matches('[').trim_end_matches(']');
        let Ok(ip) = addr.parse::<IpAddr>() else {
            return bad(&format!("{addr:?} is not an IPv4 or IPv6 address"));
        };
        if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) || prefix.len() > 3 {
            return bad(&format!("prefix length {prefix:?} is not a number"));
        }
        let prefix: u8 = prefix.parse().unwrap_or(u8::MAX);
        let max = Cidr::max_prefix(ip);
        if prefix > max {
            return bad(&format!(
                "prefix length {prefix} is longer than the address ({max} bits)"
            ));
        }
        Ok(Cidr { ip, prefix })
    }

    fn max_prefix(ip: IpAddr) -> u8 {
        match ip {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        }
    }

    /// The address as given (host bits kept).
    pub fn ip(&self) -> IpAddr {
        self.ip
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.prefix
    }

    /// How many host bits the block spans (32 − prefix for IPv4).
    pub fn host_bits(&self) -> u8 {
        Cidr::max_prefix(self.ip) - self.prefix
    }

    /// Whether `ip` is in the block (an IPv4-mapped IPv6 address counts as
    /// its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        let (a, b, bits) = match (self.ip, ip) {
            (IpAddr::V4(n), IpAddr::V4(x)) => {
                (u128::from(u32::from(n)), u128::from(u32::from(x)), 32u32)
            }
            (IpAddr::V6(n), IpAddr::V6(x)) => (u128::from(n), u128::from(x), 128),
            _ => return false,
        };
        let shift = bits - u32::from(self.prefix);
        if shift >= 128 {
            return true;
        }
        (a >> shift) == (b >> shift)
    }

    /// The form the monitors parse as an entity address with the prefix
    /// length in the nonce: `10.0.0.0:0/24`, `[fd00::]:0/64`.
    pub(crate) fn ceph_form(&self) -> String {
        match self.ip {
            IpAddr::V4(ip) => format!("{ip}:0/{}", self.prefix),
            IpAddr::V6(ip) => format!("[{ip}]:0/{}", self.prefix),
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.ip, self.prefix)
    }
}

impl std::str::FromStr for Cidr {
    type Err = Error;
    fn from_str(s: &str) -> Result<Cidr> {
        Cidr::parse(s)
    }
}

/// The monitors of a release without range blocklisting answer `EINVAL`
/// ("invalid command").
fn range_refused(e: Error) -> Error {
    let text = e.to_string();
    if e.kind() == ErrorKind::InvalidArgument && text.contains("invalid command") {
        return e.detail(format!(
            "{text}; range blocklisting needs Ceph 16.2.11, 17.2.1 or later on the monitors"
        ));
    }
    e
}

impl Cluster {
    /// Blocklists every client whose IP is in `range` for `expire_secs`
    /// seconds. Nothing here checks that the range spares the cluster's own
    /// daemons or this client: callers must (`rbdkit`'s fences do). Sends
    /// the mon command `osd blocklist range add`.
    pub fn blocklist_range_add(&self, range: &Cidr, expire_secs: u32) -> Result<()> {
        let cmd = format!(
            r#"{{"prefix": "osd blocklist", "range": "range", "blocklistop": "add", "addr": "{}", "expire": {expire_secs}.0}}"#,
            range.ceph_form()
        );
        self.mon_command(&cmd, &[]).map(drop).map_err(range_refused)
    }

    /// Removes a range entry; one that is not listed is fine. Sends the mon
    /// command `osd blocklist range rm`.
    pub fn blocklist_range_rm(&self, range: &Cidr) -> Result<()> {
        let cmd = format!(
            r#"{{"prefix": "osd blocklist", "range": "range", "blocklistop": "rm", "addr": "{}"}}"#,
            range.ceph_form()
        );
        match self.mon_command(&cmd, &[]) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(range_refused(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_blocks_are_parsed_and_refused_by_name() {
        let c = Cidr::parse("10.1.2.3/24").unwrap();
        assert!(c.contains("10.1.2.200".parse().unwrap()));
        assert!(!c.contains("10.1.3.1".parse().unwrap()));
        assert!(c.contains("::ffff:10.1.2.9".parse().unwrap()));
        assert_eq!(c.ceph_form(), "10.1.2.3:0/24");
        assert_eq!(
            Cidr::parse("fd00::/64").unwrap().ceph_form(),
            "[fd00::]:0/64"
        );
        for (bad, why) in [
            ("10.0.0.1", "no /prefix"),
            ("10.0.0.1/33", "longer than the address"),
            ("nope/8", "not an IPv4 or IPv6 address"),
            ("10.0.0.0/x", "not a number"),
        ] {
            let e = Cidr::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(why), "{bad}: {e}");
        }
    }
}
