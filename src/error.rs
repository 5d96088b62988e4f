//! The one error type of the library.
//!
//! Every librados/librbd call returns a negative errno on failure. `cvt`
//! turns that into an [`Error`] that keeps the raw errno, the C function that
//! failed and the object it concerned (`pool/namespace/image`, a pool, an
//! object), so that a message such as
//! `rbd_remove on rbd/ns1/vol-1 failed: image has snapshots (ENOTEMPTY)` is
//! complete on its own.

use std::fmt;

/// A `Result` whose error is the library's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What kind of failure an [`Error`] is, mapped from the errno.
///
/// Match on this rather than on the errno; it is `#[non_exhaustive]` so that
/// new kinds can be added without breaking callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// `ENOENT`: the pool, namespace, image, snapshot, key or object does not exist.
    NotFound,
    /// `EEXIST`: something of that name already exists.
    AlreadyExists,
    /// `EBUSY`: the image is in use (it has watchers, or a snapshot is protected / has children).
    Busy,
    /// `ENOTEMPTY`: the image still has snapshots (or the namespace/pool still has images).
    HasSnapshots,
    /// `EPERM`/`EACCES`: the cephx user's caps do not allow this.
    PermissionDenied,
    /// `ETIMEDOUT`: a connect, monitor or OSD operation ran past its timeout.
    TimedOut,
    /// `EINVAL`/`ERANGE`/`EDOM` or bad input caught before the call.
    InvalidArgument,
    /// `ENOSPC`/`EDQUOT`: the cluster or pool is full or over quota.
    NoSpace,
    /// `EROFS`: the image or snapshot is read-only.
    ReadOnly,
    /// `EOPNOTSUPP`/`ENOSYS`/`ENOTSUP`: the cluster or image does not support this.
    NotSupported,
    /// A resize would shrink the image and shrinking was not allowed.
    ShrinkRefused,
    /// A change to Ceph was refused before it was made because this process
    /// may no longer make it (a provisioner replica that no longer holds, or
    /// cannot prove it still holds, the leader lease). Whoever leads retries.
    Fenced,
    /// Any other errno, kept as it is (positive).
    Other(i32),
}

impl ErrorKind {
    /// Maps a positive errno to its kind.
    pub fn from_errno(errno: i32) -> ErrorKind {
        match errno {
            libc::ENOENT => ErrorKind::NotFound,
            libc::EEXIST => ErrorKind::AlreadyExists,
            libc::EBUSY => ErrorKind::Busy,
            libc::ENOTEMPTY => ErrorKind::HasSnapshots,
            libc::EPERM | libc::EACCES => ErrorKind::PermissionDenied,
            libc::ETIMEDOUT => ErrorKind::TimedOut,
            libc::EINVAL | libc::ERANGE | libc::EDOM => ErrorKind::InvalidArgument,
            libc::ENOSPC | libc::EDQUOT => ErrorKind::NoSpace,
            libc::EROFS => ErrorKind::ReadOnly,
            libc::EOPNOTSUPP | libc::ENOSYS => ErrorKind::NotSupported,
            other => ErrorKind::Other(other),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::Busy => "busy (in use)",
            ErrorKind::HasSnapshots => "has snapshots (or is not empty)",
            ErrorKind::PermissionDenied => "permission denied",
            ErrorKind::TimedOut => "timed out",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::NoSpace => "no space left",
            ErrorKind::ReadOnly => "read-only",
            ErrorKind::NotSupported => "not supported",
            ErrorKind::ShrinkRefused => "shrinking refused",
            ErrorKind::Fenced => "refused: this replica may no longer change Ceph",
            ErrorKind::Other(_) => "failed",
        }
    }
}

/// A failed librados/librbd call, or input refused before a call was made.
///
/// Keeps the raw errno ([`Error::errno`]), the operation (usually the C
/// function, such as `rbd_remove`) and the object (`pool/ns/image`, a pool or
/// an object name). It never holds a key or secret.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Error {
    kind: ErrorKind,
    errno: i32,
    op: &'static str,
    object: String,
    detail: Option<String>,
}

impl Error {
    /// Builds an error from a positive errno.
    pub fn from_errno(errno: i32, op: &'static str, object: impl Into<String>) -> Error {
        Error {
            kind: ErrorKind::from_errno(errno),
            errno,
            op,
            object: object.into(),
            detail: None,
        }
    }

    /// Builds an error for input refused before any call was made.
    pub fn invalid(
        op: &'static str,
        object: impl Into<String>,
        detail: impl Into<String>,
    ) -> Error {
        Error {
            kind: ErrorKind::InvalidArgument,
            errno: libc::EINVAL,
            op,
            object: object.into(),
            detail: Some(detail.into()),
        }
    }

    /// Builds an error of a given kind with an explanation.
    pub fn with_kind(
        kind: ErrorKind,
        errno: i32,
        op: &'static str,
        object: impl Into<String>,
        detail: impl Into<String>,
    ) -> Error {
        Error {
            kind,
            errno,
            op,
            object: object.into(),
            detail: Some(detail.into()),
        }
    }

