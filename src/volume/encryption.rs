//! Encrypted volumes: what a class asks for, what is recorded on an image,
//! and the steps that give a new image its passphrase and LUKS2 header,
//! carry them to clones, and open or re-key them.
//!
//! # What is recorded (as ceph-csi records it)
//! - `rbd.csi.ceph.com/encrypted`: `encryptionPrepared` (the passphrase is
//!   stored, no header yet) or `encrypted` (the header is written);
//! - `rbd.csi.ceph.com/dek`: the `metadata` KMS's encrypted passphrase;
//! - `rbd.csi.ceph.com/luks2HeaderSize`: the header's size (16 MiB);
//! - `rbdkit.encryption.kms`: the KMS id (ceph-csi keeps it in its journal);
//! - `rbdkit.encryption.key-id`: the id the passphrase is kept under, when
//!   it is not the volume's own handle (snapshot images keep their
//!   source's).
//!
//! # When the header is written
//! At create, by the provisioner or the CSI controller, inside the create
//! steps on the temporary image before it is renamed to its final name
//! ([`setup_new`]): a temporary image never held data, so a retry after a
//! crash may write the header again, and a volume never exists under its
//! name without one. The node never formats, except a ceph-csi volume
//! still in `encryptionPrepared` whose header region is all zeroes
//! ([`open_for_stage`]). So nothing is ever formatted over data.

use std::collections::BTreeMap;

use crate::error::{Error, ErrorKind, Result};
use crate::rados::Secret;
use crate::rbd::Image;
use crate::volume::kms::{
    self, Keys, LEGACY_META, META_DEK, META_HEADER_SIZE, META_KEY_ID, META_KMS_ID, META_STATE,
    STATE_ENCRYPTED, STATE_PREPARED,
};
use crate::volume::luks::{self, FormatOptions, Header, Probe, VolumeKey};

/// `encryptionType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncryptionType {
    /// LUKS2 on the block device.
    Block,
}

/// A class's encryption, from its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncryptionParams {
    /// `encryptionKMSID` (`default` when not given).
    pub kms_id: String,
    /// `encryptionType`.
    pub kind: EncryptionType,
    /// The header's data sector size (`encryptionSectorSize`, default 4096).
    pub sector_size: u32,
    /// The volume key size in bytes (`encryptionKeySize` / 8, default 64).
    pub key_size: usize,
}

impl EncryptionParams {
    /// The format options of a new header: argon2id at its lowest cost for
    /// per-volume random passphrases, calibrated to about two seconds (as
    /// cryptsetup does) for the shared passphrase of the `default` KMS.
    pub fn format_options(&self, per_volume: bool) -> FormatOptions {
        FormatOptions {
            sector_size: self.sector_size,
            key_size: self.key_size,
            kdf: if per_volume {
                luks::Kdf::default()
            } else {
                luks::Kdf::calibrated(std::time::Duration::from_secs(2))
            },
        }
    }
}

/// What the create steps need to encrypt a new volume: the class's
/// parameters and the KMS keys the request brought.
#[derive(Debug, Clone)]
pub struct NewEncryption {
    /// The class's encryption parameters.
    pub params: EncryptionParams,
    /// The KMS keys.
    pub keys: Keys,
}

impl NewEncryption {
    /// Format options for this volume's header.
    pub fn format_options(&self) -> FormatOptions {
        self.params
            .format_options(!matches!(self.keys, Keys::Shared(_)))
    }
}

/// Why `size` bytes is too small for an encrypted volume, if it is.
pub fn check_size(size: u64, sector_size: u32) -> std::result::Result<(), String> {
    if size <= luks::DATA_OFFSET + u64::from(sector_size) {
        return Err(format!(
            "an encrypted volume must be larger than its {} MiB LUKS2 header ({size} bytes asked \
             for); of what is asked for, {} MiB go to the header, as with ceph-csi",
            luks::DATA_OFFSET >> 20,
            luks::DATA_OFFSET >> 20
        ));
    }
    Ok(())
}

/// An image's encryption state ([`META_STATE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Not encrypted.
    Plain,
    /// `encryptionPrepared`: passphrase stored, no header yet.
    Prepared,
    /// `encrypted`: the header is written.
    Encrypted,
}

