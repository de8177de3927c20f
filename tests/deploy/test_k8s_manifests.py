"""deploy/k8s renders (``kubectl kustomize``, offline) and every object validates: the
KubeRay kinds and CloudNativePG's ``Cluster`` against their vendored CRD schemas
(deploy/k8s/crds, Apache-2.0),
the built-in kinds against the Kubernetes schemas (kubernetes-validate, strict: an
unknown field fails). No secret is inline anywhere under deploy/."""

from __future__ import annotations

import copy
import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from helpers.tools import require

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
CRDS = K8S / "crds"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.32"
KUBECTL_TIMEOUT_S = 60


def _render(path: Path) -> list[dict[str, Any]]:
    kubectl = require("kubectl", "kubectl")["kubectl"]  # its built-in kustomize
    out = subprocess.run(
        [kubectl, "kustomize", str(path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=KUBECTL_TIMEOUT_S,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """additionalProperties: false wherever the CRD lists properties and does not
    preserve unknown fields, so a misspelt field fails instead of being dropped."""
    s = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


# libyaml's loader where built (the vendored CRDs are ~3 MB of YAML).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=1)
def _crd_validators() -> dict[str, jsonschema.Draft7Validator]:
    out = {}
    for path in CRDS.glob("*.yaml"):
        crd = yaml.load(path.read_text(), Loader=_LOADER)
        kind = crd["spec"]["names"]["kind"]
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        out[kind] = jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))
    return out


CRD_GROUPS = ("ray.io/", "postgresql.cnpg.io/")


def _validate(doc: dict[str, Any], crds: dict[str, jsonschema.Draft7Validator]) -> list[str]:
    if doc["apiVersion"].startswith(CRD_GROUPS):
        return [f"{e.json_path}: {e.message}" for e in crds[doc["kind"]].iter_errors(doc)]
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_renders_and_validates(overlay: Path) -> None:
    docs = _render(overlay)
    crds = _crd_validators()
    errors = {f"{d['kind']}/{d['metadata']['name']}": _validate(d, crds) for d in docs}
    assert not {k: v for k, v in errors.items() if v}, errors
    kinds = {d["kind"] for d in docs}
    assert {"RayCluster", "RayJob", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    assert len({"StatefulSet", "Deployment"} & kinds) == 1, "one kind of API server"
    assert "Secret" not in kinds
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    workers = cluster["spec"]["workerGroupSpecs"]
    assert workers, "an overlay adds its booking's worker group"
    for group in workers:
        booking = group["groupName"]
        assert f"booking:{booking}" in group["rayStartParams"]["resources"]
        pod = group["template"]["spec"]
        assert pod["nodeSelector"] and pod["tolerations"]
    if "StatefulSet" in kinds:  # one API server, its SQLite store on a volume
        sts = next(d for d in docs if d["kind"] == "StatefulSet")
        assert sts["spec"]["replicas"] == 1
        assert sts["spec"]["volumeClaimTemplates"], "the store lives on a persistent volume"


def test_ha_overlay_runs_replicas_on_an_operator_managed_postgres() -> None:
    docs = _render(K8S / "overlays" / "ha-postgres")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    [api] = by_kind["Deployment"]
    assert api["spec"]["replicas"] >= 2
    assert api["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = api["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    [pdb] = [p for p in by_kind["PodDisruptionBudget"] if p["metadata"]["name"] == "ito-api"]
    assert pdb["spec"]["minAvailable"] >= 1 and "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"] == api["spec"]["selector"]["matchLabels"]
    # The store is a reference to the operator's Cluster: its -rw Service, no password.
    [cluster] = by_kind["Cluster"]
    assert cluster["spec"]["instances"] >= 3
    [config] = [c for c in by_kind["ConfigMap"] if c["metadata"]["name"] == "ito-api-config"]
    url = config["data"]["ITO_DB"]
    assert url.startswith(f"postgresql://ito@{cluster['metadata']['name']}-rw:")
    assert ":" not in url.split("@")[0].removeprefix("postgresql://")  # no password
    mounted = {v["name"]: v for v in pod["volumes"]}
    assert mounted["db-password"]["secret"]["secretName"] == f"{cluster['metadata']['name']}-app"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "db-password")
    assert config["data"]["ITO_DB_PASSWORD_FILE"].startswith(mount["mountPath"] + "/")


def test_validation_catches_a_misspelt_field() -> None:
    """The checks above can fail: a typo in a RayCluster and in a StatefulSet."""
    docs = _render(OVERLAYS[0])
    crds = _crd_validators()
    cluster = copy.deepcopy(next(d for d in docs if d["kind"] == "RayCluster"))
    cluster["spec"]["headGroupSpec"]["rayStartParam"] = {}
    assert _validate(cluster, crds)
    sts = copy.deepcopy(next(d for d in docs if d["kind"] == "StatefulSet"))
    sts["spec"]["replica"] = 1
    assert _validate(sts, crds)
    ha = _render(K8S / "overlays" / "ha-postgres")
    cluster = copy.deepcopy(next(d for d in ha if d["kind"] == "Cluster"))
    assert not _validate(cluster, crds)
    cluster["spec"]["instance"] = 3
    assert _validate(cluster, crds)


# A secret value written into a file: key material, an API key, or a credential-named
# variable or field with a literal value (references and $VAR expansions are fine).
_CREDENTIAL = re.compile(r"(?i)(password|passwd|token|secret|api[_-]?key|private[_-]?key)")
_REFERENCE_KEYS = {"secretName", "secretKeyRef", "secretRef", "name", "key"}
_TEXT_PATTERNS = [
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"\bito_[A-Za-z0-9]{20,}"),
    re.compile(
        r"(?im)^[ \t]*(?:export[ \t]+)?\w*(?:password|passwd|token|secret|api_?key)\w*"
        r"=(?![\"']?[$<(])[\"']?[A-Za-z0-9+/=_.-]{8,}"
    ),
]


