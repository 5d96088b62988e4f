//! Images: create, list, open, stat, resize, rename, remove, copy, flatten,
//! features and disk usage.

use std::fmt;
use std::ptr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rbd_sys as sys;

use crate::error::{cvt, Error, ErrorKind, Result};
use crate::rados::IoCtx;
use crate::rbd::options::ImageOptions;
use crate::rbd::Features;
use crate::util::{
    cstr, fill_array, from_cstr, no_progress, sized_buffer, string_from_buf, with_growing_buffer,
};

/// Creates an image of `size` bytes. Wraps `rbd_create4`.
///
/// Fails with [`ErrorKind::AlreadyExists`] if the name is taken; nothing is
/// changed then. A zero size is allowed (librbd allows it).
pub fn create(ioctx: &IoCtx, name: &str, size: u64, options: &ImageOptions) -> Result<()> {
    let object = ioctx.object_spec(name);
    check_image_name(name, "rbd_create4", &object)?;
    if let Some(f) = options.get_features() {
        f.check_dependencies()
            .map_err(|why| Error::invalid("rbd_create4", object.clone(), why))?;
    }
    let n = cstr(name, "rbd_create4", "image name")?;
    let opts = options.to_raw("rbd_create4", &object)?;
    // SAFETY: the ioctx is live; `n` is NUL-terminated; `opts.0` is a live
    // options object that librbd only reads.
    let ret = unsafe { sys::rbd_create4(ioctx.raw(), n.as_ptr(), size, opts.0) };
    cvt(ret, "rbd_create4", || object.clone())?;
    Ok(())
}

/// Name and id of an image, as `rbd_list2` reports them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ImageSpec {
    /// The image id (the stable one; names can change).
    pub id: String,
    /// The image name.
    pub name: String,
}

/// Lists the images of the ioctx's pool and namespace. Wraps `rbd_list2`
/// (retrying with a larger array on `ERANGE`).
pub fn list(ioctx: &IoCtx) -> Result<Vec<ImageSpec>> {
    let (ret, mut specs) = fill_array(|p, n| {
        // SAFETY: `p` has room for `*n` entries; librbd sets `*n` to the
        // count (or the count it needs, with -ERANGE).
        unsafe { sys::rbd_list2(ioctx.raw(), p, n) }
    });
    cvt(ret, "rbd_list2", || ioctx.spec())?;
    let out = specs
        .iter()
        .map(|s| ImageSpec {
            // SAFETY: librbd filled these entries with valid strings.
            id: unsafe { from_cstr(s.id) },
            // SAFETY: as above.
            name: unsafe { from_cstr(s.name) },
        })
        .collect();
    // SAFETY: the entries were filled by rbd_list2 and are released exactly
    // once here, as the header asks.
    unsafe { sys::rbd_image_spec_list_cleanup(specs.as_mut_ptr(), specs.len()) };
    Ok(out)
}

/// Names of the images of the ioctx's pool and namespace, sorted.
pub fn list_names(ioctx: &IoCtx) -> Result<Vec<String>> {
    let mut names: Vec<String> = list(ioctx)?.into_iter().map(|s| s.name).collect();
    names.sort();
    Ok(names)
}

/// Removes an image and its data. Wraps `rbd_remove`.
///
/// Errors: [`ErrorKind::NotFound`]; [`ErrorKind::Busy`] while another client
/// has it open (it has watchers); [`ErrorKind::HasSnapshots`] while it has
/// snapshots. See [`crate::rbd::trash_move`] for images that cannot go at once.
pub fn remove(ioctx: &IoCtx, name: &str) -> Result<()> {
    let n = cstr(name, "rbd_remove", "image name")?;
    // SAFETY: the ioctx is live; `n` is NUL-terminated.
    let ret = unsafe { sys::rbd_remove(ioctx.raw(), n.as_ptr()) };
    cvt(ret, "rbd_remove", || ioctx.object_spec(name)).map_err(explain_remove)?;
    Ok(())
}

