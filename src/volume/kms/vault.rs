//! The Vault KMS kinds of ceph-csi's KMS config: `vault`, `vaulttokens`
//! and `vaulttenantsa`, against HashiCorp Vault (or OpenBao) over its HTTP
//! API.
//!
//! A volume's passphrase lives in Vault's KV secrets engine (version 1 or
//! 2) exactly where ceph-csi keeps it, so a key either one writes the other
//! reads:
//! - the key is the CSI volume id, under `vaultPassphrasePath` for `vault`
//!   (`<backend>/data/<vaultPassphrasePath>/<volume id>` on KV v2,
//!   `<backend>/<vaultPassphrasePath>/<volume id>` on KV v1), with
//!   `vaultNamespace` in front of the path;
//! - the secret's one field is `data`, an object with `passphrase`:
//!   `{"data": {"passphrase": "..."}}` (on KV v2 wrapped once more in the
//!   request body, as every KV v2 write is);
//! - delete removes every version and the metadata on KV v2 when
//!   `vaultDestroyKeys` is `"true"` (the default), else only the latest
//!   version.
//!
//! Logins: `vault` posts the driver's service account token to
//! `auth/<mount>/login` (Kubernetes auth, mount from `vaultAuthPath`, role
//! `vaultRole`); `vaulttokens` reads a Vault token from the Secret
//! `tenantTokenName` (default `ceph-csi-kms-token`, key `token`) in the
//! tenant's namespace; `vaulttenantsa` logs in with a token made by the
//! TokenRequest API for the tenant's service account `tenantSAName`
//! (default `ceph-csi-vault-sa`). For the two tenant kinds, `tenants.<ns>`
//! in the section and the ConfigMap `tenantConfigName` (default
//! `ceph-csi-kms-config`) in the tenant's namespace override options, as in
//! ceph-csi.
//!
//! TLS: `vaultCAVerify: "false"` skips the certificate check (the handshake
//! signature is still checked); `vaultCAFromSecret` gives the CA bundle (for
//! `vault`, a key of the request's Secret; for the tenant kinds, the `cert`
//! key of that Secret in the tenant's namespace, else in the driver's);
//! `vaultClientCertFromSecret` / `vaultClientCertKeyFromSecret` a client
//! certificate; `vaultTLSServerName` the name checked.
//!
//! Every call is bounded by a timeout ([`VaultKms::with_timeout`]); an error
//! names the KMS id and the reason, never a token or a passphrase.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use kube::api::PostParams;
use kube::Api;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{json, Map, Value};

use crate::error::{Error, ErrorKind, Result};

/// Where the `vault` kind reads the driver's service account token.
pub const SERVICE_ACCOUNT_TOKEN_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// How long one KMS call may take, logins included, unless
/// [`VaultKms::with_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);

/// The largest Vault response read; anything longer is refused.
const MAX_RESPONSE: usize = 1 << 20;

/// Which of ceph-csi's Vault KMS types a config section is
/// (`encryptionKMSType`, or `KMS_PROVIDER` in the older format).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VaultKind {
    /// `vault`: the driver's own service account logs in with Kubernetes
    /// auth.
    Vault,
    /// `vaulttokens`: a Vault token per tenant, from a Secret in the
    /// tenant's namespace.
    Tokens,
    /// `vaulttenantsa`: the tenant's service account logs in with
    /// Kubernetes auth.
    TenantSa,
}

impl VaultKind {
    /// The kind of a KMS type string, if it is one of the Vault kinds.
    pub fn from_type(kms_type: &str) -> Option<VaultKind> {
        match kms_type {
            "vault" => Some(VaultKind::Vault),
            "vaulttokens" => Some(VaultKind::Tokens),
            "vaulttenantsa" => Some(VaultKind::TenantSa),
            _ => None,
        }
    }

    /// The KMS type string ceph-csi uses for it.
    pub fn as_str(self) -> &'static str {
        match self {
            VaultKind::Vault => "vault",
            VaultKind::Tokens => "vaulttokens",
            VaultKind::TenantSa => "vaulttenantsa",
        }
    }
}

impl fmt::Display for VaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A volume's passphrase. Its `Debug` shows no content.
#[derive(Clone, PartialEq, Eq)]
pub struct Passphrase(String);

impl Passphrase {
    /// Wraps a passphrase.
    pub fn new(passphrase: impl Into<String>) -> Passphrase {
        Passphrase(passphrase.into())
    }

    /// The passphrase itself, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Passphrase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Passphrase(<redacted>)")
    }
}

/// What a KMS call needs from the request it serves.
#[derive(Clone, Default)]
pub struct KmsContext {
    /// A client for the API server: the tenant kinds read Secrets,
    /// ConfigMaps and service accounts through it.
    pub kube: Option<kube::Client>,
    /// The tenant: the namespace of the volume's claim.
    pub tenant: Option<String>,
    /// The request's Secret (the StorageClass's provisioner or node-stage
    /// Secret): `vault` reads its CA bundle from the key named by
    /// `vaultCAFromSecret`.
    pub secrets: BTreeMap<String, String>,
    /// The driver's own namespace, where the tenant kinds look for the
    /// certificate Secrets a tenant does not have.
    pub csi_namespace: Option<String>,
}

impl fmt::Debug for KmsContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KmsContext")
            .field("kube", &self.kube.is_some())
            .field("tenant", &self.tenant)
            .field("secrets", &self.secrets.keys().collect::<Vec<_>>())
            .field("csi_namespace", &self.csi_namespace)
            .finish()
    }
}

/// The KV secrets engine version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Kv1,
    Kv2,
    /// Read from the mount's options (`GET sys/mounts`).
    Detect,
}

/// One KMS section's options after every layer (section, `tenants.<ns>`,
/// the tenant's ConfigMap) was applied.
#[derive(Debug, Clone)]
struct Settings {
    address: String,
    backend: Backend,
    backend_path: String,
    passphrase_path: String,
    destroy_keys: bool,
    namespace: String,
    auth_namespace: Option<String>,
    tls_server_name: Option<String>,
    ca_verify: bool,
    ca_from_secret: Option<String>,
    client_cert_from_secret: Option<String>,
    client_key_from_secret: Option<String>,
    auth_mount: String,
    role: String,
    tenant_config_name: String,
    token_name: String,
    sa_name: String,
}

impl Settings {
    fn defaults() -> Settings {
        Settings {
            address: String::new(),
            backend: Backend::Detect,
            backend_path: "secret/".into(),
            passphrase_path: String::new(),
            destroy_keys: true,
            namespace: String::new(),
            auth_namespace: None,
            tls_server_name: None,
            ca_verify: true,
            ca_from_secret: None,
            client_cert_from_secret: None,
            client_key_from_secret: None,
            auth_mount: "kubernetes".into(),
            role: "csi-kubernetes".into(),
            tenant_config_name: "ceph-csi-kms-config".into(),
            token_name: "ceph-csi-kms-token".into(),
            sa_name: "ceph-csi-vault-sa".into(),
        }
    }

