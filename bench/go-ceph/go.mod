module rbdkit.invalid/bench/goceph

go 1.26.8

require github.com/ceph/go-ceph v0.34.0

require golang.org/x/sys v0.33.0 // indirect
