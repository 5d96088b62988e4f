//! rbdkit's contender in the side-by-side benchmarks driven by `bench/run`.
//!
//! One process runs one measurement and prints one JSON object on stdout;
//! the driver starts a fresh process per round so that every contender's
//! peak RSS is its own. The command line is the same for all contenders
//! (rbdkit, go-ceph, Python):
//!
//! ```text
//! rbdkit-bench control     --conf C --pool P --prefix X --cycles N --size B
//! rbdkit-bench concurrency --conf C --pool P --prefix X --threads T --images M --size B
//! rbdkit-bench data        --conf C --pool P --image I --workload W --bs B --qd Q --ops N
//!                          [--engine aio|sync] [--luks-passphrase-file F]
//! ```
//!
//! See `bench/README.md` for what each mode measures.

mod args;
mod control;
mod data;
mod exec;
mod json;

use std::process::ExitCode;
use std::time::Instant;

use rbdkit::rados::{ConnectOptions, IoCtx};

use crate::args::Args;

fn main() -> ExitCode {
    match run() {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rbdkit-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Boxed error for the top level: library errors and usage errors alike.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn run() -> Result<String, BoxError> {
    let mut argv = std::env::args().skip(1);
    let mode = argv
        .next()
        .ok_or("usage: rbdkit-bench control|concurrency|data --conf C ...")?;
    let args = Args::parse(argv)?;
    let t = Instant::now();
    let (ioctx, connect_ms) = connect(&args)?;
    let mut out = json::Object::new();
    out.str("contender", "rbdkit");
    out.str("mode", &mode);
    out.num("connect_ms", connect_ms);
    match mode.as_str() {
        "control" => control::control(&args, &ioctx, &mut out)?,
        "concurrency" => control::concurrency(&args, &ioctx, &mut out)?,
        "data" => data::data(&args, &ioctx, &mut out)?,
        other => return Err(format!("unknown mode {other:?}").into()),
    }
    out.num("total_s", t.elapsed().as_secs_f64());
    Ok(out.finish())
}

/// Connects to the cluster named by `--conf` and opens `--pool`; returns the
/// ioctx and how long connecting took, in milliseconds.
fn connect(args: &Args) -> Result<(IoCtx, f64), BoxError> {
    let t = Instant::now();
    let cluster = ConnectOptions::new()
        .conf_file(args.get("conf")?)
        .connect()?;
    let ioctx = cluster.ioctx(args.get("pool")?)?;
    Ok((ioctx, t.elapsed().as_secs_f64() * 1e3))
}
