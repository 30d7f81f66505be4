#!/usr/bin/env python3
"""Offline validation of deploy/kubernetes (no API server needed).

1. Every manifest file, and every kustomization (base, overlays/example,
   overlays/no-kvm, uninstall) rendered, is validated against the Kubernetes OpenAPI schemas
   that the `kubernetes-validate` package ships (strict: unknown fields are
   errors), for each version in KUBERNETES_VERSIONS.
2. Rendering: a small renderer of the kustomize features these files use
   (resources, images, JSON 6902 patches with a target); when `kubectl` is
   on PATH, `kubectl kustomize` renders too and both results must be equal,
   which keeps the renderer honest.
3. Facts a schema cannot know: the pinned sidecar releases, the node
   deployment flags, mounts and probes, the CSIDriver fields, that each
   sidecar's role grants no more than the rules its own repository ships,
   that every binding names an existing account and role, and that the
   examples ask only for what base installs (no hostNetwork pod).

Exit status 0 when everything holds; one line per failure otherwise.
"""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

ROOT = Path(os.environ.get("CRUST_MANIFESTS_DIR")
            or Path(__file__).resolve().parent.parent / "deploy" / "kubernetes")
KUBERNETES_VERSIONS = ["1.35.0", "1.37.0"]
KUSTOMIZATIONS = ["base", "overlays/example", "overlays/no-kvm", "uninstall"]

SIDECARS = {
    "csi-provisioner": "registry.k8s.io/sig-storage/csi-provisioner:v6.3.0",
    "csi-resizer": "registry.k8s.io/sig-storage/csi-resizer:v2.2.1",
    "csi-node-driver-registrar": "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.17.0",
    "livenessprobe": "registry.k8s.io/sig-storage/livenessprobe:v2.19.0",
    "csi-external-health-monitor-controller":
        "registry.k8s.io/sig-storage/csi-external-health-monitor-controller:v0.18.0",
}

# The rules each sidecar's repository ships (deploy/kubernetes/rbac.yaml at
# the pinned tag): (apiGroup, resource) -> verbs. Our roles must be subsets.
UPSTREAM_RULES = {
    "crust-csi-provisioner": {
        ("", "persistentvolumes"): {"get", "list", "watch", "create", "patch", "delete"},
        ("", "persistentvolumeclaims"): {"get", "list", "watch", "update"},
        ("storage.k8s.io", "storageclasses"): {"get", "list", "watch"},
        ("", "events"): {"list", "watch", "create", "update", "patch"},
        ("snapshot.storage.k8s.io", "volumesnapshots"): {"get", "list", "watch", "update"},
        ("snapshot.storage.k8s.io", "volumesnapshotcontents"): {"get", "list"},
        ("storage.k8s.io", "csinodes"): {"get", "list", "watch"},
        ("", "nodes"): {"get", "list", "watch"},
        ("storage.k8s.io", "volumeattachments"): {"get", "list", "watch"},
    },
    "crust-csi-provisioner-cfg": {
        ("coordination.k8s.io", "leases"): {"get", "watch", "list", "delete", "update", "create"},
        ("storage.k8s.io", "csistoragecapacities"):
            {"get", "list", "watch", "create", "update", "patch", "delete"},
        ("", "pods"): {"get"},
        ("apps", "replicasets"): {"get"},
    },
    "crust-csi-resizer": {
        ("", "persistentvolumes"): {"get", "list", "watch", "patch"},
        ("", "persistentvolumeclaims"): {"get", "list", "watch"},
        ("", "pods"): {"get", "list", "watch"},
        ("", "persistentvolumeclaims/status"): {"patch"},
        ("", "events"): {"list", "watch", "create", "update", "patch"},
        ("storage.k8s.io", "volumeattributesclasses"): {"get", "list", "watch"},
    },
    "crust-csi-resizer-cfg": {
        ("coordination.k8s.io", "leases"): {"get", "watch", "list", "delete", "update", "create"},
    },
    "crust-csi-health-monitor": {
        ("", "persistentvolumes"): {"get", "list", "watch"},
        ("", "persistentvolumeclaims"): {"get", "list", "watch"},
        ("", "nodes"): {"get", "list", "watch"},
        ("", "pods"): {"get", "list", "watch"},
        ("", "events"): {"get", "list", "watch", "create", "patch"},
    },
    # Ours: one merge patch of its own Node object.
    "crust-node-install": {("", "nodes"): {"patch"}},
}