/// [`remove`] that stops once `deadline` passes, with an
/// [`ErrorKind::TimedOut`] error; the image may then be partly removed (its
/// data objects in part), and a later call finishes the job. Wraps
/// `rbd_remove_with_progress`, whose progress callback checks the deadline.
pub fn remove_with_deadline(ioctx: &IoCtx, name: &str, deadline: Instant) -> Result<()> {
    let n = cstr(name, "rbd_remove_with_progress", "image name")?;
    crate::util::with_deadline(
        deadline,
        "rbd_remove_with_progress",
        || ioctx.object_spec(name),
        |cb, arg| {
            // SAFETY: the ioctx is live; `n` is NUL-terminated; `cb` and
            // `arg` are the deadline callback and its `Instant`, which
            // outlives this call.
            unsafe { sys::rbd_remove_with_progress(ioctx.raw(), n.as_ptr(), cb, arg) }
        },
    )
    .map_err(explain_remove)
}

fn explain_remove(e: Error) -> Error {
    match e.kind() {
        ErrorKind::Busy => {
            e.detail("image is in use: it has watchers (open elsewhere) or is being removed")
        }
        ErrorKind::HasSnapshots => {
            e.detail("image has snapshots; remove them first or move the image to the trash")
        }
        _ => e,
    }
}

/// Renames an image within its pool and namespace. Wraps `rbd_rename`.
pub fn rename(ioctx: &IoCtx, from: &str, to: &str) -> Result<()> {
    let object = ioctx.object_spec(from);
    check_image_name(to, "rbd_rename", &object)?;
    let f = cstr(from, "rbd_rename", "image name")?;
    let t = cstr(to, "rbd_rename", "image name")?;
    // SAFETY: the ioctx is live; both names are NUL-terminated.
    let ret = unsafe { sys::rbd_rename(ioctx.raw(), f.as_ptr(), t.as_ptr()) };
    cvt(ret, "rbd_rename", || object.clone())?;
    Ok(())
}

/// Refuses names librbd would choke on, before any call is made.
fn check_image_name(name: &str, op: &'static str, object: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid(op, object, "image name is empty"));
    }
    if name.contains('/') || name.contains('@') {
        return Err(Error::invalid(
            op,
            object,
            format!("image name {name:?} contains '/' or '@'"),
        ));
    }
    if name.len() >= sys::RBD_MAX_IMAGE_NAME_SIZE as usize * 32 {
        return Err(Error::invalid(op, object, "image name is too long"));
    }
    Ok(())
}

/// How an image is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenMode {
    ReadWrite,
    ReadOnly,
}

/// An open RBD image (`rbd_image_t`).
///
/// Closed exactly once: by [`Image::close`], which reports errors, or on
/// drop. It holds its [`IoCtx`] (and so the cluster) alive, so the image
/// always closes first.
///
/// Thread safety: librbd guards an open image with its own locks (QEMU issues
/// I/O on one handle from many threads), so `Image` is `Send + Sync` and
/// methods take `&self`. The calls that change what the handle reads, such as
/// [`Image::set_snapshot`], take `&mut self`.
pub struct Image {
    raw: sys::rbd_image_t,
    // Held so the ioctx and cluster outlive the image handle.
    ioctx: IoCtx,
    name: String,
    read_only: bool,
    /// The size last seen ([`UNKNOWN_SIZE`] before the first look), for the
    /// range checks of the I/O paths; see [`Image::size_covering`].
    cached_size: AtomicU64,
    /// How often the I/O range checks had to call `rbd_get_size`.
    size_lookups: AtomicUsize,
}

/// `cached_size` before any size was seen.
const UNKNOWN_SIZE: u64 = u64::MAX;

// SAFETY: librbd's ImageCtx protects its state with owner_lock/image_lock and
// its I/O paths are used concurrently by QEMU on one handle; the calls that
// change the handle's view (rbd_snap_set*, rbd_close) take `&mut self` or
// `self`, so they never race with others on the same handle.
unsafe impl Send for Image {}
// SAFETY: as above: every `&self` method maps to a librbd call that takes
// the image's internal locks, so shared use from several threads is sound.
unsafe impl Sync for Image {}

