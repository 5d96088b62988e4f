//! Reading cephx credentials from the Secrets a StorageClass names.
//!
//! The Secret must hold `userID` and `userKey`. The key goes straight into
//! a [`crate::rados::Secret`]; no error message here ever includes any of
//! the Secret's data.

use k8s_openapi::api::core::v1::Secret as K8sSecret;
use kube::Api;

use crate::rados::Secret;
use crate::volume::clusters::Credentials;
use crate::volume::params::SecretRef;

/// The Secret key holding the cephx user id.
pub const USER_ID: &str = "userID";
/// The Secret key holding the cephx key.
pub const USER_KEY: &str = "userKey";

/// Reads the credentials in `secret`. Errors say what is missing, never
/// what is there.
pub async fn credentials(client: &kube::Client, secret: &SecretRef) -> Result<Credentials, String> {
    let s = fetch(client, secret).await?;
    credentials_from(&s).map_err(|why| format!("Secret {secret}: {why}"))
}

/// The Secret `secret`, or an error naming it (never its data).
async fn fetch(client: &kube::Client, secret: &SecretRef) -> Result<K8sSecret, String> {
    let api: Api<K8sSecret> = Api::namespaced(client.clone(), &secret.namespace);
    match api.get_opt(&secret.name).await {
        Ok(Some(s)) => Ok(s),
        Ok(None) => Err(format!("Secret {secret} not found")),
        Err(kube::Error::Api(e)) => Err(format!(
            "cannot read Secret {secret}: {} ({})",
            e.reason, e.code
        )),
        Err(e) => Err(format!("cannot read Secret {secret}: {e}")),
    }
}

/// The `encryptionPassphrase` of `secret`, if it has one (for the
/// `default` and `metadata` KMS of encrypted volumes). Errors never name
/// the Secret's data.
pub async fn encryption_passphrase(
    client: &kube::Client,
    secret: &SecretRef,
) -> Result<Option<Secret>, String> {
    let s = fetch(client, secret).await?;
    let Some(bytes) = s
        .data
        .as_ref()
        .and_then(|d| d.get(crate::volume::kms::PASSPHRASE_KEY))
    else {
        return Ok(None);
    };
    let text = std::str::from_utf8(&bytes.0).map_err(|_| {
        format!(
            "Secret {secret}: {:?} is not UTF-8",
            crate::volume::kms::PASSPHRASE_KEY
        )
    })?;
    Ok((!text.is_empty()).then(|| Secret::new(text.to_owned())))
}

/// The text values of `secret` (for a Vault KMS's `vaultCAFromSecret` and
/// client certificate keys); values that are not UTF-8 are left out.
pub async fn secret_data(
    client: &kube::Client,
    secret: &SecretRef,
) -> Result<std::collections::BTreeMap<String, String>, String> {
    let s = fetch(client, secret).await?;
    Ok(s.data
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(k, v)| String::from_utf8(v.0).ok().map(|v| (k, v)))
        .collect())
}

/// Extracts the credentials from a Secret object.
pub fn credentials_from(s: &K8sSecret) -> Result<Credentials, String> {
    let data = s.data.as_ref();
    let get = |key: &str| -> Result<String, String> {
        let bytes = data
            .and_then(|d| d.get(key))
            .ok_or_else(|| format!("has no {key:?} key"))?;
        let text = std::str::from_utf8(&bytes.0).map_err(|_| format!("{key:?} is not UTF-8"))?;
        let text = text.trim();
        if text.is_empty() {
            return Err(format!("{key:?} is empty"));
        }
        Ok(text.to_owned())
    };
    let user = get(USER_ID)?;
    let key = Secret::new(get(USER_KEY)?);
    Ok(Credentials { user, key })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use std::collections::BTreeMap;

    fn secret(pairs: &[(&str, &[u8])]) -> K8sSecret {
        K8sSecret {
            data: Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.to_vec())))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn reads_user_and_key_and_hides_the_key() {
        let c =
            credentials_from(&secret(&[("userID", b"kube\n"), ("userKey", b"AQBkey==")])).unwrap();
        assert_eq!(c.user, "kube");
        assert_eq!(c.key.expose(), "AQBkey==");
        assert!(!format!("{c:?}").contains("AQB"));
    }

    #[test]
    fn errors_name_the_missing_key_only() {
        let e = credentials_from(&secret(&[("userKey", b"AQBkey==")])).unwrap_err();
        assert!(e.contains("userID") && !e.contains("AQB"), "{e}");
        let e = credentials_from(&secret(&[("userID", b"kube"), ("userKey", b" ")])).unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let e = credentials_from(&secret(&[("userID", b"kube"), ("userKey", &[0xff, 0xfe])]))
            .unwrap_err();
        assert!(e.contains("UTF-8"), "{e}");
        assert!(credentials_from(&K8sSecret::default()).is_err());
    }
}