failures = []


def fail(msg):
    failures.append(msg)


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


# --- a renderer of the kustomize subset used here ---------------------------

def json_pointer_parts(path):
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def apply_op(doc, op):
    parts = json_pointer_parts(op["path"])
    parent = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    last = parts[-1]
    kind = op["op"]
    if isinstance(parent, list):
        if kind == "add":
            parent.insert(len(parent) if last == "-" else int(last), op["value"])
        elif kind == "replace":
            parent[int(last)] = op["value"]
        elif kind == "remove":
            del parent[int(last)]
        else:
            raise ValueError(f"unsupported op {kind}")
    else:
        if kind in ("add", "replace"):
            if kind == "replace" and last not in parent:
                raise KeyError(op["path"])
            parent[last] = op["value"]
        elif kind == "remove":
            del parent[last]
        else:
            raise ValueError(f"unsupported op {kind}")


def matches(target, doc):
    gv = doc["apiVersion"].split("/")
    group, version = (gv[0], gv[1]) if len(gv) == 2 else ("", gv[0])
    return (target.get("group", "") == group
            and target.get("version", version) == version
            and target.get("kind", doc["kind"]) == doc["kind"]
            and target.get("name", doc["metadata"]["name"]) == doc["metadata"]["name"])


def render(directory):
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "resources", "images", "patches"}
    extra = set(k) - allowed
    if extra:
        raise ValueError(f"{directory}: renderer does not support {sorted(extra)}")
    docs = []
    for r in k.get("resources", []):
        p = (directory / r).resolve()
        docs.extend(render(p) if p.is_dir() else load_docs(p))
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"])
        hit = [d for d in docs if matches(patch["target"], d)]
        if not hit:
            raise ValueError(f"{directory}: patch target {patch['target']} matches nothing")
        for d in hit:
            for op in ops:
                apply_op(d, op)
    for img in k.get("images", []):
        for d in docs:
            spec = d.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                name, _, tag = c["image"].rpartition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    return docs


def key(d):
    m = d["metadata"]
    return (d["apiVersion"], d["kind"], m.get("namespace", ""), m["name"])


def kubectl_render(directory):
    out = subprocess.run(["kubectl", "kustomize", str(directory)],
                         check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d is not None]


# --- checks --------------------------------------------------------------------

