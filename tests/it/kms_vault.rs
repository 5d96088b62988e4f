//! `rbdkit::volume::kms::vault` against a real HashiCorp Vault
//! (`scripts/kms-test-server`, built from Go modules) and the real API
//! server of the test control plane: the `vault`, `vaulttokens` and
//! `vaulttenantsa` kinds on KV v1 and v2, keys laid out as ceph-csi lays
//! them, Kubernetes auth with real service account tokens (Vault asks the
//! API server with a TokenReview), TLS, and the faults: each error names
//! the KMS and holds no token or passphrase.
use crate::support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, ServiceAccount};
use kube::Api;
use serde_json::{json, Value};

use rbdkit::volume::kms::vault::{KmsContext, Passphrase, VaultKind, VaultKms};
use rbdkit::{Error, ErrorKind};
use support::ceph::unique;
use support::k8s::ControlPlane;
use support::kms::{create_ok, service_account_token, VaultServer};

/// What each test starts from: the shared server and control plane.
async fn fixtures() -> (&'static VaultServer, &'static ControlPlane, kube::Client) {
    let vault = VaultServer::shared().await;
    let cp = tokio::task::spawn_blocking(ControlPlane::shared)
        .await
        .expect("control plane");
    let client = cp.client().await;
    (vault, cp, client)
}

fn kms(id: &str, kind: VaultKind, section: Value) -> VaultKms {
    VaultKms::from_config(id, kind, section.as_object().expect("object"))
        .unwrap_or_else(|e| panic!("{id}: {e}"))
        .with_timeout(Duration::from_secs(30))
}

/// A new namespace: the tenant of a test.
async fn tenant(client: &kube::Client, prefix: &str) -> String {
    let ns = unique(prefix);
    create_ok(
        &Api::<Namespace>::all(client.clone()),
        json!({"metadata": {"name": ns}}),
    )
    .await;
    ns
}

fn ctx(client: &kube::Client, tenant: &str) -> KmsContext {
    KmsContext {
        kube: Some(client.clone()),
        tenant: Some(tenant.to_owned()),
        ..Default::default()
    }
}

/// A volume id as ceph-csi makes them (`ComposeCSIID`), unique.
fn ceph_csi_volume_id() -> String {
    let n = unique("v");
    let tail: String = n.chars().filter(char::is_ascii_digit).collect();
    format!("0001-0009-rook-ceph-0000000000000002-b0285c97-a0ce-4f1b-9c65-{tail:0>12}")
}

/// A passphrase as ceph-csi makes them: 20 random bytes, base64url.
fn passphrase() -> Passphrase {
    let mut bytes = [0u8; 15];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("urandom");
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let text: String = bytes
        .iter()
        .flat_map(|b| [alphabet[(b >> 2) as usize], alphabet[(b & 63) as usize]])
        .map(char::from)
        .collect();
    Passphrase::new(format!("{text}=="))
}

fn secret_obj(name: &str, data: Value) -> Value {
    json!({"metadata": {"name": name}, "stringData": data})
}

/// The error names the KMS and the reason, and none of `secrets`.
#[track_caller]
fn assert_named(e: &Error, kms_id: &str, reason: &str, secrets: &[&str]) {
    let text = e.to_string();
    let debug = format!("{e:?}");
    assert!(
        text.contains(&format!("KMS {kms_id}")),
        "{text:?} does not name KMS {kms_id}"
    );
    assert!(text.contains(reason), "{text:?} does not say {reason:?}");
    for s in secrets {
        assert!(
            !text.contains(s) && !debug.contains(s),
            "{text:?} holds a secret"
        );
    }
}

