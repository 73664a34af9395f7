#!/usr/bin/env bash
# Validates the Helm chart (helm/sortie): `helm lint`, `helm template` with the default
# values and with values-production.yaml, and a strict Kubernetes schema check
# (kubeconform) of every rendered manifest. Called by .ci/run.
#
# Tools are installed by the project's own means and cached under target/tools, so the
# second run is quick:
#   - helm and kubeconform: `go install` from the Go module proxy (needs `go`);
#   - the Kubernetes JSON schemas: the `kubernetes-validate` package from PyPI (it ships
#     them), installed with pip and converted once into the layout kubeconform reads.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_VERSION=v3.16.4
KUBECONFORM_VERSION=v0.6.7
KUBERNETES_VALIDATE_VERSION=1.37.0
KUBE_VERSION=1.31.0
CHART=helm/sortie

TOOLS=$PWD/target/tools
mkdir -p "$TOOLS"
HELM=$TOOLS/helm-$HELM_VERSION
KUBECONFORM=$TOOLS/kubeconform-$KUBECONFORM_VERSION
SCHEMAS=$TOOLS/kubernetes-json-schema-$KUBERNETES_VALIDATE_VERSION

go_install() { # binary-path module@version
    local target=$1 module=$2
    [ -x "$target" ] && return
    if ! command -v go >/dev/null 2>&1; then
        echo "dev/helm-check.sh: 'go' is not installed; it is needed once to build $module" >&2
        echo "  (install Go 1.22 or newer, e.g. 'apt-get install golang', then run this again)" >&2
        exit 1
    fi
    echo "== installing $module into target/tools"
    local gobin
    gobin=$(mktemp -d "$TOOLS/gobin.XXXXXX")
    GOBIN=$gobin GOFLAGS=-buildvcs=false go install "$module"
    mv "$gobin"/* "$target"
    rmdir "$gobin"
}
go_install "$HELM" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
go_install "$KUBECONFORM" "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"

# kubernetes-validate ships "local" schemas whose $refs point at /api/_definitions.json
# under an $id on kubernetes.io; kubeconform needs files it can resolve offline. Drop the
# $id and make the refs relative to the schema's own directory.
if [ ! -f "$SCHEMAS/.complete" ]; then
    echo "== installing Kubernetes JSON schemas (kubernetes-validate $KUBERNETES_VALIDATE_VERSION from PyPI)"
    rm -rf "$SCHEMAS" "$SCHEMAS.pip"
    # A venv of our own: its pip exists even where the system Python has none.
    [ -x "$TOOLS/venv/bin/pip" ] || python3 -m venv "$TOOLS/venv"
    "$TOOLS/venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
        --target "$SCHEMAS.pip" "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
    python3 - "$SCHEMAS.pip" "$SCHEMAS" "$KUBE_VERSION" <<'PY'
import json, os, sys
src_root, out_root, version = sys.argv[1:4]
src = os.path.join(src_root, "kubernetes_validate", "kubernetes-json-schema", f"v{version}-local-strict")
out = os.path.join(out_root, f"v{version}-standalone-strict")
os.makedirs(out)
for name in os.listdir(src):
    if not name.endswith(".json"):
        continue
    with open(os.path.join(src, name)) as f:
        schema = json.load(f)
    schema.pop("$id", None)
    text = json.dumps(schema).replace('"/api/_definitions.json#', '"_definitions.json#')
    with open(os.path.join(out, name), "w") as f:
        f.write(text)
PY
    rm -rf "$SCHEMAS.pip"
    touch "$SCHEMAS/.complete"
fi

echo "== helm $HELM_VERSION, kubeconform $KUBECONFORM_VERSION, Kubernetes $KUBE_VERSION schemas"

# The chart ships a copy of the topology: it must not drift from the source of truth.
if ! diff -u topology/topics.yaml "$CHART/files/topics.yaml"; then
    echo "helm/sortie/files/topics.yaml differs from topology/topics.yaml: copy it over" >&2
    exit 1
fi

# The dashboard is valid JSON and uses only metric names the services define.
python3 - "$CHART/dashboards/sortie.json" services/*/src/metrics.rs <<'PY'
import json, re, sys
dashboard = json.load(open(sys.argv[1]))
defined = set()
for path in sys.argv[2:]:
    defined |= set(re.findall(r'"(sortie_[a-z0-9_]+)"', open(path).read()))
used = set()
def walk(node):
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            used.update(re.findall(r"\b(sortie_[a-z0-9_]+)", node["expr"]))
        for value in node.values():
            walk(value)
    elif isinstance(node, list):
        for value in node:
            walk(value)
walk(dashboard)
base = {re.sub(r"_(bucket|count|sum)$", "", name) for name in used}
unknown = sorted(name for name in base if name not in defined)
if unknown:
    sys.exit(f"the dashboard uses metrics no service defines: {unknown}")
print(f"dashboard: {len(dashboard['panels'])} panels, {len(base)} metrics, all defined")
PY

out=$(mktemp -d "${TMPDIR:-/tmp}/sortie-helm.XXXXXX")
trap 'rm -rf "$out"' EXIT

echo "== helm lint"
"$HELM" lint --strict "$CHART"
"$HELM" lint --strict "$CHART" -f "$CHART/values-production.yaml"

for values in default production; do
    args=()
    [ "$values" = production ] && args=(-f "$CHART/values-production.yaml")
    echo "== helm template ($values values)"
    "$HELM" template sortie "$CHART" --namespace sortie --kube-version "$KUBE_VERSION" \
        "${args[@]}" >"$out/$values.yaml"
    grep -c '^kind: ' "$out/$values.yaml" | sed 's/^/   documents: /'
    echo "== kubeconform ($values values)"
    # Every built-in kind against the Kubernetes $KUBE_VERSION schemas, strictly.
    "$KUBECONFORM" -strict -summary -kubernetes-version "$KUBE_VERSION" \
        -schema-location "$SCHEMAS/{{ .NormalizedKubernetesVersion }}-standalone{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
        -skip ServiceMonitor "$out/$values.yaml"
    # The ServiceMonitor is a CRD without a schema here: only it may be missing one.
    if grep -q '^kind: ServiceMonitor' "$out/$values.yaml"; then
        "$HELM" template sortie "$CHART" --namespace sortie --kube-version "$KUBE_VERSION" \
            "${args[@]}" --show-only templates/servicemonitor.yaml >"$out/$values-servicemonitor.yaml"
        "$KUBECONFORM" -strict -summary -ignore-missing-schemas -kubernetes-version "$KUBE_VERSION" \
            -schema-location "$SCHEMAS/{{ .NormalizedKubernetesVersion }}-standalone{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
            "$out/$values-servicemonitor.yaml"
    fi
done
echo "== helm chart OK"
