//! Control-path modes: the one-image lifecycle cycle, and concurrent
//! creates and removes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use rbdkit::rados::IoCtx;
use rbdkit::rbd::{self, Image, ImageOptions};

use crate::args::Args;
use crate::json::Object;
use crate::BoxError;

/// Operation names of one cycle, in order, as reported in the JSON.
const OPS: [&str; 6] = ["create", "open", "stat", "resize", "close", "remove"];

/// `control`: one untimed warm-up cycle, then `--cycles` timed cycles of
/// create → open → stat → resize (to twice the size) → close → remove,
/// one image at a time. Reports each operation's and each cycle's time in
/// milliseconds.
pub fn control(args: &Args, ioctx: &IoCtx, out: &mut Object) -> Result<(), BoxError> {
    let cycles: usize = args.num("cycles")?;
    let size: u64 = args.num("size")?;
    let prefix = args.get("prefix")?;
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(cycles); OPS.len() + 1];
    for i in 0..=cycles {
        let name = format!("{prefix}-{i}");
        let t = cycle(ioctx, &name, size)?;
        if i == 0 {
            continue; // warm-up
        }
        for (k, ms) in t.iter().enumerate() {
            times[k].push(*ms);
        }
        times[OPS.len()].push(t.iter().sum());
    }
    let mut ops = Object::new();
    for (k, op) in OPS.iter().enumerate() {
        ops.nums(op, &times[k]);
    }
    ops.nums("cycle", &times[OPS.len()]);
    out.obj("ops_ms", ops);
    Ok(())
}

/// One cycle; returns the milliseconds of each operation, in `OPS` order.
fn cycle(ioctx: &IoCtx, name: &str, size: u64) -> Result<[f64; 6], BoxError> {
    let mut t = [0.0; 6];
    let mut clock = Instant::now();
    let mut lap = |k: usize| {
        let now = Instant::now();
        t[k] = (now - clock).as_secs_f64() * 1e3;
        clock = now;
    };
    rbd::create(ioctx, name, size, &ImageOptions::new())?;
    lap(0);
    let image = Image::open(ioctx, name)?;
    lap(1);
    let info = image.stat()?;
    lap(2);
    image.resize(info.size * 2)?;
    lap(3);
    image.close()?;
    lap(4);
    rbd::remove(ioctx, name)?;
    lap(5);
    Ok(t)
}

/// `concurrency`: `--threads` threads share one ioctx and create `--images`
/// images between them (a shared counter hands out the names), then, once
/// all exist, remove them the same way. Reports both phases' wall time.
pub fn concurrency(args: &Args, ioctx: &IoCtx, out: &mut Object) -> Result<(), BoxError> {
    let threads: usize = args.num("threads")?;
    let images: usize = args.num("images")?;
    let size: u64 = args.num("size")?;
    let prefix = args.get("prefix")?;
    let opts = ImageOptions::new();
    let create_s = phase(threads, images, |i| {
        rbd::create(ioctx, &format!("{prefix}-{i}"), size, &opts)
    })?;
    let remove_s = phase(threads, images, |i| {
        rbd::remove(ioctx, &format!("{prefix}-{i}"))
    })?;
    out.num("threads", threads as f64);
    out.num("images", images as f64);
    out.num("create_s", create_s);
    out.num("remove_s", remove_s);
    Ok(())
}

/// Runs `op(0..count)` on `threads` scoped threads; returns the wall time
/// in seconds, or the first error.
fn phase<F>(threads: usize, count: usize, op: F) -> Result<f64, BoxError>
where
    F: Fn(usize) -> rbdkit::Result<()> + Sync,
{
    let next = AtomicUsize::new(0);
    let failure: Mutex<Option<rbdkit::Error>> = Mutex::new(None);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                if let Err(e) = op(i) {
                    failure
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                    next.store(count, Ordering::Relaxed);
                    break;
                }
            });
        }
    });
    let elapsed = t.elapsed().as_secs_f64();
    match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e.into()),
        None => Ok(elapsed),
    }
}
