//! The `rbdkit image ...` command line: a thin layer over the library, for
//! operators and benchmarks.
//!
//! Images are named as `rbd` names them, `pool[/namespace]/image`, snapshots
//! as `pool[/namespace]/image@snap`. Connection flags follow `rbd`:
//! `CEPH_CONF`, `-c/--conf`, `-m/--mon-host`, `--id`, `--keyring`.

use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use clap::{Args, Subcommand};
use serde_json::json;

use crate::error::{Error, ErrorKind, Result};
use crate::rados::{Cluster, ConnectOptions, IoCtx, Secret};
use crate::rbd::{self, Features, Image, ImageOptions};

pub mod encryption;
pub mod gc;
pub use gc::{run_gc, GcArgs};
pub mod migrate;
pub use migrate::{run_migrate, MigrateArgs};

/// How to reach the cluster, shared by every subcommand.
#[derive(Debug, Clone, Args)]
pub struct ConnectArgs {
    /// ceph.conf to read (default: $CEPH_CONF, then /etc/ceph/ceph.conf).
    #[arg(short = 'c', long = "conf", global = true, env = "CEPH_CONF")]
    pub conf: Option<PathBuf>,
    /// Monitor addresses, comma-separated; with no conf file, the only way in.
    #[arg(short = 'm', long = "mon-host", global = true)]
    pub mon_host: Option<String>,
    /// cephx user id, without `client.`.
    #[arg(long = "id", global = true, default_value = "admin")]
    pub id: String,
    /// Keyring file holding the user's key.
    #[arg(long = "keyring", global = true)]
    pub keyring: Option<PathBuf>,
    /// File holding only the user's key (kept off the command line).
    #[arg(long = "keyfile", global = true)]
    pub keyfile: Option<PathBuf>,
    /// Bound on connecting and on each cluster operation, e.g. `30s`.
    #[arg(long = "timeout", global = true, default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl ConnectArgs {
    /// Connects as these arguments say.
    pub fn connect(&self) -> Result<Cluster> {
        let mut o = ConnectOptions::new()
            .user(&self.id)
            .connect_timeout(self.timeout)
            .op_timeout(self.timeout);
        if let Some(c) = &self.conf {
            o = o.conf_file(c);
        }
        if let Some(m) = &self.mon_host {
            o = o.mon_host(m);
        }
        if let Some(k) = &self.keyring {
            o = o.keyring(k);
        }
        if let Some(f) = &self.keyfile {
            o = o.key(read_keyfile(f)?);
        }
        o.connect()
    }
}

/// The cephx key in `--keyfile` FILE (surrounding white space trimmed).
pub(crate) fn read_keyfile(f: &std::path::Path) -> Result<Secret> {
    let key = std::fs::read_to_string(f)
        .map_err(|e| Error::invalid("read keyfile", f.display().to_string(), e.to_string()))?;
    Ok(Secret::new(key.trim()))
}

/// `rbdkit image ...`.
#[derive(Debug, Args)]
pub struct ImageArgs {
    /// Connection flags.
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: ImageCommand,
}

/// The image subcommands.
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Create an image.
    Create {
        /// `pool[/namespace]/image`.
        spec: String,
        /// Size: bytes with a unit (`10G`, `512M`, `4096K`, `1T`); a plain number is MiB, as in `rbd`.
        #[arg(short, long)]
        size: String,
        /// Features, comma-separated (`layering,exclusive-lock,object-map,fast-diff,deep-flatten`).
        #[arg(long)]
        features: Option<String>,
        /// Object size, a power of two from 4K to 64M (`4M`).
        #[arg(long)]
        object_size: Option<String>,
        /// Stripe unit (needs --stripe-count).
        #[arg(long, requires = "stripe_count")]
        stripe_unit: Option<String>,
        /// Stripe count (needs --stripe-unit).
        #[arg(long, requires = "stripe_unit")]
        stripe_count: Option<u64>,
        /// Pool for the data objects.
        #[arg(long)]
        data_pool: Option<String>,
    },
    /// List the images of a pool or `pool/namespace`.
    Ls {
        /// `pool` or `pool/namespace`.
        pool: String,
    },
    /// Show an image's size, layout, features and snapshots.
    Info {
        /// `pool[/namespace]/image`.
        spec: String,
    },
    /// Grow an image (shrinking needs --allow-shrink).
    Resize {
        /// `pool[/namespace]/image`.
        spec: String,
        /// New size, as for `create`.
        #[arg(short, long)]
        size: String,
        /// Allow the new size to be smaller: data past it is lost.
        #[arg(long)]
        allow_shrink: bool,
    },
    /// Remove an image.
    Rm {
        /// `pool[/namespace]/image`.
        spec: String,
    },
    /// Snapshots.
    #[command(subcommand)]
    Snap(SnapCommand),
    /// Encrypted volumes: status and passphrase rotation.
    #[command(subcommand)]
    Encryption(encryption::EncryptionCommand),
}

