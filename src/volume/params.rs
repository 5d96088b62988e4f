//! StorageClass parameters: parsing and validation.
//!
//! Everything is checked before anything is created, and every error names
//! the parameter and says why, because it ends up in a ProvisioningFailed
//! event on the claim. Unknown parameters are errors too: a typo such as
//! `imagefeatures` must not silently give an image without the features.

use std::collections::BTreeMap;
use std::fmt;

use crate::rbd::Features;
use crate::volume::quantity::{parse_bytes, MIB};

/// `clusterID`: the entry of the clusters config to use.
pub const CLUSTER_ID: &str = "clusterID";
/// `pool`: the pool for the image.
pub const POOL: &str = "pool";
/// `dataPool`: a separate pool for the image's data objects.
pub const DATA_POOL: &str = "dataPool";
/// `imageFeatures`: a comma-separated feature list.
pub const IMAGE_FEATURES: &str = "imageFeatures";
/// `objectSize`: the object size, a power of two.
pub const OBJECT_SIZE: &str = "objectSize";
/// `stripeUnit`: bytes per stripe unit (with `stripeCount`).
pub const STRIPE_UNIT: &str = "stripeUnit";
/// `stripeCount`: objects per stripe (with `stripeUnit`).
pub const STRIPE_COUNT: &str = "stripeCount";
/// `volumeNamePrefix`: put before the PV name to make the image name.
pub const VOLUME_NAME_PREFIX: &str = "volumeNamePrefix";
/// The filesystem type for Filesystem volumes.
pub const FSTYPE: &str = "csi.storage.k8s.io/fstype";
/// Provisioner secret name (credentials to create and delete images).
pub const PROVISIONER_SECRET_NAME: &str = "csi.storage.k8s.io/provisioner-secret-name";
/// Provisioner secret namespace.
pub const PROVISIONER_SECRET_NAMESPACE: &str = "csi.storage.k8s.io/provisioner-secret-namespace";
/// Controller-expand secret name (credentials to resize images).
pub const EXPAND_SECRET_NAME: &str = "csi.storage.k8s.io/controller-expand-secret-name";
/// Controller-expand secret namespace.
pub const EXPAND_SECRET_NAMESPACE: &str = "csi.storage.k8s.io/controller-expand-secret-namespace";
/// Node-stage secret name (credentials for the node to map images).
pub const NODE_STAGE_SECRET_NAME: &str = "csi.storage.k8s.io/node-stage-secret-name";
/// Node-stage secret namespace.
pub const NODE_STAGE_SECRET_NAMESPACE: &str = "csi.storage.k8s.io/node-stage-secret-namespace";

/// `mounter`: how the node maps the image (`rbd`/`krbd`, `rbdkit-fuse`).
pub const MOUNTER: &str = "mounter";
/// `mapOptions`: map options, in ceph-csi's `krbd:a,b;rbdkit-fuse:c` form.
pub const MAP_OPTIONS: &str = "mapOptions";
/// `unmapOptions`: unmap options, in the same form.
pub const UNMAP_OPTIONS: &str = "unmapOptions";
/// `mkfsOptions`: options for mkfs, split on white space.
pub const MKFS_OPTIONS: &str = "mkfsOptions";
/// `tryOtherMounters`: fall back to another mapper when the chosen one fails.
pub const TRY_OTHER_MOUNTERS: &str = "tryOtherMounters";
/// `journalPool`: the pool for the journal of `journaling` images.
pub const JOURNAL_POOL: &str = "journalPool";
/// Metadata external-provisioner adds with `--extra-create-metadata`.
pub const PV_NAME_META: &str = "csi.storage.k8s.io/pv/name";
/// The claim's name, from `--extra-create-metadata`.
pub const PVC_NAME_META: &str = "csi.storage.k8s.io/pvc/name";
/// The claim's namespace, from `--extra-create-metadata`.
pub const PVC_NAMESPACE_META: &str = "csi.storage.k8s.io/pvc/namespace";

/// `encrypted`: LUKS2 encryption of the volume (Go's boolean spellings).
pub const ENCRYPTED: &str = "encrypted";
/// `encryptionKMSID`: the KMS config entry of the passphrases (`default`:
/// the Secrets' `encryptionPassphrase`).
pub const ENCRYPTION_KMS_ID: &str = "encryptionKMSID";
/// `encryptionType`: `block` (LUKS2) or `file` (fscrypt, refused).
pub const ENCRYPTION_TYPE: &str = "encryptionType";
/// `encryptionCipher`: the LUKS2 cipher (only `aes-xts-plain64`).
pub const ENCRYPTION_CIPHER: &str = "encryptionCipher";
/// `encryptionKeySize`: the volume key's size in bits (256 or 512).
pub const ENCRYPTION_KEY_SIZE: &str = "encryptionKeySize";
/// `encryptionSectorSize`: the LUKS2 data sector size (512 to 4096).
pub const ENCRYPTION_SECTOR_SIZE: &str = "encryptionSectorSize";
/// `integrityMode`: dm-integrity on the encrypted device (refused).
pub const INTEGRITY_MODE: &str = "integrityMode";

/// Clone depth past which a new clone is flattened in the background (named
/// after ceph-csi's `--rbdsoftmaxclonedepth` flag).
pub const SOFT_MAX_CLONE_DEPTH: &str = "rbdSoftMaxCloneDepth";
/// Clone depth past which a new clone is flattened before it is returned
/// (ceph-csi's `--rbdhardmaxclonedepth`).
pub const HARD_MAX_CLONE_DEPTH: &str = "rbdHardMaxCloneDepth";
/// ceph-csi's default soft clone depth limit.
pub const DEFAULT_SOFT_MAX_CLONE_DEPTH: u32 = 4;
/// ceph-csi's default hard clone depth limit.
pub const DEFAULT_HARD_MAX_CLONE_DEPTH: u32 = 8;
/// The largest hard limit accepted: deeper chains make every read walk
/// that many parents.
pub const MAX_CLONE_DEPTH: u32 = 16;

/// ceph-csi parameters that only tune rbd-nbd's logging: accepted (so a
/// ceph-csi StorageClass works unchanged) and without effect on the volume.
const NO_EFFECT: &[&str] = &["cephLogDir", "cephLogStrategy"];

/// ceph-csi parameters rbdkit cannot honour yet, each with the value that
/// means "off" (accepted) or `None` when any value is refused.
const NOT_YET: &[(&str, Option<&str>)] = &[("thickProvision", Some("false"))];

/// Values of `mounter` and the mapper each selects.
const MOUNTERS: &[(&str, &str)] = &[
    ("rbd", "krbd"),
    ("krbd", "krbd"),
    ("rbdkit-fuse", "rbdkit-fuse"),
    ("fuse", "rbdkit-fuse"),
];

/// The features an image gets when the class names none: ceph-csi's default.
pub const DEFAULT_FEATURES: Features = Features::LAYERING;
/// The filesystem when the class names none.
pub const DEFAULT_FSTYPE: &str = "ext4";
/// The object size librbd uses when none is given (order 22).
pub const DEFAULT_OBJECT_SIZE: u64 = 4 * MIB;

/// Features a class may ask for. The others are set by librbd itself
/// (`striping`, `data-pool`) or are internal states, not choices.
const SELECTABLE_FEATURES: Features = Features::from_bits(
    Features::LAYERING.bits()
        | Features::EXCLUSIVE_LOCK.bits()
        | Features::OBJECT_MAP.bits()
        | Features::FAST_DIFF.bits()
        | Features::DEEP_FLATTEN.bits()
        | Features::JOURNALING.bits(),
);

/// Filesystems the node side makes, stages and grows (`node::fs`).
/// btrfs is not one: the node has no btrfs-progs and refuses it at
/// NodeStage, so a class asking for it is refused here, before any PV is
/// made that no pod could mount.
const FSTYPES: &[&str] = &["ext4", "ext3", "xfs"];

