//! Live migration of an image to another pool, namespace or layout:
//! prepare, execute, commit (or abort), while clients keep using it.

use std::mem::size_of;

use rbd_sys as sys;

use crate::error::{cvt, Result};
use crate::rados::IoCtx;
use crate::rbd::options::ImageOptions;
use crate::util::{cstr, from_cstr};

/// Where a migration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrationState {
    /// State unknown.
    Unknown,
    /// It failed; see the description.
    Error,
    /// Being prepared.
    Preparing,
    /// Prepared: the target exists and links to the source.
    Prepared,
    /// Copying data.
    Executing,
    /// Data copied: ready to commit.
    Executed,
    /// Being aborted.
    Aborting,
}

/// The status of a migration, from `rbd_migration_status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationStatus {
    /// Source pool id.
    pub source_pool_id: i64,
    /// Source namespace.
    pub source_namespace: String,
    /// Source image name.
    pub source_image: String,
    /// Destination pool id.
    pub dest_pool_id: i64,
    /// Destination namespace.
    pub dest_namespace: String,
    /// Destination image name.
    pub dest_image: String,
    /// Where it stands.
    pub state: MigrationState,
    /// librbd's description of the state.
    pub description: String,
}

/// Prepares a migration of `image` to `dest_io`/`dest_name` with new
/// options. Clients must reopen the image afterwards. Wraps
/// `rbd_migration_prepare`.
pub fn migration_prepare(
    io: &IoCtx,
    image: &str,
    dest_io: &IoCtx,
    dest_name: &str,
    options: &ImageOptions,
) -> Result<()> {
    let object = io.object_spec(image);
    let i = cstr(image, "rbd_migration_prepare", "image name")?;
    let d = cstr(dest_name, "rbd_migration_prepare", "image name")?;
    let opts = options.to_raw("rbd_migration_prepare", &object)?;
    // SAFETY: both ioctxs are live; names are NUL-terminated; librbd only
    // reads `opts`.
    let ret = unsafe {
        sys::rbd_migration_prepare(io.raw(), i.as_ptr(), dest_io.raw(), d.as_ptr(), opts.0)
    };
    cvt(ret, "rbd_migration_prepare", || {
        format!("{object} -> {}", dest_io.object_spec(dest_name))
    })?;
    Ok(())
}

macro_rules! migration_step {
    ($(#[$doc:meta])* $name:ident, $c:ident) => {
        $(#[$doc])*
        pub fn $name(io: &IoCtx, image: &str) -> Result<()> {
            let i = cstr(image, stringify!($c), "image name")?;
            // SAFETY: the ioctx is live; `i` is NUL-terminated.
            let ret = unsafe { sys::$c(io.raw(), i.as_ptr()) };
            cvt(ret, stringify!($c), || io.object_spec(image))?;
            Ok(())
        }
    };
}

migration_step!(
    /// Copies the data of a prepared migration (`image` is the destination
    /// name). Wraps `rbd_migration_execute`.
    migration_execute,
    rbd_migration_execute
);
migration_step!(
    /// Finishes an executed migration and removes the source. Wraps
    /// `rbd_migration_commit`.
    migration_commit,
    rbd_migration_commit
);
migration_step!(
    /// Cancels a migration and restores the source. Wraps `rbd_migration_abort`.
    migration_abort,
    rbd_migration_abort
);

/// The status of the migration of `image` (source or destination name).
/// Wraps `rbd_migration_status`.
pub fn migration_status(io: &IoCtx, image: &str) -> Result<MigrationStatus> {
    let i = cstr(image, "rbd_migration_status", "image name")?;
    let mut st = sys::rbd_image_migration_status_t::default();
    // SAFETY: `st` is the header's struct and we pass its exact size; it is
    // cleaned below once filled.
    let ret = unsafe {
        sys::rbd_migration_status(
            io.raw(),
            i.as_ptr(),
            &mut st,
            size_of::<sys::rbd_image_migration_status_t>(),
        )
    };
    cvt(ret, "rbd_migration_status", || io.object_spec(image))?;
    // SAFETY: librbd filled every string of `st`.
    let out = unsafe {
        MigrationStatus {
            source_pool_id: st.source_pool_id,
            source_namespace: from_cstr(st.source_pool_namespace),
            source_image: from_cstr(st.source_image_name),
            dest_pool_id: st.dest_pool_id,
            dest_namespace: from_cstr(st.dest_pool_namespace),
            dest_image: from_cstr(st.dest_image_name),
            state: match st.state {
                sys::RBD_IMAGE_MIGRATION_STATE_ERROR => MigrationState::Error,
                sys::RBD_IMAGE_MIGRATION_STATE_PREPARING => MigrationState::Preparing,
                sys::RBD_IMAGE_MIGRATION_STATE_PREPARED => MigrationState::Prepared,
                sys::RBD_IMAGE_MIGRATION_STATE_EXECUTING => MigrationState::Executing,
                sys::RBD_IMAGE_MIGRATION_STATE_EXECUTED => MigrationState::Executed,
                sys::RBD_IMAGE_MIGRATION_STATE_ABORTING => MigrationState::Aborting,
                _ => MigrationState::Unknown,
            },
            description: from_cstr(st.state_description),
        }
    };
    // SAFETY: filled by rbd_migration_status, cleaned once.
    unsafe { sys::rbd_migration_status_cleanup(&mut st) };
    Ok(out)
}
