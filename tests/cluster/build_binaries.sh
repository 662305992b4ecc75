#!/usr/bin/env bash
# Build, once, the local control plane's binaries from the Go module proxy into a cache outside the checkout:
#   etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, kwok, helm, the Gateway API
#   inference extension's endpoint picker as epp-$GIE_VERSION (its cmd/epp), KEDA's operator as
#   keda-$KEDA_VERSION (cmd/operator: what scales a workload between 0 and 1) and the KEDA HTTP add-on's
#   interceptor and external scaler as keda-http-interceptor-$KEDA_HTTP_VERSION, keda-http-scaler-$KEDA_HTTP_VERSION
# into $GEMMA_K8S_CACHE (default $HOME/.cache/gemma-rust-operator/k8s-v$K8S_VERSION/bin).
#
#   build_binaries.sh [PART...]    PART: etcd kwok kubernetes helm kwok-stages epp keda keda-http
#                                  (default: all of them)
# The chart's static tests need only helm, which builds on its own in a fraction of the time.
#
# k8s.io/kubernetes is used as a Go module. Its go.mod points every k8s.io/* staging module at
# ./staging/src/..., which does not exist outside its repository, so a temporary go.mod requires it at a
# pinned version and replaces each staging module with the published k8s.io/<name> v0.<minor>.<patch>
# (the staging modules are tagged in lockstep with the kubernetes release). etcd, kwok and helm are built
# from their own temporary modules so their dependency graphs do not have to agree with kubernetes'. KEDA and its
# HTTP add-on are built inside a copy of their own module, with its go.mod and go.sum: KEDA's go.mod has
# replace directives, which Go honours only in the main module.
#
# Builds are niced and limited to GOFLAGS=-p=2 (the machine has 2 cores). A binary already in the cache is
# never rebuilt. Exit status is non-zero (and the log says why) if any build fails.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.37.2}"
STAGING_VERSION="v0.${K8S_VERSION#1.}"
ETCD_VERSION="${ETCD_VERSION:-v3.7.0}"   # the version k8s.io/kubernetes v1.37.2 itself requires
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
GIE_VERSION="${GIE_VERSION:-v1.5.0}"     # as tests/cluster/crds.py and fetch_crds.sh
KEDA_VERSION="${KEDA_VERSION:-v2.21.0}"  # as tests/cluster/crds.py and fetch_crds.sh
KEDA_HTTP_VERSION="${KEDA_HTTP_VERSION:-v0.12.0}"
BIN="${GEMMA_K8S_CACHE:-$HOME/.cache/gemma-rust-operator/k8s-v$K8S_VERSION/bin}"
export PATH="/usr/local/go/bin:$PATH"
export GOFLAGS="${GOFLAGS:--p=2}"
export CGO_ENABLED=0
export GOTOOLCHAIN=local

STAGING=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
  cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api cri-client
  cri-streaming csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms kube-aggregator
  kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics mount-utils
  pod-security-admission sample-apiserver streaming)

mkdir -p "$BIN"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

need() { for b in "$@"; do [[ -x "$BIN/$b" ]] || return 0; done; return 1; }

build_kubernetes() {
  need kube-apiserver kube-scheduler kube-controller-manager kubectl || { echo "kubernetes: cached"; return; }
  local d="$WORK/k8s"; mkdir -p "$d"; cd "$d"
  {
    echo "module local/k8sbuild"; echo; echo "go 1.26.0"; echo
    echo "require k8s.io/kubernetes v$K8S_VERSION"; echo; echo "replace ("
    for m in "${STAGING[@]}"; do echo "	k8s.io/$m => k8s.io/$m $STAGING_VERSION"; done
    echo ")"
  } > go.mod
  # A blank-import file makes `go mod tidy` record every dependency the four commands need.
  {
    echo "package tools"; echo "import ("
    for c in kube-apiserver kube-scheduler kube-controller-manager kubectl; do echo "	_ \"k8s.io/kubernetes/cmd/$c\""; done
    echo ")"
  } > tools.go
  # tools.go imports main packages, which Go refuses to compile, but `go mod tidy` only needs the graph.
  go mod tidy -e
  local major="${K8S_VERSION%%.*}" rest="${K8S_VERSION#*.}"; local minor="${rest%%.*}"
  local ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  rm tools.go
  nice -n 10 go build -trimpath -ldflags "$ld" -o "$BIN/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl
}