/// A refused parameter: which one and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamError {
    /// The parameter's key.
    pub param: String,
    /// What is wrong with it.
    pub why: String,
}

impl ParamError {
    fn new(param: &str, why: impl Into<String>) -> ParamError {
        ParamError {
            param: param.to_owned(),
            why: why.into(),
        }
    }
}

impl fmt::Display for ParamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StorageClass parameter {:?}: {}", self.param, self.why)
    }
}

impl std::error::Error for ParamError {}

/// A reference to a Secret whose name and namespace may hold templates such
/// as `${pvc.namespace}`, resolved per claim by [`SecretTemplate::resolve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretTemplate {
    /// The name, possibly templated.
    pub name: String,
    /// The namespace, possibly templated.
    pub namespace: String,
    /// Whether `${pvc.annotations['...']}` is allowed in the name (not for
    /// the provisioner secret: a claim's author must not pick the
    /// credentials the provisioner itself uses).
    allow_annotations: bool,
    /// The parameter key of the name, for errors.
    name_param: &'static str,
    /// The parameter key of the namespace, for errors.
    namespace_param: &'static str,
}

/// A resolved Secret reference.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SecretRef {
    /// The Secret's namespace.
    pub namespace: String,
    /// The Secret's name.
    pub name: String,
}

impl fmt::Display for SecretRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What templates can refer to.
#[derive(Debug, Clone, Copy)]
pub struct TemplateContext<'a> {
    /// The PV name (`pvc-<uid>`).
    pub pv_name: &'a str,
    /// The claim's namespace.
    pub pvc_namespace: &'a str,
    /// The claim's name.
    pub pvc_name: &'a str,
    /// The claim's annotations.
    pub pvc_annotations: &'a BTreeMap<String, String>,
}

impl SecretTemplate {
    /// Substitutes the templates and checks that the results are valid
    /// names.
    pub fn resolve(&self, ctx: &TemplateContext<'_>) -> Result<SecretRef, ParamError> {
        let namespace = expand(&self.namespace, Some(ctx), false, false)
            .map_err(|why| ParamError::new(self.namespace_param, why))?;
        let name = expand(&self.name, Some(ctx), true, self.allow_annotations)
            .map_err(|why| ParamError::new(self.name_param, why))?;
        check_dns_label(&namespace).map_err(|why| {
            ParamError::new(
                self.namespace_param,
                format!("resolves to {namespace:?}, {why}"),
            )
        })?;
        check_dns_subdomain(&name).map_err(|why| {
            ParamError::new(self.name_param, format!("resolves to {name:?}, {why}"))
        })?;
        Ok(SecretRef { namespace, name })
    }

    fn parse(
        params: &BTreeMap<String, String>,
        name_param: &'static str,
        namespace_param: &'static str,
        allow_annotations: bool,
    ) -> Result<Option<SecretTemplate>, ParamError> {
        let name = params.get(name_param);
        let namespace = params.get(namespace_param);
        let (name, namespace) = match (name, namespace) {
            (None, None) => return Ok(None),
            (Some(_), None) => {
                return Err(ParamError::new(
                    namespace_param,
                    format!("missing; it must be set together with {name_param}"),
                ))
            }
            (None, Some(_)) => {
                return Err(ParamError::new(
                    name_param,
                    format!("missing; it must be set together with {namespace_param}"),
                ))
            }
            (Some(n), Some(ns)) => (n, ns),
        };
        let t = SecretTemplate {
            name: name.clone(),
            namespace: namespace.clone(),
            allow_annotations,
            name_param,
            namespace_param,
        };
        // Check the templates now, so that a bad one is reported whatever
        // the claim.
        expand(&t.namespace, None, false, false)
            .map_err(|why| ParamError::new(namespace_param, why))?;
        expand(&t.name, None, true, allow_annotations)
            .map_err(|why| ParamError::new(name_param, why))?;
        Ok(Some(t))
    }
}

/// Expands `${pv.name}`, `${pvc.namespace}`, `${pvc.name}` (names only) and
/// `${pvc.annotations['KEY']}` (names only, when allowed).
///
/// Without a context, only checks the syntax (and substitutes `x`).
fn expand(
    text: &str,
    ctx: Option<&TemplateContext<'_>>,
    name: bool,
    annotations: bool,
) -> Result<String, String> {
    let x = "x";
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("unterminated template in {text:?}"))?;
        let var = &after[..end];
        let value = match var {
            "pv.name" => ctx.map_or(x, |c| c.pv_name).to_owned(),
            "pvc.namespace" => ctx.map_or(x, |c| c.pvc_namespace).to_owned(),
            "pvc.name" if name => ctx.map_or(x, |c| c.pvc_name).to_owned(),
            v if v.starts_with("pvc.annotations['") && v.ends_with("']") => {
                if !(name && annotations) {
                    return Err(format!("template ${{{v}}} is not allowed here"));
                }
                let key = &v["pvc.annotations['".len()..v.len() - 2];
                match ctx {
                    None => x.to_owned(),
                    Some(c) => c.pvc_annotations.get(key).cloned().ok_or_else(|| {
                        format!("the claim has no annotation {key:?} for ${{{v}}}")
                    })?,
                }
            }
            other if name => {
                return Err(format!(
                    "unknown template ${{{other}}}; use ${{pv.name}}, ${{pvc.namespace}} or ${{pvc.name}}"
                ))
            }
            other => {
                return Err(format!(
                    "unknown template ${{{other}}}; a namespace may use ${{pv.name}} or ${{pvc.namespace}}"
                ))
            }
        };
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn check_dns_label(s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err("which is not a valid namespace name".into())
    }
}

fn check_dns_subdomain(s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err("which is not a valid Secret name".into())
    }
}

/// A StorageClass's parameters, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassParams {
    /// The clusters-config entry.
    pub cluster_id: String,
    /// The pool.
    pub pool: String,
    /// The data pool, if any.
    pub data_pool: Option<String>,
    /// The image features.
    pub features: Features,
    /// The object size in bytes, if not the default.
    pub object_size: Option<u64>,
    /// Stripe unit and count, if given.
    pub striping: Option<(u64, u64)>,
    /// The filesystem of Filesystem volumes.
    pub fs_type: String,
    /// Put before the PV name to make the image name (empty by default).
    pub volume_name_prefix: String,
    /// The journal pool, if any.
    pub journal_pool: Option<String>,
    /// What the node needs: mapper, map options, mkfs options.
    pub node: NodeParams,
    /// Credentials to create and delete images (always set for a
    /// StorageClass; a CSI request brings its secrets itself).
    pub provisioner_secret: Option<SecretTemplate>,
    /// Credentials to expand images (the provisioner secret if not given).
    pub expand_secret: Option<SecretTemplate>,
    /// Credentials for the node (not used here, put on the PV).
    pub node_stage_secret: Option<SecretTemplate>,
    /// How deep clone chains may grow (restores and volume clones).
    pub clone_depth: CloneDepth,
    /// `topologyConstrainedPools`: pools per failure domain (empty: none).
    pub topology_pools: Vec<crate::volume::topology::ConstrainedPool>,
    /// I/O limits for new volumes (ceph-csi's `BaseReadIops`, ...; a
    /// VolumeAttributesClass, through CSI `mutable_parameters`, overrides
    /// them).
    pub qos: crate::volume::qos::Policy,
    /// LUKS2 encryption, when the class asks for it.
    pub encryption: Option<crate::volume::encryption::EncryptionParams>,
}

/// Bounds on the depth of a clone chain (how many parents an image has).
/// Past `soft`, a new clone is flattened in the background; past `hard`,
/// before it is handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CloneDepth {
    /// Flatten in the background past this depth.
    pub soft: u32,
    /// Flatten before use past this depth.
    pub hard: u32,
}

