"""configs/k8s/tfjob.yaml: a Kubeflow Training Operator v1 TFJob.

No Kubernetes here: the tests build the TF_CONFIG the operator injects into
each replica's pod (tf-operator's `genTFConfigJSONStr`: one address
`<job>-<replica type>-<index>.<namespace>.svc:<port>` per replica, lower-case
job names, `"environment": "cloud"`) and check that every task accepts its
own, and that the manifest says what the README says.
"""

import os
import socket

import pytest
import yaml

from conftest import ROOT
from tf_asyncps import cluster

MANIFEST = os.path.join(ROOT, "configs", "k8s", "tfjob.yaml")
NAMESPACE = "ml"


def _docs():
    with open(MANIFEST) as f:
        return {d["kind"]: d for d in yaml.safe_load_all(f)}


def _port(spec):
    for port in spec["template"]["spec"]["containers"][0].get("ports", []):
        if port.get("name") == "tfjob-port":
            return port["containerPort"]
    return 2222  # the operator's default


def operator_tf_configs(tfjob, namespace=NAMESPACE):
    """{(type, index): TF_CONFIG dict} as the Training Operator v1 sets them."""
    name = tfjob["metadata"]["name"]
    specs = tfjob["spec"]["tfReplicaSpecs"]
    spec_cluster = {
        rtype.lower(): [f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{_port(s)}"
                        for i in range(s["replicas"])]
        for rtype, s in specs.items() if rtype.lower() != "evaluator"}
    return {(rtype.lower(), i): {"cluster": spec_cluster,
                                 "task": {"type": rtype.lower(), "index": i},
                                 "environment": "cloud"}
            for rtype, s in specs.items() for i in range(s["replicas"])}


def test_manifest_is_a_v1_tfjob_with_chief_ps_and_workers():
    docs = _docs()
    job = docs["TFJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    specs = job["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {"Chief": 1, "PS": 1, "Worker": 2}
    for rtype, spec in specs.items():
        assert spec["restartPolicy"] == "OnFailure", rtype
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "tensorflow"  # the operator's container name
        assert _port(spec) == 2222
        cmd = container["command"]
        assert cmd[:2] == ["tf-asyncps", "train"], rtype
        flagfiles = [a.split("=", 1)[1] for a in cmd if a.startswith("--flagfile=")]
        assert flagfiles and all(os.path.exists(os.path.join(ROOT, f)) for f in flagfiles)


def test_the_chief_keeps_its_checkpoints_on_a_volume_that_outlives_it():
    docs = _docs()
    chief = docs["TFJob"]["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]
    cmd = chief["containers"][0]["command"]
    backup = [a.split("=", 1)[1] for a in cmd if a.startswith("--backup_dir=")]
    assert len(backup) == 1
    mounts = {m["name"]: m["mountPath"] for m in chief["containers"][0]["volumeMounts"]}
    volume = [n for n, path in mounts.items() if backup[0].startswith(path.rstrip("/") + "/")]
    assert volume, (backup, mounts)
    claim = {v["name"]: v for v in chief["volumes"]}[volume[0]]["persistentVolumeClaim"]
    assert claim["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]


def test_network_policy_admits_only_the_jobs_pods_on_the_grpc_port():
    docs = _docs()
    name = docs["TFJob"]["metadata"]["name"]
    policy = docs["NetworkPolicy"]["spec"]
    label = {"training.kubeflow.org/job-name": name}
    assert policy["podSelector"]["matchLabels"] == label
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": label}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 2222}]


def test_every_replica_accepts_the_tf_config_the_operator_injects():
    configs = operator_tf_configs(_docs()["TFJob"])
    assert len(configs) == 4
    for (rtype, index), tf_config in configs.items():
        c = cluster.validate_tf_config(tf_config)
        assert (c.task_type, c.task_id) == (rtype, index)
        assert c.num_workers == 2 and c.num_ps == 1
        assert c["chief"] == [f"tf-asyncps-digits-chief-0.{NAMESPACE}.svc:2222"]


@pytest.fixture
def pod(monkeypatch):
    """This process as the pod of one replica: its hostname is the pod's name
    and the job's headless Services resolve as cluster DNS would (the pod's
    own name to its own IP, here 127.0.0.1; the others to 198.18.0.x)."""
    real = socket.getaddrinfo

    def as_pod(pod_name):
        others = {}

        def getaddrinfo(host, *args, **kwargs):
            if host.endswith(f".{NAMESPACE}.svc"):
                ip = "127.0.0.1" if host.split(".")[0] == pod_name else \
                    others.setdefault(host, f"198.18.0.{len(others) + 10}")
                return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, 0))]
            return real(host, *args, **kwargs)

        monkeypatch.setattr(socket, "gethostname", lambda: pod_name)
        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
        monkeypatch.setattr(socket, "gethostbyname_ex",
                            lambda h: (h, [], ["127.0.0.1"]))
    return as_pod


def test_own_address_check_passes_for_the_pods_own_service_name(pod):
    configs = operator_tf_configs(_docs()["TFJob"])
    for (rtype, index), tf_config in configs.items():
        pod(f"tf-asyncps-digits-{rtype}-{index}")
        cluster.check_own_address(cluster.validate_tf_config(tf_config))


def test_own_address_check_refuses_a_task_index_of_another_pod(pod):
    configs = operator_tf_configs(_docs()["TFJob"])
    pod("tf-asyncps-digits-worker-0")  # but TF_CONFIG says worker 1
    with pytest.raises(ValueError, match=r'cluster\["worker"\]\[1\].*not an address of this host'):
        cluster.check_own_address(cluster.validate_tf_config(configs[("worker", 1)]))
