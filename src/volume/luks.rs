//! LUKS2 headers on RBD images, in rbdkit's own code: read one, unlock
//! it with a passphrase, write a new one, add and remove keyslots, and the
//! AES-XTS sector cipher of its data segment.
//!
//! Why not librbd's `rbd_encryption_format`/`_load` (wrapped in
//! [`crate::rbd`] all the same): from Reef on librbd refuses to load a
//! header whose data offset is not a multiple of the stripe period, and
//! cryptsetup (so ceph-csi) puts it at 16 MiB whatever the object size;
//! librbd formats with a PBKDF benchmarked at format (argon2id with
//! 110-175 MiB here) and aligns the data to the object size; and a worker
//! taking over a mapping would need the passphrase and a PBKDF run again.
//! One format, written here and read by both mappers, avoids all three:
//! rbdkit-fuse decrypts in its own data path with the volume key this
//! module unlocks, krbd hands the image to cryptsetup and dm-crypt (see
//! vendor-notes.md for what each side accepts, measured).
//!
//! The layout written is cryptsetup's LUKS2 default, which is also what
//! ceph-csi's nodes make: two 16 KiB metadata copies, a keyslots area up to
//! 16 MiB, the data segment at 16 MiB (`aes-xts-plain64`, a 512-bit key),
//! one argon2id keyslot with `sha256` anti-forensic splitting, a `pbkdf2`
//! `sha256` digest. What is read is any LUKS2 header cryptsetup itself
//! writes with `aes-xts-plain64` (metadata copies of 16 KiB to 4 MiB,
//! argon2i/argon2id/pbkdf2 keyslots, data sectors of 512 to 4096 bytes).
//!
//! Passphrases and keys never reach an error or a log line.

use std::fmt;

use aes::cipher::generic_array::GenericArray;
use aes::cipher::KeyInit;
use aes::{Aes128, Aes256};
use ring::rand::SecureRandom;
use serde_json::{json, Value};
use xts_mode::Xts128;

use crate::error::{Error, ErrorKind, Result};
use crate::rados::Secret;

/// The primary header's magic.
const MAGIC: &[u8; 6] = b"LUKS\xba\xbe";
/// The secondary header's magic.
const MAGIC_2: &[u8; 6] = b"SKUL\xba\xbe";
/// The binary part of a header.
const BIN_SIZE: usize = 4096;
/// The metadata sizes LUKS2 allows (binary header plus JSON area).
const HDR_SIZES: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];
/// The metadata size written: cryptsetup's default.
const HDR_SIZE: u64 = 16 << 10;
/// Where the data segment starts in what is written: cryptsetup's default
/// (and ceph-csi's) header size, so either reads it the same.
pub const DATA_OFFSET: u64 = 16 << 20;
/// Anti-forensic stripes of a keyslot (LUKS's fixed 4000).
const STRIPES: usize = 4000;
/// The volume key's size written: AES-256 in XTS mode.
const KEY_SIZE: usize = 64;
/// LUKS2's salt size.
const SALT_SIZE: usize = 32;
/// The most keyslots LUKS2 has.
const MAX_KEYSLOTS: u32 = 32;
/// Argon2 memory of a new keyslot, in KiB: ceph-csi's `--pbkdf-memory`.
pub const ARGON2_MEMORY_KIB: u32 = 32 << 10;

/// Reads and writes the bytes of a LUKS device: an image, a file.
pub trait BlockIo {
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()>;
    /// Writes `data` at `offset`.
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()>;
    /// The device's size in bytes.
    fn size(&self) -> Result<u64>;
    /// What to name in errors.
    fn describe(&self) -> String;
}

impl BlockIo for crate::rbd::Image {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.read_exact(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.write(offset, data)
    }
    fn size(&self) -> Result<u64> {
        crate::rbd::Image::size(self)
    }
    fn describe(&self) -> String {
        self.spec()
    }
}

impl BlockIo for std::fs::File {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset).map_err(|e| {
            Error::from_errno(
                e.raw_os_error().unwrap_or(libc::EIO),
                "pread",
                "LUKS device",
            )
        })
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, data, offset).map_err(|e| {
            Error::from_errno(
                e.raw_os_error().unwrap_or(libc::EIO),
                "pwrite",
                "LUKS device",
            )
        })
    }
    fn size(&self) -> Result<u64> {
        use std::io::Seek;
        let mut f = self;
        f.seek(std::io::SeekFrom::End(0)).map_err(|e| {
            Error::from_errno(
                e.raw_os_error().unwrap_or(libc::EIO),
                "lseek",
                "LUKS device",
            )
        })
    }
    fn describe(&self) -> String {
        "LUKS device".to_owned()
    }
}

fn bad(io: &dyn BlockIo, why: impl Into<String>) -> Error {
    Error::invalid("luks2", io.describe(), why)
}

/// The unlocked key of a volume. Zeroed when dropped; `Debug` shows no byte.
pub struct VolumeKey(Vec<u8>);

impl VolumeKey {
    /// Its bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// As a [`Secret`] (hex), to hand to the mapper's key store.
    pub fn to_secret(&self) -> Secret {
        Secret::new(hex(&self.0))
    }

    /// Back from [`VolumeKey::to_secret`].
    pub fn from_secret(s: &Secret) -> Option<VolumeKey> {
        unhex(s.expose()).map(VolumeKey)
    }
}

impl Drop for VolumeKey {
    fn drop(&mut self) {
        crate::rados::zeroize(&mut self.0);
    }
}