impl Default for CloneDepth {
    fn default() -> Self {
        CloneDepth {
            soft: DEFAULT_SOFT_MAX_CLONE_DEPTH,
            hard: DEFAULT_HARD_MAX_CLONE_DEPTH,
        }
    }
}

impl CloneDepth {
    /// Reads [`SOFT_MAX_CLONE_DEPTH`] and [`HARD_MAX_CLONE_DEPTH`] (each
    /// optional): whole numbers, `1 <= soft <= hard <= MAX_CLONE_DEPTH`.
    pub fn parse(params: &BTreeMap<String, String>) -> Result<CloneDepth, ParamError> {
        let get = |key: &str, default: u32| -> Result<u32, ParamError> {
            match params.get(key) {
                None => Ok(default),
                Some(v) => {
                    let n: u32 = v.trim().parse().map_err(|_| {
                        ParamError::new(key, format!("{v:?} is not a whole number"))
                    })?;
                    if !(1..=MAX_CLONE_DEPTH).contains(&n) {
                        return Err(ParamError::new(
                            key,
                            format!("{n} is outside 1..={MAX_CLONE_DEPTH}"),
                        ));
                    }
                    Ok(n)
                }
            }
        };
        let hard = get(HARD_MAX_CLONE_DEPTH, DEFAULT_HARD_MAX_CLONE_DEPTH)?;
        let soft = get(SOFT_MAX_CLONE_DEPTH, DEFAULT_SOFT_MAX_CLONE_DEPTH.min(hard))?;
        if soft > hard {
            return Err(ParamError::new(
                SOFT_MAX_CLONE_DEPTH,
                format!("{soft} is more than {HARD_MAX_CLONE_DEPTH} ({hard})"),
            ));
        }
        Ok(CloneDepth { soft, hard })
    }
}

/// The parameters the node plugin acts on. They travel to it in the PV's
/// volume attributes (the CSI volume context).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeParams {
    /// The mapper the class chose (`krbd`, `rbdkit-fuse`), or `None` for the
    /// node's default.
    pub mounter: Option<String>,
    /// `mapOptions`, as given.
    pub map_options: Option<String>,
    /// `unmapOptions`, as given.
    pub unmap_options: Option<String>,
    /// `mkfsOptions`, as given.
    pub mkfs_options: Option<String>,
    /// `tryOtherMounters`.
    pub try_other_mounters: bool,
    /// The KMS id of an encrypted volume's passphrase (`encrypted` and
    /// `encryptionKMSID`), `None` for a plain volume.
    pub encryption_kms: Option<String>,
}

impl NodeParams {
    /// The volume-context entries that carry these to the node.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(m) = &self.mounter {
            out.push((MOUNTER, m.clone()));
        }
        if let Some(o) = &self.map_options {
            out.push((MAP_OPTIONS, o.clone()));
        }
        if let Some(o) = &self.unmap_options {
            out.push((UNMAP_OPTIONS, o.clone()));
        }
        if let Some(o) = &self.mkfs_options {
            out.push((MKFS_OPTIONS, o.clone()));
        }
        if self.try_other_mounters {
            out.push((TRY_OTHER_MOUNTERS, "true".to_owned()));
        }
        if let Some(kms) = &self.encryption_kms {
            out.push((ENCRYPTED, "true".to_owned()));
            out.push((ENCRYPTION_TYPE, "block".to_owned()));
            out.push((ENCRYPTION_KMS_ID, kms.clone()));
        }
        out
    }

    /// Reads them back from a volume context (on the node), checking them
    /// as [`ClassParams::parse`] does.
    pub fn from_context(ctx: &BTreeMap<String, String>) -> Result<NodeParams, ParamError> {
        parse_node_params(ctx)
    }
}

/// The mapper a `mounter` value selects, or why it is refused.
pub fn mapper_for(mounter: &str) -> Result<&'static str, ParamError> {
    let m = mounter.trim();
    if m == "rbd-nbd" || m == "nbd" {
        return Err(ParamError::new(
            MOUNTER,
            format!("{m:?} is not supported yet; use \"rbd\" (krbd) or \"rbdkit-fuse\""),
        ));
    }
    MOUNTERS
        .iter()
        .find(|(name, _)| *name == m)
        .map(|(_, mapper)| *mapper)
        .ok_or_else(|| {
            let names: Vec<&str> = MOUNTERS.iter().map(|(n, _)| *n).collect();
            ParamError::new(
                MOUNTER,
                format!(
                    "{m:?} is not a known mounter; use one of {}",
                    names.join(", ")
                ),
            )
        })
}

fn parse_bool(params: &BTreeMap<String, String>, key: &str) -> Result<bool, ParamError> {
    match params.get(key).map(|v| v.trim()) {
        None => Ok(false),
        Some("true") => Ok(true),
        Some("false") => Ok(false),
        Some(v) => Err(ParamError::new(
            key,
            format!("{v:?} is not \"true\" or \"false\""),
        )),
    }
}

fn parse_node_params(params: &BTreeMap<String, String>) -> Result<NodeParams, ParamError> {
    let mounter = match params.get(MOUNTER) {
        None => None,
        Some(m) => Some(mapper_for(m)?.to_owned()),
    };
    for key in [MAP_OPTIONS, UNMAP_OPTIONS] {
        if let Some(v) = params.get(key) {
            check_map_options(key, v)?;
        }
    }
    if let Some(v) = params.get(MKFS_OPTIONS) {
        if v.contains(['\0', '\n']) {
            return Err(ParamError::new(MKFS_OPTIONS, "holds a NUL or newline"));
        }
    }
    Ok(NodeParams {
        mounter,
        map_options: params.get(MAP_OPTIONS).cloned(),
        unmap_options: params.get(UNMAP_OPTIONS).cloned(),
        mkfs_options: params.get(MKFS_OPTIONS).cloned(),
        try_other_mounters: parse_bool(params, TRY_OTHER_MOUNTERS)?,
        encryption_kms: parse_encryption(params)?.map(|e| e.kms_id),
    })
}

/// Go's `strconv.ParseBool`, which ceph-csi reads `encrypted` with.
fn go_bool(key: &str, v: &str) -> Result<bool, ParamError> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        other => Err(ParamError::new(
            key,
            format!("{other:?} is not a boolean (true or false)"),
        )),
    }
}

