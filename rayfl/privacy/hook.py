"""The one engine hook: a client's upload is protected on the worker (`protect`: clip, encode,
mask), the round's protected uploads are combined on the server (`combine`: unmask the sum, add
noise, decode) into ONE reply that the algorithm's `aggregate` takes as if it were the only
client. Algorithms do not know whether privacy is on; they only declare, through
`Server.sum_form`, how their aggregate depends on the sum of the uploads:

- `weighted_mean`: a sample-weighted average of array payloads (FedAvg/FedProx/FML/LG-FedAvg,
  pFedES proxy). Without DP the client contributes `n_k * payload` and `n_k`, so the sum decodes to
  exactly the algorithm's weighted average. With DP it contributes its *update* (upload minus the
  broadcast it received), clipped, with weight 1; the server adds noise to the sum, divides it by
  the fixed denominator q * N (`per_round`, the expected participants; not the uploads that
  arrived) and adds that mean update back to the broadcast.
- `class_means`: per-class statistics `{"means": (C, D), "counts": (C,)}` averaged per class by
  count (FD, FedProto, pFedES `stats`). Without DP the client contributes `counts * means` and
  `counts`. With DP there is no broadcast counterpart to subtract (the statistics are not a
  model), so the contribution is the payload itself: its per-class means and a 0/1 presence
  indicator (equal weight per client and class), clipped jointly; each class's mean is its noisy
  sum over its noisy presence sum (post-processing of the one noisy release), and presence sums
  below 0.5 mark a class as unseen.

What is noised, and the DP noise's secret (`noise_key`, kept in checkpoints, never logged), are
described in docs/privacy.md; anything else (nested dicts, per-client server logic) is refused
by `check_fits` before a run starts.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayfl.algorithms.base import Algorithm, Payload, Reply
from rayfl.errors import ConfigError, UserError
from rayfl.privacy import dp, secagg
from rayfl.sampling import sample_clients
from rayfl.schema import PrivacyConfig, RunConfig, clients_per_round
from rayfl.seeding import Purpose, seed_of, words

log = logging.getLogger(__name__)

FORMS = ("weighted_mean", "class_means")
MASKED = "secagg/masked"  # the one key of a masked upload
PLAIN = "privacy/vector"  # the one key of a clipped but unmasked upload (DP without SecAgg)
# Server options that act on each client's upload separately, which protections hide.
PER_CLIENT_OPTIONS = ("weight_cap", "clip_update")
# State-dict suffixes of normalisation statistics: buffers, not trainable parameters.
RUNNING_STATS = ("running_mean", "running_var")


def sum_form(algo: Algorithm, params: Any) -> str | None:
    """The algorithm's `Server.sum_form`; a server whose class depends on its params (pFedES
    variants) names it through a `variant_class(params)` static method."""
    server = algo.server
    variant_class = getattr(server, "variant_class", None)
    if variant_class is not None:
        server = variant_class(params)
    return getattr(server, "sum_form", None)


def check_fits(algo: Algorithm, cfg: PrivacyConfig, params: Any) -> str | None:
    """Refuse, in one line, an algorithm whose aggregate is not a function of the uploads' sum;
    its sum form when privacy is on."""
    if not cfg.enabled:
        return None
    form = sum_form(algo, params)
    on = "privacy.dp" if cfg.dp.enabled else "privacy.secagg"
    if form not in FORMS:
        raise ConfigError(
            f"{on} cannot protect algorithm.name={algo.name}: its server needs each client's upload "
            "on its own (not only their sum); turn privacy off or pick an algorithm that averages "
            "its payloads (fedavg, fedprox, fml, lg_fedavg, pfedes, fd, fedproto)"
        )
    for key in PER_CLIENT_OPTIONS:
        if getattr(params, key, None) is not None:
            raise ConfigError(
                f"algorithm.{key} acts on each client's upload, which {on} hides from the server; "
                f"set algorithm.{key}=null (privacy.dp.clip bounds each update instead)"
            )
    return form


def check_accounting(cfg: RunConfig) -> None:
    """Refuse, in one line, a DP run whose sampling the chosen accountant cannot account."""
    d, n, k = cfg.privacy.dp, cfg.data.num_clients, clients_per_round(cfg)
    if not d.enabled:
        return
    if d.accountant == "pld" and dp.replace_one(cfg.engine.sampling, n, k):
        raise ConfigError(
            "privacy.dp.accountant=pld has no event for engine.sampling=uniform (a fixed number of "
            "clients drawn without replacement); use privacy.dp.accountant=rdp or "
            "engine.sampling=poisson"
        )
    if cfg.engine.sampling == "poisson" and k < n:
        # an empty draw is redrawn (rayfl.sampling), which the accountant does not see
        empty = cfg.engine.rounds * (1.0 - k / n) ** n
        if empty > d.delta:
            raise ConfigError(
                f"engine.sampling=poisson draws no client in some round with probability {empty:.2g} "
                f"> privacy.dp.delta={d.delta:g}, which the reported epsilon would not cover; "
                "raise engine.fraction or data.num_clients"
            )


def hook_for(algo: Algorithm, cfg: RunConfig) -> PrivacyHook | None:
    """The run's privacy hook, or None when no protection is on."""
    if not cfg.privacy.enabled:
        return None
    form = check_fits(algo, cfg.privacy, cfg.algorithm.params)
    check_accounting(cfg)
    return PrivacyHook(
        cfg.privacy,
        str(form),
        cfg.seed,
        cfg.data.num_clients,
        clients_per_round(cfg),
        cfg.engine.sampling,
    )