    /// The namespace logins and the mount lookup are sent to.
    fn auth_namespace(&self) -> &str {
        match &self.auth_namespace {
            Some(ns) if !ns.is_empty() => ns,
            _ => &self.namespace,
        }
    }

    /// Applies the options present in `layer` (`why` says where they came
    /// from, for errors).
    fn apply(&mut self, kind: VaultKind, layer: &Map<String, Value>, why: &Why) -> Result<()> {
        if let Some(v) = string_opt(layer, "vaultAddress", why)? {
            if !(v.starts_with("http://") || v.starts_with("https://")) {
                return Err(why.invalid(format!(
                    "vaultAddress {v:?} is not an http:// or https:// URL"
                )));
            }
            self.address = v.trim_end_matches('/').to_owned();
        }
        if let Some(v) = string_opt(layer, "vaultBackend", why)? {
            // ceph-csi (libopenstorage) knows "kv" and "kv-v2"; any other
            // value asks the server.
            self.backend = match v.as_str() {
                "kv" => Backend::Kv1,
                "kv-v2" => Backend::Kv2,
                _ => Backend::Detect,
            };
        }
        if let Some(v) = string_opt(layer, "vaultBackendPath", why)? {
            self.backend_path = v;
        }
        if let Some(v) = bool_text_opt(layer, "vaultDestroyKeys", why)? {
            // Only the exact string "true" destroys, as in ceph-csi.
            self.destroy_keys = v == "true";
        }
        if let Some(v) = string_opt(layer, "vaultTLSServerName", why)? {
            self.tls_server_name = (!v.is_empty()).then_some(v);
        }
        if let Some(v) = string_opt(layer, "vaultNamespace", why)? {
            self.namespace = v;
        }
        if let Some(v) = string_opt(layer, "vaultAuthNamespace", why)? {
            self.auth_namespace = Some(v);
        }
        if let Some(v) = bool_text_opt(layer, "vaultCAVerify", why)? {
            self.ca_verify = parse_go_bool(&v)
                .ok_or_else(|| why.invalid(format!("vaultCAVerify {v:?} is not true or false")))?;
        }
        if let Some(v) = string_opt(layer, "vaultCAFromSecret", why)? {
            self.ca_from_secret = (!v.is_empty()).then_some(v);
        }
        if kind != VaultKind::Vault {
            if let Some(v) = string_opt(layer, "vaultClientCertFromSecret", why)? {
                self.client_cert_from_secret = (!v.is_empty()).then_some(v);
            }
            if let Some(v) = string_opt(layer, "vaultClientCertKeyFromSecret", why)? {
                self.client_key_from_secret = (!v.is_empty()).then_some(v);
            }
            if let Some(v) = string_opt(layer, "tenantConfigName", why)? {
                self.tenant_config_name = v;
            }
        }
        if kind != VaultKind::Tokens {
            if let Some(v) = string_opt(layer, "vaultAuthPath", why)? {
                self.auth_mount =
                    auth_mount(&v).ok_or_else(|| why.invalid("vaultAuthPath is empty"))?;
            }
            if let Some(v) = string_opt(layer, "vaultRole", why)? {
                self.role = v;
            }
        }
        match kind {
            VaultKind::Vault => {
                // ceph-csi's older examples give the mount as "/v1/secret".
                if let Some(v) = string_opt(layer, "vaultPassphraseRoot", why)? {
                    self.backend_path = v.strip_prefix("/v1/").unwrap_or(&v).to_owned();
                }
                if let Some(v) = string_opt(layer, "vaultPassphrasePath", why)? {
                    self.passphrase_path = v;
                }
            }
            VaultKind::Tokens => {
                if let Some(v) = string_opt(layer, "tenantTokenName", why)? {
                    self.token_name = v;
                }
            }
            VaultKind::TenantSa => {
                if let Some(v) = string_opt(layer, "tenantSAName", why)? {
                    self.sa_name = v;
                }
            }
        }
        Ok(())
    }
}

/// Where a config layer came from, for errors.
struct Why<'a> {
    kms_id: &'a str,
    layer: String,
}

impl Why<'_> {
    fn invalid(&self, detail: impl fmt::Display) -> Error {
        Error::invalid(
            "vault config",
            format!("KMS {}", self.kms_id),
            format!("{}: {detail}", self.layer),
        )
    }
}

fn string_opt(layer: &Map<String, Value>, key: &str, why: &Why) -> Result<Option<String>> {
    match layer.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => {
            Err(why.invalid(format!("{key} must be a string, not {}", json_type(other))))
        }
    }
}