impl fmt::Debug for Image {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Image")
            .field("spec", &self.spec())
            .field("read_only", &self.read_only)
            .finish()
    }
}

/// Size and layout of an image, from `rbd_stat` and friends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    /// Size in bytes.
    pub size: u64,
    /// Object size in bytes.
    pub object_size: u64,
    /// Number of objects backing the image.
    pub num_objs: u64,
    /// log2 of the object size.
    pub order: u32,
    /// Prefix of the data object names (`rbd_data.<id>`).
    pub block_name_prefix: String,
}

impl Image {
    /// Opens an image read-write. Wraps `rbd_open`.
    pub fn open(ioctx: &IoCtx, name: &str) -> Result<Image> {
        Image::open_inner(ioctx, name, None, OpenMode::ReadWrite, false)
    }

    /// Opens an image read-only: no watch is registered, so it does not block
    /// removal. Wraps `rbd_open_read_only`.
    pub fn open_read_only(ioctx: &IoCtx, name: &str) -> Result<Image> {
        Image::open_inner(ioctx, name, None, OpenMode::ReadOnly, false)
    }

    /// Opens an image at a snapshot, read-only. Wraps `rbd_open_read_only`.
    pub fn open_snapshot(ioctx: &IoCtx, name: &str, snapshot: &str) -> Result<Image> {
        Image::open_inner(ioctx, name, Some(snapshot), OpenMode::ReadOnly, false)
    }

    /// Opens an image by its id, read-write. Wraps `rbd_open_by_id`.
    pub fn open_by_id(ioctx: &IoCtx, id: &str) -> Result<Image> {
        Image::open_inner(ioctx, id, None, OpenMode::ReadWrite, true)
    }

    /// Opens an image by its id, read-only. Wraps `rbd_open_by_id_read_only`.
    pub fn open_by_id_read_only(ioctx: &IoCtx, id: &str) -> Result<Image> {
        Image::open_inner(ioctx, id, None, OpenMode::ReadOnly, true)
    }

    fn open_inner(
        ioctx: &IoCtx,
        name: &str,
        snap: Option<&str>,
        mode: OpenMode,
        by_id: bool,
    ) -> Result<Image> {
        let op = match (by_id, mode) {
            (false, OpenMode::ReadWrite) => "rbd_open",
            (false, OpenMode::ReadOnly) => "rbd_open_read_only",
            (true, OpenMode::ReadWrite) => "rbd_open_by_id",
            (true, OpenMode::ReadOnly) => "rbd_open_by_id_read_only",
        };
        let object = ioctx.object_spec(name);
        let n = cstr(name, op, if by_id { "image id" } else { "image name" })?;
        let s = snap.map(|s| cstr(s, op, "snapshot name")).transpose()?;
        let sp = s.as_ref().map_or(ptr::null(), |s| s.as_ptr());
        let mut raw: sys::rbd_image_t = ptr::null_mut();
        // SAFETY: the ioctx is live (librbd duplicates it); `n` and `sp` are
        // NUL-terminated or null; `raw` is a valid out-pointer.
        let ret = unsafe {
            match (by_id, mode) {
                (false, OpenMode::ReadWrite) => {
                    sys::rbd_open(ioctx.raw(), n.as_ptr(), &mut raw, sp)
                }
                (false, OpenMode::ReadOnly) => {
                    sys::rbd_open_read_only(ioctx.raw(), n.as_ptr(), &mut raw, sp)
                }
                (true, OpenMode::ReadWrite) => {
                    sys::rbd_open_by_id(ioctx.raw(), n.as_ptr(), &mut raw, sp)
                }
                (true, OpenMode::ReadOnly) => {
                    sys::rbd_open_by_id_read_only(ioctx.raw(), n.as_ptr(), &mut raw, sp)
                }
            }
        };
        cvt(ret, op, || match snap {
            Some(s) => format!("{object}@{s}"),
            None => object.clone(),
        })?;
        let mut image = Image {
            raw,
            ioctx: ioctx.clone(),
            name: name.to_owned(),
            read_only: mode == OpenMode::ReadOnly,
            cached_size: AtomicU64::new(UNKNOWN_SIZE),
            size_lookups: AtomicUsize::new(0),
        };
        // Cheap right after the open (the header was just read); spares the
        // first AIO write a lookup.
        let _ = image.size();
        if by_id {
            // Report the real name in messages, not the id.
            if let Ok(real) = image.get_name() {
                image.name = real;
            }
        }
        Ok(image)
    }

