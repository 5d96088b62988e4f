//! The run-wide artifacts directory (`RBDKIT_TEST_ARTIFACTS`, set by
//! `scripts/test`): every e2e fixture copies there the component logs, the
//! events and PVs it saw and the `/metrics` it scraped, so that the run's
//! last step (`scripts/key-grep`) can check that no cephx key appears in
//! any of them. Without the variable (a single test run by hand) nothing is
//! kept.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// Environment variable naming the directory.
pub const ENV: &str = "RBDKIT_TEST_ARTIFACTS";

/// The directory, if this run keeps artifacts.
pub fn dir() -> Option<PathBuf> {
    let d = PathBuf::from(std::env::var_os(ENV)?);
    std::fs::create_dir_all(&d).ok()?;
    Some(d)
}

/// `prefix-<pid>-<n>`: a file name no other test process uses.
pub fn unique_name(prefix: &str, ext: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}.{ext}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Writes `bytes` to `<dir>/<group>/<name>` (best effort: a full disk must
/// not fail the test that produced them, the key grep then finds the
/// directory short of what it expects).
pub fn save(group: &str, name: &str, bytes: &[u8]) {
    let Some(d) = dir() else { return };
    let d = d.join(group);
    if std::fs::create_dir_all(&d).is_ok() {
        let _ = std::fs::write(d.join(name), bytes);
    }
}

/// Copies the file `path` to `<dir>/<group>/`, under its own name.
pub fn copy(group: &str, path: &Path) {
    let (Some(d), Some(name)) = (dir(), path.file_name()) else {
        return;
    };
    let d = d.join(group);
    if std::fs::create_dir_all(&d).is_ok() {
        let _ = std::fs::copy(path, d.join(name));
    }
}

/// Records a secret a test used (a LUKS or KMS passphrase) for the key
/// grep to look for too, in `<dir>.secrets/list`, beside the artifacts and
/// never among them (best effort; nothing without the variable).
pub fn note_secret(secret: &str) {
    use std::io::Write;
    let Some(d) = dir() else { return };
    let mut list = d.into_os_string();
    list.push(".secrets");
    let list = PathBuf::from(list);
    if std::fs::create_dir_all(&list).is_ok() {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(list.join("list"))
        {
            let _ = writeln!(f, "{secret}");
        }
    }
}
