//! Test data helpers.

/// Deterministic pseudo-random bytes: different seeds give different data.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A zeroed buffer aligned to 4 KiB, as `O_DIRECT` I/O needs.
pub struct Aligned {
    ptr: *mut u8,
    len: usize,
}

impl Aligned {
    /// `len` zero bytes (a multiple of 512).
    pub fn new(len: usize) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Aligned { ptr, len }
    }
}

impl std::ops::Deref for Aligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for Aligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len.max(1), 4096).unwrap();
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// Opens a block device (or file) with `O_DIRECT`, for writing if `write`.
pub fn open_direct(path: &std::path::Path, write: bool) -> std::fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open {} O_DIRECT: {e}", path.display()))
}

/// Writes `data` (a multiple of 512 bytes) at `offset` of a block device
/// with `O_DIRECT`, then fsyncs.
pub fn direct_write(path: &std::path::Path, offset: u64, data: &[u8]) {
    let mut buf = Aligned::new(data.len());
    buf.copy_from_slice(data);
    let f = open_direct(path, true);
    std::os::unix::fs::FileExt::write_all_at(&f, &buf, offset)
        .unwrap_or_else(|e| panic!("write {} at {offset}: {e}", path.display()));
    f.sync_all().unwrap();
}

/// [`direct_write`] that returns the error of the write or the fsync.
pub fn try_direct_write(path: &std::path::Path, offset: u64, data: &[u8]) -> std::io::Result<()> {
    let mut buf = Aligned::new(data.len());
    buf.copy_from_slice(data);
    let f = open_direct(path, true);
    std::os::unix::fs::FileExt::write_all_at(&f, &buf, offset)?;
    f.sync_all()
}

/// Reads `len` bytes (a multiple of 512) at `offset` of a block device with
/// `O_DIRECT`.
pub fn direct_read(path: &std::path::Path, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = Aligned::new(len);
    let f = open_direct(path, false);
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, offset)
        .unwrap_or_else(|e| panic!("read {} at {offset}: {e}", path.display()));
    buf.to_vec()
}