/// A string option that may also be given as a JSON boolean.
fn bool_text_opt(layer: &Map<String, Value>, key: &str, why: &Why) -> Result<Option<String>> {
    match layer.get(key) {
        Some(Value::Bool(b)) => Ok(Some(b.to_string())),
        _ => string_opt(layer, key, why),
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Go's `strconv.ParseBool`, which ceph-csi reads `vaultCAVerify` with.
fn parse_go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// The auth mount of a `vaultAuthPath` such as `/v1/auth/kubernetes/login`:
/// the parts between `auth` and `login` (`kubernetes`); a path without them
/// is the mount itself.
fn auth_mount(path: &str) -> Option<String> {
    if path.is_empty() {
        return None;
    }
    let mut parts = Vec::new();
    let mut inside = false;
    for part in path.split('/') {
        if part == "auth" && !inside {
            inside = true;
            continue;
        }
        if part == "login" {
            break;
        }
        if inside {
            parts.push(part);
        }
    }
    let mount = parts.join("/");
    Some(if mount.is_empty() {
        path.to_owned()
    } else {
        mount
    })
}

/// The options a tenant's ConfigMap may set (ceph-csi's
/// `isTenantConfigOption` and, for `vaulttenantsa`, `isTenantSAConfigOption`).
fn tenant_may_set(kind: VaultKind, key: &str) -> bool {
    matches!(
        key,
        "vaultAddress"
            | "vaultBackend"
            | "vaultBackendPath"
            | "vaultAuthNamespace"
            | "vaultNamespace"
            | "vaultDestroyKeys"
            | "vaultTLSServerName"
            | "vaultCAFromSecret"
            | "vaultCAVerify"
    ) || (kind == VaultKind::TenantSa
        && matches!(key, "tenantSAName" | "vaultAuthPath" | "vaultRole"))
}

/// The older, environment-variable style section (`KMS_PROVIDER`,
/// `VAULT_ADDR`, ...) in the names of the newer one, as ceph-csi maps it for
/// the tenant kinds. Other keys are dropped, as there.
fn from_env_style(section: &Map<String, Value>, why: &Why) -> Result<Map<String, Value>> {
    let get = |key: &str| string_opt(section, key, why);
    let mut out = Map::new();
    for (old, new) in [
        ("VAULT_ADDR", "vaultAddress"),
        ("VAULT_BACKEND", "vaultBackend"),
        ("VAULT_BACKEND_PATH", "vaultBackendPath"),
        ("VAULT_CACERT", "vaultCAFromSecret"),
        ("VAULT_TLS_SERVER_NAME", "vaultTLSServerName"),
        ("VAULT_CLIENT_CERT", "vaultClientCertFromSecret"),
        ("VAULT_CLIENT_KEY", "vaultClientCertKeyFromSecret"),
        ("VAULT_AUTH_NAMESPACE", "vaultAuthNamespace"),
        ("VAULT_NAMESPACE", "vaultNamespace"),
    ] {
        if let Some(v) = get(old)? {
            out.insert(new.into(), Value::String(v));
        }
    }
    let destroy = get("VAULT_DESTROY_KEYS")?.unwrap_or_else(|| "true".into());
    out.insert("vaultDestroyKeys".into(), Value::String(destroy));
    let skip = get("VAULT_SKIP_VERIFY")?.unwrap_or_else(|| "false".into());
    let skip = parse_go_bool(&skip)
        .ok_or_else(|| why.invalid(format!("VAULT_SKIP_VERIFY {skip:?} is not true or false")))?;
    out.insert("vaultCAVerify".into(), Value::String((!skip).to_string()));
    Ok(out)
}

/// One Vault KMS of the KMS config: its kind and options, checked. Each
/// call ([`VaultKms::put`], [`VaultKms::get`], [`VaultKms::delete`], or a
/// [`VaultSession`] from [`VaultKms::connect`]) resolves the tenant's
/// options, logs in and talks to Vault, within the timeout.
#[derive(Debug, Clone)]
pub struct VaultKms {
    kms_id: String,
    kind: VaultKind,
    section: Arc<Map<String, Value>>,
    base: Settings,
    timeout: Duration,
    sa_token_file: PathBuf,
}

impl VaultKms {
    /// Reads the section `kms_id` of the KMS config (the JSON object under
    /// that id) as a KMS of `kind`. Refuses, by name, a missing
    /// `vaultAddress` and options of the wrong type or value.
    pub fn from_config(
        kms_id: &str,
        kind: VaultKind,
        section: &Map<String, Value>,
    ) -> Result<VaultKms> {
        let why = Why {
            kms_id,
            layer: format!("the {kind} section"),
        };
        let section = if kind != VaultKind::Vault && section.contains_key("KMS_PROVIDER") {
            from_env_style(section, &why)?
        } else {
            section.clone()
        };
        let mut base = Settings::defaults();
        base.apply(kind, &section, &why)?;
        if base.address.is_empty() {
            return Err(why.invalid("vaultAddress is missing"));
        }
        if let Some(tenants) = section.get("tenants") {
            let Value::Object(tenants) = tenants else {
                return Err(why.invalid(format!(
                    "tenants must be an object, not {}",
                    json_type(tenants)
                )));
            };
            for (tenant, layer) in tenants {
                let Value::Object(layer) = layer else {
                    return Err(why.invalid(format!("tenants.{tenant} must be an object")));
                };
                let why = Why {
                    kms_id,
                    layer: format!("tenants.{tenant}"),
                };
                base.clone().apply(kind, layer, &why)?;
            }
        }
        Ok(VaultKms {
            kms_id: kms_id.to_owned(),
            kind,
            section: Arc::new(section),
            base,
            timeout: DEFAULT_TIMEOUT,
            sa_token_file: PathBuf::from(SERVICE_ACCOUNT_TOKEN_FILE),
        })
    }

    /// Bounds every call (logins, Kubernetes reads and the request) by
    /// `timeout` instead of [`DEFAULT_TIMEOUT`].
    pub fn with_timeout(mut self, timeout: Duration) -> VaultKms {
        self.timeout = timeout;
        self
    }

    /// Reads the `vault` kind's service account token from `path` instead
    /// of [`SERVICE_ACCOUNT_TOKEN_FILE`] (a driver run outside a pod).
    pub fn with_service_account_token_file(mut self, path: impl Into<PathBuf>) -> VaultKms {
        self.sa_token_file = path.into();
        self
    }

    /// The KMS id (the key of the section in the KMS config).
    pub fn kms_id(&self) -> &str {
        &self.kms_id
    }

    /// The kind.
    pub fn kind(&self) -> VaultKind {
        self.kind
    }

    /// Stores `passphrase` as the key of `volume_id`, replacing any.
    pub async fn put(
        &self,
        ctx: &KmsContext,
        volume_id: &str,
        passphrase: &Passphrase,
    ) -> Result<()> {
        let op = "vault put";
        self.bounded(op, Some(volume_id), async {
            self.open(ctx).await?.put_now(volume_id, passphrase).await
        })
        .await
    }

    /// The key of `volume_id`; [`ErrorKind::NotFound`] if Vault has none.
    pub async fn get(&self, ctx: &KmsContext, volume_id: &str) -> Result<Passphrase> {
        self.bounded("vault get", Some(volume_id), async {
            self.open(ctx).await?.get_now(volume_id).await
        })
        .await
    }

    /// Removes the key of `volume_id` (every version and its metadata on KV
    /// v2 when `vaultDestroyKeys` is `"true"`). A missing key is no error.
    pub async fn delete(&self, ctx: &KmsContext, volume_id: &str) -> Result<()> {
        self.bounded("vault delete", Some(volume_id), async {
            self.open(ctx).await?.delete_now(volume_id).await
        })
        .await
    }

    /// Logs in for the tenant of `ctx` and returns a session for several
    /// calls (each bounded by the same timeout).
    pub async fn connect(&self, ctx: &KmsContext) -> Result<VaultSession> {
        self.bounded("vault connect", None, self.open(ctx)).await
    }

    async fn bounded<T>(
        &self,
        op: &'static str,
        volume_id: Option<&str>,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(Error::with_kind(
                ErrorKind::TimedOut,
                libc::ETIMEDOUT,
                op,
                object(&self.kms_id, volume_id),
                format!(
                    "no answer within {:?} (Vault at {}, or the API server)",
                    self.timeout, self.base.address
                ),
            )),
        }
    }

    fn err(&self, kind: ErrorKind, errno: i32, detail: impl Into<String>) -> Error {
        Error::with_kind(
            kind,
            errno,
            "vault connect",
            object(&self.kms_id, None),
            detail,
        )
    }

    /// The options for the tenant of `ctx`: the section, then
    /// `tenants.<tenant>`, then the tenant's ConfigMap.
    async fn settings_for(&self, ctx: &KmsContext) -> Result<Settings> {
        let mut s = self.base.clone();
        if self.kind == VaultKind::Vault {
            return Ok(s);
        }
        let Some(tenant) = ctx.tenant.as_deref().filter(|t| !t.is_empty()) else {
            return Ok(s);
        };
        if let Some(Value::Object(layer)) = self.section.get("tenants").and_then(|t| t.get(tenant))
        {
            let why = Why {
                kms_id: &self.kms_id,
                layer: format!("tenants.{tenant}"),
            };
            s.apply(self.kind, layer, &why)?;
        }
        let kube = self.kube(ctx)?;
        let cms: Api<ConfigMap> = Api::namespaced(kube.clone(), tenant);
        let cm = cms.get_opt(&s.tenant_config_name).await.map_err(|e| {
            self.err(
                ErrorKind::Other(libc::EIO),
                libc::EIO,
                format!(
                    "cannot read ConfigMap {tenant}/{}: {e}",
                    s.tenant_config_name
                ),
            )
        })?;
        if let Some(data) = cm.and_then(|cm| cm.data) {
            let layer: Map<String, Value> = data
                .into_iter()
                .filter(|(k, _)| tenant_may_set(self.kind, k))
                .map(|(k, v)| (k, Value::String(v)))
                .collect();
            let why = Why {
                kms_id: &self.kms_id,
                layer: format!("ConfigMap {tenant}/{}", s.tenant_config_name),
            };
            s.apply(self.kind, &layer, &why)?;
        }
        Ok(s)
    }

    fn kube<'a>(&self, ctx: &'a KmsContext) -> Result<&'a kube::Client> {
        ctx.kube.as_ref().ok_or_else(|| {
            self.err(
                ErrorKind::InvalidArgument,
                libc::EINVAL,
                format!("{} needs a Kubernetes client", self.kind),
            )
        })
    }

    fn tenant<'a>(&self, ctx: &'a KmsContext) -> Result<&'a str> {
        ctx.tenant.as_deref().filter(|t| !t.is_empty()).ok_or_else(|| {
            self.err(
                ErrorKind::InvalidArgument,
                libc::EINVAL,
                format!(
                    "{} needs the volume's tenant (the claim's namespace), and the request has none",
                    self.kind
                ),
            )
        })
    }

    /// The value of `key` in Secret `namespace/name`, as text; `None` if
    /// the Secret does not exist.
    async fn secret_key(
        &self,
        kube: &kube::Client,
        namespace: &str,
        name: &str,
        key: &str,
    ) -> Result<Option<String>> {
        let api: Api<Secret> = Api::namespaced(kube.clone(), namespace);
        let secret = api.get_opt(name).await.map_err(|e| {
            self.err(
                ErrorKind::Other(libc::EIO),
                libc::EIO,
                format!("cannot read Secret {namespace}/{name}: {e}"),
            )
        })?;
        let Some(secret) = secret else {
            return Ok(None);
        };
        let value = secret.data.and_then(|mut d| d.remove(key)).ok_or_else(|| {
            self.err(
                ErrorKind::InvalidArgument,
                libc::EINVAL,
                format!("Secret {namespace}/{name} has no key {key:?}"),
            )
        })?;
        String::from_utf8(value.0).map(Some).map_err(|_| {
            self.err(
                ErrorKind::InvalidArgument,
                libc::EINVAL,
                format!("key {key:?} of Secret {namespace}/{name} is not text"),
            )
        })
    }

    /// A certificate Secret of a tenant kind: in the tenant's namespace,
    /// else in the driver's.
    async fn tenant_cert(&self, ctx: &KmsContext, name: &str, key: &str) -> Result<String> {
        let kube = self.kube(ctx)?;
        let mut tried = Vec::new();
        for ns in [ctx.tenant.as_deref(), ctx.csi_namespace.as_deref()]
            .into_iter()
            .flatten()
            .filter(|ns| !ns.is_empty())
        {
            if let Some(v) = self.secret_key(kube, ns, name, key).await? {
                return Ok(v);
            }
            tried.push(format!("{ns}/{name}"));
        }
        Err(self.err(
            ErrorKind::NotFound,
            libc::ENOENT,
            format!("no Secret {name} (looked for {})", tried.join(", ")),
        ))
    }

    async fn open(&self, ctx: &KmsContext) -> Result<VaultSession> {
        let s = self.settings_for(ctx).await?;
        let ca = match (&s.ca_from_secret, self.kind) {
            (None, _) => None,
            (Some(key), VaultKind::Vault) => Some(ctx.secrets.get(key).cloned().ok_or_else(|| {
                self.err(
                    ErrorKind::InvalidArgument,
                    libc::EINVAL,
                    format!("vaultCAFromSecret names key {key:?}, and the request's Secret has no such key"),
                )
            })?),
            (Some(name), _) => Some(self.tenant_cert(ctx, name, "cert").await?),
        };
        let client_auth = match (&s.client_cert_from_secret, &s.client_key_from_secret) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((
                self.tenant_cert(ctx, cert, "cert").await?,
                self.tenant_cert(ctx, key, "key").await?,
            )),
            _ => {
                return Err(self.err(
                    ErrorKind::InvalidArgument,
                    libc::EINVAL,
                    "vaultClientCertFromSecret and vaultClientCertKeyFromSecret go together; one is missing",
                ))
            }
        };
        let http = http_client(&s, ca.as_deref(), client_auth, self.timeout)
            .map_err(|e| self.err(ErrorKind::InvalidArgument, libc::EINVAL, e))?;
        let mut session = VaultSession {
            kms_id: self.kms_id.clone(),
            kind: self.kind,
            http,
            settings: s,
            kv2: false,
            token: Mutex::new(Arc::new(String::new())),
            jwt: None,
            timeout: self.timeout,
        };
        match self.kind {
            VaultKind::Tokens => {
                let kube = self.kube(ctx)?;
                let tenant = self.tenant(ctx)?;
                let name = &session.settings.token_name;
                let token = self
                    .secret_key(kube, tenant, name, "token")
                    .await?
                    .ok_or_else(|| {
                        self.err(
                            ErrorKind::NotFound,
                            libc::ENOENT,
                            format!("no Secret {tenant}/{name} with the tenant's Vault token"),
                        )
                    })?;
                session.set_token(token.trim().to_owned());
            }
            VaultKind::Vault => {
                let jwt = tokio::fs::read_to_string(&self.sa_token_file)
                    .await
                    .map_err(|e| {
                        self.err(
                            ErrorKind::from_errno(e.raw_os_error().unwrap_or(libc::EIO)),
                            e.raw_os_error().unwrap_or(libc::EIO),
                            format!(
                                "cannot read the service account token {}: {e}",
                                self.sa_token_file.display()
                            ),
                        )
                    })?;
                session.jwt = Some(jwt.trim().to_owned());
                session.login().await?;
            }
            VaultKind::TenantSa => {
                session.jwt = Some(self.tenant_sa_token(ctx, &session.settings.sa_name).await?);
                session.login().await?;
            }
        }
        session.kv2 = match session.settings.backend {
            Backend::Kv1 => false,
            Backend::Kv2 => true,
            Backend::Detect => session.detect_kv2().await?,
        };
        Ok(session)
    }

    /// A token of the tenant's service account `name`: a new one from the
    /// TokenRequest API, else (clusters before 1.24) one from the
    /// service account's token Secrets.
    async fn tenant_sa_token(&self, ctx: &KmsContext, name: &str) -> Result<String> {
        let kube = self.kube(ctx)?;
        let tenant = self.tenant(ctx)?;
        let api: Api<ServiceAccount> = Api::namespaced(kube.clone(), tenant);
        let sa = api.get_opt(name).await.map_err(|e| {
            self.err(
                ErrorKind::Other(libc::EIO),
                libc::EIO,
                format!("cannot read ServiceAccount {tenant}/{name}: {e}"),
            )
        })?;
        let Some(sa) = sa else {
            return Err(self.err(
                ErrorKind::NotFound,
                libc::ENOENT,
                format!("no ServiceAccount {tenant}/{name}"),
            ));
        };
        let request = TokenRequest {
            spec: TokenRequestSpec {
                // The shortest the API allows: it is used for one login.
                expiration_seconds: Some(600),
                ..Default::default()
            },
            ..Default::default()
        };
        let made = api
            .create_token_request(name, &PostParams::default(), &request)
            .await;
        let request_error = match made {
            Ok(tr) => match tr.status.map(|s| s.token) {
                Some(token) if !token.is_empty() => return Ok(token),
                _ => "the TokenRequest returned no token".to_owned(),
            },
            Err(e) => e.to_string(),
        };
        for secret in sa.secrets.unwrap_or_default() {
            if let Some(secret_name) = secret.name {
                if let Some(token) = self.secret_key(kube, tenant, &secret_name, "token").await? {
                    return Ok(token);
                }
            }
        }
        Err(self.err(
            ErrorKind::Other(libc::EIO),
            libc::EIO,
            format!(
                "cannot get a token for ServiceAccount {tenant}/{name}: {request_error}, and it has no token Secret"
            ),
        ))
    }
}

