#!/usr/bin/env bash
# The chart's pod template ValidatingAdmissionPolicy on a REAL kube-apiserver (no kubelet, no
# controllers needed): etcd + kube-apiserver on loopback, the CRD and the rendered policy
# applied, then tests/security/pod_policy_cases.check_admission_policy (every attack refused
# by `kubectl apply` with its field named, a compliant job accepted), its kubectl output shown.
#
#   scripts/check-pod-policy-vap.sh [WORKDIR]     (default /tmp/vap-k8s; the binaries are
#                                                  unpacked there from /work/shared/k8s/bin)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=${1:-/tmp/vap-k8s}
ASSETS=${K8S_ASSETS_SRC:-/work/shared/k8s/bin}
HELM=${MALLEUS_HELM:-$ROOT/.cache/bin/helm}
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$W"
cd "$W"
[ -x kube-apiserver ] || { xz -dc "$ASSETS/kube-apiserver.xz" > kube-apiserver; chmod +x kube-apiserver; }
[ -x etcd ] || { gunzip -c "$ASSETS/etcd.gz" > etcd; chmod +x etcd; }
[ -x kubectl ] || { xz -dc "$ASSETS/kubectl.xz" > kubectl; chmod +x kubectl; }

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
E=$(free_port); P=$(free_port); A=$(free_port)

rm -rf pki etcd-data && mkdir -p pki
openssl req -x509 -newkey rsa:2048 -nodes -keyout pki/ca.key -out pki/ca.crt -days 1 -subj /CN=vap-ca 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout pki/apiserver.key -out pki/apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > pki/san.ext
openssl x509 -req -in pki/apiserver.csr -CA pki/ca.crt -CAkey pki/ca.key -CAcreateserial -out pki/apiserver.crt -days 1 -extfile pki/san.ext 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout pki/admin.key -out pki/admin.csr -subj /O=system:masters/CN=admin 2>/dev/null
openssl x509 -req -in pki/admin.csr -CA pki/ca.crt -CAkey pki/ca.key -CAcreateserial -out pki/admin.crt -days 1 2>/dev/null
openssl genrsa -out pki/sa.key 2048 2>/dev/null
openssl rsa -in pki/sa.key -pubout -out pki/sa.pub 2>/dev/null

./etcd --data-dir etcd-data --listen-client-urls "http://127.0.0.1:$E" --advertise-client-urls "http://127.0.0.1:$E" \
  --listen-peer-urls "http://127.0.0.1:$P" --log-level error > etcd.log 2>&1 &
ETCD=$!
./kube-apiserver --etcd-servers "http://127.0.0.1:$E" --bind-address 127.0.0.1 --advertise-address 127.0.0.1 \
  --secure-port "$A" --tls-cert-file pki/apiserver.crt --tls-private-key-file pki/apiserver.key --client-ca-file pki/ca.crt \
  --service-account-issuer https://kubernetes.default.svc --service-account-key-file pki/sa.pub \
  --service-account-signing-key-file pki/sa.key --service-cluster-ip-range 10.96.0.0/16 \
  --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction --endpoint-reconciler-type none \
  --enable-aggregator-routing=true > apiserver.log 2>&1 &
APISERVER=$!
stop() {  # the API server first (it keeps redialling a stopped etcd), then etcd
  for pid in "$APISERVER" "$ETCD"; do
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -9 "$pid" 2>/dev/null || true
  done
}
trap stop EXIT

cat > admin.kubeconfig <<KC
apiVersion: v1
kind: Config
clusters: [{name: vap, cluster: {server: "https://127.0.0.1:$A", certificate-authority: $W/pki/ca.crt}}]
users: [{name: admin, user: {client-certificate: $W/pki/admin.crt, client-key: $W/pki/admin.key}}]
contexts: [{name: vap, context: {cluster: vap, user: admin}}]
current-context: vap
KC
export KUBECONFIG=$W/admin.kubeconfig
for _ in $(seq 1 60); do
  [ "$(./kubectl get --raw /readyz 2>/dev/null)" = ok ] && break
  sleep 1
done
echo "+ kubectl version"; ./kubectl version
echo "+ kubectl apply -f crds/malleusjob.yaml"; ./kubectl apply -f "$ROOT/crds/malleusjob.yaml"
./kubectl wait --for condition=Established crd/malleusjobs.malleus.io --timeout 60s
for _ in $(seq 1 30); do ./kubectl get namespace default >/dev/null 2>&1 && break; sleep 1; done
./kubectl create namespace malleus-system
"$HELM" template malleus "$ROOT/helm/malleus-operator" -n malleus-system \
  --show-only templates/admission-policy.yaml > admission-policy.yaml
echo "+ kubectl apply -f admission-policy.yaml   (helm template malleus -n malleus-system --show-only templates/admission-policy.yaml)"
./kubectl apply -f admission-policy.yaml
sleep 2  # the policy's type checking and the binding are picked up asynchronously
./kubectl get validatingadmissionpolicy -o jsonpath='{.items[0].status}'; echo
KUBECTL="$W/kubectl" "$PY" - "$ROOT" <<'PYEOF'
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from tests.security.pod_policy_cases import check_admission_policy

def kubectl(*args, input=None):
    done = subprocess.run([os.environ["KUBECTL"], *args], input=input, capture_output=True, text=True)
    print("+ kubectl " + " ".join(args) + ("  <<< " + json.dumps(json.loads(input)["spec"]["podTemplate"]) if input else ""))
    print(f"  rc={done.returncode} {(done.stdout + done.stderr).strip()}")
    return done

# the binding takes effect within a second or two of its creation: wait for a refusal
probe = __import__("tests.security.pod_policy_cases", fromlist=["x"])
for _ in range(30):
    m = probe.job_manifest("probe", "malleus-system", probe.ATTACKS[0].template)
    d = subprocess.run([os.environ["KUBECTL"], "apply", "--dry-run=server", "-f", "-"], input=json.dumps(m), capture_output=True, text=True)
    if d.returncode != 0:
        break
    time.sleep(1)
check_admission_policy(kubectl, "malleus-system")

# The parameters are read from the ConfigMap: allowSecretEnv "true" admits the secret env var.
secret = next(a for a in probe.ATTACKS if a.id == "secret-env")
kubectl("patch", "configmap", "malleus-malleus-operator-pod-template-policy", "-n", "malleus-system",
        "--type", "merge", "-p", '{"data": {"allowSecretEnv": "true"}}')
for _ in range(30):
    done = kubectl("apply", "-f", "-", input=json.dumps(probe.job_manifest("secret-env-allowed", "malleus-system", secret.template)))
    if done.returncode == 0:
        break
    time.sleep(1)
assert done.returncode == 0, done.stderr

# The binding covers the namespaces the operator watches, and only those.
hostpath = probe.ATTACKS[0]
kubectl("create", "namespace", "elsewhere")
done = kubectl("apply", "-f", "-", input=json.dumps(probe.job_manifest("unwatched", "elsewhere", hostpath.template)))
assert done.returncode == 0, done.stderr
print("ALL CHECKS PASSED")
PYEOF
echo "+ kubectl get validatingadmissionpolicy -o jsonpath='{.items[0].status}'"
./kubectl get validatingadmissionpolicy -o jsonpath='{.items[0].status}'; echo