    /// Wraps an already opened handle (used by async open).
    ///
    /// # Safety
    /// `raw` must be an open image handle that nothing else will close.
    pub(crate) unsafe fn from_raw(
        raw: sys::rbd_image_t,
        ioctx: &IoCtx,
        name: &str,
        read_only: bool,
    ) -> Image {
        Image {
            raw,
            ioctx: ioctx.clone(),
            name: name.to_owned(),
            read_only,
            cached_size: AtomicU64::new(UNKNOWN_SIZE),
            size_lookups: AtomicUsize::new(0),
        }
    }

    /// Closes the image, reporting any error. Wraps `rbd_close`.
    pub fn close(mut self) -> Result<()> {
        // Null marks the handle closed, so Drop does not close it again.
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: `raw` is open and is closed only here.
        let ret = unsafe { sys::rbd_close(raw) };
        self.cvt(ret, "rbd_close")?;
        Ok(())
    }

    /// The image's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The ioctx the image was opened through.
    pub fn ioctx(&self) -> &IoCtx {
        &self.ioctx
    }

    /// True when opened read-only (or at a snapshot).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// `pool[/namespace]/image`, for messages.
    pub fn spec(&self) -> String {
        self.ioctx.object_spec(&self.name)
    }

    pub(crate) fn raw(&self) -> sys::rbd_image_t {
        self.raw
    }

    /// Takes the handle out; the `Image` then no longer closes it (used by
    /// async close, which closes it instead).
    pub(crate) fn take_raw(&mut self) -> sys::rbd_image_t {
        std::mem::replace(&mut self.raw, ptr::null_mut())
    }