def validate(docs, where):
    for d in docs:
        for v in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(d, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                fail(f"{where}: {key(d)} invalid for Kubernetes {v}: "
                     f"{'.'.join(str(p) for p in e.path)}: {e.message}")
            except Exception as e:  # unknown kind, version not shipped...
                fail(f"{where}: {key(d)} not validated for Kubernetes {v}: "
                     f"{getattr(e, 'message', e)}")


def by_kind(docs, kind, name):
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    fail(f"no {kind} {name}")
    return None


def container(ds, name):
    for c in ds["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    fail(f"{ds['metadata']['name']}: no container {name}")
    return {}


def env_field(c, name):
    for e in c.get("env", []):
        if e["name"] == name:
            return e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    return None


def check_semantics(docs):
    drv = by_kind(docs, "CSIDriver", "blk.crust.dev")
    if drv:
        want = {"attachRequired": False, "podInfoOnMount": True, "fsGroupPolicy": "File",
                "storageCapacity": True, "volumeLifecycleModes": ["Persistent"],
                "requiresRepublish": False, "seLinuxMount": False}
        for k, v in want.items():
            if drv["spec"].get(k) != v:
                fail(f"CSIDriver {k} = {drv['spec'].get(k)!r}, want {v!r}")

    images = {}
    for d in docs:
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            name = c["image"].rsplit(":", 1)[0].rsplit("/", 1)[1]
            images[name] = c["image"]
    for name, image in SIDECARS.items():
        if images.get(name) != image:
            fail(f"sidecar {name}: {images.get(name)!r}, want {image!r}")

    node = by_kind(docs, "DaemonSet", "crust-csi-node")
    if node:
        spec = node["spec"]["template"]["spec"]
        if not spec.get("hostPID"):
            fail("crust-csi-node: hostPID must be true (device-holder checks)")
        csi = container(node, "crust-csi")
        if not csi.get("securityContext", {}).get("privileged"):
            fail("crust-csi must be privileged")
        args = csi.get("args", [])
        for a in ["--expansion=node", "--allowed-target-prefix=/var/lib/kubelet/pods/"]:
            if a not in args:
                fail(f"crust-csi args lack {a}")
        if env_field(csi, "CRUST_CSI_NODE_ID") != "spec.nodeName":
            fail("crust-csi node id must come from spec.nodeName")
        mounts = {m["mountPath"]: m for m in csi.get("volumeMounts", [])}
        if mounts.get("/var/lib/kubelet", {}).get("mountPropagation") != "Bidirectional":
            fail("crust-csi: /var/lib/kubelet must be mounted with Bidirectional propagation")
        for p in ["/dev", "/var/lib/crust-csi", "/run/crust", "/opt", "/run/crust-runtime"]:
            if p not in mounts:
                fail(f"crust-csi: no mount at {p}")
        probe = csi.get("livenessProbe", {}).get("httpGet", {})
        lp = container(node, "liveness-probe")
        port = {p["name"]: p["containerPort"] for p in csi.get("ports", [])}.get(probe.get("port"))
        if f"--http-endpoint=:{port}" not in lp.get("args", []):
            fail("crust-csi's livenessProbe does not reach the liveness-probe sidecar")
        prov = container(node, "csi-provisioner")
        for a in ["--node-deployment=true", "--enable-capacity", "--strict-topology=true",
                  "--capacity-ownerref-level=1", "--snapshot-orphan-sweep-interval=0"]:
            if a not in prov.get("args", []):
                fail(f"csi-provisioner args lack {a}")
        for var, path in [("NODE_NAME", "spec.nodeName"), ("NAMESPACE", "metadata.namespace"),
                          ("POD_NAME", "metadata.name")]:
            if env_field(prov, var) != path:
                fail(f"csi-provisioner: {var} must come from {path}")
        hm = container(node, "csi-external-health-monitor-controller")
        if "--leader-election" in hm.get("args", []):
            fail("health monitor runs per node: no leader election")
        if spec.get("serviceAccountName") != "crust-csi-node":
            fail("crust-csi-node must use the crust-csi-node account")
        check_peers(docs, node, csi)

    rc = by_kind(docs, "RuntimeClass", "crust")
    if rc:
        if rc.get("handler") != "crust":
            fail("RuntimeClass handler must be crust")
        if rc.get("scheduling", {}).get("nodeSelector") != {"crust.dev/runtime": "installed"}:
            fail("RuntimeClass must select crust.dev/runtime=installed")
        if not rc.get("overhead", {}).get("podFixed"):
            fail("RuntimeClass needs a pod overhead")

    classes = [d for d in docs if d["kind"] == "StorageClass"]
    fs = set()
    for sc in classes:
        n = sc["metadata"]["name"]
        if sc.get("provisioner") != "blk.crust.dev":
            fail(f"StorageClass {n}: provisioner")
        if sc.get("volumeBindingMode") != "WaitForFirstConsumer":
            fail(f"StorageClass {n}: must be WaitForFirstConsumer")
        if sc.get("allowVolumeExpansion") is not True:
            fail(f"StorageClass {n}: allowVolumeExpansion")
        p = sc.get("parameters", {})
        fs.add((p.get("fsType"), p.get("deferFsOps", "false")))
    for want in [("ext4", "false"), ("xfs", "false"), ("ext4", "true")]:
        if want not in fs:
            fail(f"no StorageClass with fsType={want[0]} deferFsOps={want[1]}")

    inst = by_kind(docs, "DaemonSet", "crust-node-install")
    if inst:
        c = container(inst, "install")
        if env_field(c, "NODE_NAME") != "spec.nodeName":
            fail("crust-node-install: NODE_NAME from spec.nodeName")

    # RBAC: subsets of upstream, and bindings that resolve.
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("Role", "ClusterRole")}
    accounts = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs
                if d["kind"] == "ServiceAccount"}
    for (kind, name), role in roles.items():
        upstream = UPSTREAM_RULES.get(name)
        if upstream is None:
            fail(f"{kind} {name}: no upstream rules to compare with")
            continue
        for rule in role.get("rules", []):
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    extra = set(rule["verbs"]) - upstream.get((g, r), set())
                    if extra:
                        fail(f"{kind} {name}: {g or 'core'}/{r} verbs {sorted(extra)} "
                             "beyond what the sidecar's repository ships")
    for d in docs:
        if d["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ref = d["roleRef"]
        if (ref["kind"], ref["name"]) not in roles:
            fail(f"{d['kind']} {d['metadata']['name']}: no {ref['kind']} {ref['name']}")
        for s in d["subjects"]:
            if (s.get("namespace"), s["name"]) not in accounts:
                fail(f"{d['kind']} {d['metadata']['name']}: no ServiceAccount {s['name']}")
    for d in docs:
        spec = d.get("spec", {}).get("template", {}).get("spec", {})
        sa = spec.get("serviceAccountName")
        if sa and (d["metadata"]["namespace"], sa) not in accounts:
            fail(f"{d['kind']} {d['metadata']['name']}: no ServiceAccount {sa}")


def check_peers(docs, node, csi):
    """ModifyVolume across nodes: the plugin serves and asks peers on the
    port the headless Service names, with the optional key Secret."""
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in csi.get("args", []) if "=" in a}
    port = args.get("--peer-address", "").rpartition(":")[2]
    if not port:
        fail("crust-csi args lack --peer-address")
        return
    named = {p["name"]: str(p["containerPort"]) for p in csi.get("ports", [])}
    svc = next((d for d in docs if d["kind"] == "Service"
                and d["metadata"]["name"] == "crust-csi-peers"), None)
    if svc is None:
        fail("no Service crust-csi-peers")
        return
    s = svc["spec"]
    if s.get("clusterIP") != "None" or not s.get("publishNotReadyAddresses"):
        fail("crust-csi-peers must be headless and publish not-ready addresses")
    labels = node["spec"]["template"]["metadata"]["labels"]
    if not s.get("selector") or any(labels.get(k) != v for k, v in s["selector"].items()):
        fail("crust-csi-peers does not select the crust-csi-node pods")
    sp = s.get("ports", [{}])[0]
    if named.get(sp.get("targetPort")) != port or str(sp.get("port")) != port:
        fail("crust-csi-peers' port is not crust-csi's --peer-address port")
    if args.get("--peers") != f"crust-csi-peers:{port}":
        fail(f"crust-csi --peers must be crust-csi-peers:{port}")
    key = args.get("--peer-key-file", "")
    vols = {v["name"]: v for v in node["spec"]["template"]["spec"].get("volumes", [])}
    mounted = [m for m in csi.get("volumeMounts", []) if key.startswith(m["mountPath"] + "/")]
    secret = vols.get(mounted[0]["name"], {}).get("secret", {}) if mounted else {}
    if secret.get("secretName") != "crust-csi-peer-key" or secret.get("optional") is not True:
        fail("--peer-key-file must be in the optional Secret crust-csi-peer-key")


