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
        Command::FuseMapper(args) => {
            // Its data path allocates per I/O from many threads: it keeps
            // glibc's arenas.
            release_startup_stack();
            match rbdkit::node::fuse_daemon::run(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("rbdkit: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Provisioner(args) => {
            control_daemon_memory();
            serve(rbdkit::provisioner::run(args))
        }
        Command::Csi(args) => {
            control_daemon_memory();
            serve(rbdkit::csi::run(args))
        }
        Command::Gc(args) => serve(rbdkit::cli::run_gc(args)),
        Command::Migrate(args) => serve(rbdkit::cli::run_migrate(args)),
    }
}

/// Shapes a control-path daemon's memory (the provisioner, the CSI
/// driver): one glibc malloc arena, and the start-up part of the main
/// thread's stack returned to the kernel.
///
/// By default glibc gives threads arenas of their own (up to 16 here), and
/// each arena's free pages stay resident. These daemons' threads (runtime,
/// Ceph pool, librados) allocate little, so sharing one arena costs no
/// measurable time and leaves less memory stranded (bench/analysis.md,
/// section 5).
fn control_daemon_memory() {
    // SAFETY: mallopt(3) (glibc) may be called at any time with any value;
    // M_ARENA_MAX only limits how many arenas later allocations create, and
    // on failure (return 0) the defaults stay.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    release_startup_stack();
}

/// Returns to the kernel the pages of the main thread's stack that start-up
/// used and nothing uses now. librados's static initializers build Ceph's
/// table of some 2000 options on this stack before `main` runs: about 1 MiB
/// that would otherwise stay resident for the life of the daemon.
fn release_startup_stack() {
    const PAGE: usize = 4096;
    // Room for this function's own calls below the current frame.
    const MARGIN: usize = 64 * 1024;
    let marker = 0u8;
    let here = std::hint::black_box(&marker) as *const u8 as usize;
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return;
    };
    let Some(low) = maps
        .lines()
        .find(|l| l.ends_with("[stack]"))
        .and_then(|l| l.split('-').next())
        .and_then(|a| usize::from_str_radix(a, 16).ok())
    else {
        return;
    };
    let end = here.saturating_sub(MARGIN) & !(PAGE - 1);
    if end <= low {
        return;
    }
    // SAFETY: [low, end) is the part of the main thread's stack mapping
    // ("[stack]" in /proc/self/maps) below this frame minus a margin, and
    // this is the main thread: nothing live is stored below the stack
    // pointer (past the 128-byte red zone), and no other thread uses this
    // stack. madvise(2) MADV_DONTNEED on private anonymous memory only makes
    // the next touch of each page a fresh zero-filled one, which is what an
    // unused stack page is.
    unsafe {
        libc::madvise(low as *mut libc::c_void, end - low, libc::MADV_DONTNEED);
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
