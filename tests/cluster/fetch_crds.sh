#!/usr/bin/env bash
# Fetch, once, the third-party CRDs the operator's optional kinds need in tests, from their projects' Go
# modules through the Go module proxy, into a cache outside the checkout keyed by version:
#   $GEMMA_CACHE/crds/<module>-<version>/<file>   (default $HOME/.cache/gemma-rust-operator/crds/...)
# Only the CRDs the tests install are kept, from each module's config/crd/bases/:
#   github.com/kedacore/keda/v2                      keda.sh_scaledobjects.yaml, and the other CRDs KEDA's operator
#                                                    watches (scaled jobs, trigger authentications, cloud event
#                                                    sources), which it needs to start
#   github.com/kedacore/http-add-on                  http.keda.sh_httpscaledobjects.yaml
#   sigs.k8s.io/gateway-api-inference-extension      inference.networking.k8s.io_inferencepools.yaml, and the
#                                                    InferenceObjective and InferenceModelRewrite CRDs its
#                                                    endpoint picker watches (inference.networking.x-k8s.io)
# Versions are pinned: the proxy answers @latest for neither reliably. tests/cluster/crds.py reads the same
# paths. A file already in the cache is never fetched again.
set -euo pipefail

KEDA_VERSION="${KEDA_VERSION:-v2.21.0}"
KEDA_HTTP_VERSION="${KEDA_HTTP_VERSION:-v0.12.0}"
GIE_VERSION="${GIE_VERSION:-v1.5.0}"   # the endpoint picker build_binaries.sh builds
OUT="${GEMMA_CACHE:-$HOME/.cache/gemma-rust-operator}/crds"
export PATH="/usr/local/go/bin:$PATH"
export GOFLAGS=-mod=mod
export GOTOOLCHAIN=local

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
printf 'module local/crds\n\ngo 1.26.0\n' > "$WORK/go.mod"

fetch() {  # module version cache-name file...
  local mod="$1" ver="$2" name="$3"; shift 3
  local dest="$OUT/$name-$ver" missing=()
  for f in "$@"; do [[ -f "$dest/$f" ]] || missing+=("$f"); done
  if [[ ${#missing[@]} -eq 0 ]]; then echo "$name $ver: cached"; return; fi
  local src
  src="$(cd "$WORK" && go mod download -json "$mod@$ver" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -n "$src" ]] || { echo "go mod download $mod@$ver gave no directory" >&2; exit 1; }
  mkdir -p "$dest"
  for f in "${missing[@]}"; do install -m 644 "$src/config/crd/bases/$f" "$dest/$f"; done
  echo "$name $ver: fetched into $dest"
}

fetch github.com/kedacore/keda/v2 "$KEDA_VERSION" keda keda.sh_scaledobjects.yaml keda.sh_scaledjobs.yaml \
  keda.sh_triggerauthentications.yaml keda.sh_clustertriggerauthentications.yaml \
  eventing.keda.sh_cloudeventsources.yaml eventing.keda.sh_clustercloudeventsources.yaml
fetch github.com/kedacore/http-add-on "$KEDA_HTTP_VERSION" keda-http-add-on http.keda.sh_httpscaledobjects.yaml
fetch sigs.k8s.io/gateway-api-inference-extension "$GIE_VERSION" gateway-api-inference-extension \
  inference.networking.k8s.io_inferencepools.yaml inference.networking.x-k8s.io_inferenceobjectives.yaml \
  inference.networking.x-k8s.io_inferencemodelrewrites.yaml
