// The csi-addons CRDs (NetworkFence, NetworkFenceClass) for tests:
// scripts/csi-addons-crds prints the paths of their files in the Go module
// cache. Nothing here is built.
module rbdkit.invalid/tests/csi-addons

go 1.26.0

require github.com/csi-addons/kubernetes-csi-addons v0.14.0