/// The encryption parameters, ceph-csi's names: honoured, or refused by
/// name saying why. Without `encrypted: "true"` the others are ignored, as
/// ceph-csi ignores them.
pub fn parse_encryption(
    params: &BTreeMap<String, String>,
) -> Result<Option<crate::volume::encryption::EncryptionParams>, ParamError> {
    use crate::volume::encryption::{EncryptionParams, EncryptionType};
    let on = match params.get(ENCRYPTED) {
        None => false,
        Some(v) => go_bool(ENCRYPTED, v.trim())?,
    };
    if !on {
        return Ok(None);
    }
    let kind = match params.get(ENCRYPTION_TYPE).map(|v| v.trim()) {
        None | Some("block") => EncryptionType::Block,
        Some("") => return Err(ParamError::new(ENCRYPTION_TYPE, "is empty; use \"block\"")),
        Some("file") => {
            return Err(ParamError::new(
                ENCRYPTION_TYPE,
                "\"file\" (fscrypt) is not supported by rbdkit: ceph-csi keeps its fscrypt \
                 policy and protector in the filesystem under a directory the node must unlock \
                 at each stage with the google/fscrypt library's metadata format, which rbdkit \
                 does not implement; use \"block\" (LUKS2)",
            ))
        }
        Some(other) => {
            return Err(ParamError::new(
                ENCRYPTION_TYPE,
                format!("{other:?} is not an encryption type; use \"block\""),
            ))
        }
    };
    let kms_id = match params.get(ENCRYPTION_KMS_ID).map(|v| v.trim()) {
        None | Some("") => crate::volume::kms::DEFAULT_KMS_ID.to_owned(),
        Some(id) => {
            if id.contains(['\0', '\n']) {
                return Err(ParamError::new(ENCRYPTION_KMS_ID, "holds a NUL or newline"));
            }
            id.to_owned()
        }
    };
    if let Some(c) = params.get(ENCRYPTION_CIPHER).map(|v| v.trim()) {
        if c != "aes-xts-plain64" {
            return Err(ParamError::new(
                ENCRYPTION_CIPHER,
                format!(
                    "{c:?} is not supported: rbdkit-fuse decrypts in its own data path, which \
                     serves aes-xts-plain64 only (the same format krbd opens with dm-crypt)"
                ),
            ));
        }
    }
    let key_size = match params.get(ENCRYPTION_KEY_SIZE).map(|v| v.trim()) {
        None | Some("512") => 64,
        Some("256") => 32,
        Some(other) => {
            return Err(ParamError::new(
                ENCRYPTION_KEY_SIZE,
                format!("{other:?} is not 256 or 512 (bits of the aes-xts key)"),
            ))
        }
    };
    let sector_size = match params.get(ENCRYPTION_SECTOR_SIZE).map(|v| v.trim()) {
        None => 4096,
        Some(v) => match v.parse::<u32>() {
            Ok(n @ (512 | 1024 | 2048 | 4096)) => n,
            _ => {
                return Err(ParamError::new(
                    ENCRYPTION_SECTOR_SIZE,
                    format!("{v:?} is not 512, 1024, 2048 or 4096"),
                ))
            }
        },
    };
    if let Some(m) = params.get(INTEGRITY_MODE) {
        return Err(ParamError::new(
            INTEGRITY_MODE,
            format!(
                "{:?} is not supported: authenticated encryption (dm-integrity) keeps a tag per \
                 sector that rbdkit-fuse's data path does not write, and such a volume cannot \
                 be resized",
                m.trim()
            ),
        ));
    }
    Ok(Some(EncryptionParams {
        kms_id,
        kind,
        sector_size,
        key_size,
    }))
}

/// `krbd:a,b=1;rbdkit-fuse:c` or a bare `a,b`: each part names a known
/// mapper, and options are comma-separated words without spaces.
fn check_map_options(key: &str, value: &str) -> Result<(), ParamError> {
    for part in value.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let opts = match part.split_once(':') {
            Some((mapper, opts)) => {
                let mapper = mapper.trim();
                if mapper != "nbd" && mapper != "rbd-nbd" {
                    mapper_for(mapper).map_err(|e| ParamError::new(key, e.why))?;
                }
                opts
            }
            None => part,
        };
        if let Some(bad) = opts
            .split(',')
            .map(str::trim)
            .find(|o| o.is_empty() || o.contains(char::is_whitespace) || o.contains('\0'))
        {
            return Err(ParamError::new(
                key,
                format!("option {bad:?} is empty or holds white space"),
            ));
        }
    }
    Ok(())
}

impl ClassParams {
    /// Parses and validates a StorageClass's parameters (the provisioner's
    /// view: the provisioner Secret is required).
    pub fn parse(params: &BTreeMap<String, String>) -> Result<ClassParams, ParamError> {
        let p = Self::parse_any(params)?;
        if p.provisioner_secret.is_none() {
            return Err(ParamError::new(
                PROVISIONER_SECRET_NAME,
                "is required: the provisioner needs a Secret with userID and userKey",
            ));
        }
        Ok(p)
    }

    /// Parses and validates the parameters of a CSI `CreateVolume`: the same
    /// checks, but secrets come with the request, so none is required, and
    /// external-provisioner's `csi.storage.k8s.io/pv|pvc/...` metadata is
    /// allowed.
    pub fn parse_csi(params: &BTreeMap<String, String>) -> Result<ClassParams, ParamError> {
        Self::parse_any(params)
    }

    fn parse_any(params: &BTreeMap<String, String>) -> Result<ClassParams, ParamError> {
        for (key, off) in NOT_YET {
            if let Some(v) = params.get(*key) {
                if off.is_none_or(|off| v.trim() != off) {
                    return Err(ParamError::new(
                        key,
                        format!("{v:?} is not supported by rbdkit yet; remove the parameter"),
                    ));
                }
            }
        }
        const KNOWN: &[&str] = &[
            MOUNTER,
            MAP_OPTIONS,
            UNMAP_OPTIONS,
            MKFS_OPTIONS,
            TRY_OTHER_MOUNTERS,
            JOURNAL_POOL,
            PV_NAME_META,
            PVC_NAME_META,
            PVC_NAMESPACE_META,
            "imageFormat",
            CLUSTER_ID,
            POOL,
            DATA_POOL,
            IMAGE_FEATURES,
            OBJECT_SIZE,
            STRIPE_UNIT,
            STRIPE_COUNT,
            VOLUME_NAME_PREFIX,
            FSTYPE,
            PROVISIONER_SECRET_NAME,
            PROVISIONER_SECRET_NAMESPACE,
            EXPAND_SECRET_NAME,
            EXPAND_SECRET_NAMESPACE,
            NODE_STAGE_SECRET_NAME,
            NODE_STAGE_SECRET_NAMESPACE,
            SOFT_MAX_CLONE_DEPTH,
            HARD_MAX_CLONE_DEPTH,
            crate::volume::topology::TOPOLOGY_CONSTRAINED_POOLS,
            ENCRYPTED,
            ENCRYPTION_KMS_ID,
            ENCRYPTION_TYPE,
            ENCRYPTION_CIPHER,
            ENCRYPTION_KEY_SIZE,
            ENCRYPTION_SECTOR_SIZE,
            INTEGRITY_MODE,
        ];
        let known = |k: &str| {
            KNOWN.contains(&k)
                || NO_EFFECT.contains(&k)
                || NOT_YET.iter().any(|(n, _)| *n == k)
                || crate::volume::qos::CLASS_ALIASES
                    .iter()
                    .any(|(n, _)| *n == k)
        };
        if let Some(unknown) = params.keys().find(|k| !known(k)) {
            return Err(ParamError::new(
                unknown,
                format!("unknown parameter; known ones: {}", KNOWN.join(", ")),
            ));
        }
        let required = |key: &str| -> Result<String, ParamError> {
            match params.get(key).map(|v| v.trim()) {
                Some(v) if !v.is_empty() => Ok(v.to_owned()),
                Some(_) => Err(ParamError::new(key, "is empty")),
                None => Err(ParamError::new(key, "is required")),
            }
        };
        let cluster_id = required(CLUSTER_ID)?;
        let pool = required(POOL)?;
        check_pool_name(POOL, &pool)?;
        let data_pool = match params.get(DATA_POOL) {
            Some(p) => {
                check_pool_name(DATA_POOL, p)?;
                Some(p.clone())
            }
            None => None,
        };

        let features = match params.get(IMAGE_FEATURES) {
            None => DEFAULT_FEATURES,
            Some(text) => {
                let f: Features = text.parse().map_err(|e: crate::Error| {
                    // The library's message names the unknown feature.
                    let msg = e.to_string();
                    let why = msg
                        .split_once("failed: ")
                        .map(|(_, w)| w.trim_end_matches(" (EINVAL)").to_owned())
                        .unwrap_or(msg);
                    ParamError::new(IMAGE_FEATURES, why)
                })?;
                if f.is_empty() {
                    return Err(ParamError::new(
                        IMAGE_FEATURES,
                        "is empty; name at least one feature, such as layering",
                    ));
                }
                let not_selectable = f.without(SELECTABLE_FEATURES);
                if !not_selectable.is_empty() {
                    return Err(ParamError::new(
                        IMAGE_FEATURES,
                        format!(
                            "feature {not_selectable} cannot be requested; choose from {SELECTABLE_FEATURES}"
                        ),
                    ));
                }
                f.check_dependencies()
                    .map_err(|why| ParamError::new(IMAGE_FEATURES, why))?;
                f
            }
        };

        let object_size = match params.get(OBJECT_SIZE) {
            None => None,
            Some(text) => {
                let bytes =
                    parse_bytes(text).map_err(|e| ParamError::new(OBJECT_SIZE, e.to_string()))?;
                if !bytes.is_power_of_two() {
                    return Err(ParamError::new(
                        OBJECT_SIZE,
                        format!("{bytes} bytes is not a power of two"),
                    ));
                }
                if !(4096..=64 * MIB).contains(&bytes) {
                    return Err(ParamError::new(
                        OBJECT_SIZE,
                        format!("{bytes} bytes is outside 4Ki..64Mi"),
                    ));
                }
                Some(bytes)
            }
        };

        let striping = match (params.get(STRIPE_UNIT), params.get(STRIPE_COUNT)) {
            (None, None) => None,
            (Some(_), None) => {
                return Err(ParamError::new(
                    STRIPE_COUNT,
                    format!("missing; it must be set together with {STRIPE_UNIT}"),
                ))
            }
            (None, Some(_)) => {
                return Err(ParamError::new(
                    STRIPE_UNIT,
                    format!("missing; it must be set together with {STRIPE_COUNT}"),
                ))
            }
            (Some(unit), Some(count)) => {
                let unit =
                    parse_bytes(unit).map_err(|e| ParamError::new(STRIPE_UNIT, e.to_string()))?;
                let count: u64 = count.trim().parse().map_err(|_| {
                    ParamError::new(STRIPE_COUNT, format!("{count:?} is not a whole number"))
                })?;
                if count == 0 {
                    return Err(ParamError::new(STRIPE_COUNT, "must be at least 1"));
                }
                let osize = object_size.unwrap_or(DEFAULT_OBJECT_SIZE);
                if unit == 0 || osize % unit != 0 {
                    return Err(ParamError::new(
                        STRIPE_UNIT,
                        format!(
                            "{unit} bytes must be > 0 and divide the object size ({osize} bytes)"
                        ),
                    ));
                }
                Some((unit, count))
            }
        };
        let features = match striping {
            Some((unit, count))
                if unit != object_size.unwrap_or(DEFAULT_OBJECT_SIZE) || count != 1 =>
            {
                features | Features::STRIPING
            }
            _ => features,
        };

        let fs_type = params
            .get(FSTYPE)
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|| DEFAULT_FSTYPE.to_owned());
        if !FSTYPES.contains(&fs_type.as_str()) {
            return Err(ParamError::new(
                FSTYPE,
                format!(
                    "{fs_type:?} is not supported; use one of {}",
                    FSTYPES.join(", ")
                ),
            ));
        }

