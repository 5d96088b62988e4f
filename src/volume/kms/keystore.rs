//! A Vault KMS through a volume's life: the steps the provisioner, the CSI
//! controller, the node and the CLI take with the per-volume passphrases
//! Vault keeps ([`KeyStore`]).
//!
//! Where keys live, as in ceph-csi: under the CSI volume id (the volume
//! handle) for a volume, under the snapshot handle for a snapshot (ceph-csi
//! copies the source's passphrase to the snapshot's id, so a snapshot
//! outlives its source). A clone or restore gets the parent's passphrase
//! copied under its own handle (the LUKS2 header comes with the data).
//!
//! Order, so that a crash never loses a key: a key is stored before the
//! image that needs it is made ([`KeyStore::ensure`],
//! [`KeyStore::ensure_copy`] reuse a key already stored under that id, so a
//! retry never makes a second, different key for one volume), and removed
//! only after its image is gone.

use crate::error::{ErrorKind, Result};
use crate::rados::Secret;
use crate::volume::kms::vault::{KmsContext, Passphrase, VaultKms};

/// One Vault KMS for one request: the client and the request's context
/// (tenant, Secret, Kubernetes client).
#[derive(Debug, Clone)]
pub struct KeyStore {
    vault: VaultKms,
    ctx: KmsContext,
}

fn secret(p: Passphrase) -> Secret {
    Secret::new(p.expose().to_owned())
}

impl KeyStore {
    /// The store of `vault` for the request described by `ctx`.
    pub fn new(vault: VaultKms, ctx: KmsContext) -> KeyStore {
        KeyStore { vault, ctx }
    }

    /// The KMS id.
    pub fn kms_id(&self) -> &str {
        self.vault.kms_id()
    }

    /// The passphrase stored under `key_id`.
    pub async fn get(&self, key_id: &str) -> Result<Secret> {
        self.vault.get(&self.ctx, key_id).await.map(secret)
    }

    /// Stores `passphrase` under `key_id`, replacing any.
    pub async fn put(&self, key_id: &str, passphrase: &Secret) -> Result<()> {
        self.vault
            .put(&self.ctx, key_id, &Passphrase::new(passphrase.expose()))
            .await
    }

    /// The passphrase of a new volume `key_id`: the one already stored (a
    /// retry), else a new one ([`super::new_passphrase`]), stored before it
    /// is returned.
    pub async fn ensure(&self, key_id: &str) -> Result<Secret> {
        let session = self.vault.connect(&self.ctx).await?;
        match session.get(key_id).await {
            Ok(p) => return Ok(secret(p)),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let new = super::new_passphrase()?;
        session.put(key_id, &Passphrase::new(new.expose())).await?;
        Ok(new)
    }

    /// The passphrase of a copy (a snapshot, clone or restore) `to` of the
    /// volume or snapshot whose key is `from`: the one already stored under
    /// `to` (a retry), else `from`'s, stored under `to` first.
    pub async fn ensure_copy(&self, from: &str, to: &str) -> Result<Secret> {
        let session = self.vault.connect(&self.ctx).await?;
        match session.get(to).await {
            Ok(p) => return Ok(secret(p)),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let p = session.get(from).await?;
        session.put(to, &p).await?;
        Ok(secret(p))
    }

    /// The passphrase of new volume `key_id`: for a clone or restore
    /// (`parent`: `Some` of its parent image's key record, if it has one)
    /// its parent's, copied ([`KeyStore::ensure_copy`]); for a new volume
    /// [`KeyStore::ensure`]'s. A parent not encrypted with this KMS gets a
    /// new, unstored passphrase: the clone steps refuse it by name before
    /// they read keys.
    pub async fn ensure_for(
        &self,
        key_id: &str,
        parent: Option<Option<crate::volume::encryption::KeyRecord>>,
    ) -> Result<Secret> {
        match parent {
            None => self.ensure(key_id).await,
            Some(Some(r)) if r.state.encrypted() && r.kms_id == self.kms_id() => {
                self.ensure_copy(&r.key_id, key_id).await
            }
            Some(_) => super::new_passphrase(),
        }
    }

    /// Removes the key `key_id` (call once its image is gone); a missing
    /// key is no error.
    pub async fn delete(&self, key_id: &str) -> Result<()> {
        self.vault.delete(&self.ctx, key_id).await
    }
}

/// A [`KeyStore`] for blocking code (the steps of a rotation,
/// [`crate::volume::encryption::rotate_volume`]): each call waits on the
/// runtime of `handle`, a multi-threaded one, from a thread that is not
/// one of its workers (a blocking task's, or one outside it).
#[derive(Debug, Clone)]
pub struct BlockingKeyStore {
    store: KeyStore,
    handle: tokio::runtime::Handle,
}

impl BlockingKeyStore {
    /// `store`, its calls run on `handle`'s runtime.
    pub fn new(store: KeyStore, handle: tokio::runtime::Handle) -> BlockingKeyStore {
        BlockingKeyStore { store, handle }
    }
}

impl crate::volume::encryption::KeptKeys for BlockingKeyStore {
    fn get(&self, key_id: &str) -> Result<Secret> {
        self.handle.block_on(self.store.get(key_id))
    }

    fn put(&self, key_id: &str, passphrase: &Secret) -> Result<()> {
        self.handle.block_on(self.store.put(key_id, passphrase))
    }
}