impl fmt::Debug for VolumeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VolumeKey(<{} bytes redacted>)", self.0.len())
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The parameters of a new header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatOptions {
    /// The data segment's sector size: 512, 1024, 2048 or 4096.
    pub sector_size: u32,
    /// The volume key's size in bytes: 32 (AES-128-XTS) or 64 (AES-256-XTS).
    pub key_size: usize,
    /// The keyslot's key derivation.
    pub kdf: Kdf,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            sector_size: 4096,
            key_size: KEY_SIZE,
            kdf: Kdf::default(),
        }
    }
}

/// How a keyslot turns a passphrase into its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kdf {
    /// Argon2id with this time cost, memory (KiB) and parallelism.
    Argon2id {
        /// Passes over the memory.
        time: u32,
        /// Memory in KiB.
        memory_kib: u32,
        /// Lanes.
        cpus: u32,
    },
}

impl Default for Kdf {
    /// Argon2id at LUKS2's lowest time cost, with ceph-csi's memory: enough
    /// for the random 160-bit passphrases of per-volume keys, whose
    /// strength is not in the KDF (see the README).
    fn default() -> Self {
        Kdf::Argon2id {
            time: 4,
            memory_kib: ARGON2_MEMORY_KIB,
            cpus: 1,
        }
    }
}

impl Kdf {
    /// Argon2id costly enough to take about `target` here, for a passphrase
    /// a person chose (one shared by many volumes).
    pub fn calibrated(target: std::time::Duration) -> Kdf {
        let probe = Kdf::default();
        let started = std::time::Instant::now();
        let mut out = [0u8; 32];
        let _ = derive_argon2(
            argon2::Algorithm::Argon2id,
            &probe,
            b"probe",
            &[7u8; 32],
            &mut out,
        );
        let took = started.elapsed().max(std::time::Duration::from_millis(1));
        let Kdf::Argon2id {
            time,
            memory_kib,
            cpus,
        } = probe;
        let scaled = (u128::from(time) * target.as_millis() / took.as_millis().max(1)) as u32;
        Kdf::Argon2id {
            time: scaled.clamp(time, 1000),
            memory_kib,
            cpus,
        }
    }

    fn json(&self, salt: &[u8]) -> Value {
        match *self {
            Kdf::Argon2id {
                time,
                memory_kib,
                cpus,
            } => json!({
                "type": "argon2id",
                "time": time,
                "memory": memory_kib,
                "cpus": cpus,
                "salt": b64(salt),
            }),
        }
    }
}

fn derive_argon2(
    alg: argon2::Algorithm,
    kdf: &Kdf,
    pass: &[u8],
    salt: &[u8],
    out: &mut [u8],
) -> std::result::Result<(), String> {
    let Kdf::Argon2id {
        time,
        memory_kib,
        cpus,
    } = *kdf;
    let params = argon2::Params::new(memory_kib, time, cpus, Some(out.len()))
        .map_err(|e| format!("argon2 parameters: {e}"))?;
    let a = argon2::Argon2::new(alg, argon2::Version::V0x13, params);
    let mut blocks = vec![argon2::Block::default(); a.params().block_count()];
    a.hash_password_into_with_memory(pass, salt, out, &mut blocks[..])
        .map_err(|e| format!("argon2: {e}"))
}

fn b64(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(b)
}

fn unb64(s: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).ok()
}

fn random(buf: &mut [u8]) -> Result<()> {
    ring::rand::SystemRandom::new()
        .fill(buf)
        .map_err(|_| Error::from_errno(libc::EIO, "getrandom", "LUKS2 key material"))
}

/// A hash LUKS names (`sha1`, `sha256`, `sha512`).
#[derive(Debug, Clone, Copy)]
enum Hash {
    Sha1,
    Sha256,
    Sha512,
}

impl Hash {
    fn parse(name: &str) -> Option<Hash> {
        match name {
            "sha1" => Some(Hash::Sha1),
            "sha256" => Some(Hash::Sha256),
            "sha512" => Some(Hash::Sha512),
            _ => None,
        }
    }

    fn digest(self) -> &'static ring::digest::Algorithm {
        match self {
            Hash::Sha1 => &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
            Hash::Sha256 => &ring::digest::SHA256,
            Hash::Sha512 => &ring::digest::SHA512,
        }
    }

    fn pbkdf2(self) -> ring::pbkdf2::Algorithm {
        match self {
            Hash::Sha1 => ring::pbkdf2::PBKDF2_HMAC_SHA1,
            Hash::Sha256 => ring::pbkdf2::PBKDF2_HMAC_SHA256,
            Hash::Sha512 => ring::pbkdf2::PBKDF2_HMAC_SHA512,
        }
    }
}

fn pbkdf2(hash: Hash, iterations: u32, salt: &[u8], secret: &[u8], out: &mut [u8]) {
    let n = std::num::NonZeroU32::new(iterations.max(1)).unwrap_or(std::num::NonZeroU32::MIN);
    ring::pbkdf2::derive(hash.pbkdf2(), n, salt, secret, out);
}

/// LUKS's anti-forensic diffuser: each hash-sized block of `buf` becomes
/// `H(be32(i) || block)`.
fn diffuse(hash: Hash, buf: &mut [u8]) {
    let ds = hash.digest().output_len();
    for (i, chunk) in buf.chunks_mut(ds).enumerate() {
        let mut ctx = ring::digest::Context::new(hash.digest());
        ctx.update(&(i as u32).to_be_bytes());
        ctx.update(chunk);
        let d = ctx.finish();
        let n = chunk.len();
        chunk.copy_from_slice(&d.as_ref()[..n]);
    }
}

fn af_merge(hash: Hash, material: &[u8], key_size: usize, stripes: usize) -> Vec<u8> {
    let mut acc = vec![0u8; key_size];
    for i in 0..stripes - 1 {
        for (a, m) in acc
            .iter_mut()
            .zip(&material[i * key_size..(i + 1) * key_size])
        {
            *a ^= m;
        }
        diffuse(hash, &mut acc);
    }
    let last = &material[(stripes - 1) * key_size..stripes * key_size];
    acc.iter().zip(last).map(|(a, b)| a ^ b).collect()
}

