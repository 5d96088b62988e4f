//! `rbdkit`: the command line for operators (`rbdkit image ...`) and the
//! Kubernetes provisioner (`rbdkit provisioner ...`), and the node's
//! userspace mapper daemon (`rbdkit fuse-mapper ...`).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Ceph RBD in process: image operations and the Kubernetes provisioner.
#[derive(Debug, Parser)]
#[command(name = "rbdkit", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up, so the size difference between variants is moot.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Create, list, inspect, resize and remove images and snapshots.
    Image(rbdkit::cli::ImageArgs),
    /// Run the Kubernetes provisioner (PVC -> RBD image -> PV).
    Provisioner(rbdkit::provisioner::ProvisionerArgs),
    /// Run the CSI driver (Identity, Controller and Node services).
    Csi(rbdkit::csi::CsiArgs),
    /// Run the rbdkit-fuse mapper daemon (RBD images as loop devices over FUSE).
    FuseMapper(rbdkit::node::fuse_daemon::FuseMapperArgs),
    /// List (and with --apply remove) the images a provisioner left behind.
    Gc(rbdkit::cli::GcArgs),
    /// Turn PVs of the old RBD provisioners (rbd-provisioner, in-tree, rook
    /// flex) into rbdkit CSI PVs on the same images (a dry run unless --apply).
    Migrate(rbdkit::cli::MigrateArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Image(args) => match rbdkit::cli::run_image(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rbdkit: {e}");
                ExitCode::FAILURE
            }
        },
        Command::FuseMapper(args) => match rbdkit::node::fuse_daemon::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rbdkit: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Provisioner(args) => {
            few_malloc_arenas();
            serve_on(provisioner_runtime(), rbdkit::provisioner::run(args))
        }
        Command::Csi(args) => serve(rbdkit::csi::run(args)),
        Command::Gc(args) => serve(rbdkit::cli::run_gc(args)),
        Command::Migrate(args) => serve(rbdkit::cli::run_migrate(args)),
    }
}

/// Caps glibc's malloc arenas at two (`mallopt(M_ARENA_MAX)`). The
/// provisioner has some 25 threads (runtime, Ceph pool, librados), and by
/// default each may get an arena of its own whose free pages stay resident;
/// its allocations are small and rare, so the lock contention of fewer
/// arenas costs nothing measurable, and peak RSS drops.
fn few_malloc_arenas() {
    // SAFETY: mallopt(3) (glibc) may be called at any time with any value;
    // M_ARENA_MAX only limits how many arenas later allocations create, and
    // on failure (return 0) the defaults stay.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    // A fixed threshold (glibc's default, which it otherwise raises to the
    // largest block freed) keeps the big transient buffers of a burst (LIST
    // pages, watch batches) in mmaps returned on free, not in the heap.
    // SAFETY: as above, mallopt(3) accepts any value at any time; a failure
    // leaves the dynamic threshold.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// The provisioner's runtime: its tasks only wait on the API server (Ceph
/// calls run on its own `--ceph-threads` pool), so a worker per core of a big
/// node would only add stacks and per-thread caches; and tokio's blocking
/// pool, which it uses only for DNS lookups, file reads, monitor probes and
/// closing Ceph connections (all bounded in time), would otherwise grow to
/// 512 threads under a burst of those.
fn provisioner_runtime() -> tokio::runtime::Builder {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(cores.min(4)).max_blocking_threads(32);
    b
}

/// Runs a long-lived service on a multi-threaded runtime.
fn serve(fut: impl std::future::Future<Output = anyhow::Result<()>>) -> ExitCode {
    serve_on(tokio::runtime::Builder::new_multi_thread(), fut)
}

/// Runs a long-lived service on a runtime built from `builder`.
fn serve_on(
    mut builder: tokio::runtime::Builder,
    fut: impl std::future::Future<Output = anyhow::Result<()>>,
) -> ExitCode {
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rbdkit: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rbdkit: {e:#}");
            ExitCode::FAILURE
        }
    }
}
