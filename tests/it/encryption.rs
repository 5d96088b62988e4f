//! Encrypted volumes against the real cluster, the real rbdkit-fuse daemon
//! and the real cryptsetup: the header rbdkit writes is one cryptsetup
//! opens, a volume made the way ceph-csi makes it (cryptsetup's header,
//! ceph-csi's metadata KMS record made by an independent implementation)
//! opens and decrypts in rbdkit, data the daemon writes decrypts with an
//! independent AES-XTS, clones and snapshots keep their keys, rotation is
//! a keyslot change that survives being cut short, and every fault is a
//! clear error that names no key.
//!
//! The independent implementations are Python's `hashlib.scrypt` and the
//! `cryptography` package (AES-GCM, AES-XTS), fed on stdin.

use crate::node_fuse::{read_direct, spec, tempdir, write_direct, Daemon};
use crate::support;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use rbdkit::node::Mapper;
use rbdkit::rados::Secret;
use rbdkit::rbd::{self, Image, ImageOptions};
use rbdkit::volume::encryption::{self, EncryptionParams, EncryptionType, NewEncryption, State};
use rbdkit::volume::kms::{self, Keys, META_DEK, META_KEY_ID, META_KMS_ID, META_STATE};
use rbdkit::volume::luks::{self, Header};
use rbdkit::volume::ops::{delete_image, ensure_image_encrypted, Owner, VolumeError};
use rbdkit::volume::snapshot::{
    ensure_snapshot, ensure_volume_from_snapshot, ensure_volume_from_volume, CloneOptions,
    SnapshotOwner,
};
use rbdkit::volume::{NoFence, NoMetrics, VolumeId};
use rbdkit::ErrorKind;
use support::ceph::{cluster, TestNs, POOL};
use support::data::pattern;

const MIB: u64 = 1 << 20;
const PROV: &str = "enc.rbdkit.test";
const KEK: &str = "the-kms-passphrase-of-the-secret";

fn vol(ns: &TestNs, image: &str) -> VolumeId {
    VolumeId {
        cluster_id: "test".into(),
        pool: POOL.into(),
        rados_namespace: ns.name.clone(),
        image: image.into(),
    }
}

fn owner(pv: &str) -> Owner {
    Owner {
        provisioner: PROV.into(),
        pv_name: pv.into(),
        pvc_namespace: "apps".into(),
        pvc_name: format!("claim-{pv}"),
        cluster_id: "test".into(),
    }
}

fn metadata_kms() -> NewEncryption {
    NewEncryption {
        params: EncryptionParams {
            kms_id: "meta".into(),
            kind: EncryptionType::Block,
            sector_size: 4096,
            key_size: 64,
        },
        keys: Keys::Metadata(Secret::new(KEK.to_owned())),
    }
}