fn af_split(hash: Hash, key: &[u8], stripes: usize) -> Result<Vec<u8>> {
    let n = key.len();
    let mut out = vec![0u8; n * stripes];
    random(&mut out[..n * (stripes - 1)])?;
    let mut acc = vec![0u8; n];
    for i in 0..stripes - 1 {
        for (a, m) in acc.iter_mut().zip(&out[i * n..(i + 1) * n]) {
            *a ^= m;
        }
        diffuse(hash, &mut acc);
    }
    for (j, b) in key.iter().enumerate() {
        out[(stripes - 1) * n + j] = acc[j] ^ b;
    }
    crate::rados::zeroize(&mut acc);
    Ok(out)
}

/// AES in XTS mode with a 256- or 512-bit key.
enum Xts {
    Aes128(Box<Xts128<Aes128>>),
    Aes256(Box<Xts128<Aes256>>),
}

impl Xts {
    fn new(key: &[u8]) -> Option<Xts> {
        let half = key.len() / 2;
        let (k1, k2) = key.split_at(half);
        match key.len() {
            32 => Some(Xts::Aes128(Box::new(Xts128::new(
                Aes128::new(GenericArray::from_slice(k1)),
                Aes128::new(GenericArray::from_slice(k2)),
            )))),
            64 => Some(Xts::Aes256(Box::new(Xts128::new(
                Aes256::new(GenericArray::from_slice(k1)),
                Aes256::new(GenericArray::from_slice(k2)),
            )))),
            _ => None,
        }
    }

    fn sector(&self, buf: &mut [u8], iv: u64, encrypt: bool) {
        let tweak = u128::from(iv).to_le_bytes();
        match (self, encrypt) {
            (Xts::Aes128(x), true) => x.encrypt_sector(buf, tweak),
            (Xts::Aes128(x), false) => x.decrypt_sector(buf, tweak),
            (Xts::Aes256(x), true) => x.encrypt_sector(buf, tweak),
            (Xts::Aes256(x), false) => x.decrypt_sector(buf, tweak),
        }
    }
}

/// The cipher of a data segment: `aes-xts-plain64` with the IV counted in
/// 512-byte units whatever the sector size, as dm-crypt does for LUKS2.
pub struct DataCipher {
    xts: Xts,
    sector_size: usize,
    iv_tweak: u64,
    /// Where the data segment starts on the device.
    pub offset: u64,
}

impl fmt::Debug for DataCipher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataCipher")
            .field("sector_size", &self.sector_size)
            .field("offset", &self.offset)
            .finish_non_exhaustive()
    }
}

impl DataCipher {
    /// The segment's sector size in bytes.
    pub fn sector_size(&self) -> usize {
        self.sector_size
    }

    /// Whether `[pos, pos+len)` of the segment is whole sectors.
    pub fn aligned(&self, pos: u64, len: usize) -> bool {
        let s = self.sector_size as u64;
        pos.is_multiple_of(s) && (len as u64).is_multiple_of(s)
    }

    fn run(&self, pos: u64, buf: &mut [u8], encrypt: bool) {
        let s = self.sector_size;
        for (i, sector) in buf.chunks_mut(s).enumerate() {
            let iv = (pos + (i * s) as u64) / 512 + self.iv_tweak;
            self.xts.sector(sector, iv, encrypt);
        }
    }

    /// Encrypts whole sectors that go at `pos` of the data segment.
    pub fn encrypt(&self, pos: u64, buf: &mut [u8]) {
        self.run(pos, buf, true)
    }

    /// Decrypts whole sectors read from `pos` of the data segment.
    pub fn decrypt(&self, pos: u64, buf: &mut [u8]) {
        self.run(pos, buf, false)
    }
}

/// A parsed LUKS2 header (the newer of its two copies).
#[derive(Debug, Clone)]
pub struct Header {
    /// The metadata size of each copy (binary header and JSON area).
    pub hdr_size: u64,
    /// The sequence id, raised on every change.
    pub seqid: u64,
    /// The header's UUID.
    pub uuid: String,
    label: [u8; 48],
    subsystem: [u8; 48],
    json: Value,
    /// Where the data segment starts.
    pub data_offset: u64,
    /// Its sector size.
    pub sector_size: u32,
    /// Its cipher (`aes-xts-plain64`).
    pub cipher: String,
    /// The IV added to the sector number.
    pub iv_tweak: u64,
    /// Keyslots in the JSON, by number.
    pub keyslots: Vec<u32>,
}

/// What the start of a device holds.
#[derive(Debug)]
pub enum Probe {
    /// A LUKS2 header.
    Luks2(Box<Header>),
    /// A LUKS version 1 header (not served).
    Luks1,
    /// Only zeroes where a header would be.
    Blank,
    /// Something else (a filesystem, data).
    Other,
}

