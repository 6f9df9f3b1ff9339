"""deploy/kubernetes/: the overlays render, validate offline against the Kubernetes API schemas
of every version they claim to run on, and lay out the decode pod as kvd needs it: kvd a native
sidecar of the engine, sharing /dev/shm and its runtime directory through pod-private volumes,
without host namespaces or privileges, probed on the paths kvd serves."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvd.daemon.binding import EndpointError
from kvd.daemon.config import load_config, unknown_env
from kvd.daemon.metrics_http import HEALTH_PATH, READY_PATH, parse_metrics_addr
from kvd.daemon.runtime_dir import prepare_runtime_dir
from tests.kustomize import KustomizeError, merge, render

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
# Native sidecars (restartPolicy: Always on an init container) are on by default from 1.29;
# the GPU overlay's claim is resource.k8s.io/v1, from 1.34.
OLDEST = {"cpu": "1.29", "gpu": "1.34"}
NEWEST = kubernetes_validate.latest_version()
KUBECTL = shutil.which("kubectl")

Object = dict[str, Any]


def rendered(overlay: str) -> list[Object]:
    return render(DEPLOY / "overlays" / overlay)


def pod_spec(overlay: str) -> Object:
    (deployment,) = (o for o in rendered(overlay) if o["kind"] == "Deployment")
    spec: Object = deployment["spec"]["template"]["spec"]
    return spec


def containers(spec: Object) -> tuple[Object, Object]:
    """(kvd, the engine)."""
    (kvd,) = spec["initContainers"]
    (vllm,) = spec["containers"]
    return kvd, vllm


def env(container: Object) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def mounts(container: Object) -> dict[str, str]:
    """Mount path by volume name."""
    return {m["name"]: m["mountPath"] for m in container["volumeMounts"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_validate_against_the_api_schemas(overlay: str) -> None:
    objects = rendered(overlay)
    assert objects
    for version in sorted({OLDEST[overlay], NEWEST}):
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_gpu_claim_needs_kubernetes_1_34() -> None:
    (claim,) = (o for o in rendered("gpu") if o["kind"] == "ResourceClaimTemplate")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(claim, "1.33", strict=True)


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The check has teeth: a field the API does not have fails it."""
    (deployment,) = (o for o in rendered("cpu") if o["kind"] == "Deployment")
    kvd, _ = containers(deployment["spec"]["template"]["spec"])
    kvd["restartPolicyy"] = kvd.pop("restartPolicy")
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicyy"):
        kubernetes_validate.validate(deployment, NEWEST, strict=True)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it is not in CI)")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_renderer_agrees_with_kubectl_kustomize(overlay: str) -> None:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(DEPLOY / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout

    def by_name(objects: list[Object]) -> dict[tuple[str, str], Object]:
        return {(o["kind"], o["metadata"]["name"]): o for o in objects}

    assert by_name(rendered(overlay)) == by_name(list(yaml.safe_load_all(out)))


