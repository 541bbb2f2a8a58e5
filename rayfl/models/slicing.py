"""Width slicing of a global model into sub-models and back (HeteroFL / FedFD).

Diao et al., "HeteroFL: Computation and Communication Efficient Federated Learning for
Heterogeneous Clients" (ICLR 2021). A client of width rate r holds the *leading* slice of
every global tensor (the first `round(c * r)` channels of each layer); the server averages
every entry over the clients whose slice contains it. Width-scaled models built by
`rayfl.models.resnet.ResNet18` have exactly this nesting; the output-class dimension of the head
is full in every sub-model, so its slice is the whole dimension.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["aggregate_sliced", "slice_state", "state_shapes"]


def _leading(shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(0, int(d)) for d in shape)


def _check_fits(key: str, sub: Sequence[int], full: Sequence[int]) -> None:
    if len(sub) != len(full) or any(s > f for s, f in zip(sub, full)):
        raise ValueError(
            f"entry {key!r}: sub-model shape {tuple(sub)} is not a leading slice of the "
            f"global shape {tuple(full)}"
        )


def state_shapes(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Size]:
    """The shape of every entry of a state dict (the `sub_state_shapes` argument)."""
    return {key: value.shape for key, value in state.items()}


def slice_state(
    global_state: Mapping[str, torch.Tensor], sub_state_shapes: Mapping[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """A fresh copy of `global[key][:s0, :s1, ...]` for every key of the sub-model's shapes
    (`state_shapes(sub_model.state_dict())`): HeteroFL's "first channels" rule."""
    out: dict[str, torch.Tensor] = {}
    for key, shape in sub_state_shapes.items():
        if key not in global_state:
            raise ValueError(f"entry {key!r} of the sub-model is not in the global state")
        full = global_state[key]
        _check_fits(key, shape, full.shape)
        out[key] = full[_leading(shape)].clone()
    return out


def aggregate_sliced(
    global_state: Mapping[str, torch.Tensor],
    sub_states: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
) -> dict[str, torch.Tensor]:
    """Per-entry weighted average of sliced sub-model states into the global state.

    Every entry of every floating-point tensor becomes the weighted mean of the clients whose
    slice covers it; entries no client covers (or only clients of weight 0) keep the global
    value, and so do non-float buffers such as BatchNorm's `num_batches_tracked`. Sums run in
    float64 so that averaging identical values returns them bit for bit. `global_state` is
    not modified; `weights` (one per client, e.g. its sample count) are finite and >= 0.

    >>> g = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    >>> a, b = {"w": torch.tensor([10.0, 20.0])}, {"w": torch.tensor([30.0, 40.0, 50.0, 60.0])}
    >>> aggregate_sliced(g, [a, b], [1.0, 3.0])["w"]
    tensor([25., 35., 50., 60.])
    """
    if len(sub_states) != len(weights):
        raise ValueError(f"{len(sub_states)} sub-states but {len(weights)} weights")
    w = [float(x) for x in weights]
    if any(not x >= 0 or x == float("inf") for x in w):
        raise ValueError(f"weights must be finite and >= 0, got {w}")
    for sub in sub_states:
        for key, value in sub.items():
            if key not in global_state:
                raise ValueError(f"entry {key!r} of a sub-model is not in the global state")
            _check_fits(key, value.shape, global_state[key].shape)

    out: dict[str, torch.Tensor] = {}
    for key, full in global_state.items():
        if not torch.is_floating_point(full):
            out[key] = full.clone()
            continue
        total = torch.zeros(full.shape, dtype=torch.float64, device=full.device)
        mass = torch.zeros(full.shape, dtype=torch.float64, device=full.device)
        for sub, weight in zip(sub_states, w):
            if key not in sub or weight == 0:
                continue
            value = sub[key]
            region = _leading(value.shape)
            total[region] += weight * value.to(device=full.device, dtype=torch.float64)
            mass[region] += weight
        covered = mass > 0
        mean = total / torch.where(covered, mass, torch.ones_like(mass))
        out[key] = torch.where(covered, mean, full.to(torch.float64)).to(full.dtype)
    return out
