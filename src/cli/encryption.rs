//! `rbdkit image encryption ...`: look at and re-key an encrypted volume.
//!
//! `rotate` gives a volume a new passphrase: a new LUKS2 keyslot for it,
//! the KMS updated, every other keyslot removed; the volume key and the
//! data stay as they are, and a mapped volume keeps working. Re-run after a
//! crash at any point it ends with one keyslot, the one the KMS's
//! passphrase opens ([`crate::volume::encryption::rotate`]).

use std::path::PathBuf;

use clap::Subcommand;
use serde_json::json;

use crate::error::{Error, Result};
use crate::rados::Secret;
use crate::rbd::Image;
use crate::volume::encryption::{self, State};
use crate::volume::kms::keystore::KeyStore;
use crate::volume::kms::{self, Keys, KmsConfig, KmsKind, META_DEK};
use crate::volume::luks::Header;
use crate::volume::VolumeId;

use super::ConnectArgs;

/// The encryption subcommands.
#[derive(Debug, Subcommand)]
pub enum EncryptionCommand {
    /// Write a LUKS2 header (the format both mappers open) on an image
    /// whose first 16 MiB are all zeroes, for the `default` KMS: the
    /// passphrase is the file's. Refuses an image holding data there.
    Format {
        /// `pool[/namespace]/image`.
        spec: String,
        /// A file holding the passphrase.
        #[arg(long)]
        passphrase_file: PathBuf,
        /// The data sector size.
        #[arg(long, default_value_t = 4096)]
        sector_size: u32,
        /// How long the keyslot's argon2id should take, as cryptsetup's
        /// `--iter-time` (a person's passphrase); 0: LUKS2's lowest cost,
        /// for a random passphrase.
        #[arg(long, default_value_t = 2000)]
        pbkdf_time_ms: u64,
    },
    /// Show a volume's encryption: state, KMS, keyslots; with the KMS's
    /// key (--passphrase-file, or a Vault KMS), whether it opens the header.
    Status {
        /// The volume handle (`rbdkit1/<cluster>/<pool>/<namespace>/<image>`).
        volume_id: String,
        /// Where the volume's passphrase comes from.
        #[command(flatten)]
        kms: KmsArgs,
    },
    /// Give a volume a new passphrase (a LUKS keyslot change; no data is
    /// rewritten).
    Rotate {
        /// The volume handle.
        volume_id: String,
        /// Where the volume's passphrase comes from.
        #[command(flatten)]
        kms: KmsArgs,
    },
}

/// Where `status` and `rotate` get a volume's passphrase.
#[derive(Debug, Clone, clap::Args)]
pub struct KmsArgs {
    /// A file holding the KMS's `encryptionPassphrase` (the Secret's), for
    /// the `default` and `metadata` KMS.
    #[arg(long)]
    pub passphrase_file: Option<PathBuf>,
    /// The KMS config.
    #[arg(long, default_value = kms::DEFAULT_CONFIG_PATH)]
    pub kms_config: PathBuf,
    /// The kubeconfig the `vaulttokens` and `vaulttenantsa` KMS read the
    /// tenant's Secrets, ConfigMap and service account with (default: the
    /// pod's service account).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The service account token the `vault` KMS logs in with (default:
    /// the pod's).
    #[arg(long, value_name = "FILE")]
    pub service_account_token_file: Option<PathBuf>,
}

/// The Vault key store of `kms_id` for the volume whose image metadata is
/// `meta`, or `None` when `kms_id` is not a Vault KMS.
fn vault_store(
    rt: &tokio::runtime::Runtime,
    args: &KmsArgs,
    config: &KmsConfig,
    kms_id: &str,
    meta: &std::collections::BTreeMap<String, String>,
    image: &str,
    handle: &str,
) -> Result<Option<KeyStore>> {
    use crate::volume::kms::vault::{KmsContext, VaultKind};
    if !matches!(config.kind(kms_id), Ok(KmsKind::Vault)) {
        return Ok(None);
    }
    let Some(mut vault) = config.vault(kms_id)? else {
        return Ok(None);
    };
    if let Some(f) = &args.service_account_token_file {
        vault = vault.with_service_account_token_file(f);
    }
    let kube = if vault.kind() == VaultKind::Vault {
        None
    } else {
        let client = rt
            .block_on(crate::k8s::client::client(args.kubeconfig.as_deref()))
            .map_err(|e| {
                Error::invalid(
                    "kms",
                    kms_id.to_owned(),
                    format!(
                        "a {} KMS reads the tenant's Kubernetes objects, and the API server \
                         cannot be reached (give --kubeconfig): {e:#}",
                        vault.kind()
                    ),
                )
            })?;
        Some(client)
    };
    let ctx = KmsContext {
        kube,
        tenant: encryption::key_record(meta, image, handle)?.tenant,
        ..Default::default()
    };
    Ok(Some(KeyStore::new(vault, ctx)))
}