        let volume_name_prefix = params.get(VOLUME_NAME_PREFIX).cloned().unwrap_or_default();
        if volume_name_prefix.len() > 64
            || !volume_name_prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        {
            return Err(ParamError::new(
                VOLUME_NAME_PREFIX,
                "may hold at most 64 letters, digits, '-', '_' or '.'",
            ));
        }

        if let Some(v) = params.get("imageFormat") {
            if v.trim() != "2" {
                return Err(ParamError::new(
                    "imageFormat",
                    format!("{v:?} is not supported; only format \"2\" exists in current Ceph"),
                ));
            }
        }
        let journal_pool = match params.get(JOURNAL_POOL) {
            Some(p) => {
                check_pool_name(JOURNAL_POOL, p)?;
                if !features.contains(Features::JOURNALING) {
                    return Err(ParamError::new(
                        JOURNAL_POOL,
                        "is set but imageFeatures does not include journaling",
                    ));
                }
                Some(p.clone())
            }
            None => None,
        };
        let node = parse_node_params(params)?;
        let provisioner_secret = SecretTemplate::parse(
            params,
            PROVISIONER_SECRET_NAME,
            PROVISIONER_SECRET_NAMESPACE,
            false,
        )?;
        let expand_secret =
            SecretTemplate::parse(params, EXPAND_SECRET_NAME, EXPAND_SECRET_NAMESPACE, true)?;
        let node_stage_secret = SecretTemplate::parse(
            params,
            NODE_STAGE_SECRET_NAME,
            NODE_STAGE_SECRET_NAMESPACE,
            true,
        )?;

        Ok(ClassParams {
            cluster_id,
            pool,
            data_pool,
            features,
            object_size,
            striping,
            fs_type,
            volume_name_prefix,
            journal_pool,
            node,
            provisioner_secret,
            expand_secret,
            node_stage_secret,
            clone_depth: CloneDepth::parse(params)?,
            topology_pools: crate::volume::topology::parse_constrained_pools(
                params
                    .get(crate::volume::topology::TOPOLOGY_CONSTRAINED_POOLS)
                    .map_or("", String::as_str),
            )?,
            qos: crate::volume::qos::Policy::from_class(params)?,
            encryption: parse_encryption(params)?,
        })
    }

    /// The librbd options for a new image.
    pub fn image_options(&self) -> crate::Result<crate::rbd::ImageOptions> {
        let mut o = crate::rbd::ImageOptions::new().features(self.features);
        if let Some(size) = self.object_size {
            o = o.object_size(size)?;
        }
        if let Some((unit, count)) = self.striping {
            o = o.striping(unit, count)?;
        }
        if let Some(p) = &self.data_pool {
            o = o.data_pool(p.clone());
        }
        if let Some(p) = &self.journal_pool {
            o = o.journal_pool(p.clone());
        }
        Ok(o)
    }

    /// The image name for a PV: the prefix, then the PV name.
    pub fn image_name(&self, pv_name: &str) -> String {
        format!("{}{pv_name}", self.volume_name_prefix)
    }
}

/// Put before the snapshot's request name to make its image name
/// (ceph-csi's VolumeSnapshotClass parameter of that name).
pub const SNAPSHOT_NAME_PREFIX: &str = "snapshotNamePrefix";
/// The VolumeSnapshot's name, from external-snapshotter's
/// `--extra-create-metadata`.
pub const VOLUMESNAPSHOT_NAME_META: &str = "csi.storage.k8s.io/volumesnapshot/name";
/// The VolumeSnapshot's namespace (`--extra-create-metadata`).
pub const VOLUMESNAPSHOT_NAMESPACE_META: &str = "csi.storage.k8s.io/volumesnapshot/namespace";
/// The VolumeSnapshotContent's name (`--extra-create-metadata`).
pub const VOLUMESNAPSHOTCONTENT_NAME_META: &str = "csi.storage.k8s.io/volumesnapshotcontent/name";
/// The Secret to take and delete snapshots with.
pub const SNAPSHOTTER_SECRET_NAME: &str = "csi.storage.k8s.io/snapshotter-secret-name";
/// Its namespace.
pub const SNAPSHOTTER_SECRET_NAMESPACE: &str = "csi.storage.k8s.io/snapshotter-secret-namespace";

/// A VolumeSnapshotClass's parameters (CSI `CreateSnapshot` parameters),
/// validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotParams {
    /// The cluster the source must be in, if the class names one.
    pub cluster_id: Option<String>,
    /// The pool the source must be in, if the class names one (snapshot
    /// images live in their source's pool).
    pub pool: Option<String>,
    /// Put before the request name to make the snapshot image's name.
    pub snapshot_name_prefix: String,
    /// Clone depth limits for the snapshot image.
    pub clone_depth: CloneDepth,
    /// Credentials to take and delete snapshots with, if named.
    pub snapshotter_secret: Option<SecretTemplate>,
    /// The VolumeSnapshot's namespace and name, if given.
    pub snapshot_object: Option<(String, String)>,
}