fn object(kms_id: &str, volume_id: Option<&str>) -> String {
    match volume_id {
        Some(v) => format!("KMS {kms_id} volume {v}"),
        None => format!("KMS {kms_id}"),
    }
}

type HttpClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// A client for `s.address` with the TLS settings of `s`.
fn http_client(
    s: &Settings,
    ca_pem: Option<&str>,
    client_auth: Option<(String, String)>,
    timeout: Duration,
) -> std::result::Result<HttpClient, String> {
    // ring's provider, the one kube already brings: deprecated in rustls
    // 0.23.48 only for lacking post-quantum key exchange, which no Vault
    // requires.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?;
    let builder = if !s.ca_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
    } else {
        let mut roots = rustls::RootCertStore::empty();
        match ca_pem {
            Some(pem) => {
                // As Vault's own client: the given bundle replaces the
                // system's roots.
                for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                    let cert = cert.map_err(|e| {
                        format!("the CA bundle (vaultCAFromSecret) is not PEM: {e}")
                    })?;
                    roots.add(cert).map_err(|e| {
                        format!("the CA bundle (vaultCAFromSecret) has a bad certificate: {e}")
                    })?;
                }
                if roots.is_empty() {
                    return Err("the CA bundle (vaultCAFromSecret) holds no certificate".into());
                }
            }
            None => {
                let native = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(native.certs);
            }
        }
        builder.with_root_certificates(roots)
    };
    let config = match client_auth {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| {
                    format!("the client certificate (vaultClientCertFromSecret) is not PEM: {e}")
                })?;
            if chain.is_empty() {
                return Err(
                    "the client certificate (vaultClientCertFromSecret) holds no certificate"
                        .into(),
                );
            }
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|_| {
                "the client key (vaultClientCertKeyFromSecret) is not a PEM private key".to_owned()
            })?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("the client certificate and key do not fit: {e}"))?
        }
    };
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(timeout));
    let tls = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http();
    let tls = match &s.tls_server_name {
        Some(name) => {
            let name = ServerName::try_from(name.clone()).map_err(|_| {
                format!("vaultTLSServerName {name:?} is not a DNS name or IP address")
            })?;
            tls.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
        }
        None => tls,
    };
    Ok(Client::builder(TokioExecutor::new()).build(tls.enable_http1().wrap_connector(http)))
}

