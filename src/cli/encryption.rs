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
use crate::volume::encryption::RotationKms;
use crate::volume::encryption::{self, State};
use crate::volume::kms::keystore::{BlockingKeyStore, KeyStore};
use crate::volume::kms::{self, Keys, KmsConfig, KmsKind};
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

/// The Vault key store of `kms_id` for a volume of `tenant` (its key
/// record's), or `None` when `kms_id` is not a Vault KMS.
fn vault_store(
    rt: &tokio::runtime::Runtime,
    args: &KmsArgs,
    config: &KmsConfig,
    kms_id: &str,
    tenant: Option<String>,
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
        tenant,
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

/// A runtime for the KMS calls: multi-threaded, so the blocking steps of a
/// rotation can wait on it ([`BlockingKeyStore`]).
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| Error::from_errno(libc::EIO, "tokio runtime", e.to_string()))
}

/// The volume of `volume_id` and the passphrase of `--passphrase-file`,
/// if given.
fn volume_and_passphrase(volume_id: &str, args: &KmsArgs) -> Result<(VolumeId, Option<Secret>)> {
    let vol = VolumeId::parse(volume_id)
        .map_err(|why| Error::invalid("encryption", volume_id.to_owned(), why))?;
    let passphrase = args
        .passphrase_file
        .as_deref()
        .map(read_passphrase)
        .transpose()?;
    Ok((vol, passphrase))
}

/// `rotate`: [`encryption::rotation_target`] refuses what cannot be
/// rotated, [`encryption::rotate_volume`] rotates.
fn rotate(connect: &ConnectArgs, volume_id: &str, args: &KmsArgs, json: bool) -> Result<()> {
    let (vol, passphrase) = volume_and_passphrase(volume_id, args)?;
    let config = KmsConfig::load(&args.kms_config)?;
    let c = connect.connect()?;
    let (rec, kind) = encryption::rotation_target(&c, &vol, volume_id, &config)?;
    let rt = runtime()?;
    let kms = match vault_store(&rt, args, &config, &rec.kms_id, rec.tenant.clone())? {
        Some(store) => {
            RotationKms::Kept(Box::new(BlockingKeyStore::new(store, rt.handle().clone())))
        }
        None => match passphrase {
            Some(p) => match kms::keys_for(&rec.kms_id, kind, Some(p), None)? {
                Keys::Metadata(kek) => RotationKms::Metadata(kek),
                _ => unreachable!("rotation_target refuses the other kinds"),
            },
            None => {
                return Err(Error::invalid(
                    "encryption",
                    volume_id.to_owned(),
                    format!(
                        "KMS {:?} is not a Vault KMS: rotate needs --passphrase-file",
                        rec.kms_id
                    ),
                ))
            }
        },
    };
    let slot = encryption::rotate_volume(&c, &vol, &rec, &kms)?;
    if json {
        println!("{}", json!({"volume": volume_id, "keyslot": slot}));
    } else {
        println!("{volume_id}: new passphrase in keyslot {slot}; other keyslots removed");
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
        EncryptionCommand::Rotate { volume_id, kms } => {
            return rotate(connect, volume_id, kms, json)
        }
        EncryptionCommand::Status { volume_id, kms } => (volume_id, kms),
    };
    let (vol, passphrase) = volume_and_passphrase(volume_id, kms_args)?;
    let c = connect.connect()?;
    let io = c.ioctx_ns(&vol.pool, &vol.rados_namespace)?;
    let image = Image::open_read_only(&io, &vol.image)?;
    let meta = image.metadata_list()?;
    let state = encryption::state_of(&meta, &vol.image)?;
    let kms_id = encryption::kms_id_of(&meta);
    let key_id = encryption::key_id_of(&meta, volume_id);
    let rt = runtime()?;
    let config = KmsConfig::load(&kms_args.kms_config)?;
    let store = match state {
        State::Plain => None,
        _ => {
            let tenant = encryption::key_record(&meta, &vol.image, volume_id)?.tenant;
            vault_store(&rt, kms_args, &config, &kms_id, tenant)?
        }
    };
    let keys = match (&store, passphrase) {
        (Some(store), _) => Some(Keys::Given(rt.block_on(store.get(&key_id))?)),
        (None, None) => None,
        (None, Some(p)) => {
            let kind = config.kind(&kms_id)?;
            Some(kms::keys_for(&kms_id, kind, Some(p), None)?)
        }
    };
    let header = match state {
        State::Plain => None,
        _ => Some(Header::read(&image)?),
    };
    let opens = match (&header, &keys) {
        (Some(h), Some(keys)) => {
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