    pub(crate) fn cvt<T>(&self, ret: T, op: &'static str) -> Result<T>
    where
        T: Copy + PartialOrd + Default + TryInto<i32>,
    {
        cvt(ret, op, || self.spec())
    }

    /// Size and layout. Wraps `rbd_stat`.
    pub fn stat(&self) -> Result<ImageInfo> {
        let mut info = sys::rbd_image_info_t::default();
        // SAFETY: `info` is the header's struct and we pass its exact size.
        let ret = unsafe {
            sys::rbd_stat(
                self.raw,
                &mut info,
                std::mem::size_of::<sys::rbd_image_info_t>(),
            )
        };
        self.cvt(ret, "rbd_stat")?;
        let prefix: Vec<u8> = info.block_name_prefix.iter().map(|c| *c as u8).collect();
        Ok(ImageInfo {
            size: info.size,
            object_size: info.obj_size,
            num_objs: info.num_objs,
            order: info.order as u32,
            block_name_prefix: string_from_buf(&prefix),
        })
    }

    /// Size in bytes. Wraps `rbd_get_size`.
    pub fn size(&self) -> Result<u64> {
        let mut size = 0u64;
        // SAFETY: valid out-pointer; the image is open.
        let ret = unsafe { sys::rbd_get_size(self.raw, &mut size) };
        self.cvt(ret, "rbd_get_size")?;
        self.cached_size.store(size, Ordering::Relaxed);
        Ok(size)
    }

    /// The image size for a range check that needs the image to reach
    /// `end`: the size last seen if it does, without a librbd call (which
    /// can block to refresh the header); otherwise a fresh `rbd_get_size`.
    /// So a grown image is seen as soon as I/O reaches past the old end; a
    /// shrink by another client is seen only by librbd itself.
    pub(crate) fn size_covering(&self, end: u64) -> Result<u64> {
        let cached = self.cached_size.load(Ordering::Relaxed);
        if cached != UNKNOWN_SIZE && end <= cached {
            return Ok(cached);
        }
        self.size_lookups.fetch_add(1, Ordering::Relaxed);
        self.size()
    }

    /// How many times this handle's I/O range checks (AIO writes,
    /// `ImageIo`) had to call `rbd_get_size` rather than use the size last
    /// seen. For tests.
    #[doc(hidden)]
    pub fn io_size_lookups(&self) -> usize {
        self.size_lookups.load(Ordering::Relaxed)
    }

    /// Grows the image to `size` bytes (a no-op when it is that size already).
    /// A smaller size is refused with [`ErrorKind::ShrinkRefused`] and nothing
    /// changes; use [`Image::resize_allow_shrink`] to shrink. Wraps
    /// `rbd_resize2` with `allow_shrink = false`.
    pub fn resize(&self, size: u64) -> Result<()> {
        let current = self.size()?;
        if size < current {
            return Err(Error::with_kind(
                ErrorKind::ShrinkRefused,
                libc::EINVAL,
                "rbd_resize2",
                self.spec(),
                format!("new size {size} is smaller than the current size {current}; shrinking loses data and must be allowed explicitly"),
            ));
        }
        self.resize2(size, false)
    }

    /// Resizes to `size` bytes, shrinking if needed: data past the new end is
    /// discarded. Wraps `rbd_resize2` with `allow_shrink = true`.
    pub fn resize_allow_shrink(&self, size: u64) -> Result<()> {
        self.resize2(size, true)
    }

    fn resize2(&self, size: u64, allow_shrink: bool) -> Result<()> {
        // SAFETY: the image is open; the progress callback is a no-op that
        // ignores its (null) argument.
        let ret = unsafe {
            sys::rbd_resize2(
                self.raw,
                size,
                allow_shrink,
                Some(no_progress),
                ptr::null_mut(),
            )
        };
        // Whatever happened, the size is re-read when I/O next needs it.
        self.cached_size.store(UNKNOWN_SIZE, Ordering::Relaxed);
        match self.cvt(ret, "rbd_resize2") {
            Err(e) if !allow_shrink && e.kind() == ErrorKind::InvalidArgument => {
                Err(Error::with_kind(
                    ErrorKind::ShrinkRefused,
                    e.errno(),
                    "rbd_resize2",
                    self.spec(),
                    "librbd refused to shrink the image (it changed size meanwhile?)",
                ))
            }
            other => other.map(|_| ()),
        }
    }

    /// The image's id. Wraps `rbd_get_id`.
    pub fn id(&self) -> Result<String> {
        let buf = with_growing_buffer(64, "rbd_get_id", &|| self.spec(), |buf| {
            // SAFETY: `buf` is writable for its length; -ERANGE if too small.
            let ret = unsafe { sys::rbd_get_id(self.raw, buf.as_mut_ptr().cast(), buf.len()) };
            (i64::from(ret), 0)
        })?;
        Ok(string_from_buf(&buf))
    }

    /// The RADOS object of the image's header (`rbd_header.<id>`, format 2),
    /// in the image's pool and namespace: where object locks and xattrs
    /// about the image can live and die with it. Wraps `rbd_get_id`.
    pub fn header_oid(&self) -> Result<String> {
        Ok(format!("rbd_header.{}", self.id()?))
    }

    /// The image's current name. Wraps `rbd_get_name`.
    pub fn get_name(&self) -> Result<String> {
        let buf = sized_buffer(128, "rbd_get_name", &|| self.spec(), |p, len| {
            // SAFETY: `p` is writable for `*len` bytes; on -ERANGE librbd
            // sets `*len` to the size it needs.
            unsafe { sys::rbd_get_name(self.raw, p, len) }
        })?;
        Ok(string_from_buf(&buf))
    }

    /// The image's features. Wraps `rbd_get_features`.
    pub fn features(&self) -> Result<Features> {
        let mut bits = 0u64;
        // SAFETY: valid out-pointer; the image is open.
        let ret = unsafe { sys::rbd_get_features(self.raw, &mut bits) };
        self.cvt(ret, "rbd_get_features")?;
        Ok(Features::from_bits(bits))
    }

    /// Turns features on or off (only [`Features::MUTABLE`] ones). Wraps
    /// `rbd_update_features`.
    pub fn update_features(&self, features: Features, enable: bool) -> Result<()> {
        let immutable = features.without(Features::MUTABLE);
        if !immutable.is_empty() {
            return Err(Error::invalid(
                "rbd_update_features",
                self.spec(),
                format!("features {immutable} cannot be changed after creation"),
            ));
        }
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_update_features(self.raw, features.bits(), u8::from(enable)) };
        self.cvt(ret, "rbd_update_features")?;
        Ok(())
    }