/// `vaultCAVerify: "false"`: any certificate is taken, but the handshake
/// must still be signed by its key.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> std::result::Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// One request to Vault.
struct Req<'a> {
    method: http::Method,
    path: &'a [String],
    namespace: &'a str,
    body: Option<&'a Value>,
    with_token: bool,
}

/// A Vault answer: the status and the JSON body, if any.
struct Reply {
    status: u16,
    body: Option<Value>,
}

/// A logged-in connection to the Vault of one KMS for one tenant, from
/// [`VaultKms::connect`]. Each call is bounded by the KMS's timeout.
pub struct VaultSession {
    kms_id: String,
    kind: VaultKind,
    http: HttpClient,
    settings: Settings,
    kv2: bool,
    token: Mutex<Arc<String>>,
    /// The service account token a Kubernetes-auth kind logs in (again) with.
    jwt: Option<String>,
    timeout: Duration,
}

impl fmt::Debug for VaultSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VaultSession")
            .field("kms_id", &self.kms_id)
            .field("kind", &self.kind)
            .field("address", &self.settings.address)
            .field("kv2", &self.kv2)
            .finish_non_exhaustive()
    }
}

/// Percent-encodes one path segment.
fn encode_segment(seg: &str, out: &mut String) {
    for b in seg.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
}

/// Joins path parts as Go's `path.Join` would for these inputs (empty parts
/// and `.` dropped), refusing `..`.
fn join_path(parts: &[&str]) -> std::result::Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in parts {
        for seg in part.split('/') {
            match seg {
                "" | "." => {}
                ".." => return Err(format!("{part:?} has a \"..\" component")),
                s => out.push(s.to_owned()),
            }
        }
    }
    Ok(out)
}

impl VaultSession {
    /// Whether the backend is KV version 2.
    pub fn is_kv2(&self) -> bool {
        self.kv2
    }

