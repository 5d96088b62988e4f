//! The resident memory of the `rbdkit` binary's long-lived daemons (a
//! module of the binary, `src/main.rs`, not of the library).

/// Shapes a control-path daemon's memory (the provisioner, the CSI
/// driver): one glibc malloc arena, and the start-up part of the main
/// thread's stack and of the code returned to the kernel. Call it first in
/// `main`, while the process has one thread.
///
/// By default glibc gives threads arenas of their own (up to 16 here), and
/// each arena's free pages stay resident. These daemons' threads (runtime,
/// Ceph pool, librados) allocate little, so sharing one arena costs no
/// measurable time and leaves less memory stranded (bench/analysis.md,
/// section 5).
pub(crate) fn control_daemon() {
    // SAFETY: mallopt(3) (glibc) may be called at any time with any value;
    // M_ARENA_MAX only limits how many arenas later allocations create, and
    // on failure (return 0) the defaults stay.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    release_startup_stack();
    if threads() == Some(1) {
        release_startup_code();
    }
}

/// The number of threads in this process (`Threads:` in
/// `/proc/self/status`).
fn threads() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))?
        .trim()
        .parse()
        .ok()
}

/// Returns to the kernel the pages of the main thread's stack that start-up
/// used and nothing uses now. librados's static initializers build Ceph's
/// table of some 2000 options on this stack before `main` runs: about 1 MiB
/// that would otherwise stay resident for the life of the daemon.
pub(crate) fn release_startup_stack() {
    const PAGE: usize = 4096;
    // Room for this function's own calls below the current frame.
    const MARGIN: usize = 64 * 1024;
    let marker = 0u8;
    let here = std::hint::black_box(&marker) as *const u8 as usize;
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return;
    };
    let Some(low) = stack_start(&maps) else {
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

/// Drops from this process's resident set the pages of its ELF objects (the
/// binary, librados, librbd, libceph-common and the rest) that are still
/// exactly the file's contents, so that only code and constants that run
/// again come back.
///
/// Start-up reads much that is never read again. The libraries are bound
/// at load (`BIND_NOW`), so the dynamic linker reads every one's symbol
/// tables and relocations (libceph-common's symbol names alone are 1.5 MB),
/// and Ceph's static initializers build its table of some 2000 options with
/// about 0.5 MB of generated code; Linux maps 64 KiB around every page
/// fault in a file, so whole windows of neighbours stay resident with them.
/// In the burst benchmark this took 17 MiB off the idle provisioner and
/// 9 MiB off its peak (bench/analysis.md, section 5).
///
/// Only mappings that are not writable, belong to a shared object or the
/// executable, and have no private (copy-on-write) page are touched, so no
/// relocated or written byte can be lost: a dropped page is read back from
/// the file on its next use. Call it while nothing can map or unmap a
/// library (in `main`, before any other thread exists): a library loaded
/// meanwhile could be mapped over a range already read as clean. Returns
/// the bytes of the mappings it released.
pub(crate) fn release_startup_code() -> usize {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return 0;
    };
    let exe = std::fs::read_link("/proc/self/exe").ok();
    let mut released = 0;
    for (start, end) in clean_object_mappings(&smaps, exe.as_deref()) {
        // SAFETY: [start, end) is one whole mapping listed in
        // /proc/self/smaps: private, not writable, of a shared object or the
        // executable, with no anonymous (copy-on-write) page, so every page
        // in it equals the file's bytes at its offset and, not being
        // writable, cannot become private before this call. madvise(2)
        // MADV_DONTNEED on such a private file mapping only unmaps the
        // pages; the next access reads them from the file again (the
        // objects are not truncated while mapped: package managers replace
        // them by rename). Nothing maps or unmaps objects meanwhile (the
        // function's doc).
        let rc =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        if rc == 0 {
            released += end - start;
        }
    }
    released
}