/// The snapshot subcommands.
#[derive(Debug, Subcommand)]
pub enum SnapCommand {
    /// Create a snapshot: `pool[/ns]/image@snap`.
    Create {
        /// `pool[/namespace]/image@snap`.
        spec: String,
    },
    /// List an image's snapshots.
    Ls {
        /// `pool[/namespace]/image`.
        spec: String,
    },
    /// Remove a snapshot.
    Rm {
        /// `pool[/namespace]/image@snap`.
        spec: String,
    },
    /// Protect a snapshot so it can be cloned.
    Protect {
        /// `pool[/namespace]/image@snap`.
        spec: String,
    },
    /// Unprotect a snapshot.
    Unprotect {
        /// `pool[/namespace]/image@snap`.
        spec: String,
    },
    /// Roll the image back to a snapshot.
    Rollback {
        /// `pool[/namespace]/image@snap`.
        spec: String,
    },
}

/// An image (or snapshot) named `pool[/namespace]/image[@snap]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpec {
    /// Pool.
    pub pool: String,
    /// Rados namespace ("" for the default).
    pub namespace: String,
    /// Image name.
    pub image: String,
    /// Snapshot, if one was named.
    pub snap: Option<String>,
}

impl ImageSpec {
    /// Parses `pool[/namespace]/image[@snap]`.
    pub fn parse(s: &str) -> Result<ImageSpec> {
        let bad = |why: &str| {
            Error::invalid(
                "parse image spec",
                s,
                format!("{s:?} {why}; expected pool[/namespace]/image[@snap]"),
            )
        };
        let (path, snap) = match s.split_once('@') {
            Some((p, snap)) if !snap.is_empty() => (p, Some(snap.to_owned())),
            Some(_) => return Err(bad("has an empty snapshot name")),
            None => (s, None),
        };
        let parts: Vec<&str> = path.split('/').collect();
        let (pool, namespace, image) = match parts.as_slice() {
            [p, i] => (*p, "", *i),
            [p, n, i] => (*p, *n, *i),
            [_] => return Err(bad("names no pool")),
            _ => return Err(bad("has too many '/'")),
        };
        if pool.is_empty() || image.is_empty() {
            return Err(bad("has an empty pool or image name"));
        }
        Ok(ImageSpec {
            pool: pool.to_owned(),
            namespace: namespace.to_owned(),
            image: image.to_owned(),
            snap,
        })
    }

    fn need_snap(&self) -> Result<&str> {
        self.snap.as_deref().ok_or_else(|| {
            Error::invalid(
                "parse image spec",
                self.to_string(),
                "a snapshot is needed: pool[/namespace]/image@snap",
            )
        })
    }

    fn no_snap(&self) -> Result<()> {
        match &self.snap {
            Some(_) => Err(Error::invalid(
                "parse image spec",
                self.to_string(),
                "this command takes an image, not a snapshot",
            )),
            None => Ok(()),
        }
    }

    fn ioctx(&self, c: &Cluster) -> Result<IoCtx> {
        c.ioctx_ns(&self.pool, &self.namespace)
    }
}

impl std::fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.pool)?;
        if !self.namespace.is_empty() {
            write!(f, "/{}", self.namespace)?;
        }
        write!(f, "/{}", self.image)?;
        if let Some(s) = &self.snap {
            write!(f, "@{s}")?;
        }
        Ok(())
    }
}

/// Parses a size such as `10G`, `512M`, `4096K`, `1T`, `1GiB` or `123B`;
/// a plain number is MiB, as in `rbd`.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || {
        Error::invalid(
            "parse size",
            s,
            format!("size {s:?} is not a number with an optional unit (B, K, M, G, T)"),
        )
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" if unit.trim().eq_ignore_ascii_case("b") => 0,
        "" => 20,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        "P" => 50,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| Error::invalid("parse size", s, format!("size {s:?} is too large")))
}

