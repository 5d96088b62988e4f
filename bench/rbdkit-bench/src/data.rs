//! Data-path mode: one workload (sequential or random, read or write, one
//! block size, one queue depth) against an existing image.
//!
//! The offsets are the same in every contender: op `i` of a sequential
//! workload is at block `i mod blocks`; of a random one at block
//! `splitmix64(i) mod blocks`, where `blocks = image size / block size`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use rbdkit::rados::IoCtx;
use rbdkit::rbd::Image;

use crate::args::Args;
use crate::json::Object;
use crate::BoxError;

/// What one data run does.
#[derive(Debug, Clone, Copy)]
struct Workload {
    write: bool,
    random: bool,
    bs: usize,
    qd: usize,
    ops: u64,
    blocks: u64,
}

impl Workload {
    /// Byte offset of op `i`.
    fn offset(&self, i: u64) -> u64 {
        let block = if self.random {
            splitmix64(i) % self.blocks
        } else {
            i % self.blocks
        };
        block * self.bs as u64
    }
}

/// The splitmix64 mixer: a stateless, well-spread hash of the op number.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The bytes every write sends: a fixed non-zero pattern.
fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) % 251 + 1) as u8)
        .collect()
}

/// `data`: opens `--image` and flushes it (untimed, like `rbd bench`), runs
/// `--ops` operations of `--workload`
/// (`seqwrite`, `seqread`, `randwrite`, `randread`) of `--bs` bytes with
/// `--qd` in flight, flushes after writes, and reports the time from the
/// first submission to the last completion (flush included).
///
/// `--engine aio` (the default) keeps `qd` AIO futures in flight from one
/// thread; `--engine sync` runs `qd` threads doing blocking calls on the
/// shared image, which is what a synchronous binding (go-ceph) must do.
pub fn data(args: &Args, ioctx: &IoCtx, out: &mut Object) -> Result<(), BoxError> {
    let image = Image::open(ioctx, args.get("image")?)?;
    // `--luks-passphrase-file`: librbd's own LUKS2 data path
    // (rbd_encryption_load), which `rbd bench` of no release offers.
    let luks = args.get_or("luks-passphrase-file", "");
    if !luks.is_empty() {
        let pass = std::fs::read(luks)?;
        image.encryption_load(rbdkit::rbd::EncryptionFormat::Luks2, &pass)?;
    }
    // As `rbd bench` does before it starts: a first flush switches librbd's
    // cache from write-through to write-back (rbd_cache_writethrough_until_flush).
    image.flush()?;
    let size = image.size()?;
    let name = args.get("workload")?;
    let (write, random) = match name {
        "seqwrite" => (true, false),
        "seqread" => (false, false),
        "randwrite" => (true, true),
        "randread" => (false, true),
        other => return Err(format!("unknown workload {other:?}").into()),
    };
    let bs: usize = args.num("bs")?;
    let blocks = size / bs as u64;
    if bs == 0 || blocks == 0 {
        return Err(format!("block size {bs} does not fit the image ({size} bytes)").into());
    }
    let w = Workload {
        write,
        random,
        bs,
        qd: args.num("qd")?,
        ops: args.num("ops")?,
        blocks,
    };
    let engine = args.get_or("engine", "aio");
    let elapsed = match engine {
        "aio" => run_aio(&image, &w)?,
        "sync" => run_sync(&image, &w)?,
        other => return Err(format!("unknown engine {other:?}").into()),
    };
    image.close()?;
    out.str("engine", engine);
    out.str("workload", name);
    out.num("bs", bs as f64);
    out.num("qd", w.qd as f64);
    out.num("ops", w.ops as f64);
    out.num("elapsed_s", elapsed);
    out.num("iops", w.ops as f64 / elapsed);
    out.num(
        "mib_s",
        (w.ops * bs as u64) as f64 / elapsed / (1u64 << 20) as f64,
    );
    Ok(())
}

/// `qd` threads, each taking the next op number from a shared counter and
/// making one blocking call at a time on the shared image.
fn run_sync(image: &Image, w: &Workload) -> Result<f64, BoxError> {
    let next = AtomicU64::new(0);
    let failure: Mutex<Option<rbdkit::Error>> = Mutex::new(None);
    let data = pattern(w.bs);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..w.qd.max(1) {
            s.spawn(|| {
                let mut buf = vec![0u8; w.bs];
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= w.ops {
                        break;
                    }
                    let off = w.offset(i);
                    let r = if w.write {
                        image.write(off, &data)
                    } else {
                        image.read(off, &mut buf).map(|_| ())
                    };
                    if let Err(e) = r {
                        failure
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                        next.store(w.ops, Ordering::Relaxed);
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e.into());
    }
    if w.write {
        image.flush()?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// `qd` AIO futures in flight from this one thread.
fn run_aio(image: &Image, w: &Workload) -> Result<f64, BoxError> {
    use std::cell::RefCell;

    use crate::exec::{block_on, run_queue};
    let data = pattern(w.bs);
    // One shared buffer feeds every write: no copy per request.
    let shared: std::sync::Arc<[u8]> = data.clone().into();
    // Read buffers go round: aio_read_into hands each back when it completes.
    let spare: RefCell<Vec<Vec<u8>>> = RefCell::new((0..w.qd).map(|_| vec![0; w.bs]).collect());
    let t = Instant::now();
    if w.write {
        run_queue(
            w.qd,
            w.ops,
            |i| image.aio_write_shared(w.offset(i), std::sync::Arc::clone(&shared)),
            drop,
        )?;
        block_on(image.aio_flush())?;
    } else {
        run_queue(
            w.qd,
            w.ops,
            |i| {
                let buf = spare.borrow_mut().pop().unwrap_or_else(|| vec![0; w.bs]);
                image.aio_read_into(w.offset(i), buf)
            },
            |mut buf| {
                buf.resize(w.bs, 0);
                spare.borrow_mut().push(buf);
            },
        )?;
    }
    Ok(t.elapsed().as_secs_f64())
}
