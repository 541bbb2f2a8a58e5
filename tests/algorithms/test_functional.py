import math

import numpy as np
import pytest
import torch

from rayfl.algorithms import functional as fn


def test_weighted_average_golden():
    a = {"w": np.array([1.0, 2.0], dtype=np.float32), "n": np.array(5)}
    b = {"w": np.array([3.0, 6.0], dtype=np.float32), "n": np.array(9)}
    out = fn.weighted_average([a, b], [1, 3])
    np.testing.assert_allclose(out["w"], [2.5, 5.0])
    assert out["w"].dtype == np.float32
    assert int(out["n"]) == 5  # integer buffers are not averaged


def test_normalized_weights_cap_water_filling():
    w = fn.normalized_weights([6, 2, 1, 1], cap=0.4)
    # 0.6 is capped to 0.4; the remaining 0.6 is spread 2:1:1 over the others.
    np.testing.assert_allclose(w, [0.4, 0.3, 0.15, 0.15])
    np.testing.assert_allclose(fn.normalized_weights([1, 3]), [0.25, 0.75])
    np.testing.assert_allclose(
        fn.normalized_weights([9, 1], cap=0.3), [0.5, 0.5]
    )  # cap*n < 1: uniform


def test_clip_update_golden():
    u = {"a": np.array([3.0, 0.0]), "b": np.array([4.0])}  # global norm 5
    out = fn.clip_update(u, 1.0)
    np.testing.assert_allclose(out["a"], [0.6, 0.0])
    np.testing.assert_allclose(out["b"], [0.8])
    same = fn.clip_update(u, 10.0)
    np.testing.assert_allclose(same["b"], [4.0])


def test_ema_golden():
    out = fn.ema({"w": np.array([1.0])}, {"w": np.array([11.0])}, 0.9)
    np.testing.assert_allclose(out["w"], [2.0])


def test_kd_loss_golden():
    # teacher logits [0, ln 3] at T=1 -> p = [0.25, 0.75]; student uniform q = [0.5, 0.5]
    student = torch.zeros(1, 2)
    teacher = torch.tensor([[0.0, math.log(3.0)]])
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert fn.kd_loss(student, teacher, 1.0).item() == pytest.approx(expected, rel=1e-6)
    # with T=2 the logits are halved and the loss multiplied by T^2 = 4
    p = torch.softmax(teacher / 2, 1)[0]
    expected_t2 = 4 * float((p * torch.log(p / 0.5)).sum())
    assert fn.kd_loss(student, teacher, 2.0).item() == pytest.approx(expected_t2, rel=1e-6)
    assert fn.kd_loss(teacher, teacher, 4.0).item() == pytest.approx(0.0, abs=1e-7)
    # 'mean' (nn.KLDivLoss()'s default): also divided by the 2 classes, over a batch of 2
    pair_s, pair_t = torch.cat([student, student]), torch.cat([teacher, student])
    assert fn.kd_loss(pair_s, pair_t, 1.0, "mean").item() == pytest.approx(expected / 4, rel=1e-6)
    assert fn.kd_loss(pair_s, pair_t, 1.0).item() == pytest.approx(expected / 2, rel=1e-6)
    reference = (
        torch.nn.KLDivLoss(reduction="sum")(torch.log_softmax(pair_s, 1), torch.softmax(pair_t, 1))
        / pair_s.numel()
    )
    assert fn.kd_loss(pair_s, pair_t, 1.0, "mean").item() == pytest.approx(reference.item())
    with pytest.raises(ValueError, match="reduction"):
        fn.kd_loss(pair_s, pair_t, 1.0, "sum")


def test_logit_kl_direction():
    a = torch.tensor([[0.0, math.log(3.0)]])
    b = torch.zeros(1, 2)
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)  # KL(softmax(a) || softmax(b))
    assert fn.logit_kl(a, b).item() == pytest.approx(expected, rel=1e-6)