    /// Image flags such as `RBD_FLAG_OBJECT_MAP_INVALID`. Wraps `rbd_get_flags`.
    pub fn flags(&self) -> Result<u64> {
        let mut flags = 0u64;
        // SAFETY: valid out-pointer; the image is open.
        let ret = unsafe { sys::rbd_get_flags(self.raw, &mut flags) };
        self.cvt(ret, "rbd_get_flags")?;
        Ok(flags)
    }

    /// The stripe unit in bytes. Wraps `rbd_get_stripe_unit`.
    pub fn stripe_unit(&self) -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: valid out-pointer; the image is open.
        let ret = unsafe { sys::rbd_get_stripe_unit(self.raw, &mut v) };
        self.cvt(ret, "rbd_get_stripe_unit")?;
        Ok(v)
    }

    /// The stripe count. Wraps `rbd_get_stripe_count`.
    pub fn stripe_count(&self) -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: valid out-pointer; the image is open.
        let ret = unsafe { sys::rbd_get_stripe_count(self.raw, &mut v) };
        self.cvt(ret, "rbd_get_stripe_count")?;
        Ok(v)
    }

    /// The id of the pool holding the data objects. Wraps `rbd_get_data_pool_id`.
    pub fn data_pool_id(&self) -> Result<i64> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_get_data_pool_id(self.raw) };
        self.cvt(ret, "rbd_get_data_pool_id")
    }

    /// When the image was created. Wraps `rbd_get_create_timestamp`.
    pub fn create_timestamp(&self) -> Result<SystemTime> {
        let (ret, t) = get_timestamp(|ts| {
            // SAFETY: the image is open; `ts` points to a valid out-struct.
            unsafe { sys::rbd_get_create_timestamp(self.raw, ts) }
        });
        self.cvt(ret, "rbd_get_create_timestamp")?;
        Ok(t)
    }

    /// When the image was last written. Wraps `rbd_get_modify_timestamp`.
    pub fn modify_timestamp(&self) -> Result<SystemTime> {
        let (ret, t) = get_timestamp(|ts| {
            // SAFETY: the image is open; `ts` points to a valid out-struct.
            unsafe { sys::rbd_get_modify_timestamp(self.raw, ts) }
        });
        self.cvt(ret, "rbd_get_modify_timestamp")?;
        Ok(t)
    }

    /// When the image was last read. Wraps `rbd_get_access_timestamp`.
    pub fn access_timestamp(&self) -> Result<SystemTime> {
        let (ret, t) = get_timestamp(|ts| {
            // SAFETY: the image is open; `ts` points to a valid out-struct.
            unsafe { sys::rbd_get_access_timestamp(self.raw, ts) }
        });
        self.cvt(ret, "rbd_get_access_timestamp")?;
        Ok(t)
    }

    /// Operation features (`RBD_OPERATION_FEATURE_*`: clone parent/child,
    /// group, snap trash) in force on the image. Wraps `rbd_get_op_features`.
    pub fn op_features(&self) -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: valid out-pointer; the image is open.
        let ret = unsafe { sys::rbd_get_op_features(self.raw, &mut v) };
        self.cvt(ret, "rbd_get_op_features")?;
        Ok(v)
    }

    /// For a clone, how many bytes still overlap its parent. Wraps
    /// `rbd_get_overlap`.
    pub fn overlap(&self) -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: valid out-pointer; the image is open.
        let ret = unsafe { sys::rbd_get_overlap(self.raw, &mut v) };
        self.cvt(ret, "rbd_get_overlap")?;
        Ok(v)
    }

    /// Rebuilds an invalid object map (see [`Image::flags`]). Wraps
    /// `rbd_rebuild_object_map`.
    pub fn rebuild_object_map(&self) -> Result<()> {
        // SAFETY: the image is open; the progress callback is a no-op that
        // ignores its (null) argument.
        let ret =
            unsafe { sys::rbd_rebuild_object_map(self.raw, Some(no_progress), ptr::null_mut()) };
        self.cvt(ret, "rbd_rebuild_object_map")?;
        Ok(())
    }

    /// Copies the image (head only) into a new image. Wraps `rbd_copy3`.
    pub fn copy_to(&self, dest: &IoCtx, dest_name: &str, options: &ImageOptions) -> Result<()> {
        let object = dest.object_spec(dest_name);
        check_image_name(dest_name, "rbd_copy3", &object)?;
        let d = cstr(dest_name, "rbd_copy3", "image name")?;
        let opts = options.to_raw("rbd_copy3", &object)?;
        // SAFETY: the image and `dest` are live; `d` is NUL-terminated;
        // librbd only reads `opts`.
        let ret = unsafe { sys::rbd_copy3(self.raw, dest.raw(), d.as_ptr(), opts.0) };
        cvt(ret, "rbd_copy3", || format!("{} -> {object}", self.spec()))?;
        Ok(())
    }

    /// Copies the image with all its snapshots. Wraps `rbd_deep_copy`.
    pub fn deep_copy_to(
        &self,
        dest: &IoCtx,
        dest_name: &str,
        options: &ImageOptions,
    ) -> Result<()> {
        let object = dest.object_spec(dest_name);
        check_image_name(dest_name, "rbd_deep_copy", &object)?;
        let d = cstr(dest_name, "rbd_deep_copy", "image name")?;
        let opts = options.to_raw("rbd_deep_copy", &object)?;
        // SAFETY: as in `copy_to`.
        let ret = unsafe { sys::rbd_deep_copy(self.raw, dest.raw(), d.as_ptr(), opts.0) };
        cvt(ret, "rbd_deep_copy", || {
            format!("{} -> {object}", self.spec())
        })?;
        Ok(())
    }

    /// Copies the parent's data into a clone so it no longer depends on its
    /// parent. Wraps `rbd_flatten`.
    pub fn flatten(&self) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_flatten(self.raw) };
        self.cvt(ret, "rbd_flatten")?;
        Ok(())
    }

    /// [`Image::flatten`] that stops once `deadline` passes, with an
    /// [`ErrorKind::TimedOut`] error; a later call goes on from where it
    /// stopped. Wraps `rbd_flatten_with_progress`, whose progress callback
    /// checks the deadline.
    pub fn flatten_with_deadline(&self, deadline: Instant) -> Result<()> {
        crate::util::with_deadline(
            deadline,
            "rbd_flatten_with_progress",
            || self.spec(),
            |cb, arg| {
                // SAFETY: the image is open; `cb`/`arg` are the deadline
                // callback and its `Instant`, which outlives this call.
                unsafe { sys::rbd_flatten_with_progress(self.raw, cb, arg) }
            },
        )
    }

    /// Deallocates runs of zeroes of at least `sparse_size` bytes. Wraps
    /// `rbd_sparsify`.
    pub fn sparsify(&self, sparse_size: usize) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_sparsify(self.raw, sparse_size) };
        self.cvt(ret, "rbd_sparsify")?;
        Ok(())
    }

    /// [`Image::sparsify`] that stops once `deadline` passes, with an
    /// [`ErrorKind::TimedOut`] error; a later call goes on (sparsify only
    /// deallocates runs that read as zeroes, so doing a range again is
    /// harmless). Wraps `rbd_sparsify_with_progress`, whose progress
    /// callback checks the deadline.
    pub fn sparsify_with_deadline(&self, sparse_size: usize, deadline: Instant) -> Result<()> {
        crate::util::with_deadline(
            deadline,
            "rbd_sparsify_with_progress",
            || self.spec(),
            |cb, arg| {
                // SAFETY: the image is open; `cb`/`arg` are the deadline
                // callback and its `Instant`, which outlives this call.
                unsafe { sys::rbd_sparsify_with_progress(self.raw, sparse_size, cb, arg) }
            },
        )
    }

    /// Bytes allocated in the image's head, as `rbd du` reports them: the sum
    /// of the extents that exist, counted in whole objects. Uses
    /// `rbd_diff_iterate2` (fast with the `fast-diff` feature).
    pub fn disk_usage(&self) -> Result<u64> {
        let size = self.size()?;
        let mut used = 0u64;
        self.diff_iterate(None, 0, size, false, true, |_, len, exists| {
            if exists {
                used += len;
            }
            std::ops::ControlFlow::Continue(())
        })?;
        Ok(used)
    }

    /// Bytes allocated in the image's head, counted by extent rather than
    /// by whole object: what the objects really hold (a 4 MiB object with
    /// one 4 KiB block written counts 4 KiB, where [`Image::disk_usage`]
    /// counts 4 MiB). Uses `rbd_diff_iterate2` with `whole_object` off.
    pub fn allocated_bytes(&self) -> Result<u64> {
        let size = self.size()?;
        let mut used = 0u64;
        self.diff_iterate(None, 0, size, false, false, |_, len, exists| {
            if exists {
                used += len;
            }
            std::ops::ControlFlow::Continue(())
        })?;
        Ok(used)
    }

    /// Sets the snapshot this handle reads (`None` for the head). Wraps
    /// `rbd_snap_set`. Takes `&mut self` because it changes what every other
    /// call on this handle sees.
    pub fn set_snapshot(&mut self, snapshot: Option<&str>) -> Result<()> {
        let s = snapshot
            .map(|s| cstr(s, "rbd_snap_set", "snapshot name"))
            .transpose()?;
        // SAFETY: the image is open and exclusively borrowed; the name is
        // NUL-terminated or null (head).
        let ret =
            unsafe { sys::rbd_snap_set(self.raw, s.as_ref().map_or(ptr::null(), |s| s.as_ptr())) };
        self.cvt(ret, "rbd_snap_set")?;
        Ok(())
    }
}