impl State {
    /// Encrypted or to be.
    pub fn encrypted(self) -> bool {
        self != State::Plain
    }
}

/// An image's metadata value of `key`, or of its older ceph-csi name.
pub fn meta_value<'a>(meta: &'a BTreeMap<String, String>, key: &str) -> Option<&'a str> {
    meta.get(key)
        .or_else(|| {
            LEGACY_META
                .iter()
                .find(|(_, new)| *new == key)
                .and_then(|(old, _)| meta.get(*old))
        })
        .map(String::as_str)
}

/// The encryption state recorded in `meta`; an unknown value is an error.
pub fn state_of(meta: &BTreeMap<String, String>, image: &str) -> Result<State> {
    match meta_value(meta, META_STATE) {
        None | Some("") => Ok(State::Plain),
        Some(STATE_PREPARED) => Ok(State::Prepared),
        Some(STATE_ENCRYPTED) => Ok(State::Encrypted),
        Some(other) => Err(Error::invalid(
            "encryption",
            image.to_owned(),
            format!("its {META_STATE} metadata is {other:?}, not a state rbdkit knows"),
        )),
    }
}

/// The KMS id recorded in `meta` (`default` for an image ceph-csi made,
/// which records it elsewhere).
pub fn kms_id_of(meta: &BTreeMap<String, String>) -> String {
    meta.get(META_KMS_ID)
        .cloned()
        .unwrap_or_else(|| kms::DEFAULT_KMS_ID.to_owned())
}

/// The id a volume's passphrase is kept under: the recorded one, else
/// the volume's handle.
pub fn key_id_of(meta: &BTreeMap<String, String>, handle: &str) -> String {
    meta.get(META_KEY_ID)
        .cloned()
        .unwrap_or_else(|| handle.to_owned())
}

/// Where an image's passphrase is kept, as its metadata records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    /// The encryption state.
    pub state: State,
    /// The KMS id ([`kms_id_of`]).
    pub kms_id: String,
    /// The id the passphrase is kept under ([`key_id_of`]).
    pub key_id: String,
    /// The tenant the Vault KMS's tenant kinds log in for: the claim's
    /// namespace (for a snapshot image, the VolumeSnapshot's), if recorded.
    pub tenant: Option<String>,
}

/// The [`KeyRecord`] of image `image` (handle `handle`) from its metadata.
pub fn key_record(meta: &BTreeMap<String, String>, image: &str, handle: &str) -> Result<KeyRecord> {
    let tenant = [
        kms::META_KEY_TENANT,
        crate::volume::ops::META_PVC_NAMESPACE,
        crate::volume::snapshot::META_SNAPSHOT_NAMESPACE,
    ]
    .iter()
    .find_map(|k| meta.get(*k).filter(|v| !v.is_empty()).cloned());
    Ok(KeyRecord {
        state: state_of(meta, image)?,
        kms_id: kms_id_of(meta),
        key_id: key_id_of(meta, handle),
        tenant,
    })
}

