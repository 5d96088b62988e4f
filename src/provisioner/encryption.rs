//! The provisioner's steps for encrypted volumes: the KMS keys of a new
//! volume (from the provisioner Secret, or a Vault KMS that keeps them), a
//! snapshot's copy of its source's Vault key, and a Vault key's removal
//! once its image is gone. The Ceph side is [`crate::volume::encryption`].

use crate::provisioner::controller::Context;
use crate::provisioner::metrics::Metrics;
use crate::provisioner::secrets;
use crate::rados::Cluster;
use crate::volume::clusters::Conn;
use crate::volume::ops::VolumeError;
use crate::volume::params::SecretRef;
use crate::volume::{Fence, VolumeId};

/// A new volume's encryption, its Vault key not fetched yet.
pub(crate) enum PendingEncryption {
    /// The keys are known (the `default` and `metadata` KMS).
    Ready(crate::volume::encryption::NewEncryption),
    /// A Vault KMS: the passphrase is stored under the volume's handle
    /// once the claim is protected ([`vault_encryption`]).
    Vault(
        crate::volume::encryption::EncryptionParams,
        Box<crate::volume::kms::keystore::KeyStore>,
    ),
}

/// The KMS keys for a new encrypted volume of class encryption `e`, from
/// the provisioner Secret; `size` (a new, empty volume) is checked
/// against the LUKS2 header. `tenant` is the claim's namespace.
pub(crate) async fn encryption_for(
    ctx: &Context,
    e: &crate::volume::encryption::EncryptionParams,
    secret: &SecretRef,
    size: Option<u64>,
    tenant: &str,
) -> Result<PendingEncryption, String> {
    if let Some(size) = size {
        crate::volume::encryption::check_size(size, e.sector_size)?;
    }
    if let Some(store) = key_store(ctx, &e.kms_id, Some(tenant), secret).await? {
        return Ok(PendingEncryption::Vault(e.clone(), Box::new(store)));
    }
    let keys = secret_keys(ctx, &e.kms_id, secret).await?;
    Ok(PendingEncryption::Ready(
        crate::volume::encryption::NewEncryption {
            params: e.clone(),
            keys,
        },
    ))
}

/// The keys of KMS `kms_id` that is not a Vault one (`default`,
/// `metadata`): the `encryptionPassphrase` of `secret`.
async fn secret_keys(
    ctx: &Context,
    kms_id: &str,
    secret: &SecretRef,
) -> Result<crate::volume::kms::Keys, String> {
    use crate::volume::kms;
    let config = kms::KmsConfig::load(&ctx.kms_config).map_err(|e| e.to_string())?;
    let kind = config.kind(kms_id).map_err(|e| e.to_string())?;
    let passphrase = secrets::encryption_passphrase(&ctx.client, secret).await?;
    kms::keys_for(kms_id, kind, passphrase, None).map_err(|err| format!("Secret {secret}: {err}"))
}

/// Where a rotation of the volume whose key record is `rec` reads and
/// keeps its passphrase ([`crate::volume::encryption::rotate_volume`]):
/// its Vault KMS (for the record's tenant, with the data of `secret`), or
/// the `encryptionPassphrase` of `secret` for the `metadata` KMS. Must be
/// called on a multi-threaded runtime: the Vault calls run on it from the
/// rotation's blocking steps.
pub(crate) async fn rotation_kms(
    ctx: &Context,
    rec: &crate::volume::encryption::KeyRecord,
    secret: &SecretRef,
) -> Result<crate::volume::encryption::RotationKms, String> {
    use crate::volume::encryption::RotationKms;
    use crate::volume::kms::{keystore::BlockingKeyStore, Keys};
    if let Some(store) = key_store(ctx, &rec.kms_id, rec.tenant.as_deref(), secret).await? {
        let handle = tokio::runtime::Handle::current();
        return Ok(RotationKms::Kept(Box::new(BlockingKeyStore::new(
            store, handle,
        ))));
    }
    match secret_keys(ctx, &rec.kms_id, secret).await? {
        Keys::Metadata(kek) => Ok(RotationKms::Metadata(kek)),
        _ => Err(format!(
            "KMS {:?} keeps no passphrase per volume: there is none to rotate",
            rec.kms_id
        )),
    }
}

/// The Vault key store of KMS `kms_id` for `tenant` with the data of
/// `secret`, or `None` when `kms_id` is not a Vault KMS.
async fn key_store(
    ctx: &Context,
    kms_id: &str,
    tenant: Option<&str>,
    secret: &SecretRef,
) -> Result<Option<crate::volume::kms::keystore::KeyStore>, String> {
    use crate::volume::kms::{self, vault::KmsContext};
    let config = kms::KmsConfig::load(&ctx.kms_config).map_err(|e| e.to_string())?;
    let Some(vault) = config.vault(kms_id).map_err(|e| e.to_string())? else {
        return Ok(None);
    };
    let kctx = KmsContext {
        kube: Some(ctx.client.clone()),
        tenant: tenant.filter(|t| !t.is_empty()).map(str::to_owned),
        secrets: secrets::secret_data(&ctx.client, secret).await?,
        csi_namespace: Some(crate::k8s::client::own_namespace()),
    };
    Ok(Some(kms::keystore::KeyStore::new(vault, kctx)))
}

