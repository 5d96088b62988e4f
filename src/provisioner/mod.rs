//! The Kubernetes provisioner: PVC → RBD image → PV, delete and expand.
//!
//! (Being built; see the provisioner issue.)

/// Command-line arguments of `rbdkit provisioner`.
#[derive(Debug, clap::Args)]
pub struct ProvisionerArgs {
    /// The provisioner name that StorageClasses name.
    #[arg(long, default_value = "rbd.rbdkit.io")]
    pub name: String,
}

/// Runs the provisioner until it is told to stop.
pub async fn run(args: ProvisionerArgs) -> anyhow::Result<()> {
    anyhow::bail!("provisioner {} is not built yet", args.name)
}
