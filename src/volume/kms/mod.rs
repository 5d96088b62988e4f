//! Where the passphrases of encrypted volumes come from: ceph-csi's KMS
//! configuration, read from the same file (the `ceph-csi-encryption-kms-config`
//! ConfigMap's `config.json`, mounted into the provisioner, the CSI
//! controller and the node plugin), and the kinds of KMS it names.
//!
//! The file is one JSON object, `{ "<encryptionKMSID>": { "encryptionKMSType":
//! "<kind>", ... }, ... }`. A StorageClass names an entry with
//! `encryptionKMSID`; without one it gets `default`, which is never looked
//! up in the file (as in ceph-csi).
//!
//! Kinds served:
//! - `default` (ceph-csi's *secrets* KMS): every volume's LUKS passphrase is
//!   the `encryptionPassphrase` of the request's Secret (the provisioner
//!   Secret at create, the node-stage Secret at stage), as given;
//! - `metadata` (ceph-csi's secrets-metadata): a passphrase per volume, 20
//!   random bytes in URL-safe base64 (28 characters), kept in the image's
//!   metadata `rbd.csi.ceph.com/dek` encrypted with AES-256-GCM under
//!   `scrypt(encryptionPassphrase, salt = the volume id, N=32768, r=8, p=1)`,
//!   exactly as ceph-csi stores it ([`wrap_dek`], [`unwrap_dek`]).
//!
//! `vault`, `vaulttokens` and `vaulttenantsa` keep the passphrase in
//! Vault's (or OpenBao's) KV store under the volume id ([`KmsKind::Vault`],
//! the client in [`vault`], the steps of a volume's life in [`keystore`]);
//! the other kinds ceph-csi has (`aws-metadata`, `aws-sts-metadata`, `azure-kv`, `ibmkeyprotect`,
//! `kp-metadata`, `kmip`) are refused by name. So is `metadata` with
//! `secretName`: it reads a Secret through the Kubernetes API, which the
//! CSI driver does not use.

pub mod keystore;
pub mod vault;

use std::collections::BTreeMap;
use std::path::Path;

use ring::rand::SecureRandom;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, ErrorKind, Result};
use crate::rados::Secret;

/// Where ceph-csi mounts the KMS config, and where rbdkit reads it.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/ceph-csi-encryption-kms-config/config.json";
/// The KMS id a class without `encryptionKMSID` gets.
pub const DEFAULT_KMS_ID: &str = "default";
/// The Secret key holding the passphrase (`default`) or the key that
/// encrypts the per-volume passphrases (`metadata`).
pub const PASSPHRASE_KEY: &str = "encryptionPassphrase";
/// Image metadata: the encrypted per-volume passphrase (`metadata` KMS).
pub const META_DEK: &str = "rbd.csi.ceph.com/dek";
/// Image metadata: the encryption state.
pub const META_STATE: &str = "rbd.csi.ceph.com/encrypted";
/// Image metadata: the LUKS2 header size ceph-csi 3.15 and later records.
pub const META_HEADER_SIZE: &str = "rbd.csi.ceph.com/luks2HeaderSize";
/// The names older ceph-csi releases used for [`META_DEK`] and
/// [`META_STATE`] (read when the new ones are missing).
pub const LEGACY_META: [(&str, &str); 2] = [
    (".rbd.csi.ceph.com/dek", META_DEK),
    (".rbd.csi.ceph.com/encrypted", META_STATE),
];
/// [`META_STATE`]: the passphrase is stored, the header not written yet.
pub const STATE_PREPARED: &str = "encryptionPrepared";
/// [`META_STATE`]: the image has its LUKS2 header.
pub const STATE_ENCRYPTED: &str = "encrypted";
/// Image metadata: the KMS id the volume's passphrase is kept with.
pub const META_KMS_ID: &str = "rbdkit.encryption.kms";
/// Image metadata: the id the passphrase is kept under (the scrypt salt
/// of `metadata`, the key name of Vault), when it is not the image's own
/// volume handle: a snapshot image keeps its source's, an adopted ceph-csi
/// volume its ceph-csi volume id.
pub const META_KEY_ID: &str = "rbdkit.encryption.key-id";