/// Runs `python3 -c script` with `input` on stdin; its stdout.
fn python(script: &str, input: &str) -> String {
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// ceph-csi's metadata KMS, written independently: a new passphrase and
/// its `rbd.csi.ceph.com/dek` record for `volume_id`.
fn ceph_csi_passphrase_and_dek(volume_id: &str) -> (String, String) {
    let script = r#"
import base64, hashlib, json, os, sys
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
req = json.load(sys.stdin)
passphrase = base64.urlsafe_b64encode(os.urandom(20)).decode()
kek = hashlib.scrypt(req["kek"].encode(), salt=req["volume_id"].encode(), n=32768, r=8, p=1, dklen=32, maxmem=64 << 20)
nonce = os.urandom(12)
dek = AESGCM(kek).encrypt(nonce, passphrase.encode(), None)
rec = json.dumps({"dek": base64.b64encode(dek).decode(), "nonce": base64.b64encode(nonce).decode()}, separators=(",", ":"))
print(json.dumps({"passphrase": passphrase, "dek": rec}))
"#;
    let input = serde_json::json!({"kek": KEK, "volume_id": volume_id}).to_string();
    let v: serde_json::Value = serde_json::from_str(&python(script, &input)).unwrap();
    (
        v["passphrase"].as_str().unwrap().to_owned(),
        v["dek"].as_str().unwrap().to_owned(),
    )
}

/// `rbd.csi.ceph.com/dek` opened independently.
fn open_dek_independently(volume_id: &str, rec: &str) -> String {
    let script = r#"
import base64, hashlib, json, sys
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
req = json.load(sys.stdin)
rec = json.loads(req["rec"])
kek = hashlib.scrypt(req["kek"].encode(), salt=req["volume_id"].encode(), n=32768, r=8, p=1, dklen=32, maxmem=64 << 20)
print(AESGCM(kek).decrypt(base64.b64decode(rec["nonce"]), base64.b64decode(rec["dek"]), None).decode())
"#;
    let input = serde_json::json!({"kek": KEK, "volume_id": volume_id, "rec": rec}).to_string();
    python(script, &input).trim().to_owned()
}

/// AES-XTS (plain64 IVs in 512-byte units) done independently.
fn xts(key: &[u8], sector: usize, pos: u64, data: &[u8], encrypt: bool) -> Vec<u8> {
    let script = r#"
import json, sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
req = json.load(sys.stdin)
key = bytes.fromhex(req["key"]); data = bytes.fromhex(req["data"]); s = req["sector"]
out = bytearray()
for i in range(0, len(data), s):
    tweak = ((req["pos"] + i) // 512).to_bytes(16, "little")
    c = Cipher(algorithms.AES(key), modes.XTS(tweak))
    f = c.encryptor() if req["encrypt"] else c.decryptor()
    out += f.update(data[i:i + s]) + f.finalize()
print(out.hex())
"#;
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let input = serde_json::json!({
        "key": hex(key), "data": hex(data), "sector": sector, "pos": pos, "encrypt": encrypt,
    })
    .to_string();
    let out = python(script, &input);
    (0..out.trim().len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&out.trim()[i..i + 2], 16).unwrap())
        .collect()
}

/// Runs cryptsetup with `stdin`; (exit code, stdout, stderr).
fn cryptsetup(args: &[&str], stdin: &[u8]) -> (i32, String, String) {
    let mut child = Command::new("cryptsetup")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cryptsetup (install cryptsetup-bin)");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The volume key cryptsetup unlocks from `file` with `passphrase`.
fn cryptsetup_volume_key(file: &Path, passphrase: &str) -> Vec<u8> {
    let f = file.to_str().unwrap();
    let (code, out, err) = cryptsetup(
        &[
            "luksDump",
            "--dump-volume-key",
            "--batch-mode",
            "--key-file=-",
            f,
        ],
        passphrase.as_bytes(),
    );
    assert_eq!(code, 0, "luksDump --dump-volume-key: {err}");
    let mut hex = String::new();
    let mut on = false;
    for line in out.lines() {
        if let Some(rest) = line.strip_prefix("MK dump:") {
            on = true;
            hex.push_str(rest);
        } else if on && line.starts_with(char::is_whitespace) {
            hex.push_str(line);
        } else if on {
            break;
        }
    }
    hex.split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect()
}

/// The first `len` bytes of `image` into a sparse file of the image's size.
fn export_head(image: &Image, file: &Path, len: u64) {
    let f = std::fs::File::create(file).unwrap();
    f.set_len(image.size().unwrap()).unwrap();
    let mut buf = vec![0u8; len as usize];
    image.read_exact(0, &mut buf).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &buf, 0).unwrap();
}

/// Copies the non-zero 4 KiB blocks of `file`'s first `len` bytes into
/// `image` (as a ceph-csi node's cryptsetup wrote them through krbd).
fn import_head(file: &Path, image: &Image, len: u64) {
    let data = std::fs::read(file).unwrap();
    for (i, block) in data[..len as usize].chunks(4096).enumerate() {
        if block.iter().any(|&b| b != 0) {
            image.write((i * 4096) as u64, block).unwrap();
        }
    }
}

/// 1. rbdkit's create records what ceph-csi records, its passphrase record
///    opens with an independent scrypt + AES-GCM, its header is one
///    cryptsetup reads and opens, and a re-run changes nothing.
#[test]
fn rbdkit_format_is_one_cryptsetup_and_ceph_csi_open() {
    let ns = TestNs::new("encfmt");
    let c = cluster();
    let v = vol(&ns, "pvc-enc-1");
    let enc = metadata_kms();
    let size = 64 * MIB;
    let opts = ImageOptions::new();
    ensure_image_encrypted(
        &c,
        &NoMetrics,
        &NoFence,
        &v,
        size,
        &opts,
        &owner("pvc-enc-1"),
        Some(&enc),
    )
    .unwrap();
    let image = Image::open(&ns.ioctx, &v.image).unwrap();
    let meta = image.metadata_list().unwrap();
    assert_eq!(meta.get(META_STATE).map(String::as_str), Some("encrypted"));
    assert_eq!(meta.get(META_KMS_ID).map(String::as_str), Some("meta"));
    assert_eq!(
        meta.get("rbd.csi.ceph.com/luks2HeaderSize")
            .map(String::as_str),
        Some("16777216")
    );
    let rec = meta.get(META_DEK).expect("a DEK record").clone();
    let passphrase = open_dek_independently(&v.handle(), &rec);
    assert_eq!(
        passphrase.len(),
        28,
        "ceph-csi's 20 bytes in URL-safe base64"
    );

    // cryptsetup reads the header and opens it with that passphrase.
    let dir = tempdir("encfmt");
    let file = dir.path().join("head.img");
    export_head(&image, &file, 2 * MIB);
    let f = file.to_str().unwrap();
    let (code, dump, err) = cryptsetup(&["luksDump", f], b"");
    assert_eq!(code, 0, "luksDump: {err}");
    for want in [
        "Version:       \t2",
        "offset: 16777216 [bytes]",
        "sector: 4096 [bytes]",
        "aes-xts-plain64",
        "argon2id",
    ] {
        assert!(dump.contains(want), "{want:?} not in:\n{dump}");
    }
    let (code, _, err) = cryptsetup(
        &["open", "--test-passphrase", "--key-file=-", f],
        passphrase.as_bytes(),
    );
    assert_eq!(code, 0, "cryptsetup does not open rbdkit's header: {err}");
    let (code, _, _) = cryptsetup(&["open", "--test-passphrase", "--key-file=-", f], b"wrong");
    assert_eq!(code, 2, "a wrong passphrase opens it");
    // The volume key cryptsetup unlocks is rbdkit's.
    let h = Header::read(&image).unwrap();
    let (key, slot) = h.unlock(&image, passphrase.as_bytes()).unwrap();
    assert_eq!(slot, 0);
    assert_eq!(cryptsetup_volume_key(&file, &passphrase), key.bytes());
    assert_eq!(h.data_size(size), size - 16 * MIB);

    // A re-run (a retried CreateVolume) adopts it as it is.
    drop(image);
    ensure_image_encrypted(
        &c,
        &NoMetrics,
        &NoFence,
        &v,
        size,
        &opts,
        &owner("pvc-enc-1"),
        Some(&enc),
    )
    .unwrap();
    let image = Image::open_read_only(&ns.ioctx, &v.image).unwrap();
    assert_eq!(image.metadata_get(META_DEK).unwrap(), rec);
    // The same name asked for without encryption is a conflict, not a
    // plaintext volume over ciphertext.
    drop(image);
    let e = ensure_image_encrypted(
        &c,
        &NoMetrics,
        &NoFence,
        &v,
        size,
        &opts,
        &owner("pvc-enc-1"),
        None,
    )
    .unwrap_err();
    assert!(matches!(e, VolumeError::Conflict { .. }), "{e}");
    // Too small for the header: refused by name before anything exists.
    let small = vol(&ns, "pvc-enc-small");
    let e = ensure_image_encrypted(
        &c,
        &NoMetrics,
        &NoFence,
        &small,
        16 * MIB,
        &opts,
        &owner("pvc-enc-small"),
        Some(&enc),
    )
    .unwrap_err();
    assert!(e.to_string().contains("LUKS2 header"), "{e}");
    assert!(!rbd::list_names(&ns.ioctx)
        .unwrap()
        .iter()
        .any(|n| n.contains("small")));
    delete_image(&c, &NoMetrics, &NoFence, &v, PROV, "pvc-enc-1").unwrap();
}

/// Makes `image_name` the way ceph-csi does: its DEK record, cryptsetup's
/// header with ceph-csi's arguments (with `new_style`, 3.15's pinned
/// metadata and keyslot sizes), the state `encrypted`, and data encrypted
/// by an independent AES-XTS. Returns (passphrase, volume key, sector).
fn ceph_csi_volume(
    ns: &TestNs,
    dir: &Path,
    image_name: &str,
    volume_id: &str,
    size: u64,
    new_style: bool,
    plain: &[u8],
) -> (String, Vec<u8>, usize) {
    rbd::create(&ns.ioctx, image_name, size, &ImageOptions::new()).unwrap();
    let image = Image::open(&ns.ioctx, image_name).unwrap();
    let (passphrase, dek) = ceph_csi_passphrase_and_dek(volume_id);
    let file = dir.join(format!("{image_name}.img"));
    std::fs::File::create(&file).unwrap().set_len(size).unwrap();
    let f = file.to_str().unwrap();
    let mut args = vec!["-q", "luksFormat", "--type", "luks2", "--hash", "sha256"];
    if new_style {
        args.extend([
            "--luks2-metadata-size",
            "4096k",
            "--luks2-keyslots-size",
            "8192k",
        ]);
    }
    args.extend(["--pbkdf-memory", "32768", f, "-d", "-"]);
    let (code, _, err) = cryptsetup(&args, passphrase.as_bytes());
    assert_eq!(code, 0, "luksFormat: {err}");
    import_head(&file, &image, 16 * MIB);
    image.metadata_set(META_STATE, "encrypted").unwrap();
    image.metadata_set(META_DEK, &dek).unwrap();
    let key = cryptsetup_volume_key(&file, &passphrase);
    let h = Header::read(&image).unwrap();
    let sector = h.sector_size as usize;
    let cipher = xts(&key, sector, 0, plain, true);
    image.write(h.data_offset, &cipher).unwrap();
    (passphrase, key, sector)
}

/// 2. Volumes made the way ceph-csi makes them (both header styles) open
///    in rbdkit: the passphrase from the DEK record, the header with it,
///    and rbdkit-fuse serves the plaintext; what it writes decrypts with
///    an independent AES-XTS; the raw image holds no plaintext.
#[test]
fn ceph_csi_volumes_open_and_decrypt_through_rbdkit_fuse() {
    let ns = TestNs::new("enccsi");
    let dir = tempdir("enccsi");
    let d = Daemon::start(dir.path());
    for (i, new_style) in [false, true].into_iter().enumerate() {
        let name = format!("csi-vol-{i}");
        let volume_id =
            format!("0001-0009-rook-ceph-0000000000000002-00000000-0000-0000-0000-00000000000{i}");
        let plain = pattern(7 + i as u64, 256 << 10);
        let (passphrase, key, sector) = ceph_csi_volume(
            &ns,
            dir.path(),
            &name,
            &volume_id,
            64 * MIB,
            new_style,
            &plain,
        );
        let image = Image::open(&ns.ioctx, &name).unwrap();
        // An adopted ceph-csi volume keeps its ceph-csi id as its key id.
        image.metadata_set(META_KEY_ID, &volume_id).unwrap();
        let meta = image.metadata_list().unwrap();
        assert_eq!(
            encryption::state_of(&meta, &name).unwrap(),
            State::Encrypted
        );
        let key_id = encryption::key_id_of(&meta, "rbdkit1/test/x//y");
        let got = encryption::passphrase_of(
            &meta,
            &name,
            &key_id,
            &Keys::Metadata(Secret::new(KEK.to_owned())),
        )
        .unwrap();
        assert_eq!(got.expose(), passphrase);
        let h = Header::read(&image).unwrap();
        assert_eq!(h.data_offset, 16 * MIB, "new_style={new_style}");
        let (k, _) = h.unlock(&image, passphrase.as_bytes()).unwrap();
        assert_eq!(k.bytes(), key.as_slice());
        drop(image);

        let mut s = spec(&ns, &format!("vol-{i}"), &name);
        s.encryption = Some(Secret::new(passphrase.clone()));
        let dev = d.mapper().map(&s).unwrap();
        assert_eq!(crate::node_fuse::device_size(&dev), 48 * MIB);
        let read = read_direct(&dev, 0, plain.len()).unwrap();
        assert!(
            read == plain,
            "rbdkit-fuse does not decrypt ceph-csi's data (new_style={new_style})"
        );
        // Written through the device: decrypts independently, and the image
        // holds no plaintext of it.
        let mine = pattern(100 + i as u64, 64 << 10);
        write_direct(&dev, 1 << 20, &mine);
        let image = Image::open_read_only(&ns.ioctx, &name).unwrap();
        let mut raw = vec![0u8; mine.len()];
        image.read_exact(16 * MIB + (1 << 20), &mut raw).unwrap();
        assert_ne!(raw, mine);
        assert_eq!(xts(&key, sector, 1 << 20, &raw, false), mine);
        d.mapper().unmap(&format!("vol-{i}"), &[]).unwrap();
    }
}

/// 3. Bad keys and bad metadata are clear errors naming no key; nothing is
///    ever formatted over data; a ceph-csi volume still `encryptionPrepared`
///    is formatted only while its header region is blank.
#[test]
fn faults_are_clear_errors_and_nothing_is_formatted_over_data() {
    let ns = TestNs::new("encbad");
    let c = cluster();
    let dir = tempdir("encbad");
    let d = Daemon::start(dir.path());
    let v = vol(&ns, "pvc-bad");
    ensure_image_encrypted(
        &c,
        &NoMetrics,
        &NoFence,
        &v,
        32 * MIB,
        &ImageOptions::new(),
        &owner("pvc-bad"),
        Some(&metadata_kms()),
    )
    .unwrap();
    let image = Image::open(&ns.ioctx, &v.image).unwrap();
    let meta = image.metadata_list().unwrap();
    let handle = v.handle();
    // A wrong KMS passphrase.
    let e = encryption::passphrase_of(
        &meta,
        &v.image,
        &handle,
        &Keys::Metadata(Secret::new("nope".to_owned())),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(
        !e.to_string().contains(KEK) && !e.to_string().contains("nope"),
        "{e}"
    );
    // A KMS record that is garbage.
    let mut bad = meta.clone();
    bad.insert(
        META_DEK.into(),
        "{\"dek\":\"!!\",\"nonce\":\"AAAA\"}".into(),
    );
    let e = encryption::passphrase_of(
        &bad,
        &v.image,
        &handle,
        &Keys::Metadata(Secret::new(KEK.to_owned())),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // A wrong passphrase at the mapper: refused, nothing mapped.
    let mut s = spec(&ns, "bad-1", &v.image);
    s.encryption = Some(Secret::new("not-the-passphrase".to_owned()));
    let e = d.mapper().map(&s).unwrap_err();
    assert!(e.to_string().contains("wrong key"), "{e}");
    assert!(!e.to_string().contains("not-the-passphrase"), "{e}");
    assert!(d.mapper().list().unwrap().is_empty());

    // Metadata says encrypted, the header is gone: refused, and left as is.
    let plain = vol(&ns, "plain-said-encrypted");
    rbd::create(&ns.ioctx, &plain.image, 32 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, &plain.image).unwrap();
    img.write(0, b"a filesystem superblock, say").unwrap();
    let mut s = spec(&ns, "bad-2", &plain.image);
    s.encryption = Some(Secret::new("whatever".to_owned()));
    let e = d.mapper().map(&s).unwrap_err();
    assert!(e.to_string().contains("no LUKS2 header"), "{e}");
    let fmt = luks::FormatOptions::default();
    let pass = Secret::new("p".to_owned());
    let e = encryption::open_for_stage(&img, State::Prepared, &pass, &fmt).unwrap_err();
    assert!(e.to_string().contains("refusing to format"), "{e}");
    let e = encryption::open_for_stage(&img, State::Encrypted, &pass, &fmt).unwrap_err();
    assert!(e.to_string().contains("no LUKS2 header"), "{e}");
    let mut head = vec![0u8; 28];
    img.read_exact(0, &mut head).unwrap();
    assert_eq!(
        &head, b"a filesystem superblock, say",
        "data was overwritten"
    );

    // Prepared and blank (ceph-csi made it, no node staged it yet): the
    // header is written, then the state says so; a second stage adopts it.
    let fresh = vol(&ns, "prepared");
    rbd::create(&ns.ioctx, &fresh.image, 32 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, &fresh.image).unwrap();
    img.metadata_set(META_STATE, "encryptionPrepared").unwrap();
    encryption::open_for_stage(&img, State::Prepared, &pass, &fmt).unwrap();
    assert_eq!(img.metadata_get(META_STATE).unwrap(), "encrypted");
    let h1 = Header::read(&img).unwrap();
    encryption::open_for_stage(&img, State::Prepared, &pass, &fmt).unwrap();
    assert_eq!(Header::read(&img).unwrap().uuid, h1.uuid, "formatted twice");
}

/// 4. Rotation is a keyslot change: the old passphrase no longer opens,
///    the new one (from the KMS record) does, the data still reads the
///    same; a rotation cut short after its new keyslot (the KMS not
///    updated) is finished by the next one, leaving one keyslot.
#[test]
fn rotation_changes_the_keyslot_only_and_survives_being_cut_short() {
    let ns = TestNs::new("encrot");
    let c = cluster();
    let v = vol(&ns, "pvc-rot");
    let enc = metadata_kms();
    ensure_image_encrypted(
        &c,
        &NoMetrics,
        &NoFence,
        &v,
        32 * MIB,
        &ImageOptions::new(),
        &owner("pvc-rot"),
        Some(&enc),
    )
    .unwrap();
    let image = Image::open(&ns.ioctx, &v.image).unwrap();
    let handle = v.handle();
    let kek = Secret::new(KEK.to_owned());
    let keys = Keys::Metadata(kek.clone());
    let old = encryption::passphrase_of(&image.metadata_list().unwrap(), &v.image, &handle, &keys)
        .unwrap();
    let (key, _) = Header::read(&image)
        .unwrap()
        .unlock(&image, old.expose().as_bytes())
        .unwrap();
    let data = pattern(3, 8192);
    let cipher = Header::read(&image).unwrap().data_cipher(&key).unwrap();
    let mut ct = data.clone();
    cipher.encrypt(0, &mut ct);
    image.write(16 * MIB, &ct).unwrap();

    // Cut short: a new keyslot added, the KMS never told.
    let mut h = Header::read(&image).unwrap();
    h.add_keyslot(&image, &key, b"orphan", &luks::Kdf::default())
        .unwrap();
    assert_eq!(Header::read(&image).unwrap().keyslots, vec![0, 1]);

    let slot = encryption::rotate(&image, &old, |new| {
        image.metadata_set(META_DEK, &kms::wrap_dek(&kek, &handle, new)?)
    })
    .unwrap();
    let h = Header::read(&image).unwrap();
    assert_eq!(h.keyslots, vec![slot], "one keyslot left");
    let new = encryption::passphrase_of(&image.metadata_list().unwrap(), &v.image, &handle, &keys)
        .unwrap();
    assert_ne!(new, old);
    assert_eq!(
        h.unlock(&image, old.expose().as_bytes())
            .unwrap_err()
            .kind(),
        ErrorKind::PermissionDenied
    );
    assert!(h.unlock(&image, b"orphan").is_err());
    let (k2, _) = h.unlock(&image, new.expose().as_bytes()).unwrap();
    assert_eq!(k2.bytes(), key.bytes(), "the volume key is kept");
    let mut back = vec![0u8; data.len()];
    image.read_exact(16 * MIB, &mut back).unwrap();
    h.data_cipher(&k2).unwrap().decrypt(0, &mut back);
    assert_eq!(back, data);
    // A second rotation (idempotent in effect): still one keyslot.
    encryption::rotate(&image, &new, |n| {
        image.metadata_set(META_DEK, &kms::wrap_dek(&kek, &handle, n)?)
    })
    .unwrap();
    assert_eq!(Header::read(&image).unwrap().keyslots.len(), 1);
}

/// 5. Snapshots and clones of an encrypted volume: the snapshot image keeps
///    its source's record (and says under which id), a restore and a clone
///    each get their own record under their own handle and open with the
///    same header; an encrypted source into an unencrypted class, and the
///    reverse, are refused by name with nothing made.
#[test]
fn snapshots_and_clones_keep_their_keys_and_refuse_mixing() {
    let ns = TestNs::new("encsnap");
    let c = cluster();
    let src = vol(&ns, "pvc-src");
    let enc = metadata_kms();
    ensure_image_encrypted(
        &c,
        &NoMetrics,
        &NoFence,
        &src,
        32 * MIB,
        &ImageOptions::new(),
        &owner("pvc-src"),
        Some(&enc),
    )
    .unwrap();
    let keys = Keys::Metadata(Secret::new(KEK.to_owned()));
    let img = Image::open(&ns.ioctx, &src.image).unwrap();
    let pass = encryption::passphrase_of(
        &img.metadata_list().unwrap(),
        &src.image,
        &src.handle(),
        &keys,
    )
    .unwrap();
    drop(img);
    let sowner = SnapshotOwner {
        provisioner: PROV.into(),
        snapshot_name: "snap-1".into(),
        cluster_id: "test".into(),
        snapshot_namespace: "apps".into(),
        snapshot_object: "vs".into(),
    };
    let info = ensure_snapshot(
        &c,
        &NoMetrics,
        &src,
        "snap-img-1",
        &sowner,
        &CloneOptions::default(),
    )
    .unwrap();
    let simg = Image::open_read_only(&ns.ioctx, "snap-img-1").unwrap();
    let smeta = simg.metadata_list().unwrap();
    assert_eq!(smeta.get(META_KEY_ID), Some(&src.handle()));
    assert_eq!(smeta.get(META_KMS_ID).map(String::as_str), Some("meta"));
    drop(simg);

    let with_enc = CloneOptions {
        encryption: Some(metadata_kms()),
        ..Default::default()
    };
    for (name, from_snapshot) in [("pvc-restored", true), ("pvc-clone", false)] {
        let dst = vol(&ns, name);
        if from_snapshot {
            ensure_volume_from_snapshot(
                &c,
                &NoMetrics,
                &info.id,
                &dst,
                64 * MIB,
                &ImageOptions::new(),
                &owner(name),
                &with_enc,
            )
            .unwrap();
        } else {
            ensure_volume_from_volume(
                &c,
                &NoMetrics,
                &src,
                &dst,
                0,
                &ImageOptions::new(),
                &owner(name),
                &with_enc,
            )
            .unwrap();
        }
        let d = Image::open(&ns.ioctx, name).unwrap();
        let m = d.metadata_list().unwrap();
        assert_eq!(m.get(META_STATE).map(String::as_str), Some("encrypted"));
        assert!(
            !m.contains_key(META_KEY_ID),
            "{name} keeps a key id of its own handle"
        );
        let got = encryption::passphrase_of(&m, name, &dst.handle(), &keys).unwrap();
        assert_eq!(got, pass, "{name} opens with the source's passphrase");
        assert_eq!(
            open_dek_independently(&dst.handle(), m.get(META_DEK).unwrap()),
            pass.expose()
        );
        Header::read(&d)
            .unwrap()
            .unlock(&d, got.expose().as_bytes())
            .unwrap();
    }

    // Mixing is refused, naming what is wrong; nothing is made.
    let plain = vol(&ns, "pvc-plain-from-enc");
    let e = ensure_volume_from_snapshot(
        &c,
        &NoMetrics,
        &info.id,
        &plain,
        0,
        &ImageOptions::new(),
        &owner("p1"),
        &CloneOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(e, VolumeError::Refused { .. }) && e.to_string().contains("is encrypted"),
        "{e}"
    );
    let plain_src = vol(&ns, "pvc-plain-src");
    ensure_image_encrypted(
        &c,
        &NoMetrics,
        &NoFence,
        &plain_src,
        32 * MIB,
        &ImageOptions::new(),
        &owner("pvc-plain-src"),
        None,
    )
    .unwrap();
    let e = ensure_volume_from_volume(
        &c,
        &NoMetrics,
        &plain_src,
        &vol(&ns, "pvc-enc-from-plain"),
        0,
        &ImageOptions::new(),
        &owner("p2"),
        &with_enc,
    )
    .unwrap_err();
    assert!(e.to_string().contains("not encrypted"), "{e}");
    let names = rbd::list_names(&ns.ioctx).unwrap();
    assert!(
        !names.iter().any(|n| n.contains("from-")),
        "a refused clone left {names:?}"
    );
}

mod e2e {
    //! The whole path on the real node: a ceph-csi StorageClass with
    //! `encrypted: "true"` and a `metadata` KMS, the provisioner, the node
    //! plugin with rbdkit-fuse, pods of the kubelet, the snapshot-controller.
    use super::*;

    use kube::api::PostParams;
    use serde_json::json;

    use support::k8s::ControlPlane;
    use support::node::{
        busybox_pod, claim_volume, create_pod, delete_pod, pod_logs, prepare_namespace, wait_phase,
        Node, NodePlugin, POD_WAIT,
    };
    use support::provisioner::{eventually, from_json, Env, WAIT};
    use support::snapshots::{self as snaps, SnapshotController};

    const KMS_ID: &str = "kms-test";

    fn data_mount() -> serde_json::Value {
        json!([{"name": "data", "mountPath": "/data"}])
    }

    async fn run_to_success(node: &Node, env: &Env, pod: serde_json::Value) -> String {
        let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
        create_pod(&env.client, &env.ns, pod).await;
        wait_phase(node, &env.client, &env.ns, &name, &["Succeeded"], POD_WAIT).await;
        let log = pod_logs(&env.client, &env.ns, &name).await;
        delete_pod(node, &env.client, &env.ns, &name).await;
        log
    }

    fn image_of(env: &Env, pv: &k8s_openapi::api::core::v1::PersistentVolume) -> VolumeId {
        let v = support::provisioner::volume_id(pv);
        assert_eq!(v.rados_namespace, env.rbd.name);
        v
    }

    /// Whether `needle` occurs anywhere in the image's bytes (read with
    /// the library, 4 MiB at a time).
    fn image_holds(env: &Env, image: &str, needle: &[u8]) -> bool {
        let img = Image::open_read_only(&env.rbd.ioctx, image).unwrap();
        let size = img.size().unwrap();
        let mut buf = vec![0u8; 4 << 20];
        let mut at = 0;
        while at < size {
            let n = (size - at).min(buf.len() as u64) as usize;
            img.read_exact(at, &mut buf[..n]).unwrap();
            if buf[..n].windows(needle.len()).any(|w| w == needle) {
                return true;
            }
            at += n as u64;
        }
        false
    }

    /// Where the class's passphrases are kept.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Kms {
        /// ceph-csi's secrets-metadata: a DEK record on the image.
        Metadata,
        /// `vaulttokens` against the real Vault: a key per volume there.
        Vault,
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn an_encrypted_claim_mounts_grows_snapshots_restores_and_deletes() {
        encrypted_claim_lives_and_dies(Kms::Metadata, "nenc").await;
    }

    /// The same life with a Vault KMS (`vaulttokens`, the token in the
    /// claim's namespace): keys in Vault, one per volume and snapshot, and
    /// none left after the deletes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_vault_encrypted_claim_mounts_grows_snapshots_restores_and_deletes() {
        encrypted_claim_lives_and_dies(Kms::Vault, "nencv").await;
    }

    async fn encrypted_claim_lives_and_dies(kms: Kms, test: &str) {
        SnapshotController::shared(ControlPlane::shared()).await;
        let node = Node::shared();
        let mut env = Env::new(test).await;
        prepare_namespace(&env.client, &env.ns).await;
        let kms_dir = tempdir(test);
        let kms_config = kms_dir.path().join("config.json");
        let kms_flag = kms_config.display().to_string();
        let mut node_args = vec!["--kms-config".to_owned(), kms_flag.clone()];
        let vault = match kms {
            Kms::Metadata => {
                support::artifacts::note_secret(KEK);
                // The KMS passphrase in the provisioner and node-stage
                // Secrets, as ceph-csi's docs ask; the KMS config as its
                // ConfigMap would hold it.
                env.set_encryption_passphrase(KEK).await;
                std::fs::write(
                    &kms_config,
                    json!({KMS_ID: {"encryptionKMSType": "metadata"}}).to_string(),
                )
                .unwrap();
                None
            }
            Kms::Vault => {
                // The tenant is the claim's namespace; the node plugin reads
                // its token Secret through the API server.
                let vault = support::kms::VaultServer::shared().await;
                let (section, mount) =
                    support::kms::vaulttokens_kms(vault, &env.client, &env.ns).await;
                std::fs::write(&kms_config, json!({ KMS_ID: section }).to_string()).unwrap();
                node_args.extend([
                    "--kubeconfig".to_owned(),
                    ControlPlane::shared()
                        .kubeconfig_path()
                        .display()
                        .to_string(),
                ]);
                Some((vault, mount))
            }
        };
        let provisioner = env.start_in_process_with(&[("--kms-config", kms_flag.as_str())]);
        let plugin =
            NodePlugin::start_with(node, &env.client, &env.name, &env.config_path(), &node_args)
                .await;
        let class = env
            .storage_class(
                "enc",
                json!({
                    // xfs grows while mounted without CAP_SYS_RESOURCE,
                    // which ext4's online resize needs and the test node
                    // plugin lacks; xfsprogs makes none under 300 MB.
                    "csi.storage.k8s.io/fstype": "xfs",
                    "encrypted": "true",
                    "encryptionKMSID": KMS_ID,
                }),
                json!({"allowVolumeExpansion": true}),
            )
            .await;
        env.claim("data", &class, "340Mi", &["ReadWriteOnce"], "Filesystem")
            .await;
        let (_, pv) = env.wait_bound("data").await;
        let vol = image_of(&env, &pv);
        let img = Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
        let meta = img.metadata_list().unwrap();
        assert_eq!(meta.get(META_STATE).map(String::as_str), Some("encrypted"));
        assert_eq!(meta.get(META_KMS_ID).map(String::as_str), Some(KMS_ID));
        let passphrase = match &vault {
            None => open_dek_independently(&vol.handle(), meta.get(META_DEK).unwrap()),
            Some((vault, mount)) => {
                assert!(!meta.contains_key(META_DEK), "a Vault volume has no DEK");
                vault
                    .kv2_passphrase(mount, &vol.handle())
                    .await
                    .expect("the key in Vault under the volume id")
            }
        };
        support::artifacts::note_secret(&passphrase);
        drop(img);
        let attrs = pv
            .spec
            .as_ref()
            .unwrap()
            .csi
            .as_ref()
            .unwrap()
            .volume_attributes
            .clone()
            .unwrap();
        assert_eq!(attrs.get("encrypted").map(String::as_str), Some("true"));
        let pv_text = serde_json::to_string(&pv).unwrap();
        assert!(
            !pv_text.contains(KEK) && !pv_text.contains(&passphrase),
            "a passphrase is in the PV"
        );

        // Written by one pod, read by the next (a restage in between).
        let marker = format!("ENCRYPTED-PLAINTEXT-MARKER-{}", env.ns);
        let script = format!(
            "set -e; for i in $(seq 1 2000); do echo '{marker}'; done > /data/secret; \
             sync -f /data/secret; head -1 /data/secret; \
             mount | grep ' /data ' | cut -d' ' -f1,5"
        );
        let out = run_to_success(
            node,
            &env,
            busybox_pod(node, "w1", &script, claim_volume("data"), data_mount()),
        )
        .await;
        assert!(out.starts_with(&marker), "writer log: {out}");
        assert!(
            out.contains("/dev/loop") && out.contains("xfs"),
            "writer log: {out}"
        );
        let out = run_to_success(
            node,
            &env,
            busybox_pod(
                node,
                "r1",
                "head -1 /data/secret; df -k /data | tail -1",
                claim_volume("data"),
                data_mount(),
            ),
        )
        .await;
        assert!(out.starts_with(&marker), "reader log: {out}");
        // The filesystem is inside the LUKS2 data segment: 340 MiB less its
        // 16 MiB header.
        let kib: u64 = out
            .lines()
            .nth(1)
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            kib <= 324 * 1024 && kib > 250 * 1024,
            "xfs of {kib} KiB on a 324 MiB data segment"
        );
        // The image holds no plaintext of what the pod wrote.
        assert!(
            !image_holds(&env, &vol.image, marker.as_bytes()),
            "plaintext in the image"
        );

        // Online growth: a running pod sees it.
        create_pod(
            &env.client,
            &env.ns,
            busybox_pod(
                node,
                "grow",
                "while :; do echo \"DF $(df -k /data | tail -1)\"; sleep 1; done",
                claim_volume("data"),
                data_mount(),
            ),
        )
        .await;
        wait_phase(node, &env.client, &env.ns, "grow", &["Running"], POD_WAIT).await;
        env.resize_claim("data", "680Mi").await;
        eventually(
            "df in the pod to see the encrypted volume grow",
            WAIT,
            || async {
                let log = pod_logs(&env.client, &env.ns, "grow").await;
                let last = log
                    .lines()
                    .filter(|l| l.starts_with("DF "))
                    .filter_map(|l| l.split_whitespace().nth(2)?.parse::<u64>().ok())
                    .next_back();
                match last {
                    Some(k) if k > kib + 300 * 1024 => Ok(()),
                    other => Err(format!(
                        "last df {other:?} KiB; claim status {:?}\n{}",
                        env.claims().get("data").await.ok().and_then(|c| c.status),
                        node.kubelet_log_tail(15)
                    )),
                }
            },
        )
        .await;
        delete_pod(node, &env.client, &env.ns, "grow").await;

        // A snapshot and a restore into the same encrypted class: the
        // restore reads the marker; it has a passphrase record of its own.
        let sclass = snaps::create_class(
            &env.client,
            &format!("{}-snap", env.ns),
            &env.name,
            json!({
                "csi.storage.k8s.io/snapshotter-secret-name": env.secret,
                "csi.storage.k8s.io/snapshotter-secret-namespace": env.ns,
            }),
            "Delete",
        )
        .await;
        snaps::create_snapshot(&env.client, &env.ns, "s1", &sclass, "data").await;
        snaps::wait_ready(&env.client, &env.ns, "s1", WAIT).await;
        if let Some((vault, mount)) = &vault {
            // The snapshot's own copy, so it outlives its source.
            assert_eq!(
                vault.kv2_keys(mount).await.len(),
                2,
                "volume and snapshot keys"
            );
        }
        env.claims()
            .create(
                &PostParams::default(),
                &from_json(json!({
                    "metadata": {"name": "restored"},
                    "spec": {
                        "storageClassName": class,
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "680Mi"}},
                        "dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "s1"},
                    },
                })),
            )
            .await
            .unwrap();
        let (_, rpv) = env.wait_bound("restored").await;
        let rvol = image_of(&env, &rpv);
        let out = run_to_success(
            node,
            &env,
            busybox_pod(
                node,
                "r2",
                "head -1 /data/secret",
                claim_volume("restored"),
                data_mount(),
            ),
        )
        .await;
        assert!(out.starts_with(&marker), "the restore reads: {out}");
        let rimg = Image::open_read_only(&env.rbd.ioctx, &rvol.image).unwrap();
        let rmeta = rimg.metadata_list().unwrap();
        drop(rimg);
        match &vault {
            None => {
                assert_ne!(
                    rmeta.get(META_DEK),
                    meta.get(META_DEK),
                    "the restore has its own record"
                );
                assert_eq!(
                    open_dek_independently(&rvol.handle(), rmeta.get(META_DEK).unwrap()),
                    passphrase,
                );
            }
            Some((vault, mount)) => assert_eq!(
                vault.kv2_passphrase(mount, &rvol.handle()).await,
                Some(passphrase.clone()),
                "the restore's own copy of the key"
            ),
        }

        // A restore into a class without encryption is refused by name.
        let plain = env.storage_class("plain", json!({}), json!({})).await;
        env.claims()
            .create(
                &PostParams::default(),
                &from_json(json!({
                    "metadata": {"name": "plain-restore"},
                    "spec": {
                        "storageClassName": plain,
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "680Mi"}},
                        "dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "s1"},
                    },
                })),
            )
            .await
            .unwrap();
        env.wait_event("plain-restore", "ProvisioningFailed", &["is encrypted"])
            .await;

        // Deleting leaves nothing: claims, snapshot, images.
        env.delete_claim("plain-restore").await;
        env.delete_claim("restored").await;
        snaps::delete_snapshot(&env.client, &env.ns, "s1").await;
        env.delete_claim("data").await;
        eventually("every image removed", WAIT, || async {
            let images = env.images();
            if images.is_empty() {
                Ok(())
            } else {
                Err(format!("images {images:?}, trash {:?}", env.trash()))
            }
        })
        .await;
        if let Some((vault, mount)) = &vault {
            eventually("every key removed from Vault", WAIT, || async {
                let keys = vault.kv2_keys(mount).await;
                if keys.is_empty() {
                    Ok(())
                } else {
                    Err(format!("keys {keys:?}"))
                }
            })
            .await;
        }
        eventually("nothing mapped on the node", WAIT, || async {
            let maps = plugin.fuse_mapper().list().map_err(|e| e.to_string())?;
            if maps.is_empty() {
                Ok(())
            } else {
                Err(format!("{maps:?}"))
            }
        })
        .await;
        drop(plugin);
        provisioner.stop().await;
    }
}

