#!/usr/bin/env bash
# Makes every module this build shares with the test control plane
# (tests/k8s-control-plane) resolve to the control plane's version, then
# tidies go.mod and go.sum.
#
#   ./align-versions.sh     # re-run after changing either module's versions
#
# Why: Go's build cache keys a compiled package on its module's selected
# version and on all the packages below it. With the same k8s.io, x/net,
# protobuf, ... versions as the control plane, the snapshot-controller's
# build reuses the control plane's compiled packages (client-go,
# apimachinery, api, ...) instead of compiling its own copies.
#
# How: a require at the control plane's version; where something in the
# graph asks for a higher one, an exclude of that higher version (since Go
# 1.16 a requirement on an excluded version is dropped). A replace would
# not do: the cache key keeps the version the graph selected, not the
# replacement's. The build (scripts/snapshot-controller build) is the check
# that external-snapshotter still compiles against the lower versions.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here"

export GOTOOLCHAIN=local GOWORK=off GOFLAGS=-mod=mod CGO_ENABLED=0
export GOSUMDB="${GOSUMDB_OVERRIDE:-off}"
pkg=github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller

# built PKG...: "PATH VERSION" of each module whose packages the build of
# PKG... compiles, at its selected version.
built() {
	go list -deps -f '{{with .Module}}{{.Path}} {{.Version}}{{end}}' "$@" | sort -u
}

# What scripts/k8s-test-control-plane and scripts/k8s-test-node build there.
cp_mods=$(cd ../k8s-control-plane && GOFLAGS=-mod=readonly built go.etcd.io/etcd/server/v3 \
	k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
	k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler)

# Start from no excludes, so a version the control plane moved past is
# allowed again.
excluded() { # "PATH@VERSION" of every exclude line in go.mod
	go mod edit -json | awk '
		/"Exclude": \[/ { e = 1; next } e && /^\t\]/ { e = 0 }
		e && /"Path":/ { gsub(/[",]/, "", $2); p = $2 }
		e && /"Version":/ { gsub(/[",]/, "", $2); print p "@" $2 }'
}
for x in $(excluded); do
	go mod edit -dropexclude="$x"
done

# newer A B: whether semantic version A is above B (pseudo-versions and
# pre-releases included: v1.2.3-0.2026... is below v1.2.3).
newer() {
	awk -v a="$1" -v b="$2" '
		function cmp_id(x, y, nx, ny) {
			nx = x ~ /^[0-9]+$/; ny = y ~ /^[0-9]+$/
			if (nx && ny) return (x + 0 > y + 0) - (x + 0 < y + 0)
			if (nx != ny) return nx ? -1 : 1
			return (x > y) - (x < y)
		}
		function cmp(x, y,   xc, yc, xp, yp, i, n, m, xa, ya, c) {
			sub(/^v/, "", x); sub(/^v/, "", y); sub(/\+.*/, "", x); sub(/\+.*/, "", y)
			xp = index(x, "-") ? substr(x, index(x, "-") + 1) : ""
			yp = index(y, "-") ? substr(y, index(y, "-") + 1) : ""
			xc = index(x, "-") ? substr(x, 1, index(x, "-") - 1) : x
			yc = index(y, "-") ? substr(y, 1, index(y, "-") - 1) : y
			split(xc, xa, "."); split(yc, ya, ".")
			for (i = 1; i <= 3; i++) if (xa[i] + 0 != ya[i] + 0) return xa[i] + 0 > ya[i] + 0 ? 1 : -1
			if (xp == "" || yp == "") return (xp == "") - (yp == "")
			n = split(xp, xa, "."); m = split(yp, ya, ".")
			for (i = 1; i <= n && i <= m; i++) if ((c = cmp_id(xa[i], ya[i])) != 0) return c
			return (n > m) - (n < m)
		}
		BEGIN { exit !(cmp(a, b) > 0) }'
}

# Excluding one version can let the graph pick another higher one, so
# repeat until every shared module is at the control plane's version.
for round in $(seq 1 20); do
	mapfile -t diff < <(join <(built "$pkg") <(echo "$cp_mods") | awk '$2 != $3 { print $1, $2, $3 }')
	((${#diff[@]} > 0)) || break
	((round < 20)) || {
		echo "versions still differ after $round rounds: ${diff[*]}" >&2
		exit 1
	}
	for d in "${diff[@]}"; do
		read -r m have want <<<"$d"
		# A higher version than the control plane's is selected because
		# something in the graph asks for it: exclude that version.
		if newer "$have" "$want"; then
			go mod edit -exclude="$m@$have"
		fi
		go mod edit -require="$m@$want"
	done
done
# One exclude block (go mod edit writes a line each), sorted.
mapfile -t ex < <(excluded | sort)
for x in "${ex[@]}"; do
	go mod edit -dropexclude="$x"
done
if ((${#ex[@]} > 0)); then
	{
		echo
		echo "// Versions above the control plane's, excluded by align-versions.sh."
		echo "exclude ("
		printf '\t%s\n' "${ex[@]/@/ }"
		echo ")"
	} >>go.mod
fi
go mod tidy
echo "$(join <(built "$pkg") <(echo "$cp_mods") | wc -l) modules shared with the control plane, all at its versions; $(excluded | wc -l) higher versions excluded" >&2