#[tokio::test]
async fn vault_kind_logs_in_with_a_service_account_and_destroys_keys() {
    let (vault, cp, client) = fixtures().await;
    vault.kubernetes_auth(cp).await;
    let ns = tenant(&client, "kms-vault").await;
    let mount = unique("kv2");
    vault.mount_kv(&mount, 2).await;
    let policy = format!("{mount}-rw");
    vault
        .policy(
            &policy,
            &format!(
                "path \"{mount}/data/ceph-csi/*\" {{ capabilities = [\"create\", \"update\", \"read\", \"delete\"] }}\n\
                 path \"{mount}/metadata/ceph-csi/*\" {{ capabilities = [\"read\", \"delete\"] }}"
            ),
        )
        .await;
    let sa = "rbd-csi-provisioner";
    create_ok(
        &Api::<ServiceAccount>::namespaced(client.clone(), &ns),
        json!({"metadata": {"name": sa}}),
    )
    .await;
    let role = format!("{ns}-csi");
    vault.kubernetes_role(&role, &ns, sa, &policy).await;
    let jwt = service_account_token(&client, &ns, sa, 600).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, &jwt).expect("write token");

    // ceph-csi's own example section (examples/kms/vault/kms-config.yaml).
    let k = kms(
        "vault-test",
        VaultKind::Vault,
        json!({
            "encryptionKMSType": "vault",
            "vaultAddress": vault.addr,
            "vaultAuthPath": "/v1/auth/kubernetes/login",
            "vaultRole": role,
            "vaultBackend": "kv-v2",
            "vaultDestroyKeys": "true",
            "vaultPassphraseRoot": format!("/v1/{mount}"),
            "vaultPassphrasePath": "ceph-csi/",
            "vaultCAVerify": "false",
        }),
    )
    .with_service_account_token_file(&token_file);
    let c = KmsContext::default();
    let vol = ceph_csi_volume_id();
    let p1 = passphrase();
    k.put(&c, &vol, &p1).await.expect("put");
    // Where and how ceph-csi keeps it: the secret's one field "data".
    let raw = vault
        .root("GET", &format!("{mount}/data/ceph-csi/{vol}"), None)
        .await;
    assert_eq!(
        raw["data"]["data"],
        json!({"data": {"passphrase": p1.expose()}})
    );
    assert_eq!(k.get(&c, &vol).await.expect("get"), p1);
    let p2 = passphrase();
    k.put(&c, &vol, &p2).await.expect("put again");
    assert_eq!(k.get(&c, &vol).await.expect("get"), p2);

    // A session logs in once for several calls.
    let session = k.connect(&c).await.expect("connect");
    assert!(session.is_kv2());
    assert_eq!(session.get(&vol).await.expect("get"), p2);

    k.delete(&c, &vol).await.expect("delete");
    // vaultDestroyKeys "true": every version and the metadata are gone.
    let (status, _) = vault
        .request(
            vault.root_token(),
            "GET",
            &format!("{mount}/metadata/ceph-csi/{vol}"),
            None,
        )
        .await;
    assert_eq!(status, 404, "the key's metadata is destroyed");
    let e = k.get(&c, &vol).await.expect_err("deleted");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert_named(
        &e,
        "vault-test",
        "no key for this volume",
        &[p1.expose(), p2.expose(), &jwt],
    );
    k.delete(&c, &vol)
        .await
        .expect("a second delete is no error");

    // A role that does not bind this service account: refused by name.
    let other = format!("{ns}-other");
    vault
        .kubernetes_role(&other, &ns, "someone-else", &policy)
        .await;
    let wrong = kms(
        "vault-wrong-role",
        VaultKind::Vault,
        json!({"vaultAddress": vault.addr, "vaultRole": other, "vaultBackendPath": mount}),
    )
    .with_service_account_token_file(&token_file);
    let e = wrong.put(&c, &vol, &p1).await.expect_err("wrong role");
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert_named(
        &e,
        "vault-wrong-role",
        "Kubernetes login",
        &[p1.expose(), &jwt],
    );

    // Vault asks the API server (TokenReview): the token of a service
    // account deleted since is refused, though the role would take it.
    let gone = "deleted-since";
    let sas = Api::<ServiceAccount>::namespaced(client.clone(), &ns);
    create_ok(&sas, json!({"metadata": {"name": gone}})).await;
    let gone_role = format!("{ns}-gone");
    vault.kubernetes_role(&gone_role, &ns, gone, &policy).await;
    let gone_jwt = service_account_token(&client, &ns, gone, 600).await;
    std::fs::write(&token_file, &gone_jwt).expect("write token");
    let k = kms(
        "vault-gone-sa",
        VaultKind::Vault,
        json!({"vaultAddress": vault.addr, "vaultRole": gone_role, "vaultBackend": "kv-v2", "vaultBackendPath": mount}),
    )
    .with_service_account_token_file(&token_file);
    k.connect(&c)
        .await
        .expect("the live service account logs in");
    sas.delete(gone, &Default::default())
        .await
        .expect("delete the service account");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let e = loop {
        match k.connect(&c).await {
            Err(e) => break e,
            Ok(_) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "a deleted service account still logs in after 30 s"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert_named(&e, "vault-gone-sa", "Kubernetes login", &[&gone_jwt]);
}

#[tokio::test]
async fn vaulttokens_reads_the_tenants_token_secret_on_kv1_and_kv2() {
    let (vault, _cp, client) = fixtures().await;
    let ns = tenant(&client, "kms-tokens").await;
    let kv1 = unique("kv1");
    let kv2 = unique("kv2");
    vault.mount_kv(&kv1, 1).await;
    vault.mount_kv(&kv2, 2).await;
    let policy = unique("tokens");
    vault
        .policy(
            &policy,
            &format!(
                "path \"{kv1}/*\" {{ capabilities = [\"create\", \"update\", \"read\", \"delete\"] }}\n\
                 path \"{kv2}/data/*\" {{ capabilities = [\"create\", \"update\", \"read\", \"delete\"] }}\n\
                 path \"{kv2}/metadata/*\" {{ capabilities = [\"read\", \"delete\"] }}\n\
                 path \"sys/mounts\" {{ capabilities = [\"read\"] }}"
            ),
        )
        .await;
    let token = vault.child_token(&[&policy]).await;
    create_ok(
        &Api::<Secret>::namespaced(client.clone(), &ns),
        secret_obj("ceph-csi-kms-token", json!({"token": token})),
    )
    .await;
    let c = ctx(&client, &ns);

    // No vaultBackend: the version is read from the mount (sys/mounts).
    for (mount, kv2) in [(&kv1, false), (&kv2, true)] {
        let id = format!("tokens-{}", if kv2 { "kv2" } else { "kv1" });
        let k = kms(
            &id,
            VaultKind::Tokens,
            json!({"encryptionKMSType": "vaulttokens", "vaultAddress": vault.addr, "vaultBackendPath": format!("{mount}/")}),
        );
        assert_eq!(k.connect(&c).await.expect("connect").is_kv2(), kv2, "{id}");
        let vol = ceph_csi_volume_id();
        let p = passphrase();
        k.put(&c, &vol, &p).await.expect("put");
        // The key is the volume id itself (no vaultPassphrasePath).
        let raw = if kv2 {
            vault
                .root("GET", &format!("{mount}/data/{vol}"), None)
                .await["data"]["data"]
                .clone()
        } else {
            vault.root("GET", &format!("{mount}/{vol}"), None).await["data"].clone()
        };
        assert_eq!(raw, json!({"data": {"passphrase": p.expose()}}), "{id}");
        assert_eq!(k.get(&c, &vol).await.expect("get"), p, "{id}");
        k.delete(&c, &vol).await.expect("delete");
        let e = k.get(&c, &vol).await.expect_err("deleted");
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        assert_named(&e, &id, "no key", &[p.expose(), &token]);
    }

    // The older env-style section (csi-kms-connection-details).
    let k = kms(
        "tokens-env-style",
        VaultKind::Tokens,
        json!({"KMS_PROVIDER": "vaulttokens", "VAULT_ADDR": vault.addr, "VAULT_BACKEND": "kv-v2",
               "VAULT_BACKEND_PATH": kv2, "VAULT_DESTROY_KEYS": "true", "VAULT_SKIP_VERIFY": "true"}),
    );
    let vol = ceph_csi_volume_id();
    let p = passphrase();
    k.put(&c, &vol, &p).await.expect("put");
    assert_eq!(k.get(&c, &vol).await.expect("get"), p);
    k.delete(&c, &vol).await.expect("delete");
}

#[tokio::test]
async fn keys_written_by_ceph_csi_are_read_and_the_reverse() {
    let (vault, _cp, client) = fixtures().await;
    let ns = tenant(&client, "kms-compat").await;
    let kv2 = unique("kv2");
    let kv1 = unique("kv1");
    vault.mount_kv(&kv2, 2).await;
    vault.mount_kv(&kv1, 1).await;
    let policy = unique("compat");
    vault
        .policy(
            &policy,
            &format!(
                "path \"{kv1}/*\" {{ capabilities = [\"create\", \"update\", \"read\", \"delete\"] }}\n\
                 path \"{kv2}/*\" {{ capabilities = [\"create\", \"update\", \"read\", \"delete\"] }}"
            ),
        )
        .await;
    create_ok(
        &Api::<Secret>::namespaced(client.clone(), &ns),
        secret_obj(
            "ceph-csi-kms-token",
            json!({"token": vault.child_token(&[&policy]).await}),
        ),
    )
    .await;
    let c = ctx(&client, &ns);
    for (mount, backend) in [(&kv2, "kv-v2"), (&kv1, "kv")] {
        let k = kms(
            "compat",
            VaultKind::Tokens,
            json!({"vaultAddress": vault.addr, "vaultBackend": backend, "vaultBackendPath": mount}),
        );
        // The request ceph-csi's Vault client (libopenstorage) sends:
        // StoreDEK's {"data": {"passphrase": ...}}, wrapped once more on
        // KV v2, written to <mount>/[data/]<volume id>.
        let vol = ceph_csi_volume_id();
        let theirs = passphrase();
        let (path, body) = if backend == "kv-v2" {
            (
                format!("{mount}/data/{vol}"),
                json!({"data": {"data": {"passphrase": theirs.expose()}}}),
            )
        } else {
            (
                format!("{mount}/{vol}"),
                json!({"data": {"passphrase": theirs.expose()}}),
            )
        };
        vault.root("PUT", &path, Some(body)).await;
        assert_eq!(
            k.get(&c, &vol).await.expect("read ceph-csi's key"),
            theirs,
            "{backend}"
        );

        // And what rbdkit writes, read the way ceph-csi's FetchDEK reads it:
        // the secret's fields (KV v2: .data.data; v1: .data), then
        // ["data"]["passphrase"].
        let vol = ceph_csi_volume_id();
        let ours = passphrase();
        k.put(&c, &vol, &ours).await.expect("put");
        let (path, fields) = if backend == "kv-v2" {
            let path = format!("{mount}/data/{vol}");
            let got = vault.root("GET", &path, None).await;
            (path, got["data"]["data"].clone())
        } else {
            let path = format!("{mount}/{vol}");
            let got = vault.root("GET", &path, None).await;
            (path, got["data"].clone())
        };
        assert_eq!(fields["data"]["passphrase"], json!(ours.expose()), "{path}");
        assert_eq!(
            fields.as_object().map(|o| o.len()),
            Some(1),
            "one field, data: {fields}"
        );

        // An rbdkit volume handle has '/' (and may have an empty part):
        // it becomes nested path parts, as Go's path.Join makes them.
        let handle = format!("rbdkit1/{}/pool//vol-1", unique("c"));
        let p = passphrase();
        k.put(&c, &handle, &p).await.expect("put under a handle");
        assert_eq!(k.get(&c, &handle).await.expect("get"), p);
        let cleaned = handle.replace("//", "/");
        let raw_path = if backend == "kv-v2" {
            format!("{mount}/data/{cleaned}")
        } else {
            format!("{mount}/{cleaned}")
        };
        vault.root("GET", &raw_path, None).await;
        k.delete(&c, &handle).await.expect("delete");
    }
}

#[tokio::test]
async fn soft_delete_keeps_the_history_when_destroy_is_off() {
    let (vault, _cp, client) = fixtures().await;
    let ns = tenant(&client, "kms-soft").await;
    let mount = unique("kv2");
    vault.mount_kv(&mount, 2).await;
    let policy = unique("soft");
    vault
        .policy(
            &policy,
            &format!("path \"{mount}/data/*\" {{ capabilities = [\"create\", \"update\", \"read\", \"delete\"] }}"),
        )
        .await;
    create_ok(
        &Api::<Secret>::namespaced(client.clone(), &ns),
        secret_obj(
            "ceph-csi-kms-token",
            json!({"token": vault.child_token(&[&policy]).await}),
        ),
    )
    .await;
    let c = ctx(&client, &ns);
    let k = kms(
        "soft",
        VaultKind::Tokens,
        json!({"vaultAddress": vault.addr, "vaultBackend": "kv-v2", "vaultBackendPath": mount, "vaultDestroyKeys": "false"}),
    );
    let vol = ceph_csi_volume_id();
    k.put(&c, &vol, &passphrase()).await.expect("put");
    k.delete(&c, &vol).await.expect("delete");
    let e = k.get(&c, &vol).await.expect_err("soft-deleted");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let meta = vault
        .root("GET", &format!("{mount}/metadata/{vol}"), None)
        .await;
    let deleted = &meta["data"]["versions"]["1"]["deletion_time"];
    assert!(
        deleted.as_str().is_some_and(|t| !t.is_empty()),
        "version 1 is soft-deleted: {meta}"
    );
}

#[tokio::test]
async fn vaulttenantsa_logs_in_as_the_tenants_service_account_with_tenant_options() {
    let (vault, cp, client) = fixtures().await;
    vault.kubernetes_auth(cp).await;
    let ns = tenant(&client, "kms-tenantsa").await;
    let mount = unique("kv2");
    vault.mount_kv(&mount, 2).await;
    let policy = unique("tenantsa");
    vault
        .policy(
            &policy,
            &format!(
                "path \"{mount}/data/*\" {{ capabilities = [\"create\", \"update\", \"read\", \"delete\"] }}\n\
                 path \"{mount}/metadata/*\" {{ capabilities = [\"read\", \"delete\"] }}"
            ),
        )
        .await;
    create_ok(
        &Api::<ServiceAccount>::namespaced(client.clone(), &ns),
        json!({"metadata": {"name": "ceph-csi-vault-sa"}}),
    )
    .await;
    let role = format!("{ns}-tenant");
    vault
        .kubernetes_role(&role, &ns, "ceph-csi-vault-sa", &policy)
        .await;
    // The tenant's ConfigMap names the role and the mount; the section's
    // own values would fail.
    create_ok(
        &Api::<ConfigMap>::namespaced(client.clone(), &ns),
        json!({"metadata": {"name": "ceph-csi-kms-config"},
               "data": {"vaultRole": role, "vaultBackendPath": mount, "tenantTokenName": "ignored"}}),
    )
    .await;
    let k = kms(
        "vault-tenant-sa-test",
        VaultKind::TenantSa,
        json!({"encryptionKMSType": "vaulttenantsa", "vaultAddress": vault.addr, "vaultBackend": "kv-v2",
               "vaultBackendPath": "no-such-mount", "vaultRole": "no-such-role"}),
    );
    let c = ctx(&client, &ns);
    let vol = ceph_csi_volume_id();
    let p = passphrase();
    k.put(&c, &vol, &p).await.expect("put");
    let raw = vault
        .root("GET", &format!("{mount}/data/{vol}"), None)
        .await;
    assert_eq!(raw["data"]["data"]["data"]["passphrase"], json!(p.expose()));
    assert_eq!(k.get(&c, &vol).await.expect("get"), p);
    k.delete(&c, &vol).await.expect("delete");

    // tenants.<ns> in the section names a service account that does not
    // exist: refused by name.
    let k = kms(
        "vault-tenant-sa-missing",
        VaultKind::TenantSa,
        json!({"vaultAddress": vault.addr, "tenants": {ns.clone(): {"tenantSAName": "nobody"}}}),
    );
    let e = k.get(&c, &vol).await.expect_err("no such service account");
    assert_named(
        &e,
        "vault-tenant-sa-missing",
        &format!("no ServiceAccount {ns}/nobody"),
        &[],
    );
}

#[tokio::test]
async fn tls_takes_a_ca_bundle_a_server_name_a_client_certificate_or_no_check() {
    let (vault, cp, client) = fixtures().await;
    let ns = tenant(&client, "kms-tls").await;
    let driver_ns = tenant(&client, "kms-tls-driver").await;
    let mount = unique("kv2");
    vault.mount_kv(&mount, 2).await;
    let policy = unique("tls");
    let rw_hcl = format!(
        "path \"{mount}/data/*\" {{ capabilities = [\"create\", \"update\", \"read\", \"delete\"] }}\n\
         path \"{mount}/metadata/*\" {{ capabilities = [\"delete\"] }}"
    );
    vault.policy(&policy, &rw_hcl).await;
    let token = vault.child_token(&[&policy]).await;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    create_ok(
        &secrets,
        secret_obj("ceph-csi-kms-token", json!({"token": token})),
    )
    .await;
    // The CA is in the driver's namespace only: the fallback.
    create_ok(
        &Api::<Secret>::namespaced(client.clone(), &driver_ns),
        secret_obj("vault-ca", json!({"cert": vault.ca_pem})),
    )
    .await;
    create_ok(
        &secrets,
        secret_obj("vault-client-cert", json!({"cert": vault.client_cert_pem})),
    )
    .await;
    create_ok(
        &secrets,
        secret_obj("vault-client-key", json!({"key": vault.client_key_pem})),
    )
    .await;
    let c = KmsContext {
        csi_namespace: Some(driver_ns.clone()),
        ..ctx(&client, &ns)
    };
    let base = json!({"vaultBackend": "kv-v2", "vaultBackendPath": mount});
    let section = |extra: Value| {
        let mut s = base.clone();
        s.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s
    };
    let round_trip = |k: VaultKms| {
        let c = c.clone();
        async move {
            let vol = ceph_csi_volume_id();
            let p = passphrase();
            k.put(&c, &vol, &p).await?;
            assert_eq!(k.get(&c, &vol).await?, p);
            k.delete(&c, &vol).await
        }
    };
    let https_by_name = vault.https_addr.replace("127.0.0.1", "localhost");

    // The CA bundle from a Secret.
    round_trip(kms(
        "tls-ca",
        VaultKind::Tokens,
        section(json!({"vaultAddress": https_by_name, "vaultCAFromSecret": "vault-ca"})),
    ))
    .await
    .expect("CA bundle");
    // An IP address, checked as another name.
    round_trip(kms(
        "tls-name",
        VaultKind::Tokens,
        section(json!({"vaultAddress": vault.https_addr, "vaultCAFromSecret": "vault-ca", "vaultTLSServerName": vault.tls_server_name})),
    ))
    .await
    .expect("vaultTLSServerName");
    // No check at all.
    round_trip(kms(
        "tls-noverify",
        VaultKind::Tokens,
        section(json!({"vaultAddress": vault.https_addr, "vaultCAVerify": "false"})),
    ))
    .await
    .expect("vaultCAVerify false");
    // A client certificate for the listener that requires one.
    round_trip(kms(
        "tls-client",
        VaultKind::Tokens,
        section(json!({"vaultAddress": vault.mtls_addr.replace("127.0.0.1", "localhost"), "vaultCAFromSecret": "vault-ca",
                        "vaultClientCertFromSecret": "vault-client-cert", "vaultClientCertKeyFromSecret": "vault-client-key"})),
    ))
    .await
    .expect("client certificate");

    // Refusals, each by name.
    for (id, extra, reason) in [
        (
            "tls-unknown-ca",
            json!({"vaultAddress": https_by_name}),
            "cannot reach Vault",
        ),
        (
            "tls-wrong-name",
            json!({"vaultAddress": vault.https_addr, "vaultCAFromSecret": "vault-ca", "vaultTLSServerName": "vault.example.invalid"}),
            "cannot reach Vault",
        ),
        (
            "tls-no-client-cert",
            json!({"vaultAddress": vault.mtls_addr.replace("127.0.0.1", "localhost"), "vaultCAFromSecret": "vault-ca"}),
            "cannot reach Vault",
        ),
        (
            "tls-no-ca-secret",
            json!({"vaultAddress": https_by_name, "vaultCAFromSecret": "nope"}),
            "no Secret nope",
        ),
    ] {
        let e = round_trip(kms(id, VaultKind::Tokens, section(extra)))
            .await
            .expect_err(id);
        assert_named(&e, id, reason, &[&token]);
    }

    // The vault kind takes its CA from a key of the request's Secret.
    vault.kubernetes_auth(cp).await;
    let sa = "rbd-csi-nodeplugin";
    create_ok(
        &Api::<ServiceAccount>::namespaced(client.clone(), &ns),
        json!({"metadata": {"name": sa}}),
    )
    .await;
    let rw = unique("tls-vault");
    vault.policy(&rw, &rw_hcl).await;
    let role = format!("{ns}-tls");
    vault.kubernetes_role(&role, &ns, sa, &rw).await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("token"),
        service_account_token(&client, &ns, sa, 600).await,
    )
    .expect("token");
    let k = kms(
        "tls-vault-kind",
        VaultKind::Vault,
        section(json!({"vaultAddress": https_by_name, "vaultRole": role, "vaultCAFromSecret": "vaultCA"})),
    )
    .with_service_account_token_file(dir.path().join("token"));
    let with_ca = KmsContext {
        secrets: BTreeMap::from([("vaultCA".to_owned(), vault.ca_pem.clone())]),
        ..Default::default()
    };
    let vol = ceph_csi_volume_id();
    let p = passphrase();
    k.put(&with_ca, &vol, &p).await.expect("put over TLS");
    assert_eq!(k.get(&with_ca, &vol).await.expect("get"), p);
    let e = k
        .get(&KmsContext::default(), &vol)
        .await
        .expect_err("no CA key");
    assert_named(
        &e,
        "tls-vault-kind",
        "vaultCAFromSecret names key \"vaultCA\"",
        &[p.expose()],
    );
    k.delete(&with_ca, &vol).await.expect("delete");
}