impl SnapshotParams {
    /// Parses and validates a VolumeSnapshotClass's parameters.
    pub fn parse(params: &BTreeMap<String, String>) -> Result<SnapshotParams, ParamError> {
        const KNOWN: &[&str] = &[
            CLUSTER_ID,
            POOL,
            SNAPSHOT_NAME_PREFIX,
            SOFT_MAX_CLONE_DEPTH,
            HARD_MAX_CLONE_DEPTH,
            VOLUMESNAPSHOT_NAME_META,
            VOLUMESNAPSHOT_NAMESPACE_META,
            VOLUMESNAPSHOTCONTENT_NAME_META,
            SNAPSHOTTER_SECRET_NAME,
            SNAPSHOTTER_SECRET_NAMESPACE,
        ];
        if let Some(unknown) = params.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(ParamError::new(
                unknown,
                format!(
                    "unknown snapshot parameter; known ones: {}",
                    KNOWN.join(", ")
                ),
            ));
        }
        let non_empty = |key: &str| -> Result<Option<String>, ParamError> {
            match params.get(key).map(|v| v.trim()) {
                None => Ok(None),
                Some("") => Err(ParamError::new(key, "is empty")),
                Some(v) => Ok(Some(v.to_owned())),
            }
        };
        let pool = non_empty(POOL)?;
        if let Some(p) = &pool {
            check_pool_name(POOL, p)?;
        }
        let prefix = params
            .get(SNAPSHOT_NAME_PREFIX)
            .cloned()
            .unwrap_or_default();
        if prefix.len() > 64
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        {
            return Err(ParamError::new(
                SNAPSHOT_NAME_PREFIX,
                "may hold at most 64 letters, digits, '-', '_' or '.'",
            ));
        }
        let snapshot_object = match (
            params.get(VOLUMESNAPSHOT_NAMESPACE_META),
            params.get(VOLUMESNAPSHOT_NAME_META),
        ) {
            (Some(ns), Some(n)) => Some((ns.clone(), n.clone())),
            _ => None,
        };
        Ok(SnapshotParams {
            cluster_id: non_empty(CLUSTER_ID)?,
            pool,
            snapshot_name_prefix: prefix,
            clone_depth: CloneDepth::parse(params)?,
            snapshotter_secret: SecretTemplate::parse(
                params,
                SNAPSHOTTER_SECRET_NAME,
                SNAPSHOTTER_SECRET_NAMESPACE,
                true,
            )?,
            snapshot_object,
        })
    }
}

fn check_pool_name(param: &str, name: &str) -> Result<(), ParamError> {
    if name.is_empty() || name.contains('/') || name.contains('@') || name.trim() != name {
        return Err(ParamError::new(
            param,
            format!("{name:?} is not a valid pool name"),
        ));
    }
    Ok(())
}