fn field_u64(v: &Value) -> Option<u64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// One copy of the header, checked; `None` when its checksum is wrong.
fn read_copy(io: &dyn BlockIo, at: u64, magic: &[u8; 6]) -> Result<Option<(Vec<u8>, u64)>> {
    let mut bin = vec![0u8; BIN_SIZE];
    io.read_at(at, &mut bin)?;
    if &bin[..6] != magic {
        return Ok(None);
    }
    let version = u16::from_be_bytes([bin[6], bin[7]]);
    if version != 2 {
        return Ok(None);
    }
    let hdr_size = u64::from_be_bytes(bin[8..16].try_into().expect("8 bytes"));
    let hdr_offset = u64::from_be_bytes(bin[256..264].try_into().expect("8 bytes"));
    if !HDR_SIZES.contains(&hdr_size) || hdr_offset != at {
        return Ok(None);
    }
    let mut all = vec![0u8; hdr_size as usize];
    all[..BIN_SIZE].copy_from_slice(&bin);
    io.read_at(at + BIN_SIZE as u64, &mut all[BIN_SIZE..])?;
    let Some(hash) = Hash::parse(&cstr(&all[72..104])) else {
        return Ok(None);
    };
    let want = all[448..448 + hash.digest().output_len()].to_vec();
    all[448..512].fill(0);
    let got = ring::digest::digest(hash.digest(), &all);
    if got.as_ref() != want.as_slice() {
        return Ok(None);
    }
    all[448..448 + want.len()].copy_from_slice(&want);
    Ok(Some((all, hdr_size)))
}

impl Header {
    /// Reads the header at the start of `io`: the newer valid copy.
    pub fn probe(io: &dyn BlockIo) -> Result<Probe> {
        let mut first = vec![0u8; BIN_SIZE];
        io.read_at(0, &mut first)?;
        if &first[..6] == MAGIC && u16::from_be_bytes([first[6], first[7]]) == 1 {
            return Ok(Probe::Luks1);
        }
        let primary = read_copy(io, 0, MAGIC)?;
        let mut best = primary.clone();
        let offsets: Vec<u64> = match &primary {
            Some((_, size)) => vec![*size],
            None => HDR_SIZES.to_vec(),
        };
        let dev_size = io.size()?;
        for off in offsets {
            if off + BIN_SIZE as u64 > dev_size {
                continue;
            }
            if let Some(copy) = read_copy(io, off, MAGIC_2)? {
                let newer = match &best {
                    None => true,
                    Some((b, _)) => seqid_of(&copy.0) > seqid_of(b),
                };
                if newer {
                    best = Some(copy);
                }
                break;
            }
        }
        match best {
            Some((bytes, hdr_size)) => {
                Header::parse(io, &bytes, hdr_size).map(|h| Probe::Luks2(Box::new(h)))
            }
            None if first.iter().all(|&b| b == 0) => Ok(Probe::Blank),
            None if &first[..6] == MAGIC || &first[..6] == MAGIC_2 => Err(bad(
                io,
                "the LUKS2 header at its start is damaged (no copy has a valid checksum)",
            )),
            None => Ok(Probe::Other),
        }
    }

    /// Reads the header, or fails naming what is there instead.
    pub fn read(io: &dyn BlockIo) -> Result<Header> {
        match Header::probe(io)? {
            Probe::Luks2(h) => Ok(*h),
            Probe::Luks1 => Err(bad(
                io,
                "it has a LUKS1 header; only LUKS2 (what cryptsetup and ceph-csi make) is served",
            )),
            Probe::Blank => Err(bad(
                io,
                "its metadata says it is encrypted, but it has no LUKS2 header (its start is \
                 blank); nothing was formatted",
            )),
            Probe::Other => Err(bad(
                io,
                "its metadata says it is encrypted, but it holds no LUKS2 header (other data \
                 is at its start); nothing was formatted",
            )),
        }
    }

    fn parse(io: &dyn BlockIo, bytes: &[u8], hdr_size: u64) -> Result<Header> {
        let area = &bytes[BIN_SIZE..];
        let end = area.iter().position(|&b| b == 0).unwrap_or(area.len());
        let json: Value = serde_json::from_slice(&area[..end])
            .map_err(|e| bad(io, format!("its LUKS2 JSON metadata does not parse: {e}")))?;
        if json
            .pointer("/config/requirements/mandatory")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
        {
            return Err(bad(
                io,
                "its LUKS2 header has mandatory requirements (an unfinished reencryption?); \
                 finish that with cryptsetup first",
            ));
        }
        let segs = json
            .get("segments")
            .and_then(Value::as_object)
            .ok_or_else(|| bad(io, "its LUKS2 header has no segments"))?;
        if segs.len() != 1 {
            return Err(bad(
                io,
                format!(
                    "its LUKS2 header has {} data segments; one is served",
                    segs.len()
                ),
            ));
        }
        let seg = segs.values().next().expect("one segment");
        if seg.get("type").and_then(Value::as_str) != Some("crypt") {
            return Err(bad(io, "its LUKS2 data segment is not of type crypt"));
        }
        if seg.get("integrity").is_some() {
            return Err(bad(
                io,
                "its LUKS2 data segment has integrity protection (dm-integrity), which is not served",
            ));
        }
        let cipher = seg
            .get("encryption")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let data_offset = seg
            .get("offset")
            .and_then(field_u64)
            .ok_or_else(|| bad(io, "its LUKS2 data segment has no offset"))?;
        let sector_size = seg
            .get("sector_size")
            .and_then(Value::as_u64)
            .unwrap_or(512) as u32;
        if !matches!(sector_size, 512 | 1024 | 2048 | 4096) {
            return Err(bad(
                io,
                format!("LUKS2 sector size {sector_size} is not valid"),
            ));
        }
        if seg.get("size").and_then(Value::as_str) != Some("dynamic") {
            return Err(bad(
                io,
                "its LUKS2 data segment has a fixed size; only \"dynamic\" (the whole device) is served",
            ));
        }
        let iv_tweak = seg.get("iv_tweak").and_then(field_u64).unwrap_or(0);
        let mut keyslots: Vec<u32> = json
            .get("keyslots")
            .and_then(Value::as_object)
            .map(|m| m.keys().filter_map(|k| k.parse().ok()).collect())
            .unwrap_or_default();
        keyslots.sort_unstable();
        let mut label = [0u8; 48];
        label.copy_from_slice(&bytes[24..72]);
        let mut subsystem = [0u8; 48];
        subsystem.copy_from_slice(&bytes[208..256]);
        Ok(Header {
            hdr_size,
            seqid: seqid_of(bytes),
            uuid: cstr(&bytes[168..208]),
            label,
            subsystem,
            json,
            data_offset,
            sector_size,
            cipher,
            iv_tweak,
            keyslots,
        })
    }

