"""The multi-domain folder loader (rayfl.data.images) on a tree of real PNG and JPEG files."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from rayfl.config import DomainsConfig
from rayfl.data.datasets import load_dataset
from rayfl.data.federated import build_federation
from rayfl.errors import ConfigError, UserError

# domain -> (file suffix, the red value every image of it carries)
DOMAINS = {"photo": (".jpg", 200), "sketch": (".png", 40)}
CLASSES = ("cat", "dog")


@pytest.fixture
def tree(tmp_path):
    """root/<domain>/<class>/<i>.png|jpg: 2 domains x 2 classes x 5 images of 10x12 pixels,
    each a flat colour: red from the domain, green from the class, blue the image's number."""
    for domain, (suffix, red) in DOMAINS.items():
        for label, cls in enumerate(CLASSES):
            folder = tmp_path / domain / cls
            folder.mkdir(parents=True)
            for i in range(5):
                colour = (red, 100 * label, 20 * i)
                Image.new("RGB", (12, 10), colour).save(folder / f"{i}{suffix}")
    (tmp_path / "photo" / "cat" / "notes.txt").write_text("not an image")
    return tmp_path


def test_the_folder_loader_reads_a_written_tree(tree):
    ds = load_dataset("folder", tree, size=[8, 6], test_fraction=0.2)
    assert ds.domain_names == ("photo", "sketch") and ds.num_classes == 2
    assert ds.x_train.shape == (16, 3, 8, 6) and ds.x_test.shape == (4, 3, 8, 6)
    assert ds.x_train.dtype == np.uint8
    # one test image per domain and class count: 20% of each domain's 10 images
    assert np.bincount(ds.domain_test).tolist() == [2, 2]
    x = np.concatenate([ds.x_train, ds.x_test])
    y = np.concatenate([ds.y_train, ds.y_test])
    dom = np.concatenate([ds.domain_train, ds.domain_test])
    red = np.where(dom == 0, 200, 40)
    # PNG is lossless; JPEG of a flat colour is off by a few levels at most
    assert np.abs(x[:, 0].mean(axis=(1, 2)) - red).max() <= 3
    assert np.abs(x[:, 1].mean(axis=(1, 2)) - 100 * y).max() <= 3
    png = dom == 1
    assert (x[png, 0] == 40).all()
    grey = load_dataset("folder", tree, size=[4, 4], channels=1)
    assert grey.x_train.shape[1:] == (1, 4, 4) and len(grey.mean) == 1


def test_clients_live_in_the_datasets_own_domains(tree):
    ds = load_dataset("folder", tree, size=[4, 4])
    fed = build_federation(
        ds,
        num_clients=4,
        partitioner="iid",
        partition_options={},
        seed=0,
        test_fraction=0.25,
        domains=DomainsConfig(held_out="sketch"),
    )
    assert fed.client_domain == ("photo", "photo", "sketch", "sketch")
    assert fed.eval_only == (2, 3)
    for cid, split in enumerate(fed.clients):
        idx = np.concatenate([split.train, split.test])
        assert (ds.domain_train[idx] == cid // 2).all()
    np.testing.assert_array_equal(fed.dataset.x_train, ds.x_train)  # no transformation


def test_folder_errors_are_one_line(tree, tmp_path_factory):
    with pytest.raises(ConfigError, match="is not a folder of"):
        load_dataset("folder", tree, domains=["art"])
    with pytest.raises(ConfigError, match="needs data.root"):
        load_dataset("folder")
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(UserError, match="no domain folders"):
        load_dataset("folder", empty)
    with pytest.raises(ConfigError, match="leave transforms empty"):
        build_federation(
            load_dataset("folder", tree, size=[4, 4]),
            num_clients=2,
            partitioner="iid",
            partition_options={},
            seed=0,
            domains=DomainsConfig(transforms=("rotate:90",)),
        )
    bad = tree / "sketch" / "dog" / "broken.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(UserError, match="not a readable image") as err:
        load_dataset("folder", tree)
    assert "\n" not in str(err.value)
