//! `rbdkit`: the command line for operators (`rbdkit image ...`) and the
//! Kubernetes provisioner (`rbdkit provisioner ...`), and the node's
//! userspace mapper daemon (`rbdkit fuse-mapper ...`).

mod daemon_memory;

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
    // Every subcommand may hold a cephx key (a keyfile, a Secret, the
    // node-stage secrets, the mapper's keys): no core dump may carry it.
    if let Err(e) = rbdkit::rados::keep_keys_out_of_core_dumps() {
        eprintln!("rbdkit: warning: {e}");
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Image(args) => match rbdkit::cli::run_image(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rbdkit: {e}");
                ExitCode::FAILURE
            }
        },
        Command::FuseMapper(args) => {
            // Its data path allocates per I/O from many threads: it keeps
            // glibc's arenas. The start-up pages go, as in the control
            // daemons: A/B, supervisor 39.6 -> 18.7 MiB, worker with one
            // image attached and read 82.5 -> 71.1 MiB (bench/analysis.md).
            daemon_memory::release_startup_stack();
            daemon_memory::release_startup_code();
            match rbdkit::node::fuse_daemon::run(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("rbdkit: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Provisioner(args) => {
            daemon_memory::control_daemon();
            serve(rbdkit::provisioner::run(args))
        }
        Command::Csi(args) => {
            daemon_memory::control_daemon();
            serve(rbdkit::csi::run(args))
        }
        Command::Gc(args) => serve(rbdkit::cli::run_gc(args)),
        Command::Migrate(args) => serve(rbdkit::cli::run_migrate(args)),
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