    /// Stores `passphrase` as the key of `volume_id`, replacing any.
    pub async fn put(&self, volume_id: &str, passphrase: &Passphrase) -> Result<()> {
        self.bounded("vault put", volume_id, self.put_now(volume_id, passphrase))
            .await
    }

    /// The key of `volume_id`; [`ErrorKind::NotFound`] if Vault has none.
    pub async fn get(&self, volume_id: &str) -> Result<Passphrase> {
        self.bounded("vault get", volume_id, self.get_now(volume_id))
            .await
    }

    /// Removes the key of `volume_id`; a missing key is no error.
    pub async fn delete(&self, volume_id: &str) -> Result<()> {
        self.bounded("vault delete", volume_id, self.delete_now(volume_id))
            .await
    }

    async fn bounded<T>(
        &self,
        op: &'static str,
        volume_id: &str,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(Error::with_kind(
                ErrorKind::TimedOut,
                libc::ETIMEDOUT,
                op,
                object(&self.kms_id, Some(volume_id)),
                format!(
                    "no answer from Vault at {} within {:?}",
                    self.settings.address, self.timeout
                ),
            )),
        }
    }

    fn set_token(&self, token: String) {
        *self.token.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(token);
    }

    fn token(&self) -> Arc<String> {
        self.token.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The key's path segments under `kind` (`data` or `metadata` on KV v2).
    fn key_path(&self, kind: &str, volume_id: &str) -> std::result::Result<Vec<String>, String> {
        if volume_id.is_empty() {
            return Err("the volume id is empty".into());
        }
        let key_prefix = match self.kind {
            VaultKind::Vault => self.settings.passphrase_path.as_str(),
            _ => "",
        };
        let s = &self.settings;
        if self.kv2 {
            join_path(&[&s.namespace, &s.backend_path, kind, key_prefix, volume_id])
        } else {
            join_path(&[&s.namespace, &s.backend_path, key_prefix, volume_id])
        }
    }

    fn op_err(
        &self,
        op: &'static str,
        volume_id: Option<&str>,
        kind: ErrorKind,
        errno: i32,
        detail: String,
    ) -> Error {
        Error::with_kind(kind, errno, op, object(&self.kms_id, volume_id), detail)
    }

    /// Sends one request to `/v1/<path>`: the namespace in the
    /// `X-Vault-Namespace` header, the token, if asked for, in
    /// `X-Vault-Token`.
    async fn send(&self, op: &'static str, volume_id: Option<&str>, r: Req<'_>) -> Result<Reply> {
        let Req {
            method,
            path,
            namespace,
            body,
            with_token,
        } = r;
        let mut uri = format!("{}/v1", self.settings.address);
        for seg in path {
            uri.push('/');
            encode_segment(seg, &mut uri);
        }
        let mut req = http::Request::builder()
            .method(method)
            .uri(&uri)
            .header("X-Vault-Request", "true");
        if !namespace.is_empty() {
            req = req.header("X-Vault-Namespace", namespace);
        }
        if with_token {
            let mut value = http::HeaderValue::from_str(&self.token()).map_err(|_| {
                self.op_err(
                    op,
                    volume_id,
                    ErrorKind::InvalidArgument,
                    libc::EINVAL,
                    "the Vault token has characters a header cannot carry".into(),
                )
            })?;
            value.set_sensitive(true);
            req = req.header("X-Vault-Token", value);
        }
        let body = match body {
            Some(v) => {
                req = req.header("Content-Type", "application/json");
                Bytes::from(serde_json::to_vec(v).expect("JSON of a Value"))
            }
            None => Bytes::new(),
        };
        let req = req.body(Full::new(body)).map_err(|e| {
            self.op_err(
                op,
                volume_id,
                ErrorKind::InvalidArgument,
                libc::EINVAL,
                format!("bad request to {uri}: {e}"),
            )
        })?;
        let resp = self.http.request(req).await.map_err(|e| {
            let errno = if e.is_connect() {
                libc::ECONNREFUSED
            } else {
                libc::EIO
            };
            self.op_err(
                op,
                volume_id,
                ErrorKind::Other(errno),
                errno,
                format!(
                    "cannot reach Vault at {}: {}",
                    self.settings.address,
                    error_chain(&e)
                ),
            )
        })?;
        let status = resp.status().as_u16();
        let bytes = Limited::new(resp.into_body(), MAX_RESPONSE)
            .collect()
            .await
            .map_err(|e| {
                self.op_err(
                    op,
                    volume_id,
                    ErrorKind::Other(libc::EIO),
                    libc::EIO,
                    format!(
                        "reading Vault's answer (HTTP {status}) failed: {e} (at most {MAX_RESPONSE} bytes are read)"
                    ),
                )
            })?
            .to_bytes();
        let body = if bytes.iter().all(u8::is_ascii_whitespace) {
            None
        } else {
            Some(serde_json::from_slice(&bytes).map_err(|_| {
                self.op_err(
                    op,
                    volume_id,
                    ErrorKind::Other(libc::EIO),
                    libc::EIO,
                    format!(
                        "Vault at {} answered HTTP {status} with {} bytes that are not JSON; is it a Vault server?",
                        self.settings.address,
                        bytes.len()
                    ),
                )
            })?)
        };
        Ok(Reply { status, body })
    }

    /// An error for an answer other than success: the status and Vault's
    /// own error strings (which hold no token or passphrase of ours; any
    /// that did would be cut out).
    fn refused(
        &self,
        op: &'static str,
        volume_id: Option<&str>,
        reply: &Reply,
        what: &str,
        secrets: &[&str],
    ) -> Error {
        let mut messages: Vec<String> = reply
            .body
            .as_ref()
            .and_then(|b| b.get("errors"))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(|m| m.chars().take(300).collect())
                    .collect()
            })
            .unwrap_or_default();
        let token = self.token();
        for m in &mut messages {
            for s in secrets.iter().copied().chain([token.as_str()]) {
                if s.len() >= 4 && m.contains(s) {
                    *m = m.replace(s, "<redacted>");
                }
            }
        }
        let said = if messages.is_empty() {
            String::new()
        } else {
            format!(": {}", messages.join("; "))
        };
        let (kind, errno, hint) = match reply.status {
            403 => (
                ErrorKind::PermissionDenied,
                libc::EACCES,
                " (the token or role lacks a policy for this path, or the token is not valid)",
            ),
            404 => (ErrorKind::NotFound, libc::ENOENT, ""),
            503 => (
                ErrorKind::Other(libc::EAGAIN),
                libc::EAGAIN,
                " (Vault is sealed or not ready)",
            ),
            400 => (ErrorKind::InvalidArgument, libc::EINVAL, ""),
            _ => (ErrorKind::Other(libc::EIO), libc::EIO, ""),
        };
        self.op_err(
            op,
            volume_id,
            kind,
            errno,
            format!("{what}: Vault answered HTTP {}{said}{hint}", reply.status),
        )
    }

    /// Logs in with the service account token (Kubernetes auth).
    async fn login(&self) -> Result<()> {
        let op = "vault login";
        let jwt = self.jwt.as_deref().unwrap_or_default();
        let s = &self.settings;
        let path = join_path(&["auth", &s.auth_mount, "login"]).map_err(|e| {
            self.op_err(
                op,
                None,
                ErrorKind::InvalidArgument,
                libc::EINVAL,
                format!("vaultAuthPath: {e}"),
            )
        })?;
        let body = json!({"role": s.role, "jwt": jwt});
        let reply = self
            .send(
                op,
                None,
                Req {
                    method: http::Method::PUT,
                    path: &path,
                    namespace: s.auth_namespace(),
                    body: Some(&body),
                    with_token: false,
                },
            )
            .await?;
        if reply.status != 200 {
            let what = format!(
                "Kubernetes login at auth/{} with role {:?} was refused",
                s.auth_mount, s.role
            );
            return Err(self.refused(op, None, &reply, &what, &[jwt]));
        }
        let token = reply
            .body
            .as_ref()
            .and_then(|b| b.pointer("/auth/client_token"))
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                self.op_err(
                    op,
                    None,
                    ErrorKind::Other(libc::EIO),
                    libc::EIO,
                    format!(
                        "the login at auth/{} returned no client token",
                        s.auth_mount
                    ),
                )
            })?;
        self.set_token(token.to_owned());
        Ok(())
    }

    /// Whether the mount `vaultBackendPath` is KV version 2, from its
    /// options (`GET sys/mounts`).
    async fn detect_kv2(&self) -> Result<bool> {
        let op = "vault connect";
        let s = &self.settings;
        let path = vec!["sys".to_owned(), "mounts".to_owned()];
        let reply = self
            .send(
                op,
                None,
                Req {
                    method: http::Method::GET,
                    path: &path,
                    namespace: s.auth_namespace(),
                    body: None,
                    with_token: true,
                },
            )
            .await?;
        if reply.status != 200 {
            let what = format!(
                "reading sys/mounts to learn the KV version of {:?} failed (or set vaultBackend to \"kv\" or \"kv-v2\")",
                s.backend_path
            );
            return Err(self.refused(op, None, &reply, &what, &[]));
        }
        let body = reply.body.unwrap_or(Value::Null);
        let mounts = body.get("data").unwrap_or(&body);
        let want = s.backend_path.trim_matches('/');
        let mount = mounts
            .as_object()
            .and_then(|m| m.iter().find(|(k, _)| k.trim_matches('/') == want))
            .map(|(_, v)| v);
        let Some(mount) = mount else {
            return Err(self.op_err(
                op,
                None,
                ErrorKind::NotFound,
                libc::ENOENT,
                format!(
                    "Vault has no secrets engine mounted at {:?}",
                    s.backend_path
                ),
            ));
        };
        Ok(mount.pointer("/options/version").and_then(Value::as_str) == Some("2"))
    }

    /// Sends a request with the token; a Kubernetes-auth kind whose token
    /// was refused logs in again once and retries (as ceph-csi does).
    async fn send_authed(
        &self,
        op: &'static str,
        volume_id: &str,
        method: http::Method,
        path: &[String],
        body: Option<&Value>,
    ) -> Result<Reply> {
        let req = |method| Req {
            method,
            path,
            namespace: "",
            body,
            with_token: true,
        };
        let reply = self.send(op, Some(volume_id), req(method.clone())).await?;
        if reply.status == 403 && self.jwt.is_some() {
            self.login().await?;
            return self.send(op, Some(volume_id), req(method)).await;
        }
        Ok(reply)
    }

    fn bad_key(&self, op: &'static str, volume_id: &str, e: String) -> Error {
        self.op_err(
            op,
            Some(volume_id),
            ErrorKind::InvalidArgument,
            libc::EINVAL,
            format!("no Vault path for this volume id: {e}"),
        )
    }

    async fn put_now(&self, volume_id: &str, passphrase: &Passphrase) -> Result<()> {
        let op = "vault put";
        let path = self
            .key_path("data", volume_id)
            .map_err(|e| self.bad_key(op, volume_id, e))?;
        // The secret's fields are {"data": {"passphrase": ...}}, as
        // ceph-csi writes them; KV v2 wants them under "data" once more.
        let fields = json!({"data": {"passphrase": passphrase.expose()}});
        let body = if self.kv2 {
            json!({ "data": fields })
        } else {
            fields
        };
        let reply = self
            .send_authed(op, volume_id, http::Method::PUT, &path, Some(&body))
            .await?;
        if !(200..300).contains(&reply.status) {
            let what = format!("writing {} failed", path.join("/"));
            return Err(self.refused(op, Some(volume_id), &reply, &what, &[passphrase.expose()]));
        }
        Ok(())
    }

    async fn get_now(&self, volume_id: &str) -> Result<Passphrase> {
        let op = "vault get";
        let path = self
            .key_path("data", volume_id)
            .map_err(|e| self.bad_key(op, volume_id, e))?;
        let reply = self
            .send_authed(op, volume_id, http::Method::GET, &path, None)
            .await?;
        if reply.status == 404 {
            return Err(self.op_err(
                op,
                Some(volume_id),
                ErrorKind::NotFound,
                libc::ENOENT,
                format!("Vault has no key for this volume at {}", path.join("/")),
            ));
        }
        if reply.status != 200 {
            let what = format!("reading {} failed", path.join("/"));
            return Err(self.refused(op, Some(volume_id), &reply, &what, &[]));
        }
        let pointer = if self.kv2 {
            "/data/data/data/passphrase"
        } else {
            "/data/data/passphrase"
        };
        let passphrase = reply
            .body
            .as_ref()
            .and_then(|b| b.pointer(pointer))
            .and_then(Value::as_str)
            .filter(|p| !p.is_empty());
        match passphrase {
            Some(p) => Ok(Passphrase::new(p)),
            None => Err(self.op_err(
                op,
                Some(volume_id),
                ErrorKind::Other(libc::EIO),
                libc::EIO,
                format!(
                    "the secret at {} has no data.passphrase text (not a key written by ceph-csi or rbdkit)",
                    path.join("/")
                ),
            )),
        }
    }

    async fn delete_now(&self, volume_id: &str) -> Result<()> {
        let op = "vault delete";
        let kind = if self.settings.destroy_keys {
            "metadata"
        } else {
            "data"
        };
        let path = self
            .key_path(kind, volume_id)
            .map_err(|e| self.bad_key(op, volume_id, e))?;
        let reply = self
            .send_authed(op, volume_id, http::Method::DELETE, &path, None)
            .await?;
        if (200..300).contains(&reply.status) || reply.status == 404 {
            return Ok(());
        }
        let what = format!("deleting {} failed", path.join("/"));
        Err(self.refused(op, Some(volume_id), &reply, &what, &[]))
    }
}