fn read_passphrase(f: &std::path::Path) -> Result<Secret> {
    let text = std::fs::read_to_string(f).map_err(|e| {
        Error::invalid(
            "read passphrase file",
            f.display().to_string(),
            e.to_string(),
        )
    })?;
    // A trailing newline of an editor is not part of it (Secret values
    // written with `kubectl create secret --from-literal` have none).
    Ok(Secret::new(text.trim_end_matches(['\n', '\r']).to_owned()))
}

fn format(
    connect: &ConnectArgs,
    spec: &str,
    passphrase_file: &std::path::Path,
    sector_size: u32,
    pbkdf_time_ms: u64,
    json: bool,
) -> Result<()> {
    let spec = super::ImageSpec::parse(spec)?;
    spec.no_snap()?;
    let passphrase = read_passphrase(passphrase_file)?;
    let c = connect.connect()?;
    let image = Image::open(&spec.ioctx(&c)?, &spec.image)?;
    let size = image.size()?;
    if !crate::volume::luks::is_zero(&image, 0, crate::volume::luks::DATA_OFFSET.min(size))? {
        return Err(Error::invalid(
            "encryption format",
            spec.to_string(),
            "its first 16 MiB hold data: refusing to format over it",
        ));
    }
    let opts = crate::volume::luks::FormatOptions {
        sector_size,
        kdf: match pbkdf_time_ms {
            0 => crate::volume::luks::Kdf::default(),
            ms => crate::volume::luks::Kdf::calibrated(std::time::Duration::from_millis(ms)),
        },
        ..Default::default()
    };
    let (h, _) = crate::volume::luks::format(&image, passphrase.expose().as_bytes(), &opts)?;
    image.flush()?;
    image.metadata_set(kms::META_HEADER_SIZE, &h.data_offset.to_string())?;
    image.metadata_set(kms::META_STATE, kms::STATE_ENCRYPTED)?;
    image.close()?;
    let usable = h.data_size(size);
    if json {
        println!(
            "{}",
            json!({"image": spec.to_string(), "data_offset": h.data_offset, "size": usable})
        );
    } else {
        println!(
            "{spec}: LUKS2, data at {} bytes, {usable} bytes usable",
            h.data_offset
        );
    }
    Ok(())
}