/// Image metadata: the tenant a Vault KMS's tenant kinds log in for, when
/// the image records no claim namespace of its own (a snapshot image keeps
/// its source's).
pub const META_KEY_TENANT: &str = "rbdkit.encryption.tenant";

/// A kind of KMS, as `encryptionKMSType` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KmsKind {
    /// `default`: the Secret's `encryptionPassphrase` for every volume.
    Secrets,
    /// `metadata`: a per-volume passphrase in image metadata.
    Metadata,
    /// `vault`, `vaulttokens`, `vaulttenantsa`: a per-volume passphrase
    /// in Vault KV.
    Vault,
}

impl KmsKind {
    /// Whether the passphrase is a different one per volume.
    pub fn per_volume(self) -> bool {
        !matches!(self, KmsKind::Secrets)
    }
}

/// The KMS configuration file: every entry, checked when used.
#[derive(Debug, Clone, Default)]
pub struct KmsConfig {
    entries: BTreeMap<String, Value>,
    source: String,
}

fn kms_err(kms_id: &str, why: impl Into<String>) -> Error {
    Error::invalid("kms", kms_id.to_owned(), why)
}

impl KmsConfig {
    /// Reads the file at `path`; a missing file is an empty config (only
    /// `default` works then).
    pub fn load(path: &Path) -> Result<KmsConfig> {
        match std::fs::read_to_string(path) {
            Ok(text) => KmsConfig::parse(&text, &path.display().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(KmsConfig {
                entries: BTreeMap::new(),
                source: path.display().to_string(),
            }),
            Err(e) => Err(Error::from_errno(
                e.raw_os_error().unwrap_or(libc::EIO),
                "read",
                path.display().to_string(),
            )
            .detail("cannot read the KMS config")),
        }
    }

    /// Parses the file's text; `source` names it in errors.
    pub fn parse(text: &str, source: &str) -> Result<KmsConfig> {
        let v: Value = serde_json::from_str(text).map_err(|e| {
            Error::invalid(
                "kms",
                source.to_owned(),
                format!("the KMS config is not JSON: {e}"),
            )
        })?;
        let Value::Object(map) = v else {
            return Err(Error::invalid(
                "kms",
                source.to_owned(),
                "the KMS config is not a JSON object of KMS ids",
            ));
        };
        Ok(KmsConfig {
            entries: map.into_iter().collect(),
            source: source.to_owned(),
        })
    }

    /// The kind of KMS `kms_id` names, or why it cannot be used.
    pub fn kind(&self, kms_id: &str) -> Result<KmsKind> {
        if kms_id == DEFAULT_KMS_ID {
            return Ok(KmsKind::Secrets);
        }
        let entry = self.entries.get(kms_id).ok_or_else(|| {
            kms_err(
                kms_id,
                format!(
                    "encryptionKMSID {kms_id:?} is not in the KMS config {} (the \
                     ceph-csi-encryption-kms-config ConfigMap's config.json); known: {}",
                    self.source,
                    if self.entries.is_empty() {
                        "none".to_owned()
                    } else {
                        self.entries.keys().cloned().collect::<Vec<_>>().join(", ")
                    }
                ),
            )
        })?;
        // The type, as ceph-csi reads it: the key, else the old KMS_PROVIDER.
        let kind = entry
            .get("encryptionKMSType")
            .or_else(|| entry.get("KMS_PROVIDER"))
            .and_then(Value::as_str)
            .ok_or_else(|| kms_err(kms_id, "the KMS config entry has no encryptionKMSType"))?;
        match kind {
            "metadata" => {
                if entry.get("secretName").is_some() {
                    return Err(kms_err(
                        kms_id,
                        "a metadata KMS with secretName reads that Secret through the Kubernetes \
                         API, which rbdkit's CSI driver does not use; remove secretName and put \
                         encryptionPassphrase in the provisioner and node-stage Secrets",
                    ));
                }
                Ok(KmsKind::Metadata)
            }
            "vault" | "vaulttokens" | "vaulttenantsa" => Ok(KmsKind::Vault),
            other => Err(kms_err(
                kms_id,
                format!(
                    "KMS type {other:?} is not supported by rbdkit; use metadata, vault, \
                     vaulttokens or vaulttenantsa (or no encryptionKMSID, for the Secret's \
                     passphrase)"
                ),
            )),
        }
    }

    /// The raw entry of `kms_id` (for the Vault client).
    pub fn entry(&self, kms_id: &str) -> Option<&Value> {
        self.entries.get(kms_id)
    }

    /// The Vault client of `kms_id` if it names a Vault KMS (`None` for the
    /// other kinds); its options checked, or why not.
    pub fn vault(&self, kms_id: &str) -> Result<Option<vault::VaultKms>> {
        if self.kind(kms_id)? != KmsKind::Vault {
            return Ok(None);
        }
        let Some(Value::Object(entry)) = self.entries.get(kms_id) else {
            return Err(kms_err(kms_id, "the KMS config entry is not a JSON object"));
        };
        let kind = entry
            .get("encryptionKMSType")
            .or_else(|| entry.get("KMS_PROVIDER"))
            .and_then(Value::as_str)
            .and_then(vault::VaultKind::from_type)
            .ok_or_else(|| kms_err(kms_id, "the KMS config entry is not a Vault kind"))?;
        vault::VaultKms::from_config(kms_id, kind, entry).map(Some)
    }
}

/// The secret a KMS works with, taken from a request's Secret data.
#[derive(Debug, Clone)]
pub enum Keys {
    /// `default`: this passphrase for every volume.
    Shared(Secret),
    /// `metadata`: the key-encryption passphrase of per-volume passphrases.
    Metadata(Secret),
    /// A per-volume passphrase the caller fetched from (or put in) an
    /// integrated KMS (Vault) under the volume's key id.
    Given(Secret),
}

/// The [`Keys`] of kind `kind`: `passphrase` is the request Secret's
/// `encryptionPassphrase`, `given` the passphrase fetched from an
/// integrated KMS (Vault).
pub fn keys_for(
    kms_id: &str,
    kind: KmsKind,
    passphrase: Option<Secret>,
    given: Option<Secret>,
) -> Result<Keys> {
    let passphrase = || {
        passphrase
            .filter(|p| !p.expose().is_empty())
            .ok_or_else(|| {
                kms_err(
                    kms_id,
                    format!(
                        "the Secret has no {PASSPHRASE_KEY:?}: the {} KMS needs it in the \
                     provisioner and node-stage Secrets",
                        if kind == KmsKind::Secrets {
                            "default"
                        } else {
                            "metadata"
                        }
                    ),
                )
            })
    };
    match kind {
        KmsKind::Secrets => Ok(Keys::Shared(passphrase()?)),
        KmsKind::Metadata => Ok(Keys::Metadata(passphrase()?)),
        KmsKind::Vault => given
            .map(Keys::Given)
            .ok_or_else(|| kms_err(kms_id, "no passphrase was fetched from the Vault KMS")),
    }
}

/// A new per-volume passphrase as ceph-csi makes one: 20 random bytes in
/// URL-safe base64 with padding.
pub fn new_passphrase() -> Result<Secret> {
    use base64::Engine;
    let mut raw = [0u8; 20];
    ring::rand::SystemRandom::new()
        .fill(&mut raw)
        .map_err(|_| Error::from_errno(libc::EIO, "getrandom", "passphrase"))?;
    let s = base64::engine::general_purpose::URL_SAFE.encode(raw);
    crate::rados::zeroize(&mut raw);
    Ok(Secret::new(s))
}

/// `rbd.csi.ceph.com/dek` as ceph-csi writes it (Go's JSON of two byte
/// slices, in this order).
#[derive(Serialize, Deserialize)]
struct EncryptedDek {
    #[serde(with = "b64std")]
    dek: Vec<u8>,
    #[serde(with = "b64std")]
    nonce: Vec<u8>,
}

mod b64std {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(serde::de::Error::custom)
    }
}