/// krbd with dm-crypt, on the kernel guest's real rbd.ko and device-mapper
/// (`kernel_vm::debian_6_1_guest` runs these there; ignored on the host,
/// which has neither).
mod guest {
    use super::*;

    use std::collections::HashMap;
    use std::path::PathBuf;
    use std::sync::Arc;

    use rbdkit::csi::node::VOLUME;
    use rbdkit::csi::proto::{
        node_client::NodeClient, CapacityRange, ControllerExpandVolumeRequest, CreateVolumeRequest,
        DeleteVolumeRequest, NodeExpandVolumeRequest, NodeStageVolumeRequest,
        NodeUnstageVolumeRequest,
    };
    use serde_json::json;
    use support::ceph::{unique, TestCluster};
    use support::csi::{channel, mount_cap, CsiEnv, Mode};
    use support::process::Proc;

    const PASSPHRASE: &str = "a-shared-passphrase-of-the-default-kms";

    /// A controller (CsiEnv) and `rbdkit csi --mode node` with krbd and a
    /// fuse-mapper, monitors as krbd takes them.
    struct World {
        ns: Arc<TestNs>,
        ctl: CsiEnv,
        node: Proc,
        _mapper: Proc,
        socket: PathBuf,
        dir: tempfile::TempDir,
    }

