"""The cloud path as documented: the shipped cluster.yaml names an image on every node type, and
docs/cluster.md carries the commands a user needs after `ray up` (auth token, MLflow port
forwarding, bringing results home, Tune storage on S3)."""

from pathlib import Path

import ray
import yaml

ROOT = Path(__file__).resolve().parents[1]
DLAMI = "resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/"


def test_every_node_type_names_a_current_gpu_driver_image():
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert cfg["docker"]["image"] == f"rayproject/ray:{ray.__version__}-py311-gpu"
    for name, node in cfg["available_node_types"].items():
        image = node["node_config"].get("ImageId", "")
        assert image.startswith(DLAMI) or image.startswith("ami-"), name


def test_cluster_doc_covers_the_steps_after_ray_up():
    doc = (ROOT / "docs" / "cluster.md").read_text()
    for needle in (
        "RAY_AUTH_MODE=token ray status",
        "--port-forward 5000",
        "-L 5000:localhost:5000",
        "ray rsync-down cluster.yaml",
        "tune.storage=s3://",
        "engine.wait_for_resources_s",
        "AmazonSSMReadOnlyAccess",
    ):
        assert needle in doc, needle


def test_cluster_doc_scopes_stop_and_mlflow_reach_as_the_config_binds_it():
    doc = (ROOT / "docs" / "cluster.md").read_text()
    for needle in (
        "--block",  # a node stopped by its own pid, not the global `ray stop`
        "kill $(cat ~/ray-head.pid)",
        "rayfl validate cluster.yaml",
        "--app-name basic-auth",  # a bound MLflow address only with authentication
        "-L 5000:127.0.0.1:5000 ubuntu@$RAY_HEAD_IP",  # or a tunnel from each worker
    ):
        assert needle in doc, needle
    cfg = (ROOT / "cluster.yaml").read_text()
    assert "mlflow server --host 127.0.0.1" in cfg  # what the doc's advice rests on
    lines = doc.splitlines()
    for i, line in enumerate(lines):  # the private address is given only with credentials
        if "<head-private-ip>:5000" in line:
            assert "MLFLOW_TRACKING_USERNAME" in "\n".join(lines[i : i + 2]), line