/// The keys of new volume `vol` once its claim is protected: for a Vault
/// KMS its passphrase is stored under its handle before any image is made
/// (a new one, or a clone's or restore's parent's copied), and a retry
/// finds the one stored.
pub(crate) async fn vault_encryption(
    ctx: &Context,
    conn: &Conn,
    pending: Option<PendingEncryption>,
    vol: &VolumeId,
    parent: Option<VolumeId>,
) -> Result<Option<crate::volume::encryption::NewEncryption>, String> {
    use crate::volume::encryption::{self, NewEncryption};
    use crate::volume::kms::Keys;
    let (params, store) = match pending {
        None => return Ok(None),
        Some(PendingEncryption::Ready(e)) => return Ok(Some(e)),
        Some(PendingEncryption::Vault(p, s)) => (p, s),
    };
    let record = match parent {
        None => None,
        Some(p) => {
            let ph = p.handle();
            Some(
                ctx.ceph(conn, move |c, _m, _f| {
                    Ok(encryption::read_key_record(c, &p, &ph)?)
                })
                .await
                .map_err(|e| format!("cannot read the source's encryption: {e}"))?,
            )
        }
    };
    let got = store.ensure_for(&vol.handle(), record).await;
    let pass = got.map_err(|e| e.to_string())?;
    Ok(Some(NewEncryption {
        params,
        keys: Keys::Given(pass),
    }))
}

/// Runs `remove` (which removes image `image` of volume or snapshot
/// `handle`) with the image's Vault key noted first, then removes the key
/// from Vault and clears the note ([`crate::volume::encryption::KEYS_TO_REMOVE`]):
/// a retry after the image is gone still removes the key.
pub(crate) async fn remove_with_key<T: Send + 'static>(
    ctx: &Context,
    conn: &Conn,
    image: &VolumeId,
    handle: &str,
    snapshot: bool,
    secret: &SecretRef,
    remove: impl FnOnce(&Cluster, &Metrics, &dyn Fence) -> Result<T, VolumeError> + Send + 'static,
) -> Result<T, String> {
    use crate::volume::encryption;
    use crate::volume::kms::{KmsConfig, KmsKind};
    let config = ctx.kms_config.clone();
    let (img, h, provisioner) = (image.clone(), handle.to_owned(), ctx.name.clone());
    let (done, noted) = ctx
        .ceph(conn, move |c, m, f| {
            encryption::note_key_before_remove(c, &img, &h, snapshot, &provisioner, &|k| {
                Ok(matches!(
                    KmsConfig::load(&config)?.kind(k),
                    Ok(KmsKind::Vault)
                ))
            })?;
            let done = remove(c, m, f)?;
            Ok((done, encryption::keys_to_remove(c, &img, Some(&h))?))
        })
        .await
        .map_err(|e| format!("cannot remove {image}: {e}"))?;
    for (h, key) in noted {
        if let Some(store) = key_store(ctx, &key.kms, key.tenant.as_deref(), secret).await? {
            store.delete(&key.key).await.map_err(|e| e.to_string())?;
        }
        let img = image.clone();
        ctx.ceph(conn, move |c, _m, _f| {
            Ok(encryption::forget_key_to_remove(c, &img, &h)?)
        })
        .await
        .map_err(|e| format!("cannot clear the key note of {image}: {e}"))?;
    }
    Ok(done)
}

/// After a snapshot image `image` (snapshot handle `handle`) is made: a
/// Vault-encrypted source's passphrase is stored under the snapshot's
/// handle, which the image then records (so the snapshot outlives its
/// source, as in ceph-csi).
pub(crate) async fn snapshot_key(
    ctx: &Context,
    conn: &Conn,
    image: &VolumeId,
    handle: &str,
    secret: &SecretRef,
) -> Result<(), String> {
    use crate::volume::encryption;
    let (img, h) = (image.clone(), handle.to_owned());
    let rec = ctx
        .ceph(conn, move |c, _m, _f| {
            Ok(encryption::read_key_record(c, &img, &h)?)
        })
        .await
        .map_err(|e| format!("cannot read the encryption of {image}: {e}"))?;
    let Some(mut rec) = rec.filter(|r| r.state.encrypted() && r.key_id != handle) else {
        return Ok(());
    };
    if rec.tenant.is_none() {
        // The source's tenant (the claim's namespace), as in ceph-csi.
        if let Ok(src) = VolumeId::parse(&rec.key_id) {
            let h = rec.key_id.clone();
            rec.tenant = ctx
                .ceph(conn, move |c, _m, _f| {
                    Ok(encryption::read_key_record(c, &src, &h)?)
                })
                .await
                .map_err(|e| format!("cannot read the encryption of the source: {e}"))?
                .and_then(|r| r.tenant);
        }
    }
    let Some(store) = key_store(ctx, &rec.kms_id, rec.tenant.as_deref(), secret).await? else {
        return Ok(());
    };
    store
        .ensure_copy(&rec.key_id, handle)
        .await
        .map_err(|e| e.to_string())?;
    let (img, h, t) = (image.clone(), handle.to_owned(), rec.tenant);
    ctx.ceph(conn, move |c, _m, _f| {
        Ok(encryption::record_key_id(c, &img, &h, t.as_deref())?)
    })
    .await
    .map_err(|e| format!("cannot record the key of {image}: {e}"))
}