    /// The data cipher for a volume key, or why this header's is not served.
    pub fn data_cipher(&self, key: &VolumeKey) -> std::result::Result<DataCipher, String> {
        if self.cipher != "aes-xts-plain64" {
            return Err(format!(
                "its LUKS2 cipher {:?} is not served by rbdkit-fuse (only aes-xts-plain64)",
                self.cipher
            ));
        }
        let xts = Xts::new(key.bytes()).ok_or_else(|| {
            format!(
                "a {}-byte aes-xts key is not served (only 32 or 64 bytes)",
                key.bytes().len()
            )
        })?;
        Ok(DataCipher {
            xts,
            sector_size: self.sector_size as usize,
            iv_tweak: self.iv_tweak,
            offset: self.data_offset,
        })
    }

    /// The size of the data segment on a device of `device_size` bytes.
    pub fn data_size(&self, device_size: u64) -> u64 {
        device_size.saturating_sub(self.data_offset) / u64::from(self.sector_size)
            * u64::from(self.sector_size)
    }

    fn digests_for(&self, slot: u32) -> Vec<&Value> {
        let s = slot.to_string();
        self.json
            .get("digests")
            .and_then(Value::as_object)
            .map(|m| {
                m.values()
                    .filter(|d| {
                        d.get("keyslots")
                            .and_then(Value::as_array)
                            .is_some_and(|a| a.iter().any(|k| k.as_str() == Some(&s)))
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Checks `key` against the digests of `slot`.
    fn verify(&self, slot: u32, key: &[u8]) -> bool {
        self.digests_for(slot).into_iter().any(|d| {
            let (Some("pbkdf2"), Some(hash), Some(it), Some(salt), Some(want)) = (
                d.get("type").and_then(Value::as_str),
                d.get("hash").and_then(Value::as_str).and_then(Hash::parse),
                d.get("iterations").and_then(Value::as_u64),
                d.get("salt").and_then(Value::as_str).and_then(unb64),
                d.get("digest").and_then(Value::as_str).and_then(unb64),
            ) else {
                return false;
            };
            let mut got = vec![0u8; want.len()];
            pbkdf2(hash, it as u32, &salt, key, &mut got);
            got.len() == want.len()
                && got.iter().zip(&want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
        })
    }

    /// Checks that `key` is this header's volume key (a kept key after a
    /// restart, before it is used).
    pub fn check_key(&self, key: &VolumeKey) -> bool {
        self.keyslots.iter().any(|s| self.verify(*s, key.bytes()))
    }

    /// Tries `passphrase` on one keyslot.
    fn open_slot(
        &self,
        io: &dyn BlockIo,
        slot: u32,
        passphrase: &[u8],
    ) -> Result<Option<VolumeKey>> {
        let ks = &self.json["keyslots"][slot.to_string()];
        let unsupported =
            |what: String| bad(io, format!("keyslot {slot}: {what} is not supported"));
        if ks.get("type").and_then(Value::as_str) != Some("luks2") {
            return Err(unsupported("its type".into()));
        }
        let key_size = ks.get("key_size").and_then(Value::as_u64).unwrap_or(0) as usize;
        let af = &ks["af"];
        let stripes = af.get("stripes").and_then(Value::as_u64).unwrap_or(0) as usize;
        let af_hash = af
            .get("hash")
            .and_then(Value::as_str)
            .and_then(Hash::parse)
            .ok_or_else(|| unsupported("its anti-forensic hash".into()))?;
        if af.get("type").and_then(Value::as_str) != Some("luks1") || stripes == 0 || key_size == 0
        {
            return Err(unsupported("its anti-forensic splitter".into()));
        }
        let area = &ks["area"];
        let enc = area
            .get("encryption")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let area_key_size = area.get("key_size").and_then(Value::as_u64).unwrap_or(0) as usize;
        let (Some(off), Some(size)) = (
            area.get("offset").and_then(field_u64),
            area.get("size").and_then(field_u64),
        ) else {
            return Err(unsupported("its area".into()));
        };
        if enc != "aes-xts-plain64" || area.get("type").and_then(Value::as_str) != Some("raw") {
            return Err(unsupported(format!("area encryption {enc:?}")));
        }
        let material_len = (key_size * stripes).div_ceil(512) * 512;
        if material_len as u64 > size || size > 64 << 20 {
            return Err(unsupported("its area size".into()));
        }
        let kdf = &ks["kdf"];
        let salt = kdf
            .get("salt")
            .and_then(Value::as_str)
            .and_then(unb64)
            .ok_or_else(|| unsupported("its KDF salt".into()))?;
        let mut area_key = vec![0u8; area_key_size];
        match kdf.get("type").and_then(Value::as_str) {
            Some("pbkdf2") => {
                let hash = kdf
                    .get("hash")
                    .and_then(Value::as_str)
                    .and_then(Hash::parse)
                    .ok_or_else(|| unsupported("its PBKDF2 hash".into()))?;
                let it = kdf.get("iterations").and_then(Value::as_u64).unwrap_or(0) as u32;
                pbkdf2(hash, it, &salt, passphrase, &mut area_key);
            }
            Some(t @ ("argon2i" | "argon2id")) => {
                let alg = if t == "argon2i" {
                    argon2::Algorithm::Argon2i
                } else {
                    argon2::Algorithm::Argon2id
                };
                let n = |k: &str| kdf.get(k).and_then(Value::as_u64).unwrap_or(0) as u32;
                let params = Kdf::Argon2id {
                    time: n("time"),
                    memory_kib: n("memory"),
                    cpus: n("cpus"),
                };
                derive_argon2(alg, &params, passphrase, &salt, &mut area_key)
                    .map_err(unsupported)?;
            }
            other => return Err(unsupported(format!("KDF {other:?}"))),
        }
        let xts = Xts::new(&area_key).ok_or_else(|| unsupported("its area key size".into()))?;
        crate::rados::zeroize(&mut area_key);
        let mut material = vec![0u8; material_len];
        io.read_at(off, &mut material)?;
        for (i, sector) in material.chunks_mut(512).enumerate() {
            xts.sector(sector, i as u64, false);
        }
        let mut key = af_merge(af_hash, &material, key_size, stripes);
        crate::rados::zeroize(&mut material);
        if self.verify(slot, &key) {
            Ok(Some(VolumeKey(key)))
        } else {
            crate::rados::zeroize(&mut key);
            Ok(None)
        }
    }

    /// Unlocks the volume key with `passphrase`: the first keyslot it opens
    /// and that slot's number. A passphrase no slot takes is a
    /// `PermissionDenied` error that says so (and nothing of the key).
    pub fn unlock(&self, io: &dyn BlockIo, passphrase: &[u8]) -> Result<(VolumeKey, u32)> {
        let mut order: Vec<(i64, u32)> = self
            .keyslots
            .iter()
            .map(|s| {
                let p = self.json["keyslots"][s.to_string()]
                    .get("priority")
                    .and_then(Value::as_i64)
                    .unwrap_or(1);
                (-p, *s)
            })
            .filter(|(p, _)| *p != 0)
            .collect();
        order.sort_unstable();
        for (_, slot) in order {
            if let Some(k) = self.open_slot(io, slot, passphrase)? {
                return Ok((k, slot));
            }
        }
        Err(Error::with_kind(
            ErrorKind::PermissionDenied,
            libc::EACCES,
            "luks2",
            io.describe(),
            "no keyslot of its LUKS2 header opens with the passphrase from the KMS (wrong key)",
        ))
    }

    /// The header's bytes (one copy, checksum made) with `seqid`.
    fn encode(&self, at: u64, seqid: u64) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.hdr_size as usize];
        out[..6].copy_from_slice(if at == 0 { MAGIC } else { MAGIC_2 });
        out[6..8].copy_from_slice(&2u16.to_be_bytes());
        out[8..16].copy_from_slice(&self.hdr_size.to_be_bytes());
        out[16..24].copy_from_slice(&seqid.to_be_bytes());
        out[24..72].copy_from_slice(&self.label);
        out[72..78].copy_from_slice(b"sha256");
        random(&mut out[104..168])?;
        let uuid = self.uuid.as_bytes();
        out[168..168 + uuid.len().min(39)].copy_from_slice(&uuid[..uuid.len().min(39)]);
        out[208..256].copy_from_slice(&self.subsystem);
        out[256..264].copy_from_slice(&at.to_be_bytes());
        let text = serde_json::to_vec(&self.json).expect("JSON serialises");
        if text.len() >= self.hdr_size as usize - BIN_SIZE {
            return Err(Error::invalid(
                "luks2",
                self.uuid.clone(),
                "the LUKS2 JSON metadata does not fit its area",
            ));
        }
        out[BIN_SIZE..BIN_SIZE + text.len()].copy_from_slice(&text);
        let sum = ring::digest::digest(&ring::digest::SHA256, &out);
        out[448..480].copy_from_slice(sum.as_ref());
        Ok(out)
    }

    /// Writes both copies with the next seqid, in one write (a RADOS
    /// object write is atomic, and both copies lie in the first object).
    fn store(&mut self, io: &dyn BlockIo) -> Result<()> {
        let seqid = self.seqid + 1;
        let mut both = self.encode(0, seqid)?;
        both.extend(self.encode(self.hdr_size, seqid)?);
        io.write_at(0, &both)?;
        self.seqid = seqid;
        Ok(())
    }

    fn keyslots_area(&self) -> (u64, u64) {
        let size = self
            .json
            .pointer("/config/keyslots_size")
            .and_then(field_u64)
            .unwrap_or(self.data_offset.saturating_sub(2 * self.hdr_size));
        (2 * self.hdr_size, 2 * self.hdr_size + size)
    }

    /// Keyslot `slot`'s area: its offset and size.
    fn slot_area(&self, slot: u32) -> Option<(u64, u64)> {
        let a = &self.json["keyslots"][slot.to_string()]["area"];
        Some((
            a.get("offset").and_then(field_u64)?,
            a.get("size").and_then(field_u64)?,
        ))
    }

    /// A free keyslot number and area for `len` bytes.
    fn free_slot(&self, len: u64) -> Option<(u32, u64)> {
        let slot = (0..MAX_KEYSLOTS).find(|s| !self.keyslots.contains(s))?;
        let mut used: Vec<(u64, u64)> = self
            .keyslots
            .iter()
            .filter_map(|s| self.slot_area(*s))
            .collect();
        used.sort_unstable();
        let (start, end) = self.keyslots_area();
        let mut at = start;
        for (o, s) in used {
            if o >= at + len {
                break;
            }
            at = at.max(o + s);
        }
        (at + len <= end).then_some((slot, at))
    }

    /// Adds a keyslot for `key` opened by `passphrase`: the key material is
    /// written first, then the header that points at it. Returns the slot.
    pub fn add_keyslot(
        &mut self,
        io: &dyn BlockIo,
        key: &VolumeKey,
        passphrase: &[u8],
        kdf: &Kdf,
    ) -> Result<u32> {
        let k = key.bytes();
        let material_len = (k.len() * STRIPES).div_ceil(512) * 512;
        let area_len = (material_len as u64).div_ceil(4096) * 4096;
        let (slot, at) = self
            .free_slot(area_len)
            .ok_or_else(|| bad(io, "its LUKS2 header has no free keyslot or keyslot area"))?;
        let mut salt = [0u8; SALT_SIZE];
        random(&mut salt)?;
        let mut area_key = vec![0u8; k.len()];
        derive_argon2(
            argon2::Algorithm::Argon2id,
            kdf,
            passphrase,
            &salt,
            &mut area_key,
        )
        .map_err(|e| bad(io, e))?;
        let xts = Xts::new(&area_key).ok_or_else(|| bad(io, "volume key size"))?;
        crate::rados::zeroize(&mut area_key);
        let mut material = af_split(Hash::Sha256, k, STRIPES)?;
        material.resize(material_len, 0);
        for (i, sector) in material.chunks_mut(512).enumerate() {
            xts.sector(sector, i as u64, true);
        }
        io.write_at(at, &material)?;
        let ks = json!({
            "type": "luks2",
            "key_size": k.len(),
            "af": {"type": "luks1", "stripes": STRIPES, "hash": "sha256"},
            "area": {
                "type": "raw",
                "offset": at.to_string(),
                "size": area_len.to_string(),
                "encryption": "aes-xts-plain64",
                "key_size": k.len(),
            },
            "kdf": kdf.json(&salt),
        });
        let s = slot.to_string();
        self.json["keyslots"]
            .as_object_mut()
            .ok_or_else(|| bad(io, "its LUKS2 keyslots are not an object"))?
            .insert(s.clone(), ks);
        // The slot joins the digest that proves the key (the segment's).
        let digest = self
            .json
            .get_mut("digests")
            .and_then(Value::as_object_mut)
            .and_then(|m| m.values_mut().next())
            .ok_or_else(|| bad(io, "its LUKS2 header has no digest"))?;
        if let Some(list) = digest.get_mut("keyslots").and_then(Value::as_array_mut) {
            list.push(Value::String(s));
        }
        self.keyslots.push(slot);
        self.keyslots.sort_unstable();
        self.store(io)?;
        Ok(slot)
    }

    /// Removes every keyslot but `keep`: the header first, then the
    /// slots' key material is overwritten with zeroes.
    pub fn keep_only(&mut self, io: &dyn BlockIo, keep: u32) -> Result<Vec<u32>> {
        let gone: Vec<u32> = self
            .keyslots
            .iter()
            .copied()
            .filter(|s| *s != keep)
            .collect();
        if gone.is_empty() {
            return Ok(gone);
        }
        let areas: Vec<(u64, u64)> = gone.iter().filter_map(|s| self.slot_area(*s)).collect();
        if let Some(m) = self.json.get_mut("keyslots").and_then(Value::as_object_mut) {
            for s in &gone {
                m.remove(&s.to_string());
            }
        }
        let keep_s = keep.to_string();
        if let Some(m) = self.json.get_mut("digests").and_then(Value::as_object_mut) {
            for d in m.values_mut() {
                if let Some(list) = d.get_mut("keyslots").and_then(Value::as_array_mut) {
                    list.retain(|k| k.as_str() == Some(keep_s.as_str()));
                }
            }
        }
        self.keyslots.retain(|s| *s == keep);
        self.store(io)?;
        let (start, end) = self.keyslots_area();
        for (o, s) in areas {
            if o >= start && o + s <= end {
                io.write_at(o, &vec![0u8; s as usize])?;
            }
        }
        Ok(gone)
    }
}

fn seqid_of(bytes: &[u8]) -> u64 {
    u64::from_be_bytes(bytes[16..24].try_into().expect("8 bytes"))
}

fn new_uuid() -> Result<String> {
    let mut b = [0u8; 16];
    random(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

/// Writes a new LUKS2 header with one keyslot for `passphrase` at the
/// start of `io`, in one write (headers and key material lie in the first
/// 300 KiB, inside the image's first object), and returns it with its
/// volume key. The caller has made sure nothing is there to lose.
pub fn format(
    io: &dyn BlockIo,
    passphrase: &[u8],
    opts: &FormatOptions,
) -> Result<(Header, VolumeKey)> {
    if !matches!(opts.sector_size, 512 | 1024 | 2048 | 4096) {
        return Err(bad(
            io,
            format!(
                "sector size {} is not 512, 1024, 2048 or 4096",
                opts.sector_size
            ),
        ));
    }
    if !matches!(opts.key_size, 32 | 64) {
        return Err(bad(
            io,
            format!("key size {} bits is not 256 or 512", opts.key_size * 8),
        ));
    }
    let size = io.size()?;
    if size <= DATA_OFFSET + u64::from(opts.sector_size) {
        return Err(bad(
            io,
            format!(
                "an encrypted volume must be larger than its {} MiB LUKS2 header",
                DATA_OFFSET >> 20
            ),
        ));
    }
    let mut key = vec![0u8; opts.key_size];
    random(&mut key)?;
    let key = VolumeKey(key);
    let mut digest_salt = [0u8; SALT_SIZE];
    random(&mut digest_salt)?;
    let iterations = 1000u32;
    let mut digest = [0u8; 32];
    pbkdf2(
        Hash::Sha256,
        iterations,
        &digest_salt,
        key.bytes(),
        &mut digest,
    );
    let json = json!({
        "keyslots": {},
        "tokens": {},
        "segments": {
            "0": {
                "type": "crypt",
                "offset": DATA_OFFSET.to_string(),
                "size": "dynamic",
                "iv_tweak": "0",
                "encryption": "aes-xts-plain64",
                "sector_size": opts.sector_size,
            }
        },
        "digests": {
            "0": {
                "type": "pbkdf2",
                "keyslots": [],
                "segments": ["0"],
                "hash": "sha256",
                "iterations": iterations,
                "salt": b64(&digest_salt),
                "digest": b64(&digest),
            }
        },
        "config": {
            "json_size": (HDR_SIZE - BIN_SIZE as u64).to_string(),
            "keyslots_size": (DATA_OFFSET - 2 * HDR_SIZE).to_string(),
        }
    });
    let mut h = Header {
        hdr_size: HDR_SIZE,
        seqid: 0,
        uuid: new_uuid()?,
        label: [0u8; 48],
        subsystem: [0u8; 48],
        json,
        data_offset: DATA_OFFSET,
        sector_size: opts.sector_size,
        cipher: "aes-xts-plain64".to_owned(),
        iv_tweak: 0,
        keyslots: Vec::new(),
    };
    // Built in memory, written once: the slot's material, then both copies.
    let mem = MemIo::new(2 * HDR_SIZE + 512 * 1024);
    h.add_keyslot(&mem, &key, passphrase, &opts.kdf)?;
    let image = mem.into_inner();
    let used = image.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    io.write_at(0, &image[..used.div_ceil(4096) * 4096])?;
    Ok((h, key))
}

/// A device in memory, to build a header in before it is written at once.
struct MemIo(std::cell::RefCell<Vec<u8>>);

impl MemIo {
    fn new(len: u64) -> MemIo {
        MemIo(std::cell::RefCell::new(vec![0u8; len as usize]))
    }
    fn into_inner(self) -> Vec<u8> {
        self.0.into_inner()
    }
}

impl BlockIo for MemIo {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let v = self.0.borrow();
        let o = offset as usize;
        buf.copy_from_slice(&v[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let mut v = self.0.borrow_mut();
        let o = offset as usize;
        if v.len() < o + data.len() {
            v.resize(o + data.len(), 0);
        }
        v[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn size(&self) -> Result<u64> {
        Ok(DATA_OFFSET * 2)
    }
    fn describe(&self) -> String {
        "new LUKS2 header".to_owned()
    }
}

/// Whether `len` bytes from `offset` of `io` are all zero (read in 1 MiB
/// pieces).
pub fn is_zero(io: &dyn BlockIo, offset: u64, len: u64) -> Result<bool> {
    let mut buf = vec![0u8; 1 << 20];
    let mut at = offset;
    while at < offset + len {
        let n = ((offset + len - at) as usize).min(buf.len());
        io.read_at(at, &mut buf[..n])?;
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_unlock_rotate_round_trip_in_memory() {
        let dev = MemIo::new(DATA_OFFSET * 2);
        let opts = FormatOptions::default();
        let (h, key) = format(&dev, b"first", &opts).unwrap();
        assert_eq!(h.data_offset, DATA_OFFSET);
        let mut h = match Header::probe(&dev).unwrap() {
            Probe::Luks2(h) => *h,
            other => panic!("{other:?}"),
        };
        let (k, slot) = h.unlock(&dev, b"first").unwrap();
        assert_eq!(k.bytes(), key.bytes());
        assert_eq!(slot, 0);
        let e = h.unlock(&dev, b"wrong").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        assert!(!e.to_string().contains("first"));
        let new = h.add_keyslot(&dev, &k, b"second", &Kdf::default()).unwrap();
        assert_eq!(new, 1);
        let h2 = Header::read(&dev).unwrap();
        assert_eq!(h2.keyslots, vec![0, 1]);
        assert!(h2.seqid > 1);
        let mut h2 = h2;
        assert_eq!(h2.keep_only(&dev, 1).unwrap(), vec![0]);
        let h3 = Header::read(&dev).unwrap();
        assert_eq!(h3.keyslots, vec![1]);
        assert!(h3.unlock(&dev, b"first").is_err());
        assert_eq!(h3.unlock(&dev, b"second").unwrap().0.bytes(), key.bytes());
        assert!(h3.check_key(&key));
    }

    #[test]
    fn data_cipher_round_trips_and_counts_ivs_in_512_byte_units() {
        let dev = MemIo::new(DATA_OFFSET * 2);
        let (h, key) = format(&dev, b"p", &FormatOptions::default()).unwrap();
        let c = h.data_cipher(&key).unwrap();
        let plain: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
        let mut buf = plain.clone();
        c.encrypt(4096, &mut buf);
        assert_ne!(buf, plain);
        // The second 4 KiB sector alone decrypts the same: IVs are per
        // sector, by position.
        let mut second = buf[4096..].to_vec();
        c.decrypt(8192, &mut second);
        assert_eq!(second, plain[4096..]);
        c.decrypt(4096, &mut buf);
        assert_eq!(buf, plain);
    }

    #[test]
    fn af_split_and_merge_are_inverse() {
        let key = [9u8; 64];
        let m = af_split(Hash::Sha256, &key, 4000).unwrap();
        assert_eq!(af_merge(Hash::Sha256, &m, 64, 4000), key.to_vec());
    }

    #[test]
    fn blank_and_other_starts_are_told_apart() {
        let dev = MemIo::new(DATA_OFFSET * 2);
        assert!(matches!(Header::probe(&dev).unwrap(), Probe::Blank));
        dev.write_at(1024, b"\x53\xef").unwrap();
        dev.write_at(0, b"not zero").unwrap();
        assert!(matches!(Header::probe(&dev).unwrap(), Probe::Other));
        let e = Header::read(&dev).unwrap_err();
        assert!(e.to_string().contains("no LUKS2 header"), "{e}");
    }
}
