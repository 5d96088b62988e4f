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
            serve(rbdkit::provisioner::run(args))
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
}

/// Runs a long-lived service on a multi-threaded runtime.
fn serve(fut: impl std::future::Future<Output = anyhow::Result<()>>) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
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