def mebibytes(quantity):
    """A memory quantity in Mi or Gi, in MiB."""
    units = {"Mi": 1, "Gi": 1024}
    return int(quantity[:-2]) * units[quantity[-2:]]


def check_examples(base, examples):
    """What an example asks of the cluster, the base installs: its pod's
    RuntimeClass, its claims' StorageClasses, and the claims it mounts.
    A crust example runs on the pod network (CNI, mirrored into the VM), not
    hostNetwork, and a deferred claim is ReadWriteOncePod (one sandbox)."""
    classes = {d["metadata"]["name"]: d for d in base if d["kind"] == "StorageClass"}
    runtimes = {d["metadata"]["name"] for d in base if d["kind"] == "RuntimeClass"}
    for name, docs in examples.items():
        claims = {(d["metadata"].get("namespace", "default"), d["metadata"]["name"]): d
                  for d in docs if d["kind"] == "PersistentVolumeClaim"}
        for (ns, cn), pvc in claims.items():
            sc = pvc["spec"].get("storageClassName")
            if sc not in classes:
                fail(f"{name}: claim {cn} asks for StorageClass {sc}, which base lacks")
            elif classes[sc].get("parameters", {}).get("deferFsOps") == "true" and \
                    pvc["spec"].get("accessModes") != ["ReadWriteOncePod"]:
                fail(f"{name}: claim {cn} of deferred class {sc} must be ReadWriteOncePod")
        for pod in (d for d in docs if d["kind"] == "Pod"):
            pn = pod["metadata"]["name"]
            spec = pod["spec"]
            rc = spec.get("runtimeClassName")
            if rc not in runtimes:
                fail(f"{name}: pod {pn} asks for RuntimeClass {rc}, which base lacks")
            if spec.get("hostNetwork"):
                fail(f"{name}: pod {pn} uses hostNetwork; crust pods run on the pod network")
            ns = pod["metadata"].get("namespace", "default")
            for v in spec.get("volumes", []):
                cn = v.get("persistentVolumeClaim", {}).get("claimName")
                if cn and (ns, cn) not in claims:
                    fail(f"{name}: pod {pn} mounts claim {cn}, which the example lacks")