/// A loopback TCP server that answers every connection with `answer`
/// (`None`: accepts and never answers), for as long as the test runs.
fn fake_server(answer: Option<&'static [u8]>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().take(16) {
            let Ok(mut conn) = conn else { return };
            match answer {
                Some(bytes) => {
                    let mut buf = [0u8; 4096];
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                    let _ = conn.read(&mut buf);
                    let _ = conn.write_all(bytes);
                }
                None => held.push(conn),
            }
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn faults_are_named_and_never_show_a_token_or_passphrase() {
    let (vault, _cp, client) = fixtures().await;
    let ns = tenant(&client, "kms-faults").await;
    let mount = unique("kv2");
    vault.mount_kv(&mount, 2).await;
    let read_only = unique("ro");
    vault
        .policy(
            &read_only,
            &format!("path \"{mount}/data/*\" {{ capabilities = [\"read\"] }}"),
        )
        .await;
    let token = vault.child_token(&[&read_only]).await;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    create_ok(
        &secrets,
        secret_obj("ceph-csi-kms-token", json!({"token": token})),
    )
    .await;
    let bogus = format!("hvs.{}", passphrase().expose());
    create_ok(&secrets, secret_obj("bogus-token", json!({"token": bogus}))).await;
    let c = ctx(&client, &ns);
    let p = passphrase();
    let vol = ceph_csi_volume_id();
    let at = |addr: &str, extra: Value| {
        let mut s =
            json!({"vaultAddress": addr, "vaultBackend": "kv-v2", "vaultBackendPath": mount});
        s.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s
    };

    // Nothing listens.
    let gone = TcpListener::bind("127.0.0.1:0").expect("bind");
    let gone_addr = format!("http://{}", gone.local_addr().unwrap());
    drop(gone);
    let e = kms(
        "f-unreachable",
        VaultKind::Tokens,
        at(&gone_addr, json!({})),
    )
    .put(&c, &vol, &p)
    .await
    .expect_err("unreachable");
    assert_named(
        &e,
        "f-unreachable",
        "cannot reach Vault",
        &[p.expose(), &token],
    );

    // Something listens and never answers: the timeout.
    let silent = fake_server(None);
    let e = kms("f-silent", VaultKind::Tokens, at(&silent, json!({})))
        .with_timeout(Duration::from_secs(2))
        .put(&c, &vol, &p)
        .await
        .expect_err("silent");
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert_named(&e, "f-silent", "no answer", &[p.expose(), &token]);

    // Garbage: HTTP with a body that is not JSON, and not HTTP at all.
    let not_json = fake_server(Some(
        b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nConnection: close\r\n\r\n<html>hi</>".as_slice(),
    ));
    let e = kms("f-not-json", VaultKind::Tokens, at(&not_json, json!({})))
        .get(&c, &vol)
        .await
        .expect_err("not json");
    assert_named(&e, "f-not-json", "not JSON", &[&token]);
    let not_http = fake_server(Some(b"\x16\x03\x01 certainly not HTTP\r\n\r\n".as_slice()));
    let e = kms("f-not-http", VaultKind::Tokens, at(&not_http, json!({})))
        .get(&c, &vol)
        .await
        .expect_err("not http");
    assert_named(&e, "f-not-http", "cannot reach Vault", &[&token]);

    // A token Vault does not know.
    let e = kms(
        "f-bad-token",
        VaultKind::Tokens,
        at(&vault.addr, json!({"tenantTokenName": "bogus-token"})),
    )
    .put(&c, &vol, &p)
    .await
    .expect_err("bad token");
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert_named(&e, "f-bad-token", "HTTP 403", &[p.expose(), &bogus]);

    // A token that may read but not write.
    let k = kms("f-read-only", VaultKind::Tokens, at(&vault.addr, json!({})));
    let e = k.put(&c, &vol, &p).await.expect_err("read-only");
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert_named(
        &e,
        "f-read-only",
        "permission denied",
        &[p.expose(), &token],
    );

    // No key for the volume, and a secret that is not a key.
    let e = k.get(&c, &vol).await.expect_err("missing");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert_named(&e, "f-read-only", "no key for this volume", &[&token]);
    vault
        .root(
            "PUT",
            &format!("{mount}/data/{vol}"),
            Some(json!({"data": {"passphrase": "flat, not nested"}})),
        )
        .await;
    let e = k.get(&c, &vol).await.expect_err("wrong shape");
    assert_named(
        &e,
        "f-read-only",
        "no data.passphrase",
        &[&token, "flat, not nested"],
    );

    // No token Secret, and no tenant at all.
    let e = kms(
        "f-no-secret",
        VaultKind::Tokens,
        at(&vault.addr, json!({"tenantTokenName": "absent"})),
    )
    .get(&c, &vol)
    .await
    .expect_err("no token secret");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert_named(&e, "f-no-secret", &format!("no Secret {ns}/absent"), &[]);
    let e = k
        .get(
            &KmsContext {
                tenant: None,
                ..c.clone()
            },
            &vol,
        )
        .await
        .expect_err("no tenant");
    assert_named(&e, "f-read-only", "needs the volume's tenant", &[]);
}