/// An error and its sources, one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn kind_names_round_trip() {
        for k in [VaultKind::Vault, VaultKind::Tokens, VaultKind::TenantSa] {
            assert_eq!(VaultKind::from_type(k.as_str()), Some(k));
        }
        assert_eq!(VaultKind::from_type("metadata"), None);
    }

    #[test]
    fn auth_mount_takes_the_parts_between_auth_and_login() {
        assert_eq!(
            auth_mount("/v1/auth/kubernetes/login").as_deref(),
            Some("kubernetes")
        );
        assert_eq!(
            auth_mount("/v1/auth/k8s/cluster-1/login").as_deref(),
            Some("k8s/cluster-1")
        );
        assert_eq!(auth_mount("kube").as_deref(), Some("kube"));
        assert_eq!(auth_mount(""), None);
    }

    #[test]
    fn the_ceph_csi_example_section_reads() {
        let kms = VaultKms::from_config(
            "vault-test",
            VaultKind::Vault,
            &section(json!({
                "encryptionKMSType": "vault",
                "vaultAddress": "http://vault.default.svc.cluster.local:8200/",
                "vaultAuthPath": "/v1/auth/kubernetes/login",
                "vaultRole": "csi-kubernetes",
                "vaultBackend": "kv-v2",
                "vaultDestroyKeys": "true",
                "vaultPassphraseRoot": "/v1/secret",
                "vaultPassphrasePath": "ceph-csi/",
                "vaultCAVerify": "false"
            })),
        )
        .expect("valid");
        let s = &kms.base;
        assert_eq!(s.address, "http://vault.default.svc.cluster.local:8200");
        assert_eq!(s.backend, Backend::Kv2);
        assert_eq!(s.backend_path, "secret");
        assert_eq!(s.passphrase_path, "ceph-csi/");
        assert!(s.destroy_keys);
        assert!(!s.ca_verify);
        assert_eq!(s.auth_mount, "kubernetes");
        assert_eq!(s.role, "csi-kubernetes");
    }

    #[test]
    fn only_the_string_true_destroys_keys() {
        for (v, want) in [
            (json!("true"), true),
            (json!("True"), false),
            (json!("false"), false),
            (json!(true), true),
        ] {
            let kms = VaultKms::from_config(
                "k",
                VaultKind::Tokens,
                &section(json!({"vaultAddress": "http://v:8200", "vaultDestroyKeys": v})),
            )
            .expect("valid");
            assert_eq!(kms.base.destroy_keys, want, "vaultDestroyKeys {v}");
        }
    }

    #[test]
    fn bad_sections_are_refused_by_name() {
        for (sec, words) in [
            (json!({}), vec!["KMS k1", "vaultAddress is missing"]),
            (
                json!({"vaultAddress": "vault:8200"}),
                vec!["KMS k1", "vaultAddress", "http"],
            ),
            (
                json!({"vaultAddress": 8200}),
                vec!["vaultAddress must be a string"],
            ),
            (
                json!({"vaultAddress": "http://v", "vaultCAVerify": "maybe"}),
                vec!["vaultCAVerify"],
            ),
            (
                json!({"vaultAddress": "http://v", "tenants": []}),
                vec!["tenants must be an object"],
            ),
            (
                json!({"vaultAddress": "http://v", "tenants": {"a": {"vaultCAVerify": "x"}}}),
                vec!["tenants.a", "vaultCAVerify"],
            ),
        ] {
            let e = VaultKms::from_config("k1", VaultKind::Tokens, &section(sec.clone()))
                .expect_err(&format!("{sec} must be refused"));
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            let text = e.to_string();
            for w in words {
                assert!(text.contains(w), "{text:?} lacks {w:?}");
            }
        }
    }

    #[test]
    fn the_env_style_section_maps_to_the_new_names() {
        let kms = VaultKms::from_config(
            "vault-tokens-test",
            VaultKind::Tokens,
            &section(json!({
                "KMS_PROVIDER": "vaulttokens",
                "VAULT_ADDR": "https://vault:8200",
                "VAULT_BACKEND_PATH": "secret",
                "VAULT_DESTROY_KEYS": "false",
                "VAULT_SKIP_VERIFY": "true",
                "VAULT_CACERT": "vault-ca",
                "VAULT_NAMESPACE": "ns1"
            })),
        )
        .expect("valid");
        let s = &kms.base;
        assert_eq!(s.address, "https://vault:8200");
        assert_eq!(s.backend_path, "secret");
        assert!(!s.destroy_keys);
        assert!(!s.ca_verify);
        assert_eq!(s.ca_from_secret.as_deref(), Some("vault-ca"));
        assert_eq!(s.namespace, "ns1");
        assert_eq!(s.auth_namespace(), "ns1");
    }

    #[test]
    fn paths_join_like_go_and_refuse_dot_dot() {
        assert_eq!(
            join_path(&["", "secret/", "data", "ceph-csi/", "0001-vol"]).unwrap(),
            vec!["secret", "data", "ceph-csi", "0001-vol"]
        );
        assert_eq!(
            join_path(&["ns1", "/secret", "rbdkit1/c/pool//img"]).unwrap(),
            vec!["ns1", "secret", "rbdkit1", "c", "pool", "img"]
        );
        assert!(join_path(&["secret", "../sys"]).is_err());
        let mut s = String::new();
        encode_segment("a b%/c", &mut s);
        assert_eq!(s, "a%20b%25%2Fc");
    }

    #[test]
    fn tenant_config_maps_may_set_only_connection_options() {
        assert!(tenant_may_set(VaultKind::Tokens, "vaultAddress"));
        assert!(!tenant_may_set(VaultKind::Tokens, "tenantTokenName"));
        assert!(!tenant_may_set(VaultKind::Tokens, "vaultRole"));
        assert!(tenant_may_set(VaultKind::TenantSa, "vaultRole"));
        assert!(tenant_may_set(VaultKind::TenantSa, "tenantSAName"));
    }

    #[test]
    fn a_passphrase_does_not_debug_print() {
        let p = Passphrase::new("hunter2-secret");
        assert!(!format!("{p:?}").contains("hunter2"));
        let ctx = KmsContext {
            secrets: BTreeMap::from([("ca".to_owned(), "sekrit-value".to_owned())]),
            ..Default::default()
        };
        assert!(!format!("{ctx:?}").contains("sekrit"));
    }
}
