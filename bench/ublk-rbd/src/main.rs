//! ublk-rbd: an RBD image served as a ublk block device (`/dev/ublkbN`)
//! through librbd's AIO, one queue, write-through. It exists to measure
//! what ublk would give rbdkit's userspace mapper beside FUSE + loop
//! (bench/profile/ublk_guest.py, issue 39): no restart recovery, no
//! journal, no encryption, so it is no mapper.
//!
//! ```text
//! ublk-rbd --conf CEPH_CONF --pool POOL --image IMAGE [--namespace NS]
//!          [--depth TAGS] [--max-io-kib KIB] [--set OPTION=VALUE]...
//! ```
//! prints the block device's path once it is live, serves it until
//! SIGTERM or SIGINT, then removes it and prints what it served.

mod ctrl;
mod queue;
mod sys;

use std::process::ExitCode;
use std::sync::Arc;

use rbdkit::rados::ConnectOptions;
use rbdkit::rbd::Image;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The command line.
#[derive(Debug)]
struct Args {
    conf: String,
    pool: String,
    namespace: String,
    image: String,
    depth: u16,
    max_io: u32,
    set: Vec<(String, String)>,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        conf: String::new(),
        pool: String::new(),
        namespace: String::new(),
        image: String::new(),
        depth: 64,
        max_io: 1 << 20,
        set: Vec::new(),
    };
    while let Some(flag) = it.next() {
        let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--conf" => a.conf = v,
            "--pool" => a.pool = v,
            "--namespace" => a.namespace = v,
            "--image" => a.image = v,
            "--depth" => {
                a.depth = v
                    .parse()
                    .ok()
                    .filter(|d| (1..=4096).contains(d))
                    .ok_or("--depth: 1 to 4096")?
            }
            "--max-io-kib" => {
                let k: u32 = v
                    .parse()
                    .ok()
                    .filter(|k| (4..=4096).contains(k))
                    .ok_or("--max-io-kib: 4 to 4096")?;
                a.max_io = k << 10;
            }
            "--set" => {
                let (k, val) = v.split_once('=').ok_or("--set takes OPTION=VALUE")?;
                a.set.push((k.into(), val.into()));
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.conf.is_empty() || a.pool.is_empty() || a.image.is_empty() {
        return Err("--conf, --pool and --image are required".into());
    }
    Ok(a)
}

/// Blocks SIGTERM and SIGINT in this thread and every thread it starts
/// (librbd's included), so that `wait_signal` takes them.
fn block_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset on a zeroed local set, then
    // pthread_sigmask with valid pointers; all return codes are of no use
    // here (the set and signals are valid).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_signal(set: &libc::sigset_t) {
    let mut sig = 0;
    // SAFETY: sigwait(3) with a valid set and out-pointer.
    unsafe { libc::sigwait(set, &mut sig) };
}

fn run(a: Args) -> Result<(), BoxError> {
    let signals = block_signals();
    let mut opts = ConnectOptions::new()
        .conf_file(&a.conf)
        .set("rbd_cache", "false");
    for (k, v) in &a.set {
        opts = opts.set(k.clone(), v.clone());
    }
    let cluster = opts.connect()?;
    let ioctx = cluster.ioctx_ns(&a.pool, &a.namespace)?;
    let image = Arc::new(Image::open(&ioctx, &a.image)?);
    let size = image.size()?;

    let mut ctl = ctrl::Control::open()?;
    let id = ctl.add(a.depth, a.max_io)?;
    ctl.set_params(id, size, a.max_io)?;
    let (depth, max_io) = (a.depth, a.max_io as usize);
    let q = match queue::Queue::open(id, depth, max_io, Arc::clone(&image)) {
        Ok(q) => q,
        Err(e) => {
            let _ = ctl.del(id);
            return Err(e.into());
        }
    };
    let server = std::thread::spawn(move || q.serve());
    if let Err(e) = ctl.start(id) {
        let _ = ctl.del(id);
        return Err(e.into());
    }
    println!("/dev/ublkb{id}");
    wait_signal(&signals);
    ctl.stop(id)?;
    let stats = server.join().map_err(|_| "the queue thread panicked")??;
    ctl.del(id)?;
    eprintln!(
        "ublk-rbd: served {} requests, {} failed",
        stats.requests, stats.errors
    );
    Ok(())
}

fn main() -> ExitCode {
    let a = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ublk-rbd: {e}");
            return ExitCode::from(2);
        }
    };
    match run(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ublk-rbd: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    fn args(s: &str) -> impl Iterator<Item = String> + '_ {
        s.split_whitespace().map(str::to_owned)
    }

    #[test]
    fn flags_are_parsed_and_bad_ones_named() {
        let a = parse(args(
            "--conf c --pool p --image i --depth 16 --set rbd_cache=true",
        ))
        .unwrap();
        assert_eq!((a.depth, a.max_io), (16, 1 << 20));
        assert_eq!(a.set, vec![("rbd_cache".into(), "true".into())]);
        assert!(parse(args("--conf c --pool p"))
            .unwrap_err()
            .contains("--image"));
        assert!(parse(args("--conf c --pool p --image i --depth 0"))
            .unwrap_err()
            .contains("--depth"));
        assert!(parse(args("--bogus x")).unwrap_err().contains("--bogus"));
    }
}