/// The [`KeyRecord`] of the image of `vol` (handle `handle`), `None` if
/// there is no such image.
pub fn read_key_record(
    cluster: &crate::rados::Cluster,
    vol: &crate::volume::VolumeId,
    handle: &str,
) -> Result<Option<KeyRecord>> {
    let io = cluster.ioctx_ns(&vol.pool, &vol.rados_namespace)?;
    let image = match Image::open_read_only(&io, &vol.image) {
        Ok(i) => i,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = image.metadata_list()?;
    key_record(&meta, &vol.image, handle).map(Some)
}

/// Records on the image of `vol` that its passphrase is kept under
/// `key_id` for `tenant` (a snapshot image, once its own copy of the key
/// is stored).
pub fn record_key_id(
    cluster: &crate::rados::Cluster,
    vol: &crate::volume::VolumeId,
    key_id: &str,
    tenant: Option<&str>,
) -> Result<()> {
    let io = cluster.ioctx_ns(&vol.pool, &vol.rados_namespace)?;
    let image = Image::open(&io, &vol.image)?;
    if let Some(t) = tenant {
        set(&image, kms::META_KEY_TENANT, t)?;
    }
    set(&image, META_KEY_ID, key_id)
}

/// The RADOS object (one per pool and RADOS namespace) whose omap lists
/// the Vault keys of removed images not yet confirmed removed from Vault:
/// key the volume (or snapshot) handle, value a JSON [`KeyToRemove`].
/// Written before the image is removed and cleared after the key is, so a
/// retry whose image is already gone still removes the key, and `rbdkit gc`
/// reports what a crash left.
pub const KEYS_TO_REMOVE: &str = "rbdkit.kms.keys-to-remove";

/// A KMS key to remove once its image is gone.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeyToRemove {
    /// The KMS id.
    pub kms: String,
    /// The key's id in that KMS.
    pub key: String,
    /// The tenant to log in for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

fn keys_io(
    cluster: &crate::rados::Cluster,
    vol: &crate::volume::VolumeId,
) -> Result<crate::rados::IoCtx> {
    cluster.ioctx_ns(&vol.pool, &vol.rados_namespace)
}

/// [`keys_io`], `None` when the pool itself is gone (and so are its images
/// and notes).
fn keys_io_if_pool(
    cluster: &crate::rados::Cluster,
    vol: &crate::volume::VolumeId,
) -> Result<Option<crate::rados::IoCtx>> {
    match keys_io(cluster, vol) {
        Ok(io) => Ok(Some(io)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Notes, in [`KEYS_TO_REMOVE`] of `vol`'s pool, that `key` goes once the
/// image of `handle` is gone.
pub fn note_key_to_remove(
    cluster: &crate::rados::Cluster,
    vol: &crate::volume::VolumeId,
    handle: &str,
    key: &KeyToRemove,
) -> Result<()> {
    let value = serde_json::to_vec(key).expect("serialises");
    keys_io(cluster, vol)?.omap_set(KEYS_TO_REMOVE, &[(handle, value)])
}

/// The keys noted in [`KEYS_TO_REMOVE`] of `vol`'s pool: all of them, or
/// only that of `handle`. An entry that is not a [`KeyToRemove`] is an
/// error naming it.
pub fn keys_to_remove(
    cluster: &crate::rados::Cluster,
    vol: &crate::volume::VolumeId,
    handle: Option<&str>,
) -> Result<BTreeMap<String, KeyToRemove>> {
    let Some(io) = keys_io_if_pool(cluster, vol)? else {
        return Ok(BTreeMap::new());
    };
    let raw = match handle {
        Some(h) => io.omap_get(KEYS_TO_REMOVE, &[h]),
        None => io.omap_list(KEYS_TO_REMOVE, ""),
    };
    let raw = match raw {
        Ok(r) => r,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(e),
    };
    raw.into_iter()
        .map(|(k, v)| {
            serde_json::from_slice(&v)
                .map(|r| (k.clone(), r))
                .map_err(|e| {
                    Error::invalid(
                        "encryption",
                        format!("{KEYS_TO_REMOVE} entry {k:?}"),
                        format!("not a KMS key record: {e}"),
                    )
                })
        })
        .collect()
}

/// Before the image of `image` is removed: if it is one of `provisioner`'s
/// and encrypted with a KMS that keeps its keys itself
/// (`kept_outside(kms_id)`, Vault; asked only for an encrypted image, so
/// the KMS config matters to no other delete), notes its key in [`KEYS_TO_REMOVE`]
/// under `handle`. A volume's key is its recorded key id; a snapshot's
/// (`snapshot`) is always its own handle, never the source's it may still
/// record.
pub fn note_key_before_remove(
    cluster: &crate::rados::Cluster,
    image: &crate::volume::VolumeId,
    handle: &str,
    snapshot: bool,
    provisioner: &str,
    kept_outside: &dyn Fn(&str) -> Result<bool>,
) -> Result<()> {
    let Some(io) = keys_io_if_pool(cluster, image)? else {
        return Ok(());
    };
    let meta = match Image::open_read_only(&io, &image.image) {
        Ok(i) => i.metadata_list()?,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if meta
        .get(crate::volume::ops::META_PROVISIONER)
        .map(String::as_str)
        != Some(provisioner)
    {
        return Ok(());
    }
    let rec = key_record(&meta, &image.image, handle)?;
    if !rec.state.encrypted() || !kept_outside(&rec.kms_id)? {
        return Ok(());
    }
    let key = KeyToRemove {
        kms: rec.kms_id,
        key: if snapshot {
            handle.to_owned()
        } else {
            rec.key_id
        },
        tenant: rec.tenant,
    };
    note_key_to_remove(cluster, image, handle, &key)
}

/// Clears the [`KEYS_TO_REMOVE`] entry of `handle` (its key is removed).
pub fn forget_key_to_remove(
    cluster: &crate::rados::Cluster,
    vol: &crate::volume::VolumeId,
    handle: &str,
) -> Result<()> {
    let Some(io) = keys_io_if_pool(cluster, vol)? else {
        return Ok(());
    };
    match io.omap_remove(KEYS_TO_REMOVE, &[handle]) {
        Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The passphrase of an encrypted image from its metadata and `keys`.
pub fn passphrase_of(
    meta: &BTreeMap<String, String>,
    image: &str,
    key_id: &str,
    keys: &Keys,
) -> Result<Secret> {
    match keys {
        Keys::Shared(p) | Keys::Given(p) => Ok(p.clone()),
        Keys::Metadata(kek) => {
            let stored = meta_value(meta, META_DEK).ok_or_else(|| {
                Error::invalid(
                    "encryption",
                    image.to_owned(),
                    format!(
                        "it is encrypted with the metadata KMS but has no {META_DEK} metadata: \
                         its passphrase is lost"
                    ),
                )
            })?;
            kms::unwrap_dek(kek, key_id, stored)
        }
    }
}

fn set(image: &Image, key: &str, value: &str) -> Result<()> {
    image.metadata_set(key, value)
}

/// Gives a new image (the temporary image of a create, ours, never used)
/// its passphrase and LUKS2 header, and records both as ceph-csi does.
/// Re-run after a crash at any step it finishes: a stored passphrase is
/// used again, a header not known to be complete is written again.
pub fn setup_new(
    image: &Image,
    handle: &str,
    kms_id: &str,
    keys: &Keys,
    opts: &FormatOptions,
) -> Result<()> {
    let meta = image.metadata_list()?;
    if state_of(&meta, handle)? == State::Encrypted {
        return Ok(());
    }
    let passphrase = match keys {
        Keys::Shared(p) | Keys::Given(p) => p.clone(),
        Keys::Metadata(kek) => match meta_value(&meta, META_DEK) {
            Some(stored) => kms::unwrap_dek(kek, handle, stored)?,
            None => {
                let p = kms::new_passphrase()?;
                set(image, META_DEK, &kms::wrap_dek(kek, handle, &p)?)?;
                p
            }
        },
    };
    set(image, META_KMS_ID, kms_id)?;
    set(image, META_STATE, STATE_PREPARED)?;
    luks::format(image, passphrase.expose().as_bytes(), opts)?;
    image.flush()?;
    set(image, META_HEADER_SIZE, &luks::DATA_OFFSET.to_string())?;
    set(image, META_STATE, STATE_ENCRYPTED)?;
    Ok(())
}

/// The metadata a clone of an encrypted image needs to be opened on its
/// own: the passphrase re-encrypted under the clone's handle (for the
/// `metadata` KMS; ceph-csi re-stores the parent's passphrase under the
/// new volume id the same way), the KMS id and the state. The header
/// itself comes with the clone's data.
pub fn clone_metadata(
    parent_meta: &BTreeMap<String, String>,
    parent_handle: &str,
    parent_image: &str,
    clone_handle: &str,
    kms_id: &str,
    keys: &Keys,
) -> Result<Vec<(&'static str, String)>> {
    let parent_key_id = key_id_of(parent_meta, parent_handle);
    let pass = passphrase_of(parent_meta, parent_image, &parent_key_id, keys)?;
    let mut out = vec![
        (META_KMS_ID, kms_id.to_owned()),
        (META_STATE, STATE_ENCRYPTED.to_owned()),
    ];
    if let Keys::Metadata(kek) = keys {
        out.push((META_DEK, kms::wrap_dek(kek, clone_handle, &pass)?));
    }
    Ok(out)
}

/// Why an encrypted source and a class do not go together, if they do not.
pub fn check_compatible(
    source: &str,
    source_state: State,
    source_kms: &str,
    class: Option<&str>,
) -> std::result::Result<(), String> {
    match (source_state.encrypted(), class) {
        (false, None) => Ok(()),
        (true, None) => Err(format!(
            "{source} is encrypted, and the StorageClass is not (encrypted is not \"true\"): \
             its content would be served as ciphertext; use an encrypted class"
        )),
        (false, Some(_)) => Err(format!(
            "{source} is not encrypted, and the StorageClass is (encrypted: \"true\"): an \
             unencrypted source cannot become an encrypted volume by cloning"
        )),
        (true, Some(kms)) if kms != source_kms => Err(format!(
            "{source} keeps its passphrase with KMS {source_kms:?}, and the StorageClass \
             names {kms:?}: re-wrapping a passphrase across KMSs is not supported"
        )),
        (true, Some(_)) => Ok(()),
    }
}

/// Opens an encrypted image for a stage: checks its header, and for a
/// ceph-csi volume still `encryptionPrepared` writes the header first if
/// (and only if) the whole header region is zeroes (a crash after a
/// format and before the state change leaves a header, which is adopted).
/// Returns the header; the passphrase is checked against it.
pub fn open_for_stage(
    image: &Image,
    state: State,
    passphrase: &Secret,
    opts: &FormatOptions,
) -> Result<Header> {
    let spec = image.spec();
    let pass = passphrase.expose().as_bytes();
    match (state, Header::probe(image)?) {
        (State::Plain, _) => Err(Error::invalid(
            "encryption",
            spec,
            "the volume is not encrypted",
        )),
        (_, Probe::Luks2(h)) => {
            h.unlock(image, pass)?;
            if state == State::Prepared {
                set(image, META_STATE, STATE_ENCRYPTED)?;
            }
            Ok(*h)
        }
        (State::Prepared, Probe::Blank) => {
            let size = luks::BlockIo::size(image)?;
            if !luks::is_zero(image, 0, luks::DATA_OFFSET.min(size))? {
                return Err(Error::invalid(
                    "encryption",
                    spec,
                    format!(
                        "its {META_STATE} metadata is {STATE_PREPARED} but its header region holds data; \
                         refusing to format it"
                    ),
                ));
            }
            let (h, _) = luks::format(image, pass, opts)?;
            image.flush()?;
            set(image, META_HEADER_SIZE, &luks::DATA_OFFSET.to_string())?;
            set(image, META_STATE, STATE_ENCRYPTED)?;
            Ok(h)
        }
        (State::Prepared, Probe::Other) => Err(Error::invalid(
            "encryption",
            spec,
            format!(
                "its {META_STATE} metadata is {STATE_PREPARED} but its start holds data (no LUKS2 \
                 header): refusing to format it"
            ),
        )),
        (_, other) => {
            // Let `read` name what is there.
            drop(other);
            Header::read(image)
        }
    }
}

/// Replaces the passphrase of an encrypted image: a new keyslot for a new
/// passphrase, then `store` (which must make the KMS hand out the new
/// one), then every other keyslot removed. No data is rewritten. Re-run
/// after a crash at any point it converges on one keyslot, the KMS's.
/// Returns the slot the new passphrase opens.
pub fn rotate(
    image: &Image,
    current: &Secret,
    store: impl FnOnce(&Secret) -> Result<()>,
) -> Result<u32> {
    let mut h = Header::read(image)?;
    let (key, slot): (VolumeKey, u32) = h.unlock(image, current.expose().as_bytes())?;
    // Leftovers of a run cut short: a slot whose passphrase never reached
    // the KMS, or the one the KMS no longer has.
    h.keep_only(image, slot)?;
    let new = kms::new_passphrase()?;
    let kdf = luks::Kdf::default();
    let new_slot = h.add_keyslot(image, &key, new.expose().as_bytes(), &kdf)?;
    image.flush()?;
    store(&new)?;
    h.keep_only(image, new_slot)?;
    image.flush()?;
    Ok(new_slot)
}

/// A KMS that keeps each volume's passphrase itself (Vault), as the
/// blocking steps of a rotation see it
/// ([`crate::volume::kms::keystore::BlockingKeyStore`]).
pub trait KeptKeys: Send + Sync {
    /// The passphrase kept under `key_id`.
    fn get(&self, key_id: &str) -> Result<Secret>;
    /// Keeps `passphrase` under `key_id`, replacing the one there.
    fn put(&self, key_id: &str, passphrase: &Secret) -> Result<()>;
}

/// Where [`rotate_volume`] reads a volume's passphrase and keeps its new
/// one.
pub enum RotationKms {
    /// The `metadata` KMS: the Secret's `encryptionPassphrase`, which wraps
    /// the passphrase kept in [`META_DEK`].
    Metadata(Secret),
    /// A KMS that keeps the passphrases itself (Vault).
    Kept(Box<dyn KeptKeys>),
}

/// The key record and KMS kind of volume `vol` (handle `handle`) whose
/// passphrase is to be rotated, once it is known that it can be: the
/// image exists, is encrypted, has its LUKS2 header, and its KMS (in
/// `config`) keeps a passphrase per volume. Each refusal is an
/// `InvalidArgument` error naming the volume (or `NotFound` for a missing
/// image), and nothing is changed.
pub fn rotation_target(
    cluster: &crate::rados::Cluster,
    vol: &crate::volume::VolumeId,
    handle: &str,
    config: &kms::KmsConfig,
) -> Result<(KeyRecord, kms::KmsKind)> {
    let rec = read_key_record(cluster, vol, handle)?.ok_or_else(|| {
        Error::with_kind(
            ErrorKind::NotFound,
            libc::ENOENT,
            "encryption",
            handle.to_owned(),
            format!("its image {vol} does not exist"),
        )
    })?;
    let refuse = |why: String| Err(Error::invalid("encryption", handle.to_owned(), why));
    match rec.state {
        State::Plain => {
            return refuse(format!(
                "the volume is not encrypted (its {META_STATE} metadata does not say it is): it \
                 has no passphrase to rotate"
            ))
        }
        State::Prepared => {
            return refuse(format!(
                "its LUKS2 header is not written yet ({META_STATE} is {STATE_PREPARED}): stage \
                 it once, then rotate"
            ))
        }
        State::Encrypted => {}
    }
    let kind = config.kind(&rec.kms_id)?;
    if !kind.per_volume() {
        return refuse(format!(
            "KMS {:?} gives every volume the Secret's own {}; rotate that Secret's \
             passphrase instead (a per-volume rotation would lock the volume out)",
            rec.kms_id,
            kms::PASSPHRASE_KEY
        ));
    }
    Ok((rec, kind))
}

/// Gives volume `vol` a new passphrase ([`rotate`]): the current one read
/// from `kms` under `rec`'s key id ([`rotation_target`] gives `rec`), the
/// new one kept there before the old keyslots go. Returns the keyslot the
/// new passphrase opens. Re-run after a crash at any point it converges,
/// as [`rotate`] does.
pub fn rotate_volume(
    cluster: &crate::rados::Cluster,
    vol: &crate::volume::VolumeId,
    rec: &KeyRecord,
    kms: &RotationKms,
) -> Result<u32> {
    let io = cluster.ioctx_ns(&vol.pool, &vol.rados_namespace)?;
    let image = Image::open(&io, &vol.image)?;
    let current = match kms {
        RotationKms::Metadata(kek) => passphrase_of(
            &image.metadata_list()?,
            &vol.image,
            &rec.key_id,
            &Keys::Metadata(kek.clone()),
        )?,
        RotationKms::Kept(kept) => kept.get(&rec.key_id)?,
    };
    let slot = rotate(&image, &current, |new| match kms {
        RotationKms::Metadata(kek) => set(&image, META_DEK, &kms::wrap_dek(kek, &rec.key_id, new)?),
        RotationKms::Kept(kept) => kept.put(&rec.key_id, new),
    })?;
    image.close()?;
    Ok(slot)
}