/// Runs an image subcommand and prints its output.
pub fn run_image(args: ImageArgs) -> Result<()> {
    let json = args.json;
    match args.command {
        ImageCommand::Ls { pool } => {
            let (pool, ns) = pool.split_once('/').unwrap_or((pool.as_str(), ""));
            let c = args.connect.connect()?;
            let io = c.ioctx_ns(pool, ns)?;
            let names = rbd::list_names(&io)?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string(&names).expect("strings serialise")
                );
            } else {
                for n in names {
                    println!("{n}");
                }
            }
        }
        ImageCommand::Create {
            spec,
            size,
            features,
            object_size,
            stripe_unit,
            stripe_count,
            data_pool,
        } => {
            let spec = ImageSpec::parse(&spec)?;
            spec.no_snap()?;
            // Validate everything before connecting, so bad input creates nothing.
            let size = parse_size(&size)?;
            let mut opts = ImageOptions::new();
            if let Some(f) = features {
                let f: Features = f.parse()?;
                f.check_dependencies()
                    .map_err(|why| Error::invalid("rbd_create4", spec.to_string(), why))?;
                opts = opts.features(f);
            }
            if let Some(o) = object_size {
                opts = opts.object_size(parse_size_bytes(&o)?)?;
            }
            if let (Some(u), Some(c)) = (stripe_unit, stripe_count) {
                opts = opts.striping(parse_size_bytes(&u)?, c)?;
            }
            if let Some(p) = data_pool {
                opts = opts.data_pool(p);
            }
            let c = args.connect.connect()?;
            rbd::create(&spec.ioctx(&c)?, &spec.image, size, &opts)?;
            if json {
                println!("{}", json!({"name": spec.image, "size": size}));
            }
        }
        ImageCommand::Info { spec } => {
            let spec = ImageSpec::parse(&spec)?;
            let c = args.connect.connect()?;
            let io = spec.ioctx(&c)?;
            let img = match &spec.snap {
                Some(s) => Image::open_snapshot(&io, &spec.image, s)?,
                None => Image::open_read_only(&io, &spec.image)?,
            };
            print_info(&spec, &img, json)?;
        }
        ImageCommand::Resize {
            spec,
            size,
            allow_shrink,
        } => {
            let spec = ImageSpec::parse(&spec)?;
            spec.no_snap()?;
            let size = parse_size(&size)?;
            let c = args.connect.connect()?;
            let img = Image::open(&spec.ioctx(&c)?, &spec.image)?;
            if allow_shrink {
                img.resize_allow_shrink(size)?;
            } else {
                let current = img.size()?;
                img.resize(size).map_err(|e| match e.kind() {
                    ErrorKind::ShrinkRefused => e.detail(format!(
                        "new size {size} is smaller than the current size {current}; pass --allow-shrink to shrink (data past the new end is lost)"
                    )),
                    _ => e,
                })?;
            }
            img.close()?;
            if json {
                println!("{}", json!({"name": spec.image, "size": size}));
            }
        }
        ImageCommand::Rm { spec } => {
            let spec = ImageSpec::parse(&spec)?;
            spec.no_snap()?;
            let c = args.connect.connect()?;
            rbd::remove(&spec.ioctx(&c)?, &spec.image)?;
        }
        ImageCommand::Snap(cmd) => run_snap(&args.connect, cmd, json)?,
        ImageCommand::Encryption(cmd) => encryption::run(&args.connect, cmd, json)?,
    }
    Ok(())
}

fn parse_size_bytes(s: &str) -> Result<u64> {
    // For object sizes and stripe units a plain number is bytes.
    if s.chars().all(|c| c.is_ascii_digit()) {
        return s
            .parse()
            .map_err(|_| Error::invalid("parse size", s, "not a number"));
    }
    parse_size(s)
}