class Layout:
    """The float entries of a payload (sorted keys, shapes) and their flat concatenation."""

    def __init__(self, template: Mapping[str, np.ndarray]) -> None:
        self.keys = sorted(
            k
            for k, v in template.items()
            if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating)
        )
        bad = [k for k, v in template.items() if not isinstance(v, np.ndarray)]
        if bad:
            raise UserError(
                f"privacy: payload entry {bad[0]!r} is not an array (nested payloads cannot be "
                "protected); turn privacy off for this algorithm"
            )
        self.shapes = {k: tuple(template[k].shape) for k in self.keys}
        self.dtypes = {k: template[k].dtype for k in self.keys}

    def flatten(self, payload: Mapping[str, np.ndarray]) -> np.ndarray:
        for k in self.keys:
            if k not in payload or tuple(payload[k].shape) != self.shapes[k]:
                raise UserError(
                    f"privacy: the upload's entry {k!r} does not match the broadcast's shape "
                    f"{self.shapes[k]}; this algorithm's payload cannot be protected"
                )
        if not self.keys:
            return np.zeros(0)
        return np.concatenate([np.asarray(payload[k], dtype=np.float64).ravel() for k in self.keys])

    def unflatten(self, vec: np.ndarray) -> dict[str, np.ndarray]:
        out, pos = {}, 0
        for k in self.keys:
            n = int(np.prod(self.shapes[k]))
            out[k] = vec[pos : pos + n].reshape(self.shapes[k]).astype(self.dtypes[k])
            pos += n
        return out


