//! A real HashiCorp Vault for the KMS tests, started once per test process
//! by `scripts/kms-test-server up` (built from the Go modules pinned in
//! `tests/kms-test-server`) and stopped when the process exits.
//!
//! ```ignore
//! let vault = support::kms::VaultServer::shared().await;
//! vault.mount_kv("t-kv2", 2).await;
//! let token = vault.child_token(&["t-policy"]).await;
//! vault.kubernetes_auth(support::k8s::ControlPlane::shared()).await; // auth/kubernetes
//! ```
//!
//! The fixture's own calls use the root token over the plain listener;
//! the code under test gets only what a test gives it. Tests never skip: if
//! the server cannot be built or started, they panic with the script's
//! output.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::PostParams;
use kube::Api;
use serde_json::{json, Value};
use tokio::sync::OnceCell;

use super::k8s::ControlPlane;
use super::provisioner::from_json;

/// The running server: its addresses, certificates and root token.
pub struct VaultServer {
    /// The state directory (`scripts/kms-test-server up DIR`).
    pub dir: PathBuf,
    /// The plain HTTP listener, `http://127.0.0.1:PORT`.
    pub addr: String,
    /// The HTTPS listener.
    pub https_addr: String,
    /// The HTTPS listener that requires a client certificate.
    pub mtls_addr: String,
    /// The CA that signed the server's and the client's certificates (PEM).
    pub ca_pem: String,
    /// A client certificate the mTLS listener takes (PEM).
    pub client_cert_pem: String,
    /// Its key (PEM).
    pub client_key_pem: String,
    /// A DNS name in the server certificate other than `localhost`.
    pub tls_server_name: String,
    root_token: String,
    http: Client<HttpConnector, Full<Bytes>>,
}

static SHARED: OnceLock<Result<VaultServer, String>> = OnceLock::new();
static SHARED_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);
static KUBE_AUTH: OnceCell<()> = OnceCell::const_new();

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/kms-test-server")
}

extern "C" fn stop_shared() {
    let dir = SHARED_DIR.lock().ok().and_then(|mut d| d.take());
    if let Some(dir) = dir {
        super::process::script_down(&script(), &dir);
    }
}