fn run_snap(connect: &ConnectArgs, cmd: SnapCommand, json: bool) -> Result<()> {
    let (spec, action) = match &cmd {
        SnapCommand::Create { spec } => (spec, "create"),
        SnapCommand::Ls { spec } => (spec, "ls"),
        SnapCommand::Rm { spec } => (spec, "rm"),
        SnapCommand::Protect { spec } => (spec, "protect"),
        SnapCommand::Unprotect { spec } => (spec, "unprotect"),
        SnapCommand::Rollback { spec } => (spec, "rollback"),
    };
    let spec = ImageSpec::parse(spec)?;
    let snap = if action == "ls" {
        spec.no_snap()?;
        ""
    } else {
        spec.need_snap()?
    };
    let c = connect.connect()?;
    let img = Image::open(&spec.ioctx(&c)?, &spec.image)?;
    match cmd {
        SnapCommand::Create { .. } => img.snap_create(snap)?,
        SnapCommand::Rm { .. } => img.snap_remove(snap)?,
        SnapCommand::Protect { .. } => img.snap_protect(snap)?,
        SnapCommand::Unprotect { .. } => img.snap_unprotect(snap)?,
        SnapCommand::Rollback { .. } => img.snap_rollback(snap)?,
        SnapCommand::Ls { .. } => {
            let snaps = img.snap_list()?;
            if json {
                let list: Vec<_> = snaps
                    .iter()
                    .map(|s| {
                        let protected = img.snap_is_protected(&s.name).unwrap_or(false);
                        json!({"id": s.id, "name": s.name, "size": s.size, "protected": protected})
                    })
                    .collect();
                println!("{}", serde_json::Value::Array(list));
            } else {
                println!("{:>6}  {:<24} {:>14}", "SNAPID", "NAME", "SIZE");
                for s in snaps {
                    println!("{:>6}  {:<24} {:>14}", s.id, s.name, human(s.size));
                }
            }
        }
    }
    img.close()
}

fn print_info(spec: &ImageSpec, img: &Image, json: bool) -> Result<()> {
    let info = img.stat()?;
    let features = img.features()?;
    let snaps = img.snap_list()?;
    let id = img.id()?;
    let created = img
        .create_timestamp()?
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let parent = img.parent()?;
    if json {
        let v = json!({
            "name": spec.image,
            "pool": spec.pool,
            "namespace": spec.namespace,
            "id": id,
            "size": info.size,
            "object_size": info.object_size,
            "order": info.order,
            "objects": info.num_objs,
            "block_name_prefix": info.block_name_prefix,
            "features": features.names(),
            "snapshot_count": snaps.len(),
            "stripe_unit": img.stripe_unit()?,
            "stripe_count": img.stripe_count()?,
            "create_timestamp": created,
            "parent": parent.map(|p| format!("{}/{}@{}", p.image.pool_name, p.image.image_name, p.snap_name)),
        });
        println!("{v}");
    } else {
        println!("rbd image '{}':", spec.image);
        println!("\tsize {} in {} objects", human(info.size), info.num_objs);
        println!(
            "\torder {} ({} objects)",
            info.order,
            human(info.object_size)
        );
        println!("\tsnapshot_count: {}", snaps.len());
        println!("\tid: {id}");
        println!("\tblock_name_prefix: {}", info.block_name_prefix);
        println!("\tfeatures: {}", features.names().join(", "));
        println!("\tcreate_timestamp: {created}");
        if let Some(p) = parent {
            println!(
                "\tparent: {}/{}@{}",
                p.image.pool_name, p.image.image_name, p.snap_name
            );
        }
    }
    Ok(())
}

/// `1073741824` → `1 GiB`, for text output.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let s = ImageSpec::parse("rbd/ns/img@snap").unwrap();
        assert_eq!(
            (s.pool.as_str(), s.namespace.as_str(), s.image.as_str()),
            ("rbd", "ns", "img")
        );
        assert_eq!(s.snap.as_deref(), Some("snap"));
        assert_eq!(s.to_string(), "rbd/ns/img@snap");
        let s = ImageSpec::parse("rbd/img").unwrap();
        assert_eq!(s.namespace, "");
        assert!(ImageSpec::parse("img")
            .unwrap_err()
            .to_string()
            .contains("names no pool"));
        assert!(ImageSpec::parse("a/b/c/d").is_err());
        assert!(ImageSpec::parse("rbd/").is_err());
        assert!(ImageSpec::parse("rbd/img@").is_err());
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(
            parse_size("100").unwrap(),
            100 << 20,
            "plain numbers are MiB"
        );
        assert_eq!(parse_size("4096B").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("1X").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(parse_size_bytes("65536").unwrap(), 65536);
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(1536), "1.5 KiB");
    }
}