    impl World {
        async fn new(test: &str) -> World {
            assert!(
                std::env::var_os("RBDKIT_IN_GUEST").is_some() && Path::new("/sys/bus/rbd").exists(),
                "this test needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"
            );
            let ns = Arc::new(TestNs::new(test));
            let cluster_id = unique(test);
            let ctl = CsiEnv::with_ns(
                Arc::clone(&ns),
                cluster_id.clone(),
                Mode::Controller,
                "ctl",
                &[],
            )
            .await;
            let dir = tempfile::Builder::new()
                .prefix("kvm-enc-")
                .tempdir_in("/tmp")
                .unwrap();
            let mon = TestCluster::get().conf_value("mon host").unwrap();
            let config = dir.path().join("config.json");
            std::fs::write(
                &config,
                json!([{"clusterID": cluster_id, "monitors": [mon.trim_start_matches("v1:")], "rbd": {"radosNamespace": ns.name}}]).to_string(),
            )
            .unwrap();
            let d = dir.path();
            let mapper = Proc::rbdkit(
                "fuse-mapper",
                vec![
                    "fuse-mapper".into(),
                    "--socket".into(),
                    d.join("mapper.sock").display().to_string(),
                    "--state-dir".into(),
                    d.join("fuse").display().to_string(),
                ],
                d.join("mapper.log"),
            );
            let socket = d.join("csi.sock");
            let node = Proc::rbdkit(
                "rbdkit csi node",
                vec![
                    "csi".into(),
                    "--mode".into(),
                    "node".into(),
                    "--endpoint".into(),
                    format!("unix://{}", socket.display()),
                    "--node-id".into(),
                    "guest".into(),
                    "--clusters-config".into(),
                    config.display().to_string(),
                    "--state-dir".into(),
                    d.join("state").display().to_string(),
                    "--mapper-socket".into(),
                    d.join("mapper.sock").display().to_string(),
                ],
                d.join("csi.log"),
            );
            World {
                ns,
                ctl,
                node,
                _mapper: mapper,
                socket,
                dir,
            }
        }

