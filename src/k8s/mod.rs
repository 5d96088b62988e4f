//! Kubernetes plumbing shared by the provisioner: clients, events, leader
//! election and the like. It calls the library, never the other way round.