/// One mapping of `/proc/PID/maps` or `/proc/PID/smaps`: its header line
/// and, in smaps, the `Name: value ...` lines that follow it.
struct Mapping<'a> {
    start: usize,
    end: usize,
    perms: &'a str,
    /// After offset, device and inode: the path, if any.
    path: String,
    fields: Vec<(&'a str, &'a str)>,
}

impl Mapping<'_> {
    /// The first value of field `name` (`Rss`, `Anonymous`, ...), without
    /// its unit.
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
    }
}

/// The mappings in `text` (the format of `/proc/PID/maps` or `smaps`). A
/// header whose addresses do not parse is skipped with its field lines.
fn mappings(text: &str) -> Vec<Mapping<'_>> {
    let mut out = Vec::new();
    let mut skipping = false;
    for line in text.lines() {
        let mut words = line.split_ascii_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((a, b)) = first.split_once('-') {
            let (Ok(start), Ok(end)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            else {
                skipping = true;
                continue;
            };
            skipping = false;
            let perms = words.next().unwrap_or("");
            let path = words.skip(3).collect::<Vec<_>>().join(" ");
            out.push(Mapping {
                start,
                end,
                perms,
                path,
                fields: Vec::new(),
            });
        } else if let (Some(name), false) = (first.strip_suffix(':'), skipping) {
            if let Some(m) = out.last_mut() {
                m.fields.push((name, words.next().unwrap_or("")));
            }
        }
    }
    out
}

/// The lowest address of the main thread's stack (`[stack]`) in `maps`.
fn stack_start(maps: &str) -> Option<usize> {
    mappings(maps)
        .into_iter()
        .find(|m| m.path == "[stack]")
        .map(|m| m.start)
}

/// The `(start, end)` of each mapping in `smaps` (the format of
/// `/proc/PID/smaps`) that is private and not writable, of a file named
/// like a shared object (`*.so`, `*.so.*`) or equal to `exe`, and has
/// `Anonymous: 0 kB`.
fn clean_object_mappings(smaps: &str, exe: Option<&std::path::Path>) -> Vec<(usize, usize)> {
    mappings(smaps)
        .into_iter()
        .filter(|m| {
            let perms = m.perms.as_bytes();
            let private_read_only = perms.get(1) == Some(&b'-') && perms.get(3) == Some(&b'p');
            private_read_only && is_object(&m.path, exe) && m.field("Anonymous") == Some("0")
        })
        .map(|m| (m.start, m.end))
        .collect()
}