        fn secrets(&self, base: HashMap<String, String>) -> HashMap<String, String> {
            let mut s = base;
            s.insert("encryptionPassphrase".into(), PASSPHRASE.into());
            s
        }

        /// An encrypted volume (default KMS); its id and volume context.
        async fn create(&self, name: &str, bytes: i64) -> (String, HashMap<String, String>) {
            let mut params = self.ctl.params();
            params.insert("encrypted".into(), "true".into());
            let v = self
                .ctl
                .controller()
                .await
                .create_volume(CreateVolumeRequest {
                    name: name.into(),
                    capacity_range: Some(CapacityRange {
                        required_bytes: bytes,
                        limit_bytes: 0,
                    }),
                    volume_capabilities: vec![mount_cap("ext4")],
                    parameters: params,
                    secrets: self.secrets(self.ctl.secrets()),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("CreateVolume: {e}"))
                .into_inner()
                .volume
                .unwrap();
            (v.volume_id, v.volume_context)
        }

        async fn stage(
            &self,
            id: &str,
            staging: &Path,
            ctx: &HashMap<String, String>,
            mounter: &str,
        ) {
            let mut ctx = ctx.clone();
            ctx.insert("mounter".into(), mounter.into());
            let req = NodeStageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(mount_cap("ext4")),
                secrets: self.secrets(self.ctl.node_secrets()),
                volume_context: ctx,
                ..Default::default()
            };
            NodeClient::new(channel(&self.socket).await)
                .node_stage_volume(req)
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "NodeStageVolume ({mounter}): {e}\n{}",
                        self.node.log_tail(30)
                    )
                });
        }

        async fn unstage(&self, id: &str, staging: &Path) {
            NodeClient::new(channel(&self.socket).await)
                .node_unstage_volume(NodeUnstageVolumeRequest {
                    volume_id: id.into(),
                    staging_target_path: staging.display().to_string(),
                })
                .await
                .unwrap_or_else(|e| panic!("NodeUnstageVolume: {e}\n{}", self.node.log_tail(30)));
        }

        fn mount_source(&self, staging: &Path) -> String {
            rbdkit::node::mount::mountinfo()
                .unwrap()
                .into_iter()
                .rev()
                .find(|m| m.mount_point == staging.join(VOLUME))
                .map(|m| m.source)
                .unwrap_or_default()
        }

        fn krbd_devices(&self) -> usize {
            std::fs::read_dir("/sys/bus/rbd/devices")
                .unwrap()
                .flatten()
                .filter(|e| {
                    std::fs::read_to_string(e.path().join("pool_ns"))
                        .unwrap_or_default()
                        .trim()
                        == self.ns.name
                })
                .count()
        }
    }

    impl Drop for World {
        fn drop(&mut self) {
            self.node.kill9();
            let root = self.dir.path().to_owned();
            for m in rbdkit::node::mount::mountinfo().unwrap_or_default() {
                if m.mount_point.starts_with(&root) {
                    let _ = rbdkit::node::mount::ensure_unmounted(&m.mount_point);
                }
            }
            for e in std::fs::read_dir("/dev/mapper")
                .into_iter()
                .flatten()
                .flatten()
            {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with("rbdkit-") && n.contains(&self.ns.name) {
                    let _ = Command::new("cryptsetup").args(["close", &n]).status();
                }
            }
        }
    }

    /// krbd stages an encrypted volume through dm-crypt: the filesystem is
    /// on the mapping, the data survives a restage, grows online, and the
    /// image holds no plaintext; unstaging leaves no mapping or device.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_stages_an_encrypted_volume_through_dm_crypt() {
        let w = World::new("kvm-enc").await;
        let (id, ctx) = w.create("pvc-enc", 64 << 20).await;
        let staging = w.dir.path().join("staging");
        std::fs::create_dir_all(&staging).unwrap();
        w.stage(&id, &staging, &ctx, "krbd").await;
        let src = w.mount_source(&staging);
        assert!(
            src.starts_with("/dev/mapper/rbdkit-") || src.starts_with("/dev/dm-"),
            "mounted from {src:?}"
        );
        let marker = b"KRBD-DM-CRYPT-PLAINTEXT-MARKER".repeat(100);
        std::fs::write(staging.join(VOLUME).join("f"), &marker).unwrap();
        std::fs::File::open(staging.join(VOLUME).join("f"))
            .unwrap()
            .sync_all()
            .unwrap();
        // Online growth through cryptsetup resize.
        let before = rbdkit::node::fs::stats(&staging.join(VOLUME))
            .unwrap()
            .total_bytes;
        w.ctl
            .controller()
            .await
            .controller_expand_volume(ControllerExpandVolumeRequest {
                volume_id: id.clone(),
                capacity_range: Some(CapacityRange {
                    required_bytes: 128 << 20,
                    limit_bytes: 0,
                }),
                secrets: w.ctl.secrets(),
                ..Default::default()
            })
            .await
            .unwrap();
        NodeClient::new(channel(&w.socket).await)
            .node_expand_volume(NodeExpandVolumeRequest {
                volume_id: id.clone(),
                volume_path: staging.join(VOLUME).display().to_string(),
                staging_target_path: staging.display().to_string(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("NodeExpandVolume: {e}\n{}", w.node.log_tail(30)));
        let after = rbdkit::node::fs::stats(&staging.join(VOLUME))
            .unwrap()
            .total_bytes;
        assert!(
            after > before + (50 << 20),
            "ext4 {before} -> {after} bytes"
        );
        w.unstage(&id, &staging).await;
        assert_eq!(w.krbd_devices(), 0, "a krbd device is left");
        assert!(
            !std::fs::read_dir("/dev/mapper")
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("rbdkit-")),
            "a dm-crypt mapping is left"
        );
        let vol = VolumeId::parse(&id).unwrap();
        let img = Image::open_read_only(&w.ns.ioctx, &vol.image).unwrap();
        let mut all = vec![0u8; img.size().unwrap() as usize];
        img.read_exact(0, &mut all).unwrap();
        assert!(
            !all.windows(30).any(|x| x == &marker[..30]),
            "plaintext in the image"
        );
        drop(img);
        w.stage(&id, &staging, &ctx, "krbd").await;
        assert_eq!(
            std::fs::read(staging.join(VOLUME).join("f")).unwrap(),
            marker
        );
        w.unstage(&id, &staging).await;
        w.ctl
            .controller()
            .await
            .delete_volume(DeleteVolumeRequest {
                volume_id: id,
                secrets: w.ctl.secrets(),
            })
            .await
            .unwrap();
        let log = w.node.log_text();
        assert!(
            !log.contains(PASSPHRASE),
            "the passphrase is in the node plugin's log"
        );
    }

    /// One format for both mappers: what rbdkit-fuse wrote, krbd with
    /// dm-crypt reads, and the other way round.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn fuse_and_krbd_open_each_others_encrypted_volumes() {
        let w = World::new("kvm-encx").await;
        let (id, ctx) = w.create("pvc-x", 64 << 20).await;
        let staging = w.dir.path().join("staging-x");
        std::fs::create_dir_all(&staging).unwrap();
        let from_fuse = pattern(11, 1 << 20);
        let from_krbd = pattern(12, 1 << 20);
        w.stage(&id, &staging, &ctx, "rbdkit-fuse").await;
        assert!(w.mount_source(&staging).starts_with("/dev/loop"));
        std::fs::write(staging.join(VOLUME).join("fuse"), &from_fuse).unwrap();
        w.unstage(&id, &staging).await;
        w.stage(&id, &staging, &ctx, "krbd").await;
        assert_eq!(
            std::fs::read(staging.join(VOLUME).join("fuse")).unwrap(),
            from_fuse
        );
        std::fs::write(staging.join(VOLUME).join("krbd"), &from_krbd).unwrap();
        w.unstage(&id, &staging).await;
        w.stage(&id, &staging, &ctx, "rbdkit-fuse").await;
        assert_eq!(
            std::fs::read(staging.join(VOLUME).join("krbd")).unwrap(),
            from_krbd
        );
        w.unstage(&id, &staging).await;
    }
}