impl Image {
    /// Sets the snapshot this handle reads by id, in any snapshot namespace
    /// (a clone's parent snapshot may be in the trash namespace and have no
    /// user name). Wraps `rbd_snap_set_by_id`.
    pub fn set_snapshot_by_id(&mut self, snap_id: u64) -> Result<()> {
        // SAFETY: the image is open and exclusively borrowed (librbd.h:
        // rbd_snap_set_by_id changes what the handle reads, like rbd_snap_set).
        let ret = unsafe { sys::rbd_snap_set_by_id(self.raw, snap_id) };
        self.cvt(ret, "rbd_snap_set_by_id")?;
        Ok(())
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return; // closed by `close`
        }
        // SAFETY: `raw` is an open handle, closed only here or in `close`
        // (which nulls it). Errors cannot be reported from drop.
        unsafe { sys::rbd_close(self.raw) };
    }
}

/// Calls a librbd getter that fills a `struct timespec`; returns the C
/// return value and the time it filled in (meaningful when that is >= 0).
pub(crate) fn get_timestamp(call: impl FnOnce(*mut sys::timespec) -> i32) -> (i32, SystemTime) {
    let mut ts = sys::timespec::default();
    let ret = call(&mut ts);
    let t = UNIX_EPOCH
        + Duration::new(
            ts.tv_sec.max(0) as u64,
            ts.tv_nsec.clamp(0, 999_999_999) as u32,
        );
    (ret, t)
}