/// Whether `path` names a shared object or the executable.
fn is_object(path: &str, exe: Option<&std::path::Path>) -> bool {
    if !path.starts_with('/') || path.ends_with(" (deleted)") {
        return false;
    }
    if exe.is_some_and(|e| e == std::path::Path::new(path)) {
        return true;
    }
    let name = path.rsplit('/').next().unwrap_or("");
    name.ends_with(".so") || name.contains(".so.")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0000000-55d0c0100000 r--p 00000000 fe:01 123 /usr/bin/rbdkit
Size:               1024 kB
Anonymous:             0 kB
55d0c0100000-55d0c0200000 r-xp 00100000 fe:01 123 /usr/bin/rbdkit
Size:               1024 kB
Anonymous:             0 kB
55d0c0200000-55d0c0210000 r--p 00200000 fe:01 123 /usr/bin/rbdkit
Size:                 64 kB
Anonymous:            60 kB
55d0c0210000-55d0c0220000 rw-p 00210000 fe:01 123 /usr/bin/rbdkit
Anonymous:             0 kB
7f0000000000-7f0000100000 r-xp 00000000 fe:01 456 /usr/lib/x86_64-linux-gnu/ceph/libceph-common.so.2
Anonymous:             0 kB
7f0000100000-7f0000200000 r-xp 00000000 fe:01 457 /usr/lib/x86_64-linux-gnu/libfoo.so
Anonymous:             4 kB
7f0000200000-7f0000300000 r--p 00000000 fe:01 458 /usr/lib/locale/locale-archive
Anonymous:             0 kB
7f0000300000-7f0000400000 r--p 00000000 00:00 0 
Anonymous:             0 kB
7f0000400000-7f0000500000 r-xs 00000000 fe:01 459 /dev/shm/lib.so
Anonymous:             0 kB
7f0000500000-7f0000600000 r-xp 00000000 fe:01 460 /opt/my lib/libbar.so.1 (deleted)
Anonymous:             0 kB
7ffc00000000-7ffc00002000 r-xp 00000000 00:00 0 [vdso]
Anonymous:             0 kB
";

    #[test]
    fn only_clean_read_only_private_object_mappings() {
        let exe = std::path::Path::new("/usr/bin/rbdkit");
        assert_eq!(
            clean_object_mappings(SMAPS, Some(exe)),
            vec![
                (0x55d0c0000000, 0x55d0c0100000),
                (0x55d0c0100000, 0x55d0c0200000),
                (0x7f0000000000, 0x7f0000100000),
            ]
        );
        // Without knowing the executable, only the libraries qualify.
        assert_eq!(
            clean_object_mappings(SMAPS, None),
            vec![(0x7f0000000000, 0x7f0000100000)]
        );
    }

    #[test]
    fn finds_the_main_thread_stack() {
        let maps = "\
55d0c0000000-55d0c0100000 r--p 00000000 fe:01 123 /usr/bin/rbdkit
zzzz-7ffc00000000 rw-p 00000000 00:00 0 [stack]
7ffc0aa00000-7ffc0aa21000 rw-p 00000000 00:00 0                          [stack]
7ffc0ab00000-7ffc0ab02000 r-xp 00000000 00:00 0 [vdso]
";
        assert_eq!(stack_start(maps), Some(0x7ffc0aa00000));
        assert_eq!(
            stack_start("55d0c0000000-55d0c0100000 r--p 0 fe:01 1 /x\n"),
            None
        );
    }

    #[test]
    fn counts_threads() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || rx.recv());
        assert!(threads().unwrap() >= 2);
        drop(tx);
        t.join().unwrap().unwrap_err();
    }

    #[test]
    fn released_pages_read_back_unchanged() {
        // Other tests' threads fault code pages back in while this one
        // counts, so it runs alone, in a child process of the test binary.
        const CHILD: &str = "RBDKIT_RELEASE_PAGES_CHILD";
        const NAME: &str = "daemon_memory::tests::released_pages_read_back_unchanged";
        if std::env::var_os(CHILD).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", NAME, "--test-threads=1"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "{NAME} in a child: {}\n{stdout}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            return;
        }
        // A constant in this test binary's read-only data, read before and
        // after its pages are dropped.
        static TABLE: [u64; 4096] = {
            let mut t = [0u64; 4096];
            let mut i = 0;
            while i < t.len() {
                t[i] = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                i += 1;
            }
            t
        };
        let before: u64 = std::hint::black_box(&TABLE).iter().fold(0, |a, v| a ^ v);
        let resident_before = clean_object_rss_kib();
        assert!(release_startup_code() > 0);
        let resident_after = clean_object_rss_kib();
        assert!(
            resident_after < resident_before / 2,
            "the clean object mappings' resident pages went from {resident_before} \
             to only {resident_after} KiB"
        );
        let after: u64 = std::hint::black_box(&TABLE).iter().fold(0, |a, v| a ^ v);
        assert_eq!(before, after);
    }

    /// The resident KiB of the mappings [`release_startup_code`] releases.
    fn clean_object_rss_kib() -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let clean = clean_object_mappings(&smaps, Some(&exe));
        mappings(&smaps)
            .iter()
            .filter(|m| clean.contains(&(m.start, m.end)))
            .filter_map(|m| m.field("Rss"))
            .map(|kib| kib.parse::<u64>().unwrap())
            .sum()
    }
}