/// Checks a claim's access modes and volume mode: RWO, RWOP and ROX are
/// fine; RWX only for Block volumes (a shared filesystem on RBD would be
/// corrupted by two writers).
pub fn check_access(access_modes: &[String], volume_mode: &str) -> Result<(), String> {
    if access_modes.is_empty() {
        return Err("the claim has no access modes".into());
    }
    if volume_mode != "Filesystem" && volume_mode != "Block" {
        return Err(format!("volume mode {volume_mode:?} is not supported"));
    }
    for mode in access_modes {
        match mode.as_str() {
            "ReadWriteOnce" | "ReadWriteOncePod" => {}
            // Nothing could ever format or fill it.
            "ReadOnlyMany" => {
                return Err(
                    "access mode ReadOnlyMany needs a data source: an empty read-only volume can never be written"
                        .into(),
                )
            }
            "ReadWriteMany" if volume_mode == "Block" => {}
            "ReadWriteMany" => {
                return Err(
                    "access mode ReadWriteMany needs volumeMode Block: an RBD filesystem cannot be mounted read-write on several nodes"
                        .into(),
                )
            }
            other => return Err(format!("access mode {other:?} is not supported")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clone_depth_limits_parse_and_are_checked() {
        let m = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            CloneDepth::parse(&m(&[])).unwrap(),
            CloneDepth { soft: 4, hard: 8 }
        );
        assert_eq!(
            CloneDepth::parse(&m(&[(HARD_MAX_CLONE_DEPTH, "2")])).unwrap(),
            CloneDepth { soft: 2, hard: 2 }
        );
        assert_eq!(
            CloneDepth::parse(&m(&[
                (SOFT_MAX_CLONE_DEPTH, "1"),
                (HARD_MAX_CLONE_DEPTH, "16")
            ]))
            .unwrap(),
            CloneDepth { soft: 1, hard: 16 }
        );
        for bad in [
            m(&[(SOFT_MAX_CLONE_DEPTH, "9")]),
            m(&[(HARD_MAX_CLONE_DEPTH, "0")]),
            m(&[(HARD_MAX_CLONE_DEPTH, "17")]),
            m(&[(SOFT_MAX_CLONE_DEPTH, "x")]),
            m(&[(SOFT_MAX_CLONE_DEPTH, "-1")]),
        ] {
            assert!(CloneDepth::parse(&bad).is_err(), "{bad:?}");
        }
        let class = m(&[
            (CLUSTER_ID, "c"),
            (POOL, "rbd"),
            (SOFT_MAX_CLONE_DEPTH, "3"),
            (PROVISIONER_SECRET_NAME, "s"),
            (PROVISIONER_SECRET_NAMESPACE, "n"),
        ]);
        assert_eq!(ClassParams::parse(&class).unwrap().clone_depth.soft, 3);
    }

    #[test]
    fn snapshot_class_parameters_are_validated() {
        let m = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let p = SnapshotParams::parse(&m(&[
            (CLUSTER_ID, "c"),
            (POOL, "rbd"),
            (SNAPSHOT_NAME_PREFIX, "snap-"),
            (VOLUMESNAPSHOT_NAME_META, "vs"),
            (VOLUMESNAPSHOT_NAMESPACE_META, "apps"),
            (SNAPSHOTTER_SECRET_NAME, "s"),
            (SNAPSHOTTER_SECRET_NAMESPACE, "n"),
        ]))
        .unwrap();
        assert_eq!(p.cluster_id.as_deref(), Some("c"));
        assert_eq!(p.snapshot_name_prefix, "snap-");
        assert_eq!(p.snapshot_object, Some(("apps".into(), "vs".into())));
        assert!(SnapshotParams::parse(&m(&[])).is_ok());
        for (bad, key) in [
            (m(&[("imageFeatures", "layering")]), "imageFeatures"),
            (m(&[(POOL, "a/b")]), POOL),
            (m(&[(CLUSTER_ID, " ")]), CLUSTER_ID),
            (m(&[(SNAPSHOT_NAME_PREFIX, "a b")]), SNAPSHOT_NAME_PREFIX),
            (m(&[(HARD_MAX_CLONE_DEPTH, "99")]), HARD_MAX_CLONE_DEPTH),
        ] {
            assert_eq!(SnapshotParams::parse(&bad).unwrap_err().param, key);
        }
    }

    fn params(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        let mut m: BTreeMap<String, String> = [
            (CLUSTER_ID, "c1"),
            (POOL, "rbd"),
            (PROVISIONER_SECRET_NAME, "ceph-secret"),
            (PROVISIONER_SECRET_NAMESPACE, "ceph"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        for (k, v) in pairs {
            m.insert(k.to_string(), v.to_string());
        }
        m
    }

    fn without(keys: &[&str]) -> ParamError {
        let mut m = params(&[]);
        for k in keys {
            m.remove(*k);
        }
        ClassParams::parse(&m).unwrap_err()
    }

    fn err(pairs: &[(&str, &str)]) -> ParamError {
        ClassParams::parse(&params(pairs)).unwrap_err()
    }

    #[test]
    fn minimal_class_gets_defaults() {
        let p = ClassParams::parse(&params(&[])).unwrap();
        assert_eq!(p.cluster_id, "c1");
        assert_eq!(p.pool, "rbd");
        assert_eq!(p.data_pool, None);
        assert_eq!(p.features, Features::LAYERING);
        assert_eq!(p.object_size, None);
        assert_eq!(p.striping, None);
        assert_eq!(p.fs_type, "ext4");
        assert_eq!(p.image_name("pvc-1"), "pvc-1");
        assert_eq!(p.expand_secret, None);
        assert_eq!(p.node_stage_secret, None);
    }

    #[test]
    fn full_class_parses() {
        let p = ClassParams::parse(&params(&[
            (DATA_POOL, "ec-data"),
            (
                IMAGE_FEATURES,
                "layering,exclusive-lock,object-map,fast-diff",
            ),
            (OBJECT_SIZE, "8Mi"),
            (STRIPE_UNIT, "1Mi"),
            (STRIPE_COUNT, "4"),
            (FSTYPE, "xfs"),
            (VOLUME_NAME_PREFIX, "k8s-"),
            (EXPAND_SECRET_NAME, "x-${pvc.name}"),
            (EXPAND_SECRET_NAMESPACE, "${pvc.namespace}"),
            (NODE_STAGE_SECRET_NAME, "node"),
            (NODE_STAGE_SECRET_NAMESPACE, "ceph"),
        ]))
        .unwrap();
        assert_eq!(p.data_pool.as_deref(), Some("ec-data"));
        assert!(p
            .features
            .contains(Features::FAST_DIFF | Features::STRIPING));
        assert_eq!(p.object_size, Some(8 * MIB));
        assert_eq!(p.striping, Some((MIB, 4)));
        assert_eq!(p.fs_type, "xfs");
        assert_eq!(p.image_name("pvc-1"), "k8s-pvc-1");
        let opts = p.image_options().unwrap();
        assert_eq!(opts.get_order(), Some(23));
    }

    #[test]
    fn unknown_parameter_is_named() {
        let e = err(&[("imagefeatures", "layering")]);
        assert_eq!(e.param, "imagefeatures");
        assert!(e.why.contains("unknown parameter"), "{e}");
        assert!(e.to_string().contains("\"imagefeatures\""));
    }

    #[test]
    fn required_parameters() {
        assert_eq!(without(&[CLUSTER_ID]).param, CLUSTER_ID);
        assert_eq!(without(&[POOL]).why, "is required");
        assert_eq!(err(&[(POOL, " ")]).why, "is empty");
        let e = without(&[PROVISIONER_SECRET_NAME, PROVISIONER_SECRET_NAMESPACE]);
        assert_eq!(e.param, PROVISIONER_SECRET_NAME);
    }

    #[test]
    fn feature_dependencies_and_names_are_checked() {
        let e = err(&[(IMAGE_FEATURES, "layering,object-map")]);
        assert_eq!(e.param, IMAGE_FEATURES);
        assert!(e.why.contains("exclusive-lock"), "{e}");
        assert!(err(&[(IMAGE_FEATURES, "exclusive-lock,fast-diff")])
            .why
            .contains("object-map"));
        assert!(err(&[(IMAGE_FEATURES, "journaling")])
            .why
            .contains("exclusive-lock"));
        assert!(err(&[(IMAGE_FEATURES, "layering,bogus")])
            .why
            .contains("bogus"));
        assert!(err(&[(IMAGE_FEATURES, "")]).why.contains("empty"));
        assert!(err(&[(IMAGE_FEATURES, "layering,migrating")])
            .why
            .contains("cannot be requested"));
        let ok = ClassParams::parse(&params(&[(
            IMAGE_FEATURES,
            "layering,exclusive-lock,journaling,deep-flatten",
        )]));
        assert!(ok.is_ok());
    }

    #[test]
    fn object_size_and_striping_are_checked() {
        assert!(err(&[(OBJECT_SIZE, "3Mi")]).why.contains("power of two"));
        assert!(err(&[(OBJECT_SIZE, "128Mi")]).why.contains("outside"));
        assert!(err(&[(OBJECT_SIZE, "1Ki")]).why.contains("outside"));
        assert_eq!(err(&[(OBJECT_SIZE, "lots")]).param, OBJECT_SIZE);
        assert_eq!(err(&[(STRIPE_UNIT, "64Ki")]).param, STRIPE_COUNT);
        assert_eq!(err(&[(STRIPE_COUNT, "2")]).param, STRIPE_UNIT);
        assert!(err(&[(STRIPE_UNIT, "3Ki"), (STRIPE_COUNT, "2")])
            .why
            .contains("divide"));
        assert!(err(&[(STRIPE_UNIT, "8Mi"), (STRIPE_COUNT, "2")])
            .why
            .contains("divide"));
        assert_eq!(
            err(&[(STRIPE_UNIT, "1Mi"), (STRIPE_COUNT, "0")]).param,
            STRIPE_COUNT
        );
        assert_eq!(
            err(&[(STRIPE_UNIT, "1Mi"), (STRIPE_COUNT, "x")]).param,
            STRIPE_COUNT
        );
        // The default striping is no striping.
        let p = ClassParams::parse(&params(&[(STRIPE_UNIT, "4Mi"), (STRIPE_COUNT, "1")])).unwrap();
        assert!(!p.features.contains(Features::STRIPING));
    }

    #[test]
    fn other_values_are_checked() {
        assert_eq!(err(&[(FSTYPE, "ntfs")]).param, FSTYPE);
        let btrfs = err(&[(FSTYPE, "btrfs")]);
        assert_eq!(btrfs.param, FSTYPE);
        assert!(
            btrfs.why.contains("\"btrfs\" is not supported"),
            "{btrfs:?}"
        );
        assert_eq!(
            err(&[(VOLUME_NAME_PREFIX, "a/b")]).param,
            VOLUME_NAME_PREFIX
        );
        assert_eq!(err(&[(POOL, "a/b")]).param, POOL);
        assert_eq!(err(&[(DATA_POOL, "x@y")]).param, DATA_POOL);
    }

    #[test]
    fn secrets_come_in_pairs_and_templates_resolve() {
        assert_eq!(
            err(&[(NODE_STAGE_SECRET_NAME, "n")]).param,
            NODE_STAGE_SECRET_NAMESPACE
        );
        assert_eq!(
            err(&[(EXPAND_SECRET_NAMESPACE, "n")]).param,
            EXPAND_SECRET_NAME
        );
        assert!(err(&[(PROVISIONER_SECRET_NAME, "${pvc.annotations['x']}")])
            .why
            .contains("not allowed"));
        assert!(err(&[(PROVISIONER_SECRET_NAMESPACE, "${pvc.name}")])
            .why
            .contains("unknown template"));
        assert!(err(&[(PROVISIONER_SECRET_NAME, "${pv.name")])
            .why
            .contains("unterminated"));

        let p = ClassParams::parse(&params(&[
            (PROVISIONER_SECRET_NAME, "prov-${pvc.namespace}"),
            (PROVISIONER_SECRET_NAMESPACE, "${pvc.namespace}"),
            (NODE_STAGE_SECRET_NAME, "${pvc.annotations['team/secret']}"),
            (NODE_STAGE_SECRET_NAMESPACE, "ceph"),
        ]))
        .unwrap();
        let mut ann = BTreeMap::new();
        ann.insert("team/secret".to_owned(), "team-a-key".to_owned());
        let ctx = TemplateContext {
            pv_name: "pvc-123",
            pvc_namespace: "apps",
            pvc_name: "data",
            pvc_annotations: &ann,
        };
        assert_eq!(
            p.provisioner_secret
                .as_ref()
                .unwrap()
                .resolve(&ctx)
                .unwrap(),
            SecretRef {
                namespace: "apps".into(),
                name: "prov-apps".into()
            }
        );
        assert_eq!(
            p.node_stage_secret
                .as_ref()
                .unwrap()
                .resolve(&ctx)
                .unwrap()
                .name,
            "team-a-key"
        );
        let empty = BTreeMap::new();
        let e = p
            .node_stage_secret
            .as_ref()
            .unwrap()
            .resolve(&TemplateContext {
                pvc_annotations: &empty,
                ..ctx
            })
            .unwrap_err();
        assert!(e.why.contains("no annotation"), "{e}");
        let bad = BTreeMap::from([("team/secret".to_owned(), "Not_Valid".to_owned())]);
        let e = p
            .node_stage_secret
            .as_ref()
            .unwrap()
            .resolve(&TemplateContext {
                pvc_annotations: &bad,
                ..ctx
            })
            .unwrap_err();
        assert!(e.why.contains("not a valid Secret name"), "{e}");
    }

    #[test]
    fn access_modes() {
        let m = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(check_access(&m(&["ReadWriteOnce"]), "Filesystem").is_ok());
        assert!(check_access(&m(&["ReadWriteOncePod"]), "Block").is_ok());
        let e = check_access(&m(&["ReadOnlyMany"]), "Filesystem").unwrap_err();
        assert!(
            e.contains("ReadOnlyMany") && e.contains("data source"),
            "{e}"
        );
        assert!(check_access(&m(&["ReadWriteMany"]), "Block").is_ok());
        let e = check_access(&m(&["ReadWriteOnce", "ReadWriteMany"]), "Filesystem").unwrap_err();
        assert!(e.contains("Block"), "{e}");
        assert!(check_access(&[], "Filesystem").is_err());
        assert!(check_access(&m(&["ReadWriteOnce"]), "Other").is_err());
        assert!(check_access(&m(&["Sometimes"]), "Block").is_err());
    }

    #[test]
    fn ceph_csi_parameters_are_accepted_honoured_or_refused_by_name() {
        // A ceph-csi StorageClass's node-side parameters are honoured.
        let p = ClassParams::parse(&params(&[
            (MOUNTER, "rbd"),
            (
                MAP_OPTIONS,
                "krbd:lock_on_read,queue_depth=1024;nbd:try-netlink",
            ),
            (UNMAP_OPTIONS, "krbd:force"),
            (MKFS_OPTIONS, "-m0 -Enodiscard"),
            (TRY_OTHER_MOUNTERS, "true"),
            ("cephLogDir", "/var/log/ceph"),
            ("cephLogStrategy", "remove"),
            ("encrypted", "false"),
            ("thickProvision", "false"),
            ("imageFormat", "2"),
        ]))
        .unwrap();
        assert_eq!(p.node.mounter.as_deref(), Some("krbd"));
        assert!(p.node.try_other_mounters);
        let attrs: BTreeMap<_, _> = p.node.attributes().into_iter().collect();
        assert_eq!(attrs[MKFS_OPTIONS], "-m0 -Enodiscard");
        assert_eq!(
            NodeParams::from_context(
                &attrs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.clone()))
                    .collect()
            )
            .unwrap(),
            p.node
        );

        // Those that would change the volume and are not implemented are
        // refused, naming the parameter.
        for (k, v) in [
            ("encrypted", "yes"),
            ("thickProvision", "true"),
            ("topologyConstrainedPools", r#"[{"pool": "x"}]"#),
            ("BaseReadIops", "0"),
            ("imageFormat", "1"),
            (MOUNTER, "rbd-nbd"),
            (MOUNTER, "nfs"),
            (TRY_OTHER_MOUNTERS, "yes"),
            (MAP_OPTIONS, "krbd:a b"),
            (MAP_OPTIONS, "iscsi:x"),
            (JOURNAL_POOL, "journals"),
        ] {
            let e = err(&[(k, v)]);
            assert_eq!(e.param, k, "{k}={v}: {e}");
        }
        let e = err(&[(MOUNTER, "rbd-nbd")]);
        assert!(e.why.contains("not supported yet"), "{e}");
        // QoS parameters are honoured (crate::volume::qos).
        let p = ClassParams::parse(&params(&[("BaseReadIops", "100")])).unwrap();
        assert!(!p.qos.is_empty());
        // Typos stay refused.
        assert_eq!(err(&[("mounters", "rbd")]).param, "mounters");
        // journalPool is honoured with journaling.
        let p = ClassParams::parse(&params(&[
            (IMAGE_FEATURES, "layering,exclusive-lock,journaling"),
            (JOURNAL_POOL, "journals"),
        ]))
        .unwrap();
        assert_eq!(p.journal_pool.as_deref(), Some("journals"));
    }

    #[test]
    fn encryption_parameters_are_honoured_or_refused_by_name() {
        use crate::volume::encryption::EncryptionType;
        let p = ClassParams::parse(&params(&[("encrypted", "true")])).unwrap();
        let e = p.encryption.clone().unwrap();
        assert_eq!(e.kms_id, "default");
        assert_eq!(e.kind, EncryptionType::Block);
        assert_eq!((e.sector_size, e.key_size), (4096, 64));
        let attrs: BTreeMap<_, _> = p.node.attributes().into_iter().collect();
        assert_eq!(attrs[ENCRYPTED], "true");
        assert_eq!(attrs[ENCRYPTION_KMS_ID], "default");
        let p = ClassParams::parse(&params(&[
            ("encrypted", "True"),
            (ENCRYPTION_TYPE, "block"),
            (ENCRYPTION_KMS_ID, "secrets-metadata-test"),
            (ENCRYPTION_CIPHER, "aes-xts-plain64"),
            (ENCRYPTION_KEY_SIZE, "256"),
            (ENCRYPTION_SECTOR_SIZE, "512"),
        ]))
        .unwrap();
        let e = p.encryption.unwrap();
        assert_eq!(e.kms_id, "secrets-metadata-test");
        assert_eq!((e.sector_size, e.key_size), (512, 32));
        assert_eq!(
            p.node.encryption_kms.as_deref(),
            Some("secrets-metadata-test")
        );
        // Go's booleans; the others are ignored without encryption, as in
        // ceph-csi.
        for off in ["false", "0", "F"] {
            let p = ClassParams::parse(&params(&[
                ("encrypted", off),
                (ENCRYPTION_KMS_ID, "x"),
                (ENCRYPTION_TYPE, "file"),
            ]))
            .unwrap();
            assert!(p.encryption.is_none() && p.node.encryption_kms.is_none());
        }
        for (k, v, says) in [
            ("encrypted", "yes", "not a boolean"),
            (ENCRYPTION_TYPE, "file", "fscrypt"),
            (ENCRYPTION_TYPE, "", "empty"),
            (ENCRYPTION_TYPE, "disk", "not an encryption type"),
            (
                ENCRYPTION_CIPHER,
                "serpent-xts-plain64",
                "aes-xts-plain64 only",
            ),
            (ENCRYPTION_KEY_SIZE, "384", "256 or 512"),
            (ENCRYPTION_SECTOR_SIZE, "8192", "512, 1024, 2048 or 4096"),
            (INTEGRITY_MODE, "hmac-sha256", "dm-integrity"),
        ] {
            let mut m = params(&[("encrypted", "true")]);
            m.insert(k.to_owned(), v.to_owned());
            let e = ClassParams::parse(&m).unwrap_err();
            assert_eq!(e.param, k, "{k}={v}: {e}");
            assert!(e.why.contains(says), "{k}={v}: {e}");
        }
        // The node reads them back from the volume context.
        let ctx: BTreeMap<String, String> = [
            (ENCRYPTED, "true"),
            (ENCRYPTION_TYPE, "block"),
            (ENCRYPTION_KMS_ID, "meta"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(
            NodeParams::from_context(&ctx)
                .unwrap()
                .encryption_kms
                .as_deref(),
            Some("meta")
        );
    }

    #[test]
    fn csi_requests_need_no_secret_parameters() {
        let m: BTreeMap<String, String> =
            [(CLUSTER_ID, "c1"), (POOL, "rbd"), (PVC_NAME_META, "data")]
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        let p = ClassParams::parse_csi(&m).unwrap();
        assert!(p.provisioner_secret.is_none());
        assert_eq!(
            ClassParams::parse(&m).unwrap_err().param,
            PROVISIONER_SECRET_NAME
        );
    }
}