def main():
    files = sorted(p for p in ROOT.rglob("*.yaml") if p.name != "kustomization.yaml")
    count = 0
    for f in files:
        docs = load_docs(f)
        validate(docs, str(f.relative_to(ROOT)))
        count += len(docs)
    kubectl = shutil.which("kubectl")
    rendered = {}
    for k in KUSTOMIZATIONS:
        try:
            docs = render(ROOT / k)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            fail(f"{k}: cannot render: {type(e).__name__}: {e}")
            continue
        rendered[k] = docs
        validate(docs, f"rendered {k}")
        if kubectl:
            theirs = {key(d): d for d in kubectl_render(ROOT / k)}
            ours = {key(d): d for d in docs}
            if theirs.keys() != ours.keys():
                fail(f"{k}: kubectl kustomize renders {sorted(theirs.keys() ^ ours.keys())} differently")
            for kk in theirs.keys() & ours.keys():
                if json.dumps(theirs[kk], sort_keys=True) != json.dumps(ours[kk], sort_keys=True):
                    fail(f"{k}: {kk} differs between kubectl kustomize and the renderer")
    check_semantics(rendered.get("base", []) + rendered.get("uninstall", []))
    check_examples(rendered.get("base", []),
                   {str(f.relative_to(ROOT)): load_docs(f)
                    for f in files if f.parent == ROOT / "examples"})
    overlay = {key(d): d for d in rendered.get("overlays/example", [])}
    node = overlay.get(("apps/v1", "DaemonSet", "crust-system", "crust-csi-node"))
    if node is None or node["spec"]["template"]["spec"]["containers"][0]["image"] != \
            "registry.example.com/crust/crust-csi:0.1.0":
        fail("overlay: image not retargeted")
    no_kvm = by_kind(rendered.get("overlays/no-kvm", []), "RuntimeClass", "crust")
    base_rc = by_kind(rendered.get("base", []), "RuntimeClass", "crust")
    if not no_kvm or not base_rc or mebibytes(no_kvm["overhead"]["podFixed"]["memory"]) <= \
            mebibytes(base_rc["overhead"]["podFixed"]["memory"]):
        fail("overlays/no-kvm: the RuntimeClass's podFixed memory must exceed base's (TCG costs more)")
    renderer = "kubectl kustomize and the built-in renderer" if kubectl else "the built-in renderer"
    print(f"validate-manifests: {len(files)} files ({count} objects) and "
          f"{len(KUSTOMIZATIONS)} kustomizations rendered by {renderer}, "
          f"against Kubernetes {', '.join(KUBERNETES_VERSIONS)} (kubernetes-validate "
          f"{kubernetes_validate.__version__})")
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