/// The key that wraps a volume's passphrase: scrypt of the KMS passphrase
/// with the volume id as salt (ceph-csi's parameters).
fn kek(kek_passphrase: &Secret, volume_id: &str) -> Result<[u8; 32]> {
    let params = scrypt::Params::new(15, 8, 1, 32)
        .map_err(|_| Error::invalid("scrypt", volume_id.to_owned(), "parameters"))?;
    let mut out = [0u8; 32];
    scrypt::scrypt(
        kek_passphrase.expose().as_bytes(),
        volume_id.as_bytes(),
        &params,
        &mut out,
    )
    .map_err(|_| Error::invalid("scrypt", volume_id.to_owned(), "output length"))?;
    Ok(out)
}

fn aead_key(mut k: [u8; 32], what: &str) -> Result<ring::aead::LessSafeKey> {
    let key = ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &k)
        .map_err(|_| Error::invalid("aes-256-gcm", what.to_owned(), "bad key"));
    crate::rados::zeroize(&mut k);
    Ok(ring::aead::LessSafeKey::new(key?))
}

/// `passphrase` encrypted for volume `volume_id` as ceph-csi's `metadata`
/// KMS stores it in [`META_DEK`].
pub fn wrap_dek(kek_passphrase: &Secret, volume_id: &str, passphrase: &Secret) -> Result<String> {
    let key = aead_key(kek(kek_passphrase, volume_id)?, volume_id)?;
    let mut nonce = [0u8; 12];
    ring::rand::SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| Error::from_errno(libc::EIO, "getrandom", "nonce"))?;
    let mut buf = passphrase.expose().as_bytes().to_vec();
    key.seal_in_place_append_tag(
        ring::aead::Nonce::assume_unique_for_key(nonce),
        ring::aead::Aad::empty(),
        &mut buf,
    )
    .map_err(|_| Error::invalid("aes-256-gcm", volume_id.to_owned(), "seal failed"))?;
    let out = serde_json::to_string(&EncryptedDek {
        dek: buf,
        nonce: nonce.to_vec(),
    })
    .expect("serialises");
    Ok(out)
}

