//! Kubernetes plumbing shared by the provisioner: clients, events, leader
//! election and the like. It calls the library, never the other way round.
//!
//! - [`backoff`]: per-object capped exponential backoff and a global rate limit;
//! - [`events`]: publishing Kubernetes events with bounded, single-line notes;
//! - [`leader`]: leader election on a `coordination.k8s.io` Lease;
//! - [`health`]: the `/healthz`, `/readyz` and `/metrics` HTTP server;
//! - [`client`]: building a client from a kubeconfig file or the pod's
//!   service account;
//! - [`compact`]: objects kept compactly in watch caches.

pub mod backoff;
pub mod client;
pub mod compact;
pub mod events;
pub mod health;
pub mod leader;
