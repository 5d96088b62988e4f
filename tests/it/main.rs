//! The service layers against the real parts: the volume layer, the
//! provisioner and the CSI driver against a real Ceph cluster, a real API
//! server, real mounts and a real kubelet node (`support::node`), each
//! started once for the whole binary.
//!
//! One binary for the group, so the suite links once (issue 29).
//! `tests/node_deployed.rs` is a binary of its own: it runs a second kubelet
//! on this machine, which must not overlap the shared node here.

#[path = "../support/mod.rs"]
mod support;

mod csi_controller;
mod csi_deploy;
mod csi_group_snapshots;
mod csi_krbd;
mod csi_metrics;
mod csi_node;
mod csi_qos;
mod csi_read_affinity;
mod csi_sanity;
mod csi_topology;
mod encryption;
mod gc;
mod helm_chart;
mod k8s_control_plane;
mod k8s_events;
mod kernel_vm;
mod kms_vault;
mod migrate;
mod mirror_dr;
mod node_e2e;
mod node_fuse;
mod node_group_snapshots;
mod node_mount;
mod node_qos;
mod node_race;
mod node_reclaim;
mod node_topology;
mod parsers_prop;
mod provisioner_apiserver_restart;
mod provisioner_bad_input;
mod provisioner_caps;
mod provisioner_ceph;
mod provisioner_ceph_faults;
mod provisioner_chaos;
mod provisioner_clones;
mod provisioner_dead_cluster;
mod provisioner_deploy;
mod provisioner_e2e;
mod provisioner_fence;
mod provisioner_foreign;
mod provisioner_key_rotation;
mod provisioner_legacy;
mod provisioner_network_fence;
mod provisioner_out_of_service;
mod provisioner_qos;
mod provisioner_snapshots;
mod provisioner_topology;
mod volume_snapshots;