def _yaml_secrets(node: Any, where: str) -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        if node.get("kind") == "Secret" and (node.get("data") or node.get("stringData")):
            found.append(f"{where}: inline Secret")
        env_name = node.get("name")
        if (
            isinstance(env_name, str)
            and _CREDENTIAL.search(env_name)
            and isinstance(node.get("value"), str)
            and not node["value"].startswith("$")
        ):
            found.append(f"{where}: env {env_name} has a literal value")
        for k, v in node.items():
            # A *_FILE setting whose value is a path names where a secret is mounted.
            where_it_is = str(k).endswith("_FILE") and isinstance(v, str) and v.startswith("/")
            if (
                isinstance(v, str)
                and _CREDENTIAL.search(str(k))
                and not where_it_is
                and str(k) not in _REFERENCE_KEYS
                and not v.startswith("$")
            ):
                found.append(f"{where}: {k} has a literal value")
            found += _yaml_secrets(v, where)
    elif isinstance(node, list):
        for v in node:
            found += _yaml_secrets(v, where)
    return found


def _inline_secrets(root: Path) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if not path.is_file() or "crds" in path.relative_to(root).parts:
            continue  # crds/: vendored schemas, no values
        text = path.read_text(errors="replace")
        if path.suffix in (".yaml", ".yml"):
            for doc in yaml.safe_load_all(text):
                found += _yaml_secrets(doc, str(path))
        found += [f"{path}: {m.group(0)[:40]}" for p in _TEXT_PATTERNS for m in p.finditer(text)]
    return found


def test_no_inline_secret_under_deploy() -> None:
    assert not _inline_secrets(REPO / "deploy")


def test_secret_scan_finds_a_planted_secret(tmp_path: Path) -> None:
    (tmp_path / "leak.yaml").write_text(
        "apiVersion: v1\nkind: Secret\nmetadata: {name: x}\nstringData: {k: v}\n"
    )
    (tmp_path / "job.sh").write_text("export RAY_TOKEN=abcdef0123456789\n")
    (tmp_path / "pod.yaml").write_text("env:\n  - name: HF_TOKEN\n    value: hf_abcdefgh\n")
    (tmp_path / "ok.sh").write_text('export RAY_TOKEN="$(ray get-auth-token)"\n')
    found = _inline_secrets(tmp_path)
    assert len(found) == 3, found