    /// Adds an explanation that the errno alone does not give.
    pub fn detail(mut self, detail: impl Into<String>) -> Error {
        self.detail = Some(detail.into());
        self
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The raw, positive errno (`EINVAL` for input refused before a call).
    pub fn errno(&self) -> i32 {
        self.errno
    }

    /// The operation that failed, usually the C function's name.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The object the operation concerned: `pool/ns/image`, a pool, an object.
    pub fn object(&self) -> &str {
        &self.object
    }

    /// True when the error is [`ErrorKind::NotFound`].
    pub fn is_not_found(&self) -> bool {
        self.kind == ErrorKind::NotFound
    }

    /// True when the error is [`ErrorKind::AlreadyExists`].
    pub fn is_already_exists(&self) -> bool {
        self.kind == ErrorKind::AlreadyExists
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.object.is_empty() {
            write!(f, "{} failed: ", self.op)?;
        } else {
            write!(f, "{} on {} failed: ", self.op, self.object)?;
        }
        match &self.detail {
            Some(d) => write!(f, "{d}")?,
            None => f.write_str(self.kind.describe())?,
        }
        write!(f, " ({})", errno_name(self.errno))
    }
}

impl std::error::Error for Error {}

impl From<Error> for std::io::Error {
    fn from(e: Error) -> std::io::Error {
        let kind = match e.kind {
            ErrorKind::NotFound => std::io::ErrorKind::NotFound,
            ErrorKind::AlreadyExists => std::io::ErrorKind::AlreadyExists,
            ErrorKind::PermissionDenied => std::io::ErrorKind::PermissionDenied,
            ErrorKind::TimedOut => std::io::ErrorKind::TimedOut,
            ErrorKind::InvalidArgument | ErrorKind::ShrinkRefused => {
                std::io::ErrorKind::InvalidInput
            }
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, e)
    }
}

/// Checks a C return value: negative means `-errno`, anything else is success
/// and is passed back.
///
/// The one place where negative-errno returns become [`Error`]s.
pub(crate) fn cvt<T>(ret: T, op: &'static str, object: impl FnOnce() -> String) -> Result<T>
where
    T: Copy + PartialOrd + Default + TryInto<i32>,
{
    if ret < T::default() {
        // An errno is small and positive; anything else (i32::MIN, a length
        // that wrapped negative) is reported as EIO rather than negated.
        let errno = ret
            .try_into()
            .ok()
            .and_then(|v: i32| v.checked_neg())
            .filter(|e| *e < 4096)
            .unwrap_or(libc::EIO);
        Err(Error::from_errno(errno, op, object()))
    } else {
        Ok(ret)
    }
}

/// The symbolic name of an errno, for messages.
pub(crate) fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EIO => "EIO",
        libc::E2BIG => "E2BIG",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::EXDEV => "EXDEV",
        libc::EINVAL => "EINVAL",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::EDOM => "EDOM",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ENODATA => "ENODATA",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::ESHUTDOWN => "ESHUTDOWN",
        libc::EDQUOT => "EDQUOT",
        libc::ECANCELED => "ECANCELED",
        libc::EILSEQ => "EILSEQ",
        libc::ENOTBLK => "ENOTBLK",
        libc::ENOTTY => "ENOTTY",
        libc::ENODEV => "ENODEV",
        libc::ENOTCONN => "ENOTCONN",
        libc::ESTALE => "ESTALE",
        libc::ENOKEY => "ENOKEY",
        _ => return format!("errno {errno}"),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_each_errno_to_its_kind() {
        let cases = [
            (libc::ENOENT, ErrorKind::NotFound),
            (libc::EEXIST, ErrorKind::AlreadyExists),
            (libc::EBUSY, ErrorKind::Busy),
            (libc::ENOTEMPTY, ErrorKind::HasSnapshots),
            (libc::EPERM, ErrorKind::PermissionDenied),
            (libc::EACCES, ErrorKind::PermissionDenied),
            (libc::ETIMEDOUT, ErrorKind::TimedOut),
            (libc::EINVAL, ErrorKind::InvalidArgument),
            (libc::ENOSPC, ErrorKind::NoSpace),
            (libc::EDQUOT, ErrorKind::NoSpace),
            (libc::EROFS, ErrorKind::ReadOnly),
            (libc::EOPNOTSUPP, ErrorKind::NotSupported),
            (libc::ENOSYS, ErrorKind::NotSupported),
            (libc::EIO, ErrorKind::Other(libc::EIO)),
        ];
        for (errno, kind) in cases {
            assert_eq!(ErrorKind::from_errno(errno), kind, "errno {errno}");
        }
    }

    #[test]
    fn cvt_passes_success_and_maps_failure() {
        assert_eq!(cvt(5i32, "rbd_x", String::new).unwrap(), 5);
        let e = cvt(-libc::ENOENT, "rbd_open", || "rbd/ns/img".into()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert_eq!(e.errno(), libc::ENOENT);
        assert_eq!(e.op(), "rbd_open");
        assert_eq!(
            e.to_string(),
            "rbd_open on rbd/ns/img failed: not found (ENOENT)"
        );
        let e = cvt(-(libc::EBUSY as isize), "rbd_remove", || "p/i".into()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy);
    }

    #[test]
    fn cvt_never_overflows_on_odd_negative_values() {
        for ret in [
            i32::MIN as isize,
            -(1isize << 31),
            -(1isize << 40),
            isize::MIN,
        ] {
            let e = cvt(ret, "rbd_read", || "p/i".into()).unwrap_err();
            assert_eq!(e.errno(), libc::EIO, "{ret}");
        }
        assert_eq!(
            cvt(i32::MIN, "x", String::new).unwrap_err().errno(),
            libc::EIO
        );
        assert_eq!(
            cvt(i64::MIN, "x", String::new).unwrap_err().errno(),
            libc::EIO
        );
    }

    #[test]
    fn detail_replaces_the_generic_text() {
        let e = Error::invalid("rbd_create4", "rbd/x", "size must be > 0");
        assert_eq!(
            e.to_string(),
            "rbd_create4 on rbd/x failed: size must be > 0 (EINVAL)"
        );
    }
}