/// The passphrase of volume `volume_id` from its [`META_DEK`] value. A
/// wrong KMS passphrase (or a record made for another volume id) is a
/// `PermissionDenied` error; a value that is not such a record is
/// `InvalidArgument`. Neither names a key.
pub fn unwrap_dek(kek_passphrase: &Secret, volume_id: &str, stored: &str) -> Result<Secret> {
    let rec: EncryptedDek = serde_json::from_str(stored).map_err(|e| {
        Error::invalid(
            "kms",
            volume_id.to_owned(),
            format!("its {META_DEK} metadata is not an encrypted passphrase record: {e}"),
        )
    })?;
    let nonce: [u8; 12] = rec.nonce.as_slice().try_into().map_err(|_| {
        Error::invalid(
            "kms",
            volume_id.to_owned(),
            format!(
                "its {META_DEK} metadata has a nonce of {} bytes, not 12",
                rec.nonce.len()
            ),
        )
    })?;
    let key = aead_key(kek(kek_passphrase, volume_id)?, volume_id)?;
    let mut buf = rec.dek;
    let plain = key
        .open_in_place(
            ring::aead::Nonce::assume_unique_for_key(nonce),
            ring::aead::Aad::empty(),
            &mut buf,
        )
        .map_err(|_| {
            Error::with_kind(
                ErrorKind::PermissionDenied,
                libc::EACCES,
                "kms",
                volume_id.to_owned(),
                format!(
                    "its {META_DEK} metadata does not decrypt with the Secret's \
                     {PASSPHRASE_KEY} (a wrong key, or a record made for another volume id)"
                ),
            )
        })?;
    let text = String::from_utf8(plain.to_vec());
    crate::rados::zeroize(&mut buf);
    text.map(Secret::new).map_err(|_| {
        Error::invalid(
            "kms",
            volume_id.to_owned(),
            "the decrypted passphrase is not text",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_kinds_are_read_or_refused_by_name() {
        let c = KmsConfig::parse(
            r#"{
                "meta": {"encryptionKMSType": "metadata"},
                "old": {"KMS_PROVIDER": "vaulttokens"},
                "v": {"encryptionKMSType": "vault", "vaultAddress": "http://127.0.0.1:1"},
                "sa": {"encryptionKMSType": "vaulttenantsa", "vaultAddress": "http://127.0.0.1:1"},
                "noaddr": {"encryptionKMSType": "vaulttokens"},
                "ns": {"encryptionKMSType": "metadata", "secretName": "s"},
                "aws": {"encryptionKMSType": "aws-metadata"},
                "none": {}
            }"#,
            "test",
        )
        .unwrap();
        assert_eq!(c.kind("default").unwrap(), KmsKind::Secrets);
        assert_eq!(c.kind("meta").unwrap(), KmsKind::Metadata);
        assert_eq!(c.kind("old").unwrap(), KmsKind::Vault);
        assert_eq!(c.kind("v").unwrap(), KmsKind::Vault);
        assert_eq!(c.kind("sa").unwrap(), KmsKind::Vault);
        // The Vault client of a Vault entry, none for the other kinds, and
        // a bad entry refused by name.
        assert_eq!(
            c.vault("sa").unwrap().unwrap().kind(),
            vault::VaultKind::TenantSa
        );
        assert!(c.vault("meta").unwrap().is_none());
        assert!(c.vault("default").unwrap().is_none());
        let e = c.vault("noaddr").unwrap_err().to_string();
        assert!(e.contains("vaultAddress"), "{e}");
        for (id, says) in [
            ("ns", "secretName"),
            ("aws", "aws-metadata"),
            ("none", "encryptionKMSType"),
            ("missing", "not in the KMS config"),
        ] {
            let e = c.kind(id).unwrap_err().to_string();
            assert!(e.contains(says), "{id}: {e}");
        }
        assert!(KmsConfig::parse("[]", "t").is_err());
        assert!(KmsConfig::parse("{", "t").is_err());
    }

    #[test]
    fn passphrases_look_like_ceph_csis() {
        let p = new_passphrase().unwrap();
        assert_eq!(p.expose().len(), 28);
        assert!(p.expose().ends_with('='));
        assert!(p
            .expose()
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'='));
    }

    #[test]
    fn dek_records_round_trip_and_refuse_wrong_keys() {
        let kek = Secret::new("kms-secret".to_owned());
        let pass = new_passphrase().unwrap();
        let rec = wrap_dek(&kek, "vol-1", &pass).unwrap();
        assert!(
            rec.starts_with(r#"{"dek":""#) && rec.contains(r#"","nonce":""#),
            "{rec}"
        );
        assert!(!rec.contains(pass.expose()));
        assert_eq!(unwrap_dek(&kek, "vol-1", &rec).unwrap(), pass);
        let wrong = unwrap_dek(&Secret::new("other".to_owned()), "vol-1", &rec).unwrap_err();
        assert_eq!(wrong.kind(), ErrorKind::PermissionDenied);
        let other_vol = unwrap_dek(&kek, "vol-2", &rec).unwrap_err();
        assert_eq!(other_vol.kind(), ErrorKind::PermissionDenied);
        let garbage = unwrap_dek(&kek, "vol-1", "{\"dek\":1}").unwrap_err();
        assert_eq!(garbage.kind(), ErrorKind::InvalidArgument);
        assert!(!garbage.to_string().contains("kms-secret"));
    }
}