/// The CSI calls of an encrypted class with the `default` KMS, on the host
/// (rbdkit-fuse): what a missing or wrong passphrase and an unknown KMS do,
/// each named, nothing made or mapped, no passphrase in the server's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_refuses_missing_and_wrong_keys_by_name() {
    use rbdkit::csi::proto::{CapacityRange, CreateVolumeRequest, NodeStageVolumeRequest};
    use support::csi::{mount_cap, CsiEnv, Mode};

    const SHARED: &str = "the-shared-passphrase-of-the-class";
    let env = CsiEnv::new("enccsi-f", Mode::All).await;
    let create = |secrets: std::collections::HashMap<String, String>, kms: Option<&str>| {
        let mut params = env.params();
        params.insert("encrypted".into(), "true".into());
        if let Some(k) = kms {
            params.insert("encryptionKMSID".into(), k.into());
        }
        CreateVolumeRequest {
            name: "pvc-f".into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_cap("ext4")],
            parameters: params,
            secrets,
            ..Default::default()
        }
    };
    let with = |mut s: std::collections::HashMap<String, String>, p: &str| {
        s.insert("encryptionPassphrase".into(), p.into());
        s
    };
    // No encryptionPassphrase in the provisioner Secret.
    let e = env
        .controller()
        .await
        .create_volume(create(env.secrets(), None))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("encryptionPassphrase"), "{e}");
    // A KMS id that is not configured.
    let e = env
        .controller()
        .await
        .create_volume(create(with(env.secrets(), SHARED), Some("nowhere")))
        .await
        .unwrap_err();
    assert!(e.message().contains("\"nowhere\""), "{e}");
    assert!(
        rbd::list_names(&env.rbd.ioctx).unwrap().is_empty(),
        "a refused create made an image"
    );

    let v = env
        .controller()
        .await
        .create_volume(create(with(env.secrets(), SHARED), None))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let staging = env.path("staging");
    std::fs::create_dir_all(&staging).unwrap();
    let stage = |secrets| NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(mount_cap("ext4")),
        secrets,
        volume_context: v.volume_context.clone(),
        ..Default::default()
    };
    // No passphrase at the node, then a wrong one: refused, nothing mapped.
    let e = env
        .node()
        .await
        .node_stage_volume(stage(env.node_secrets()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    let e = env
        .node()
        .await
        .node_stage_volume(stage(with(env.node_secrets(), "not-the-passphrase")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    assert!(e.message().contains("wrong key"), "{e}");
    let mapper = rbdkit::node::fuse::FuseMapper::new(env.dir.path().join("mapper.sock"));
    assert!(
        mapper.list().unwrap().is_empty(),
        "a refused stage left a mapping"
    );
    // The right one stages; the filesystem is inside the LUKS2 segment.
    env.node()
        .await
        .node_stage_volume(stage(with(env.node_secrets(), SHARED)))
        .await
        .unwrap();
    let st = rbdkit::node::fs::stats(&staging.join(rbdkit::csi::node::VOLUME)).unwrap();
    assert!(st.total_bytes < 48 << 20, "{} bytes", st.total_bytes);
    env.node()
        .await
        .node_unstage_volume(rbdkit::csi::proto::NodeUnstageVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .unwrap();
    let log = env.csi.log_text();
    assert!(
        !log.contains(SHARED) && !log.contains("not-the-passphrase"),
        "a passphrase in the CSI log"
    );
}

/// `rbdkit image encryption rotate` and `status` through the binary: a new
/// keyslot, the KMS record updated, one keyslot left; the passphrase never
/// on the command line (a file), never printed.
#[test]
fn the_cli_rotates_and_reports() {
    let ns = TestNs::new("enccli");
    let c = cluster();
    let v = vol(&ns, "pvc-cli");
    ensure_image_encrypted(
        &c,
        &NoMetrics,
        &NoFence,
        &v,
        32 * MIB,
        &ImageOptions::new(),
        &owner("pvc-cli"),
        Some(&metadata_kms()),
    )
    .unwrap();
    let dir = tempdir("enccli");
    let pass = dir.path().join("kek");
    std::fs::write(&pass, KEK).unwrap();
    let kms = dir.path().join("kms.json");
    std::fs::write(&kms, r#"{"meta": {"encryptionKMSType": "metadata"}}"#).unwrap();
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_rbdkit"))
            .arg("image")
            .arg("-c")
            .arg(support::ceph::TestCluster::get().conf())
            .arg("--json")
            .arg("encryption")
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(!text.contains(KEK), "the KMS passphrase printed");
        (out.status.success(), text)
    };
    let handle = v.handle();
    let (p, k) = (pass.to_str().unwrap(), kms.to_str().unwrap());
    let (ok, before) = cli(&["status", &handle, "--passphrase-file", p, "--kms-config", k]);
    assert!(ok, "{before}");
    let before: serde_json::Value = serde_json::from_str(before.trim()).unwrap();
    assert_eq!(before["keyslots"], serde_json::json!([0]));
    assert_eq!(before["opens_keyslot"], serde_json::json!(0));
    // Each rotation moves the passphrase to a new keyslot and frees the
    // old one (so two rotations come back to slot 0).
    let mut prev = before;
    for _ in 0..2 {
        let (ok, out) = cli(&["rotate", &handle, "--passphrase-file", p, "--kms-config", k]);
        assert!(ok, "{out}");
        let (ok, after) = cli(&["status", &handle, "--passphrase-file", p, "--kms-config", k]);
        assert!(ok, "{after}");
        let after: serde_json::Value = serde_json::from_str(after.trim()).unwrap();
        assert_eq!(after["keyslots"].as_array().unwrap().len(), 1, "{after}");
        assert_eq!(after["opens_keyslot"], after["keyslots"][0]);
        assert_ne!(after["keyslots"], prev["keyslots"]);
        prev = after;
    }
    // A wrong KMS passphrase: the status says no keyslot opens, and fails.
    std::fs::write(&pass, "wrong").unwrap();
    let (ok, out) = cli(&["status", &handle, "--passphrase-file", p, "--kms-config", k]);
    assert!(!ok && out.contains("does not decrypt"), "{out}");
}

/// A `vaulttokens` class through the CSI calls (controller and node in one
/// `rbdkit csi`, rbdkit-fuse) against the real Vault and API server: the
/// passphrase is in Vault under the volume id after create (a retried
/// create reuses it, `rbdkit image encryption rotate` replaces it), the node
/// fetches it for the claim's namespace (a
/// restage, an online expand), a snapshot, a restore and a clone get their
/// own copies, and each delete removes its key; a delete retried after the
/// image went (a crash in between) still removes the key. No passphrase in
/// the server's log, none in the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_keeps_vault_keys_from_create_to_delete() {
    use rbdkit::csi::node::VOLUME;
    use rbdkit::csi::proto::{
        volume_content_source, CapacityRange, ControllerExpandVolumeRequest, CreateSnapshotRequest,
        CreateVolumeRequest, DeleteSnapshotRequest, DeleteVolumeRequest, NodeExpandVolumeRequest,
        NodeStageVolumeRequest, NodeUnstageVolumeRequest, VolumeContentSource,
    };
    use std::collections::HashMap;
    use std::sync::Arc;
    use support::ceph::unique;
    use support::csi::{mount_cap, CsiEnv, Mode};
    use support::k8s::ControlPlane;
    use support::kms::{vaulttokens_kms, VaultServer};

    const KMS: &str = "vault-tokens-test";
    let vault = VaultServer::shared().await;
    let cp = tokio::task::spawn_blocking(ControlPlane::shared)
        .await
        .unwrap();
    let client = cp.client().await;
    let tenant = unique("encv");
    support::kms::create_ok(
        &kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone()),
        serde_json::json!({"metadata": {"name": tenant}}),
    )
    .await;
    let (section, mount) = vaulttokens_kms(vault, &client, &tenant).await;
    let dir = tempdir("enccsi-v");
    let kms_config = dir.path().join("kms.json");
    std::fs::write(&kms_config, serde_json::json!({ KMS: section }).to_string()).unwrap();
    let rbd = Arc::new(TestNs::new("enccsi-v"));
    let env = CsiEnv::with_ns(
        Arc::clone(&rbd),
        unique("enccsi-v"),
        Mode::All,
        "node-a",
        &[
            "--kms-config",
            kms_config.to_str().unwrap(),
            "--kubeconfig",
            cp.kubeconfig_path().to_str().unwrap(),
        ],
    )
    .await;
    let mut params = env.params();
    params.extend([
        ("encrypted".to_owned(), "true".to_owned()),
        ("encryptionKMSID".to_owned(), KMS.to_owned()),
        (
            "csi.storage.k8s.io/pvc/namespace".to_owned(),
            tenant.clone(),
        ),
        ("csi.storage.k8s.io/pvc/name".to_owned(), "data".to_owned()),
    ]);
    let create = |name: &str, source: Option<VolumeContentSource>| CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            // A restore is as large as its source after the expand.
            required_bytes: if source.is_some() {
                448 << 20
            } else {
                320 << 20
            },
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap("xfs")],
        parameters: params.clone(),
        secrets: env.secrets(),
        volume_content_source: source,
        ..Default::default()
    };
    let v = env
        .controller()
        .await
        .create_volume(create("pvc-v", None))
        .await
        .unwrap_or_else(|e| panic!("CreateVolume: {e}\n{}", env.csi.log_tail(30)))
        .into_inner()
        .volume
        .unwrap();
    let id = v.volume_id.clone();
    let pass = vault
        .kv2_passphrase(&mount, &id)
        .await
        .expect("the key is in Vault under the volume id");
    support::artifacts::note_secret(&pass);
    let vol = VolumeId::parse(&id).unwrap();
    let meta = Image::open_read_only(&rbd.ioctx, &vol.image)
        .unwrap()
        .metadata_list()
        .unwrap();
    assert_eq!(meta.get(META_STATE).map(String::as_str), Some("encrypted"));
    assert_eq!(meta.get(META_KMS_ID).map(String::as_str), Some(KMS));
    assert!(
        !meta.contains_key(META_DEK),
        "a Vault volume has no DEK record"
    );
    // The header opens with the key Vault holds.
    let img = Image::open_read_only(&rbd.ioctx, &vol.image).unwrap();
    Header::read(&img)
        .unwrap()
        .unlock(&img, pass.as_bytes())
        .expect("Vault's passphrase opens the header");
    drop(img);
    // A retried create finds the stored key: never a second one.
    env.controller()
        .await
        .create_volume(create("pvc-v", None))
        .await
        .unwrap();
    assert_eq!(vault.kv2_passphrase(&mount, &id).await, Some(pass.clone()));
    // The CLI rotates it: a new keyslot, the new passphrase in Vault, the
    // old one opening nothing.
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_rbdkit"))
            .arg("image")
            .arg("-c")
            .arg(support::ceph::TestCluster::get().conf())
            .arg("--json")
            .arg("encryption")
            .args(args)
            .args([
                id.as_str(),
                "--kms-config",
                kms_config.to_str().unwrap(),
                "--kubeconfig",
                cp.kubeconfig_path().to_str().unwrap(),
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {text}");
        serde_json::from_str::<serde_json::Value>(text.trim()).unwrap()
    };
    cli(&["rotate"]);
    let old = pass;
    let pass = vault.kv2_passphrase(&mount, &id).await.unwrap();
    support::artifacts::note_secret(&pass);
    assert_ne!(pass, old, "rotate stored a new passphrase");
    let st = cli(&["status"]);
    assert_eq!(st["keyslots"].as_array().unwrap().len(), 1, "{st}");
    assert_eq!(st["opens_keyslot"], st["keyslots"][0], "{st}");
    let img = Image::open_read_only(&rbd.ioctx, &vol.image).unwrap();
    let h = Header::read(&img).unwrap();
    assert!(
        h.unlock(&img, old.as_bytes()).is_err(),
        "the old passphrase opens"
    );
    drop(img);

    let staging = env.path("staging");
    std::fs::create_dir_all(&staging).unwrap();
    let stage = |id: &str, ctx: &HashMap<String, String>| NodeStageVolumeRequest {
        volume_id: id.to_owned(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(mount_cap("xfs")),
        // The node-stage Secret holds no passphrase: Vault does.
        secrets: env.node_secrets(),
        volume_context: ctx.clone(),
        ..Default::default()
    };
    let unstage = |id: &str| NodeUnstageVolumeRequest {
        volume_id: id.to_owned(),
        staging_target_path: staging.display().to_string(),
    };
    env.node()
        .await
        .node_stage_volume(stage(&id, &v.volume_context))
        .await
        .unwrap_or_else(|e| panic!("NodeStageVolume: {e}\n{}", env.csi.log_tail(30)));
    let marker = b"VAULT-ENCRYPTED-PLAINTEXT-MARKER".repeat(64);
    let file = staging.join(VOLUME).join("f");
    std::fs::write(&file, &marker).unwrap();
    std::fs::File::open(&file).unwrap().sync_all().unwrap();
    let before = rbdkit::node::fs::stats(&staging.join(VOLUME))
        .unwrap()
        .total_bytes;
    env.node()
        .await
        .node_unstage_volume(unstage(&id))
        .await
        .unwrap();
    // A restage reads it back.
    env.node()
        .await
        .node_stage_volume(stage(&id, &v.volume_context))
        .await
        .unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), marker);
    // Online growth (xfs: ext4's online resize needs CAP_SYS_RESOURCE,
    // which the test's CSI server lacks).
    env.controller()
        .await
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 448 << 20,
                limit_bytes: 0,
            }),
            secrets: env.secrets(),
            ..Default::default()
        })
        .await
        .unwrap();
    env.node()
        .await
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: staging.join(VOLUME).display().to_string(),
            staging_target_path: staging.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("NodeExpandVolume: {e}\n{}", env.csi.log_tail(30)));
    let after = rbdkit::node::fs::stats(&staging.join(VOLUME))
        .unwrap()
        .total_bytes;
    assert!(
        after > before + (100 << 20),
        "xfs {before} -> {after} bytes"
    );
    env.node()
        .await
        .node_unstage_volume(unstage(&id))
        .await
        .unwrap();
    assert!(
        !image_bytes_hold(&rbd.ioctx, &vol.image, &marker[..32]),
        "plaintext in the image"
    );

    // A snapshot gets its own copy of the key; a restore too.
    let snap = env
        .controller()
        .await
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: "snap-v".into(),
            secrets: env.secrets(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("CreateSnapshot: {e}\n{}", env.csi.log_tail(30)))
        .into_inner()
        .snapshot
        .unwrap();
    let snap_id = snap.snapshot_id.clone();
    assert_eq!(
        vault.kv2_passphrase(&mount, &snap_id).await,
        Some(pass.clone()),
        "the snapshot's key"
    );
    let r = env
        .controller()
        .await
        .create_volume(create(
            "pvc-r",
            Some(VolumeContentSource {
                r#type: Some(volume_content_source::Type::Snapshot(
                    volume_content_source::SnapshotSource {
                        snapshot_id: snap_id.clone(),
                    },
                )),
            }),
        ))
        .await
        .unwrap_or_else(|e| panic!("CreateVolume from a snapshot: {e}"))
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(
        vault.kv2_passphrase(&mount, &r.volume_id).await,
        Some(pass.clone()),
        "the restore's key"
    );
    // A clone of the volume: its own copy too, gone with it.
    let k = env
        .controller()
        .await
        .create_volume(create(
            "pvc-k",
            Some(VolumeContentSource {
                r#type: Some(volume_content_source::Type::Volume(
                    volume_content_source::VolumeSource {
                        volume_id: id.clone(),
                    },
                )),
            }),
        ))
        .await
        .unwrap_or_else(|e| panic!("CreateVolume from a volume: {e}"))
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(
        vault.kv2_passphrase(&mount, &k.volume_id).await,
        Some(pass.clone()),
        "the clone's key"
    );
    env.controller()
        .await
        .delete_volume(DeleteVolumeRequest {
            volume_id: k.volume_id.clone(),
            secrets: env.secrets(),
        })
        .await
        .unwrap();
    assert_eq!(vault.kv2_passphrase(&mount, &k.volume_id).await, None);
    // The source goes first: the snapshot and the restore keep their keys.
    env.controller()
        .await
        .delete_volume(DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: env.secrets(),
        })
        .await
        .unwrap_or_else(|e| panic!("DeleteVolume: {e}\n{}", env.csi.log_tail(30)));
    assert_eq!(
        vault.kv2_passphrase(&mount, &id).await,
        None,
        "the key stays"
    );
    env.node()
        .await
        .node_stage_volume(stage(&r.volume_id, &r.volume_context))
        .await
        .unwrap_or_else(|e| panic!("NodeStageVolume (restore): {e}\n{}", env.csi.log_tail(30)));
    assert_eq!(std::fs::read(&file).unwrap(), marker, "the restore reads");
    env.node()
        .await
        .node_unstage_volume(unstage(&r.volume_id))
        .await
        .unwrap();
    env.controller()
        .await
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: snap_id.clone(),
            secrets: env.secrets(),
        })
        .await
        .unwrap();
    assert_eq!(vault.kv2_passphrase(&mount, &snap_id).await, None);

    env.controller()
        .await
        .delete_volume(DeleteVolumeRequest {
            volume_id: r.volume_id.clone(),
            secrets: env.secrets(),
        })
        .await
        .unwrap();
    assert_eq!(vault.kv2_passphrase(&mount, &r.volume_id).await, None);

    // A delete cut short after the image went (the key noted, the image
    // removed): the retry finds the note and removes the key.
    let c = env
        .controller()
        .await
        .create_volume(create("pvc-c", None))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let cvol = VolumeId::parse(&c.volume_id).unwrap();
    encryption::note_key_before_remove(
        &cluster(),
        &cvol,
        &c.volume_id,
        false,
        "rbd.rbdkit.io",
        &|k| Ok(k == KMS),
    )
    .unwrap();
    assert_eq!(
        encryption::keys_to_remove(&cluster(), &cvol, None)
            .unwrap()
            .len(),
        1
    );
    rbd::remove(&rbd.ioctx, &cvol.image).unwrap();
    assert!(vault.kv2_passphrase(&mount, &c.volume_id).await.is_some());
    // What `rbdkit gc` reports.
    let left =
        rbdkit::volume::gc::kms_leftovers(&cluster(), &cvol.cluster_id, POOL, &rbd.name).unwrap();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].handle, c.volume_id);
    assert_eq!(left[0].key.key, c.volume_id);
    assert_eq!(left[0].key.tenant.as_deref(), Some(tenant.as_str()));
    env.controller()
        .await
        .delete_volume(DeleteVolumeRequest {
            volume_id: c.volume_id.clone(),
            secrets: env.secrets(),
        })
        .await
        .unwrap();
    assert_eq!(vault.kv2_passphrase(&mount, &c.volume_id).await, None);
    assert!(encryption::keys_to_remove(&cluster(), &cvol, None)
        .unwrap()
        .is_empty());
    assert_eq!(vault.kv2_keys(&mount).await, Vec::<String>::new());
    assert!(rbd::list_names(&rbd.ioctx).unwrap().is_empty());
    let log = env.csi.log_text();
    assert!(
        !log.contains(&pass) && !log.contains(&old),
        "a passphrase in the CSI log"
    );
}

/// Whether `needle` occurs anywhere in image `name`'s bytes.
fn image_bytes_hold(io: &rbdkit::rados::IoCtx, name: &str, needle: &[u8]) -> bool {
    let img = Image::open_read_only(io, name).unwrap();
    let size = img.size().unwrap();
    let mut buf = vec![0u8; 4 << 20];
    let mut at = 0;
    while at < size {
        let n = (size - at).min(buf.len() as u64) as usize;
        img.read_exact(at, &mut buf[..n]).unwrap();
        if buf[..n].windows(needle.len()).any(|w| w == needle) {
            return true;
        }
        at += n as u64;
    }
    false
}
