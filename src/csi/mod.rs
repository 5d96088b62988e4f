//! The CSI v1 driver: gRPC Identity, Controller and Node services over a
//! unix socket, on the code generated from the pinned `csi.proto` in [`proto`].
pub mod proto;