/// Runs an encryption subcommand.
pub fn run(connect: &ConnectArgs, cmd: EncryptionCommand, json: bool) -> Result<()> {
    if let EncryptionCommand::Format {
        spec,
        passphrase_file,
        sector_size,
        pbkdf_time_ms,
    } = &cmd
    {
        return format(
            connect,
            spec,
            passphrase_file,
            *sector_size,
            *pbkdf_time_ms,
            json,
        );
    }
    let (volume_id, kms_args) = match &cmd {
        EncryptionCommand::Format { .. } => unreachable!("handled above"),
        EncryptionCommand::Status { volume_id, kms } => (volume_id, kms),
        EncryptionCommand::Rotate { volume_id, kms } => (volume_id, kms),
    };
    let vol = VolumeId::parse(volume_id)
        .map_err(|why| Error::invalid("encryption", volume_id.clone(), why))?;
    let passphrase = kms_args
        .passphrase_file
        .as_deref()
        .map(read_passphrase)
        .transpose()?;
    let c = connect.connect()?;
    let io = c.ioctx_ns(&vol.pool, &vol.rados_namespace)?;
    let rotate = matches!(cmd, EncryptionCommand::Rotate { .. });
    let image = if rotate {
        Image::open(&io, &vol.image)?
    } else {
        Image::open_read_only(&io, &vol.image)?
    };
    let meta = image.metadata_list()?;
    let state = encryption::state_of(&meta, &vol.image)?;
    let kms_id = encryption::kms_id_of(&meta);
    let key_id = encryption::key_id_of(&meta, volume_id);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::from_errno(libc::EIO, "tokio runtime", e.to_string()))?;
    let config = KmsConfig::load(&kms_args.kms_config)?;
    let store = match state {
        State::Plain => None,
        _ => vault_store(
            &rt, kms_args, &config, &kms_id, &meta, &vol.image, volume_id,
        )?,
    };
    let keys = match (&store, passphrase) {
        (Some(store), _) => {
            let p = rt.block_on(store.get(&key_id))?;
            Some((KmsKind::Vault, Keys::Given(p)))
        }
        (None, None) => None,
        (None, Some(p)) => {
            let kind = config.kind(&kms_id)?;
            Some((kind, kms::keys_for(&kms_id, kind, Some(p), None)?))
        }
    };
    if rotate {
        encryption::require_encrypted(state, &vol.image)?;
        let Some((kind, keys)) = keys else {
            return Err(Error::invalid(
                "encryption",
                volume_id.clone(),
                format!("KMS {kms_id:?} is not a Vault KMS: rotate needs --passphrase-file"),
            ));
        };
        let current = encryption::passphrase_of(&meta, &vol.image, &key_id, &keys)?;
        let slot = match (&keys, &store) {
            (Keys::Metadata(kek), _) => encryption::rotate(&image, &current, |new| {
                image.metadata_set(META_DEK, &kms::wrap_dek(kek, &key_id, new)?)
            })?,
            (Keys::Given(_), Some(store)) => {
                encryption::rotate(&image, &current, |new| rt.block_on(store.put(&key_id, new)))?
            }
            _ => {
                return Err(Error::invalid(
                    "encryption",
                    volume_id.clone(),
                    format!(
                        "KMS {kms_id:?} ({kind:?}) gives every volume the Secret's own \
                         passphrase; rotate that Secret's passphrase instead (a per-volume \
                         rotation would lock the volume out)"
                    ),
                ))
            }
        };
        image.close()?;
        if json {
            println!("{}", json!({"volume": volume_id, "keyslot": slot}));
        } else {
            println!("{volume_id}: new passphrase in keyslot {slot}; other keyslots removed");
        }
        return Ok(());
    }
    let header = match state {
        State::Plain => None,
        _ => Some(Header::read(&image)?),
    };
    let opens = match (&header, &keys) {
        (Some(h), Some((_, keys))) => {
            let p = encryption::passphrase_of(&meta, &vol.image, &key_id, keys)?;
            Some(h.unlock(&image, p.expose().as_bytes()).map(|(_, s)| s))
        }
        _ => None,
    };
    let state_name = match state {
        State::Plain => "plain",
        State::Prepared => kms::STATE_PREPARED,
        State::Encrypted => kms::STATE_ENCRYPTED,
    };
    let opens_slot = match &opens {
        Some(Ok(s)) => Some(*s),
        _ => None,
    };
    if json {
        println!(
            "{}",
            json!({
                "volume": volume_id,
                "state": state_name,
                "kms": kms_id,
                "key_id": key_id,
                "keyslots": header.as_ref().map(|h| h.keyslots.clone()),
                "data_offset": header.as_ref().map(|h| h.data_offset),
                "sector_size": header.as_ref().map(|h| h.sector_size),
                "cipher": header.as_ref().map(|h| h.cipher.clone()),
                "opens_keyslot": opens_slot,
            })
        );
    } else {
        println!("state:    {state_name}");
        println!("kms:      {kms_id}");
        if let Some(h) = &header {
            println!("keyslots: {:?}", h.keyslots);
            println!(
                "data:     {} at offset {}, sector size {}",
                h.cipher, h.data_offset, h.sector_size
            );
        }
        match &opens {
            Some(Ok(s)) => println!("the KMS's passphrase opens keyslot {s}"),
            Some(Err(e)) => println!("the KMS's passphrase opens nothing: {e}"),
            None => {}
        }
    }
    if let Some(Err(e)) = opens {
        return Err(e);
    }
    Ok(())
}