fn launch() -> Result<VaultServer, String> {
    let dir = tempfile::Builder::new()
        .prefix("kms-vault-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .map_err(|e| format!("cannot create a directory under CARGO_TARGET_TMPDIR: {e}"))?
        .keep();
    // A killed run's server is found by its folder (scripts/test-reap).
    super::process::register_dir(&dir);
    let out = Command::new(script())
        .arg("up")
        .arg(&dir)
        // A watchdog started by the script stops the server if this
        // process dies without running its exit handlers.
        .env("KMS_TEST_SERVER_OWNER_PID", std::process::id().to_string())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script().display()))?;
    if !out.status.success() {
        return Err(format!(
            "could not start the Vault server for the KMS tests ({} up {} exited with {}; \
             its logs are in that directory):\n{}",
            script().display(),
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    *SHARED_DIR.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir.clone());
    // SAFETY: `stop_shared` is an `extern "C" fn()` with no arguments that
    // does not unwind (it only reports errors), as atexit(3) requires.
    if unsafe { libc::atexit(stop_shared) } != 0 {
        stop_shared();
        return Err("libc::atexit failed; stopped the Vault server".into());
    }
    let env = std::fs::read_to_string(dir.join("env"))
        .map_err(|e| format!("read {}/env: {e}", dir.display()))?;
    let var = |name: &str| -> Result<String, String> {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .map(str::to_owned)
            .ok_or_else(|| format!("{}/env has no {name}", dir.display()))
    };
    let read = |name: &str| -> Result<String, String> {
        let path = var(name)?;
        std::fs::read_to_string(&path).map_err(|e| format!("read {path}: {e}"))
    };
    Ok(VaultServer {
        addr: var("VAULT_ADDR")?,
        https_addr: var("VAULT_HTTPS_ADDR")?,
        mtls_addr: var("VAULT_MTLS_ADDR")?,
        ca_pem: read("VAULT_CACERT")?,
        client_cert_pem: read("VAULT_CLIENT_CERT")?,
        client_key_pem: read("VAULT_CLIENT_KEY")?,
        tls_server_name: var("VAULT_TLS_SERVER_NAME")?,
        root_token: read("VAULT_TOKEN_FILE")?.trim().to_owned(),
        // No idle connections kept: reusing one Vault has just closed fails
        // the request with a SendRequest error (seen under load).
        http: Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(HttpConnector::new()),
        dir,
    })
}

impl VaultServer {
    /// The process-wide server, started on first use (the first build of
    /// the binary takes minutes; it is cached).
    pub async fn shared() -> &'static VaultServer {
        let shared = match SHARED.get() {
            Some(s) => s,
            None => tokio::task::spawn_blocking(|| SHARED.get_or_init(launch))
                .await
                .expect("start the Vault server"),
        };
        match shared {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        }
    }

    /// The root token, for checks a test makes itself.
    pub fn root_token(&self) -> &str {
        &self.root_token
    }

    /// One request with `token` to the plain listener: the status and the
    /// JSON body (`null` when empty).
    pub async fn request(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let req = http::Request::builder()
            .method(method)
            .uri(format!("{}/v1/{path}", self.addr))
            .header("X-Vault-Token", token)
            .body(Full::new(Bytes::from(
                body.map(|b| b.to_string()).unwrap_or_default(),
            )))
            .expect("request");
        let resp = tokio::time::timeout(std::time::Duration::from_secs(30), self.http.request(req))
            .await
            .unwrap_or_else(|_| panic!("{method} {path}: no answer in 30 s"))
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        let json = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                panic!(
                    "{method} {path}: not JSON: {}",
                    String::from_utf8_lossy(&bytes)
                )
            })
        };
        (status, json)
    }

    /// A request with the root token that must succeed; its JSON body.
    pub async fn root(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, json) = self.request(&self.root_token, method, path, body).await;
        assert!(
            (200..300).contains(&status),
            "{method} {path}: HTTP {status}: {json}"
        );
        json
    }

    /// Mounts the KV secrets engine `version` (1 or 2) at `path`, and waits
    /// until it takes requests.
    pub async fn mount_kv(&self, path: &str, version: u8) {
        self.root(
            "POST",
            &format!("sys/mounts/{path}"),
            Some(json!({"type": "kv", "options": {"version": version.to_string()}})),
        )
        .await;
        if version == 2 {
            // A new KV v2 mount refuses requests until it has set itself up.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            loop {
                let (status, _) = self
                    .request(&self.root_token, "GET", &format!("{path}/config"), None)
                    .await;
                if status == 200 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "KV v2 at {path} not ready after 30 s"
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }

    /// Writes ACL policy `name`.
    pub async fn policy(&self, name: &str, hcl: &str) {
        self.root(
            "PUT",
            &format!("sys/policies/acl/{name}"),
            Some(json!({"policy": hcl})),
        )
        .await;
    }

    /// A new token with `policies` (and no others).
    pub async fn child_token(&self, policies: &[&str]) -> String {
        let reply = self
            .root(
                "POST",
                "auth/token/create",
                Some(json!({"policies": policies, "no_default_policy": true, "ttl": "1h"})),
            )
            .await;
        reply["auth"]["client_token"]
            .as_str()
            .expect("client_token")
            .to_owned()
    }

    /// Enables Kubernetes auth at `auth/kubernetes`, reviewing tokens
    /// (TokenReview) with the API server of `cp`: once per process.
    pub async fn kubernetes_auth(&'static self, cp: &'static ControlPlane) {
        KUBE_AUTH
            .get_or_init(|| async move {
                let client = cp.client().await;
                let ns = "kms-vault-auth";
                create_ok(
                    &Api::<Namespace>::all(client.clone()),
                    json!({"metadata": {"name": ns}}),
                )
                .await;
                let reviewer = "vault-token-reviewer";
                create_ok(
                    &Api::<ServiceAccount>::namespaced(client.clone(), ns),
                    json!({"metadata": {"name": reviewer}}),
                )
                .await;
                create_ok(
                    &Api::<ClusterRoleBinding>::all(client.clone()),
                    json!({
                        "metadata": {"name": "kms-vault-token-reviewer"},
                        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:auth-delegator"},
                        "subjects": [{"kind": "ServiceAccount", "name": reviewer, "namespace": ns}],
                    }),
                )
                .await;
                let jwt = service_account_token(&client, ns, reviewer, 3600).await;
                let (server, ca_pem) = api_server_of(cp);
                self.root("POST", "sys/auth/kubernetes", Some(json!({"type": "kubernetes"})))
                    .await;
                self.root(
                    "POST",
                    "auth/kubernetes/config",
                    Some(json!({
                        "kubernetes_host": server,
                        "kubernetes_ca_cert": ca_pem,
                        "token_reviewer_jwt": jwt,
                        "disable_local_ca_jwt": true,
                    })),
                )
                .await;
            })
            .await;
    }

    /// A Kubernetes auth role `name` for service account `ns/sa` with
    /// `policy`.
    pub async fn kubernetes_role(&self, name: &str, ns: &str, sa: &str, policy: &str) {
        self.root(
            "POST",
            &format!("auth/kubernetes/role/{name}"),
            Some(json!({
                "bound_service_account_names": [sa],
                "bound_service_account_namespaces": [ns],
                "token_policies": [policy],
                "token_ttl": "10m",
            })),
        )
        .await;
    }
}

/// Creates an object from JSON; one that exists already is fine.
pub async fn create_ok<K>(api: &Api<K>, obj: Value)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    match api.create(&PostParams::default(), &from_json(obj)).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create: {e}"),
    }
}