@dataclass(eq=False)
class PrivacyHook:
    """Both halves of the privacy layer for one run (picklable; built from the run spec)."""

    cfg: PrivacyConfig  # the `privacy` config section
    form: str  # the algorithm's `Server.sum_form`
    # The public run seed: SecAgg keys, masks and the simulated dropout derive from it, the
    # round and the client (the simulation's secrets are not secret).
    seed: int
    num_clients: int  # clients in the federation
    # Clients per round (`uniform`) or their expected number q * N (`poisson`): the DP
    # estimator's fixed denominator.
    per_round: int
    sampling: str = "uniform"  # `engine.sampling`: how participants are drawn and accounted
    # The secret of the DP noise: 128 bits of OS entropy unless the config pins it (unsafe).
    noise_key: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        seed_cfg = self.cfg.dp.noise_seed
        self.noise_key = secrets.randbits(128) if seed_cfg is None else int(seed_cfg)

    def participants(self, round_idx: int) -> list[int]:
        return sample_clients(self.seed, round_idx, self.num_clients, self.per_round, self.sampling)

    def noise(self, size: int, round_idx: int) -> np.ndarray:
        """This round's Gaussian noise (std z * clip) for a sum of `size` entries."""
        d = self.cfg.dp
        key = [self.noise_key >> s & 0xFFFFFFFF for s in range(0, 128, 32)]
        return dp.gaussian_noise(
            size, d.noise_multiplier * d.clip, [*key, round_idx, int(Purpose.PRIVACY)]
        )

    def epsilon(self, rounds: int) -> float:
        """The cumulative epsilon after `rounds` rounds, for the sampling that ran."""
        d = self.cfg.dp
        return dp.epsilon(
            d.noise_multiplier,
            rounds,
            d.delta,
            num_clients=self.num_clients,
            per_round=self.per_round,
            sampling=self.sampling,
            accountant=d.accountant,
        )

    def state_dict(self) -> dict[str, str]:
        """What a checkpoint must keep for a resumed run to draw the same noise."""
        return {"noise_key": f"{self.noise_key:x}"}

    def load_state_dict(self, state: Mapping[str, str]) -> None:
        self.noise_key = int(str(state["noise_key"]), 16)

    def _secagg(self, round_idx: int) -> secagg.SecAggRound:
        return secagg.SecAggRound(
            self.seed, round_idx, self.participants(round_idx), self.cfg.secagg.threshold
        )

    # -- encoding ------------------------------------------------------------------------------
    def contribution(
        self, payload: Mapping[str, np.ndarray], received: Mapping[str, np.ndarray], weight: float
    ) -> tuple[np.ndarray, float]:
        """The client's plaintext vector (what is summed) and its pre-clip norm (nan without DP)."""
        if self.form == "weighted_mean":
            layout = Layout(received)
            x = layout.flatten(payload)
            if self.cfg.dp.enabled:
                clipped, norm = dp.l2_clip(x - layout.flatten(received), self.cfg.dp.clip)
                return clipped, norm
            return np.concatenate([weight * x, [weight]]), math.nan
        means = np.asarray(payload["means"], dtype=np.float64)
        counts = np.asarray(payload["counts"], dtype=np.float64)
        if self.cfg.dp.enabled:
            present = (counts > 0).astype(np.float64)
            vec = np.concatenate([(present[:, None] * means).ravel(), present])
            clipped, norm = dp.l2_clip(vec, self.cfg.dp.clip)
            return clipped, norm
        return np.concatenate([(counts[:, None] * means).ravel(), counts]), math.nan

    def decode(
        self, total: np.ndarray, contributors: int, sent: Mapping[str, np.ndarray]
    ) -> tuple[Payload, int]:
        """The summed vector -> the payload the algorithm's aggregate takes, and its weight."""
        if self.form == "weighted_mean":
            layout = Layout(sent)
            ints = {k: np.array(v) for k, v in sent.items() if k not in layout.keys}
            if self.cfg.dp.enabled:
                # the fixed denominator q * N: the arrivals' count would be data-dependent
                mean_update = total / self.per_round
                out = layout.unflatten(layout.flatten(sent) + mean_update)
                return {**ints, **out}, max(1, contributors)
            weight = float(total[-1])
            out = layout.unflatten(total[:-1] / weight)
            return {**ints, **out}, max(1, int(round(weight)))
        num_classes = len(sent["counts"])
        sums = total[:-num_classes].reshape(num_classes, -1)
        raw = total[-num_classes:]
        # With DP the summed presence is noisy: a class counts as seen from 0.5 clients on.
        known = raw >= (0.5 if self.cfg.dp.enabled else 1e-9)
        means = np.where(known[:, None], sums / np.where(known, raw, 1.0)[:, None], 0.0)
        counts = np.where(known, np.maximum(1.0, np.rint(raw)), 0.0) if self.cfg.dp.enabled else raw
        payload = {"means": means.astype(np.float32), "counts": counts.astype(np.float32)}
        return payload, max(1, contributors)

    # -- worker side ---------------------------------------------------------------------------
    def protect(
        self,
        payload: Payload,
        received: Payload,
        round_idx: int,
        client_id: int,
        num_samples: int,
    ) -> Payload:
        """What the client actually sends: its clipped contribution, masked under SecAgg.

        An empty dict means the client dropped out after masking (simulated, or a non-finite
        contribution that a real client would not send).
        """
        vec, _ = self.contribution(payload, received, float(num_samples))
        if not np.isfinite(vec).all():
            log.warning(
                "round %d: client %d has a non-finite upload; it drops out", round_idx, client_id
            )
            return {}
        if not self.cfg.secagg.enabled:
            return {PLAIN: vec.astype(np.float32)}  # what a float upload would cost
        sa = self.cfg.secagg
        protocol = self._secagg(round_idx)
        ring = secagg.encode(vec, sa.frac_bits, len(protocol.participants))
        masked = protocol.mask(client_id, ring)
        rng = np.random.default_rng(
            seed_of(words(Purpose.PRIVACY, self.seed, round_idx, client_id))
        )
        if sa.dropout > 0 and rng.random() < sa.dropout:
            return {}  # lost after masking: the server must recover
        return {MASKED: masked}

    # -- server side ---------------------------------------------------------------------------
    def combine(
        self, replies: Sequence[Reply], round_idx: int, sent: Mapping[str, Payload]
    ) -> tuple[list[Reply], dict[str, float]]:
        """Unmask and noise the round's sum; one reply standing for all clients, and metrics."""
        first = replies[0]
        base = sent.get(first.arch) or next(iter(sent.values()))
        if self.cfg.dp.enabled:
            check_trainable_only(base)
        arrived = [r for r in replies if r.payload]
        metrics: dict[str, float] = {
            "privacy/dropped": float(len(self.participants(round_idx)) - len(arrived))
        }
        if self.cfg.secagg.enabled:
            size = self.contribution(base, base, 1.0)[0].size  # of every upload's vector
            ring = self._secagg(round_idx).unmask(
                {r.client_id: r.payload[MASKED] for r in arrived}, size
            )
            total = secagg.decode(ring, self.cfg.secagg.frac_bits)
        else:
            if not arrived:
                raise UserError(f"privacy: round {round_idx} has no upload to aggregate")
            total = np.sum(
                [np.asarray(r.payload[PLAIN], dtype=np.float64) for r in arrived], axis=0
            )
        if self.cfg.dp.enabled:
            total = total + self.noise(total.size, round_idx)
            metrics["privacy/epsilon"] = self.epsilon(round_idx)
        payload, weight = self.decode(total, len(arrived), base)
        combined = Reply(-1, first.arch, weight, payload)
        return [combined], metrics


def check_trainable_only(sent: Mapping[str, Any]) -> None:
    """Refuse, in one line, DP on a payload that shares normalisation running statistics."""
    stats = [k for k in sorted(sent) if k.endswith(RUNNING_STATS)]
    if stats:
        raise UserError(
            f"privacy.dp would add noise to the normalisation statistic {stats[0]!r} (a buffer, not a "
            "trainable parameter; noise makes variances negative); use a model without BatchNorm "
            "(mlp, cnn_small) or turn privacy.dp off"
        )
