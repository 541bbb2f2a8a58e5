"""FedALA: Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated Learning"
(AAAI 2023; arXiv 2212.01197).

FedAvg whose clients do not overwrite their model with the received global one: Adaptive Local
Aggregation (ALA) keeps the global lower layers and, for the top `layers` parameter tensors,
learns element-wise weights `W` in [0, 1] so that the start of local training is
`theta = theta_local + (theta_global - theta_local) * W`. `W` is learned on a random
`rand_percent`% of the client's training data by gradient descent on the local loss,
`W <- clip(W - eta * grad_theta * (theta_global - theta_local), 0, 1)` per minibatch (the chain
rule through `theta`), starting from ones; in a client's first ALA it is trained until the
standard deviation of the last `num_pre_loss` epoch losses falls below `threshold`, afterwards
for one epoch per round. `W` is the client's state.

Code followed: PFLlib `system/utils/ALA.py` (`adaptive_local_aggregation`) and
`flcore/clients/clientala.py`; FL-bench `fedala` (same defaults).

Shares: the whole model, both ways (the client's trained model up).
Keeps local: the model it trained and the ALA weights; the received global model enters only
through ALA at the start of the next local training.
Server: per architecture, the sample-weighted average of the models (`rayfl.algorithms.groups`);
scored as `global/acc`.

Defaults (PFLlib `main.py` and FL-bench): `eta=1.0`, `rand_percent=80`, `layers=2` (PFLlib's
`layer_idx`: the last Linear's weight and bias; 0 selects every parameter tensor),
`threshold=0.1`, `num_pre_loss=10`. Deviations: ALA is skipped for a client that has not trained
yet (PFLlib skips it when the first parameter tensors of both models agree, which is the
same first-round case there); the sample is a random subset of the shuffled split, not a
random contiguous window; the converging first phase stops after `max_init_epochs` at the
latest (PFLlib loops until it converges); the buffers of the lower part (BN statistics) are
taken from the global model with its parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    ClientContext,
    Payload,
    RoundContext,
    Trainer,
)
from rayfl.algorithms.groups import Flag, GroupClient, GroupServer, load_part
from rayfl.schema import setting


@dataclass(frozen=True)
class FedALAParams(CheckedParams):
    eta: float = setting(1.0, "learning rate of the aggregation weights W", gt=0)
    rand_percent: int = setting(
        80, "percent of the local training data that ALA learns W on", gt=0, le=100
    )
    layers: int = setting(
        2, "top parameter tensors aggregated adaptively (0: all); the rest take global"
    )
    threshold: float = setting(0.1, "first ALA stops when the std of the last losses is below this")
    num_pre_loss: int = setting(10, "how many epoch losses that standard deviation looks at", ge=1)
    max_init_epochs: int = setting(100, "cap on the epochs of a client's first ALA", ge=1)


class ALAState(nn.Module):
    """A client's ALA weights (one tensor per adaptively aggregated parameter) and whether its
    first, converging ALA has run."""

    started: torch.Tensor

    def __init__(self, top: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.names = [name for name, _ in top]
        for i, (_, p) in enumerate(top):
            self.register_buffer(f"w{i}", torch.ones_like(p, requires_grad=False))
        self.register_buffer("started", torch.zeros((), dtype=torch.int64))  # 1 after first ALA

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"w{i}") for i in range(len(self.names))]


class FedALAClient(GroupClient[FedALAParams]):
    deployed_uses_payload = False  # deploys its own trained model; the broadcast waits for ALA

    def __init__(self, ctx: ClientContext, params: FedALAParams) -> None:
        super().__init__(ctx, params)
        named = list(self.model.named_parameters())
        self.ala = ALAState(named[-params.layers :] if params.layers else named)
        self.trained = Flag()
        self.persistent = {"model": self.model, "ala": self.ala, "trained": self.trained}
        self.received: Payload = {}

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        self.received = payload  # applied by ALA when training starts

    def fit(self, trainer: Trainer) -> dict[str, float]:
        metrics = {}
        if self.received:
            if self.trained.is_set():
                metrics["ala_epochs"] = float(self.adaptive_local_aggregation(trainer))
            else:
                load_part(self.model, self.received)
        out = trainer.run(self.training_step, [self.model])
        self.trained.set()
        return {**out, **metrics}

    def adaptive_local_aggregation(self, trainer: Trainer) -> int:
        """ALA: lower entries from the global model, learned W for the top ones (see module doc).
        Returns the epochs it ran."""
        device = self.ctx.device
        self.model.train()  # as PFLlib's copy of the just-trained model (BN: batch statistics)
        glob = {k: torch.as_tensor(np.array(v)).to(device) for k, v in self.received.items()}
        local = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        top = set(self.ala.names)
        lower = {k: v.to(local[k].dtype) for k, v in glob.items() if k not in top}
        self.model.load_state_dict(lower, strict=False)
        diffs = [glob[k].to(local[k]) - local[k] for k in self.ala.names]
        weights = self.ala.weights()
        x_all, y_all = self.sample(trainer)
        losses: list[float] = []
        first = not int(self.ala.started)
        epochs = 0
        while True:
            for x, y in zip(x_all, y_all):
                ws = [w.clone().requires_grad_(True) for w in weights]
                state = {k: v.detach() for k, v in self.model.state_dict().items()}
                for k, w, d in zip(self.ala.names, ws, diffs):
                    state[k] = local[k] + d * w
                state = {k: v.clone() if not v.requires_grad else v for k, v in state.items()}
                loss = F.cross_entropy(functional_call(self.model, state, (x,)), y)
                grads = torch.autograd.grad(loss, ws)
                for w, g in zip(weights, grads):
                    w.sub_(self.params.eta * g).clamp_(0.0, 1.0)
            losses.append(float(loss.detach()))
            epochs += 1
            if not first or epochs >= self.params.max_init_epochs:
                break
            recent = losses[-self.params.num_pre_loss :]
            if len(losses) > self.params.num_pre_loss and np.std(recent) < self.params.threshold:
                break
        self.ala.started.fill_(1)
        with torch.no_grad():
            for k, w, d in zip(self.ala.names, weights, diffs):
                self.model.get_parameter(k).copy_(local[k] + d * w)
        return epochs

    def sample(self, trainer: Trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The minibatches of a random `rand_percent`% of the training split."""
        batches = list(trainer.batches("train", shuffle=True))
        total = sum(len(y) for _, y in batches)
        keep = max(1, math.floor(total * self.params.rand_percent / 100))
        xs, ys = [], []
        for x, y in batches:
            if keep <= 0:
                break
            xs.append(x[:keep])
            ys.append(y[:keep])
            keep -= len(y)
        return xs, ys


ALGORITHMS.add(
    "fedala",
    Algorithm(
        "fedala",
        FedALAParams,
        FedALAClient,
        GroupServer,
        summary="FedAvg with adaptive local aggregation of the received model (per arch group)",
    ),
)