/// A token of service account `ns/sa` from the TokenRequest API, valid for
/// `seconds`.
pub async fn service_account_token(
    client: &kube::Client,
    ns: &str,
    sa: &str,
    seconds: i64,
) -> String {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let tr = TokenRequest {
        spec: TokenRequestSpec {
            expiration_seconds: Some(seconds),
            ..Default::default()
        },
        ..Default::default()
    };
    api.create_token_request(sa, &PostParams::default(), &tr)
        .await
        .unwrap_or_else(|e| panic!("TokenRequest for {ns}/{sa}: {e}"))
        .status
        .expect("TokenRequest status")
        .token
}

/// The API server URL and its CA (PEM) from the control plane's kubeconfig.
fn api_server_of(cp: &ControlPlane) -> (String, String) {
    let kc = kube::config::Kubeconfig::read_from(cp.kubeconfig_path()).expect("kubeconfig");
    let cluster = kc
        .clusters
        .first()
        .and_then(|c| c.cluster.clone())
        .expect("a cluster in the kubeconfig");
    let server = cluster.server.expect("server in the kubeconfig");
    let ca_b64 = cluster
        .certificate_authority_data
        .expect("certificate-authority-data in the kubeconfig");
    // ByteString's serde form is base64.
    let ca: k8s_openapi::ByteString = serde_json::from_value(json!(ca_b64)).expect("base64 CA");
    (server, String::from_utf8(ca.0).expect("PEM CA"))
}

/// A `vaulttokens` KMS for the volumes of tenant (namespace) `ns`: a KV v2
/// mount of its own, a token allowed only there, and that token in the
/// tenant's `ceph-csi-kms-token` Secret, as ceph-csi's docs set it up.
/// Returns the KMS config section and the mount.
pub async fn vaulttokens_kms(
    vault: &VaultServer,
    client: &kube::Client,
    ns: &str,
) -> (Value, String) {
    use k8s_openapi::api::core::v1::Secret;
    let mount = super::ceph::unique("kv2");
    vault.mount_kv(&mount, 2).await;
    let policy = format!("{mount}-rw");
    vault
        .policy(
            &policy,
            &format!(
                "path \"{mount}/data/*\" {{ capabilities = [\"create\", \"update\", \"read\", \"delete\"] }}\n\
                 path \"{mount}/metadata/*\" {{ capabilities = [\"read\", \"delete\", \"list\"] }}"
            ),
        )
        .await;
    let token = vault.child_token(&[&policy]).await;
    super::artifacts::note_secret(&token);
    create_ok(
        &Api::<Secret>::namespaced(client.clone(), ns),
        json!({"metadata": {"name": "ceph-csi-kms-token"}, "stringData": {"token": token}}),
    )
    .await;
    let section = json!({
        "encryptionKMSType": "vaulttokens",
        "vaultAddress": vault.addr,
        "vaultBackend": "kv-v2",
        "vaultBackendPath": format!("{mount}/"),
        "vaultDestroyKeys": "true",
    });
    (section, mount)
}

/// A key id as a Vault path under a KV mount: its `/`-separated parts, each
/// percent-encoded as the KMS client encodes them.
fn key_path(key_id: &str) -> String {
    key_id
        .split('/')
        .filter(|s| !s.is_empty())
        .map(|seg| {
            seg.bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join("/")
}

impl VaultServer {
    /// The passphrase stored under `key_id` on KV v2 mount `mount` (as a
    /// ceph-csi-style `data.passphrase`), `None` if there is none.
    pub async fn kv2_passphrase(&self, mount: &str, key_id: &str) -> Option<String> {
        let path = format!("{mount}/data/{}", key_path(key_id));
        let (status, body) = self.request(&self.root_token, "GET", &path, None).await;
        match status {
            404 => None,
            200 => Some(
                body.pointer("/data/data/data/passphrase")
                    .and_then(Value::as_str)
                    .unwrap_or_else(|| panic!("GET {path}: no data.passphrase: {body}"))
                    .to_owned(),
            ),
            s => panic!("GET {path}: HTTP {s}: {body}"),
        }
    }

    /// Every key on KV v2 mount `mount`, nested paths included.
    pub async fn kv2_keys(&self, mount: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut dirs = vec![String::new()];
        while let Some(dir) = dirs.pop() {
            let path = format!("{mount}/metadata/{dir}");
            let (status, body) = self.request(&self.root_token, "LIST", &path, None).await;
            if status == 404 {
                continue;
            }
            assert_eq!(status, 200, "LIST {path}: {body}");
            for k in body["data"]["keys"].as_array().expect("keys") {
                let k = format!("{dir}{}", k.as_str().expect("key"));
                if k.ends_with('/') {
                    dirs.push(k);
                } else {
                    out.push(k);
                }
            }
        }
        out
    }
}