# --- hardening: token from a Secret, locked-down containers, network, mounts -----------
SHARED_SECRETS = {"ito-launch-key", "ito-ray-token"}


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod spec of the render, by where it sits."""
    pods: dict[str, dict[str, Any]] = {}
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("StatefulSet", "Deployment"):
            pods[name] = d["spec"]["template"]["spec"]
        elif d["kind"] == "RayCluster":
            pods[f"{name}/head"] = d["spec"]["headGroupSpec"]["template"]["spec"]
            for g in d["spec"]["workerGroupSpecs"]:
                pods[f"{name}/{g['groupName']}"] = g["template"]["spec"]
        elif d["kind"] == "RayJob":
            pods[f"{name}/submitter"] = d["spec"]["submitterPodTemplate"]["spec"]
    return pods


def hardening_faults(docs: list[dict[str, Any]]) -> list[str]:
    faults: list[str] = []
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    auth = cluster["spec"].get("authOptions") or {}
    if auth.get("mode") != "token" or auth.get("secretName") not in SHARED_SECRETS:
        faults.append("RayCluster: token auth is not from a Secret (authOptions)")
    for where, pod in _pods(docs).items():
        if pod.get("automountServiceAccountToken") is not False:
            faults.append(f"{where}: mounts a service account token")
        psc = pod.get("securityContext") or {}
        if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            faults.append(f"{where}: no RuntimeDefault seccomp profile")
        for c in pod["containers"]:
            sc = c.get("securityContext") or {}
            at = f"{where}/{c['name']}"
            if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
                faults.append(f"{at}: may run as root")
            if sc.get("allowPrivilegeEscalation") is not False:
                faults.append(f"{at}: privilege escalation allowed")
            if (sc.get("capabilities") or {}).get("drop") != ["ALL"]:
                faults.append(f"{at}: capabilities not all dropped")
            if not isinstance(sc.get("readOnlyRootFilesystem"), bool):
                faults.append(f"{at}: readOnlyRootFilesystem not decided")
            elif "/bk-" not in where and not sc["readOnlyRootFilesystem"]:
                faults.append(f"{at}: writable root (only GPU workers need one)")
            for env in c.get("env", []):
                if env["name"].startswith("RAY_AUTH_TOKEN") and "value" in env:
                    faults.append(f"{at}: the Ray token is inline")
        if "/bk-" in where:  # a booking's nodes: its own volumes and the shared keys only
            booking = where.rsplit("/", 1)[1]
            for v in pod.get("volumes", []):
                secret = (v.get("secret") or {}).get("secretName")
                claim = (v.get("persistentVolumeClaim") or {}).get("claimName", "")
                ok = (
                    secret in SHARED_SECRETS
                    or "emptyDir" in v
                    or claim.startswith(f"ito-{booking}-")
                )
                if not ok:
                    faults.append(f"{where}: volume {v['name']} is not the booking's own")
    # The API server: a StatefulSet on SQLite, a Deployment of replicas on PostgreSQL.
    api = next(d for d in docs if d["kind"] in ("StatefulSet", "Deployment"))
    env = {e["name"]: e for e in api["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    ref = ((env.get("RAY_AUTH_TOKEN") or {}).get("valueFrom") or {}).get("secretKeyRef") or {}
    if ref.get("name") != auth.get("secretName"):
        faults.append(f"{api['kind']}/ito-api: the Ray token is not the cluster's Secret")
    faults += _network_faults(docs, cluster)
    return faults


def _network_faults(docs: list[dict[str, Any]], cluster: dict[str, Any]) -> list[str]:
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    head = [
        p
        for p in policies
        if p["spec"]["podSelector"]["matchLabels"].get("ray.io/node-type") == "head"
    ]
    if not head:
        return ["no NetworkPolicy selects the Ray head"]
    faults = []
    for rule in head[0]["spec"].get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        peers = [p.get("podSelector", {}).get("matchLabels", {}) for p in rule.get("from", [])]
        if not rule.get("from") or not ports:
            faults.append("a head ingress rule allows any peer or any port")
        if 8265 in ports and peers != [{"app.kubernetes.io/name": "ito-api"}]:
            faults.append("the dashboard answers more than the API server")
        if 6379 in ports and not all(peers):
            faults.append("the GCS answers any pod")
    params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    if not {"node-manager-port", "object-manager-port", "min-worker-port"} <= set(params):
        faults.append("the head's ports are not fixed, so the policy cannot name them")
    return faults + _run_port_faults(policies, cluster)


def _run_port_faults(policies: list[dict[str, Any]], cluster: dict[str, Any]) -> list[str]:
    """Each booking's runs take ports from its ITO_LISTEN_PORTS range, which answers
    that booking's own pods and no one else (policies only add: any rule that opens
    part of the range to another peer is a hole)."""
    faults = []
    for group in cluster["spec"]["workerGroupSpecs"]:
        template = group["template"]
        labels = (template.get("metadata") or {}).get("labels") or {}
        booking = labels.get("ito.dev/booking")
        if not booking:
            faults.append(f"{group['groupName']}: its pods carry no ito.dev/booking label")
            continue
        env = {
            e["name"]: e.get("value")
            for c in template["spec"]["containers"]
            for e in c.get("env", [])
        }
        wanted = re.fullmatch(r"(\d+)-(\d+)", env.get("ITO_LISTEN_PORTS") or "")
        if not wanted:
            faults.append(f"{booking}: no ITO_LISTEN_PORTS range on its Ray workers")
            continue
        low, high = int(wanted[1]), int(wanted[2])
        # The labels KubeRay puts on the group's pods, besides the template's own.
        pod = {
            **labels,
            "ray.io/cluster": cluster["metadata"]["name"],
            "ray.io/node-type": "worker",
        }
        opened = False
        for policy in policies:
            selector = policy["spec"]["podSelector"].get("matchLabels") or {}
            if any(pod.get(k) != v for k, v in selector.items()):
                continue
            for rule in policy["spec"].get("ingress", []):
                spans = [(p["port"], p.get("endPort", p["port"])) for p in rule.get("ports", [])]
                hit = (
                    [(a, b) for a, b in spans if a <= high and b >= low] if spans else [(1, 65535)]
                )
                if not hit:
                    continue
                peers = rule.get("from") or []
                own = peers and all(
                    set(f) == {"podSelector"}
                    and f["podSelector"] == {"matchLabels": {"ito.dev/booking": booking}}
                    for f in peers
                )
                if not own:
                    faults.append(
                        f"{policy['metadata']['name']}: the runs' ports of {booking} "
                        "answer more than its own pods"
                    )
                elif any(a <= low and b >= high for a, b in hit):
                    opened = True
        if not opened:
            faults.append(f"{booking}: no policy opens its runs' ports to its own pods")
    return faults


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_deploy_is_hardened(overlay: Path) -> None:
    assert hardening_faults(_render(overlay)) == []


def test_hardening_check_catches_each_weakening() -> None:
    docs = _render(OVERLAYS[0])

    def weakened(edit: Any) -> list[str]:
        copy_ = copy.deepcopy(docs)
        edit(copy_)
        return hardening_faults(copy_)

    def kind(ds: list[dict[str, Any]], k: str) -> dict[str, Any]:
        return next(d for d in ds if d["kind"] == k)

    def head(ds: list[dict[str, Any]]) -> dict[str, Any]:
        spec: dict[str, Any] = kind(ds, "RayCluster")["spec"]["headGroupSpec"]
        return spec["template"]["spec"]

    def worker(ds: list[dict[str, Any]]) -> dict[str, Any]:
        spec: dict[str, Any] = kind(ds, "RayCluster")["spec"]["workerGroupSpecs"][0]
        return spec["template"]["spec"]

    assert weakened(lambda ds: kind(ds, "RayCluster")["spec"].pop("authOptions"))
    assert weakened(
        lambda ds: head(ds)["containers"][0]["securityContext"].update(
            allowPrivilegeEscalation=True
        )
    )
    assert weakened(
        lambda ds: head(ds)["containers"][0]["securityContext"].update(readOnlyRootFilesystem=False)
    )
    assert weakened(lambda ds: worker(ds)["containers"][0]["securityContext"].pop("capabilities"))
    assert weakened(
        lambda ds: worker(ds)["volumes"].append(
            {"name": "other", "persistentVolumeClaim": {"claimName": "ito-bk-other-data"}}
        )
    )
    assert weakened(
        lambda ds: worker(ds)["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    )
    assert weakened(
        lambda ds: kind(ds, "StatefulSet")["spec"]["template"]["spec"]["containers"][0][
            "env"
        ].append({"name": "RAY_AUTH_TOKEN_X", "value": "x"})
    )

    def head_policy(ds: list[dict[str, Any]]) -> dict[str, Any]:
        return next(d for d in ds if d["metadata"]["name"] == "ito-ray-head")

    assert weakened(
        lambda ds: head_policy(ds)["spec"]["ingress"][0]["from"].append({"podSelector": {}})
    )
    assert weakened(lambda ds: ds.remove(head_policy(ds)))

    def policy(ds: list[dict[str, Any]], name: str) -> dict[str, Any]:
        return next(d for d in ds if d["metadata"]["name"] == name)

    runs = "ito-runs-bk-example"
    # Ray's rule on the booked nodes opens every port again (the runs' range included).
    assert weakened(lambda ds: policy(ds, "ito-ray-workers")["spec"]["ingress"][0].pop("ports"))
    # The runs' range answers the whole Ray cluster, or no one.
    assert weakened(
        lambda ds: policy(ds, runs)["spec"]["ingress"][0]["from"].append(
            {"podSelector": {"matchLabels": {"ray.io/cluster": "ito-ray"}}}
        )
    )
    assert weakened(lambda ds: ds.remove(policy(ds, runs)))
    # The workers do not know the range, so the runs bind ephemeral ports.
    assert weakened(
        lambda ds: worker(ds)["containers"][0]["env"].remove(
            {"name": "ITO_LISTEN_PORTS", "value": "20000-20999"}
        )
    )