def test_strategic_merge_merges_keyed_lists_and_replaces_the_others() -> None:
    """What the kubectl comparison above shows, kept where CI runs it: keyed items merge, the
    patch's first, and a list without a merge key is replaced."""
    original = {
        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
        "args": ["x", "y"],
    }
    patch = {"env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}], "args": ["z"]}
    assert merge(original, patch) == {
        "env": [
            {"name": "B", "value": "3"},
            {"name": "C", "value": "4"},
            {"name": "A", "value": "1"},
        ],
        "args": ["z"],
    }
    with pytest.raises(KustomizeError, match="directives"):
        merge(original, {"env": [{"name": "A", "$patch": "delete"}]})


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: a-\n")
    with pytest.raises(KustomizeError, match=r"not supported here: \['namePrefix'\]"):
        render(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kvd_is_a_native_sidecar_without_host_namespaces_or_privileges(overlay: str) -> None:
    spec = pod_spec(overlay)
    kvd, vllm = containers(spec)
    assert kvd["name"] == "kvd" and kvd["restartPolicy"] == "Always"
    for host in ("hostIPC", "hostPID", "hostNetwork"):
        assert not spec.get(host), host
    assert spec["securityContext"]["runAsNonRoot"] is True
    for container in (kvd, vllm):
        context = container["securityContext"]
        assert not context.get("privileged"), container["name"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert container["resources"]["requests"]["cpu"], container["name"]
        assert container["resources"]["requests"]["memory"], container["name"]
    assert kvd["securityContext"]["readOnlyRootFilesystem"] is True
    # Every path kvd writes is a volume: sockets, journal, kernel caches, temporary files.
    kvd_env = env(kvd)
    written = [kvd_env["KVD_RUNTIME_DIR"], kvd_env["XDG_CACHE_HOME"], "/tmp", "/dev/shm"]
    for path in written:
        assert any(PurePosixPath(path).is_relative_to(m) for m in mounts(kvd).values()), path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shm_and_the_runtime_directory_are_shared_pod_volumes(overlay: str) -> None:
    spec = pod_spec(overlay)
    kvd, vllm = containers(spec)
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes["dshm"]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    assert mounts(kvd)["dshm"] == mounts(vllm)["dshm"] == "/dev/shm"
    assert mounts(kvd)["kvd-run"] == mounts(vllm)["kvd-run"]
    assert "emptyDir" in volumes["kvd-run"], "pod-private, and it outlives kvd's restarts"

    # The connector finds kvd where kvd serves.
    runtime_dir = PurePosixPath(env(kvd)["KVD_RUNTIME_DIR"])
    transfer = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == "kvd.vllm"
    assert transfer["kv_connector_extra_config"]["kvd_runtime_dir"] == str(runtime_dir)
    # kvd refuses a runtime directory, or one above it, that others may write to, and a
    # volume's root is world-writable: two levels down, kvd creates and owns both.
    volume_root = PurePosixPath(mounts(kvd)["kvd-run"])
    assert len(runtime_dir.relative_to(volume_root).parts) >= 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_scrapes_reach_what_kvd_serves(overlay: str) -> None:
    spec = pod_spec(overlay)
    kvd, _ = containers(spec)
    kvd_env = env(kvd)
    # kvd takes its environment as it stands: every KVD_* is a setting, and a valid one.
    assert unknown_env(kvd_env) == []
    config = load_config(environ=kvd_env)
    host, port = parse_metrics_addr(config.metrics_addr)
    assert host == "0.0.0.0", "the kubelet probes the pod's address, not loopback"
    (named,) = (p for p in kvd["ports"] if p["containerPort"] == port)
    for kind, path in (
        ("startupProbe", READY_PATH),
        ("readinessProbe", READY_PATH),
        ("livenessProbe", HEALTH_PATH),
    ):
        probe = kvd[kind]["httpGet"]
        assert probe["path"] == path and probe["port"] in (port, named["name"]), kind
    annotations = (o for o in rendered(overlay) if o["kind"] == "Deployment")
    pod_annotations = next(annotations)["spec"]["template"]["metadata"]["annotations"]
    assert pod_annotations["prometheus.io/scrape"] == "true"
    assert pod_annotations["prometheus.io/port"] == str(port)
    assert pod_annotations["prometheus.io/path"] == "/metrics"
    assert spec["terminationGracePeriodSeconds"] > config.drain_timeout_s


def test_the_gpu_overlay_shows_both_containers_one_gpu() -> None:
    spec = pod_spec("gpu")
    kvd, vllm = containers(spec)
    (claim,) = spec["resourceClaims"]
    for container in (kvd, vllm):
        assert container["resources"]["claims"] == [{"name": claim["name"]}], container["name"]
        limits = container["resources"].get("limits", {})
        assert not any("gpu" in name for name in limits), "a GPU per container: two GPUs"
    assert load_config(environ=env(kvd)).device == "cuda:0", "the claim's one GPU"
    assert "claims" not in containers(pod_spec("cpu"))[0]["resources"]


def test_kvd_accepts_the_runtime_directory_under_a_world_writable_volume(tmp_path: Path) -> None:
    """The layout above, on a real filesystem: a volume's root as the kubelet leaves an
    emptyDir (mode 0777, no sticky bit) is refused as the directory above kvd's, and accepted
    two levels up, where kvd created the directory in between itself."""
    kvd, _ = containers(pod_spec("cpu"))
    runtime_dir = PurePosixPath(env(kvd)["KVD_RUNTIME_DIR"])
    volume = tmp_path / "volume"
    volume.mkdir()
    volume.chmod(0o777)
    with pytest.raises(EndpointError, match="is writable by every user"):
        prepare_runtime_dir(volume / runtime_dir.name)
    below = runtime_dir.relative_to(mounts(kvd)["kvd-run"])
    prepare_runtime_dir(volume / below)
    assert (volume / below).is_dir()


def test_the_image_recipe_copies_what_exists_and_says_it_was_not_built() -> None:
    dockerfile = DEPLOY / "Dockerfile"
    text = dockerfile.read_text()
    assert "NOT BUILT HERE" in text
    root = DEPLOY.parent.parent
    copied = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    assert copied
    for sources in copied:
        for source in sources:
            assert (root / source).exists(), source
    # Both containers run the image as the pod's user.
    spec = pod_spec("gpu")
    assert f"USER {spec['securityContext']['runAsUser']}:" in text