build_single() {  # name module version package [extra ldflags]
  local name="$1" mod="$2" ver="$3" pkg="$4" extra="${5:-}"
  need "$name" || { echo "$name: cached"; return; }
  local d="$WORK/$name"; mkdir -p "$d"; cd "$d"
  printf 'module local/%sbuild\n\ngo 1.26.0\n\nrequire %s %s\n' "$name" "$mod" "$ver" > go.mod
  printf 'package tools\nimport _ "%s"\n' "$pkg" > tools.go
  go mod tidy -e
  rm tools.go
  nice -n 10 go build -trimpath -ldflags "-s -w $extra" -o "$d/out" "$pkg"
  mv "$d/out" "$BIN/$name"
}

build_in_module() {  # module version name:package...   (each built as <name> from the module's own go.mod)
  local mod="$1" ver="$2"; shift 2
  local todo=() pair
  for pair in "$@"; do need "${pair%%:*}" && todo+=("$pair"); done
  [[ ${#todo[@]} -gt 0 ]] || { echo "$mod $ver: cached"; return; }
  local d="$WORK/$(basename "$mod")-$ver" src
  mkdir -p "$WORK/dl"; cd "$WORK/dl"; printf 'module local/dl\n\ngo 1.26.0\n' > go.mod
  src="$(go mod download -json "$mod@$ver" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -n "$src" ]] || { echo "go mod download $mod@$ver gave no directory" >&2; return 1; }
  cp -r "$src" "$d"; chmod -R u+w "$d"; cd "$d"
  for pair in "${todo[@]}"; do
    nice -n 10 go build -trimpath -ldflags "-s -w" -o "$d/out-${pair%%:*}" "./${pair#*:}"
    mv "$d/out-${pair%%:*}" "$BIN/${pair%%:*}"
  done
}

# kwok ships no default stages in its binary (kwokctl embeds them); keep the release's own stage files
# (node initialize + lease heartbeat, pod fast lifecycle) next to the binaries.
copy_kwok_stages() {
  local out="$BIN/../kwok-stages"
  [[ -f "$out/pod-ready.yaml" ]] && { echo "kwok stages: cached"; return; }
  local d="$WORK/kwok-stages"; mkdir -p "$d" "$out"; cd "$d"
  printf 'module local/kwokstages\n\ngo 1.26.0\n' > go.mod
  local src; src="$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  for sub in node/fast node/heartbeat-with-lease pod/fast; do
    for f in "$src/kustomize/stage/$sub"/*.yaml; do
      [[ "$(basename "$f")" == kustomization.yaml ]] || cp "$f" "$out/"
    done
  done
  chmod 644 "$out"/*.yaml
}

PARTS=("$@")
[[ ${#PARTS[@]} -gt 0 ]] || PARTS=(etcd kwok kubernetes helm kwok-stages epp keda keda-http)
want() { local p; for p in "${PARTS[@]}"; do [[ "$p" == "$1" ]] && return 0; done; return 1; }
for p in "${PARTS[@]}"; do
  case "$p" in etcd|kwok|kubernetes|helm|kwok-stages|epp|keda|keda-http) ;; *) echo "unknown part: $p" >&2; exit 2 ;; esac
done

start=$(date +%s)
if want etcd; then build_single etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3; fi
if want kwok; then build_single kwok sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok; fi
if want kubernetes; then build_kubernetes; fi
if want helm; then
  build_single helm helm.sh/helm/v3 "$HELM_VERSION" helm.sh/helm/v3/cmd/helm \
    "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
fi
if want kwok-stages; then copy_kwok_stages; fi
if want epp; then
  build_single "epp-$GIE_VERSION" sigs.k8s.io/gateway-api-inference-extension "$GIE_VERSION" \
    sigs.k8s.io/gateway-api-inference-extension/cmd/epp
fi
if want keda; then build_in_module github.com/kedacore/keda/v2 "$KEDA_VERSION" "keda-$KEDA_VERSION:cmd/operator"; fi
if want keda-http; then
  build_in_module github.com/kedacore/http-add-on "$KEDA_HTTP_VERSION" \
    "keda-http-interceptor-$KEDA_HTTP_VERSION:interceptor" "keda-http-scaler-$KEDA_HTTP_VERSION:scaler"
fi
echo "built into $BIN in $(( $(date +%s) - start ))s"
ls -l "$BIN"
