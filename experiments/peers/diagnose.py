"""Diagnoses behind the peer checks: the rayfl side of a `compare` row run again with one thing
changed. Not peer checks themselves; each prints the row as JSON (and appends it to `--out`).

Subcommands:

    init --peer htfllib|pfllib --algo A --seed S --offset K [compare options]
        rayfl on the partition of seed S with other initial models: the streams of the initial
        weights (`Purpose.INIT`, `Purpose.SERVER`) take seed S + 1000 K, while the partition,
        the splits and the batch order keep S. Offset 0 is the compare row's own run. Measures
        how much of a peer gap one initial draw accounts for (the peers seed torch with 0, so
        their rows share one draw; `HTFL_INIT_SEED` in `htfllib.py` and a one-line patch of
        HtFLlib's `clientbase.py:20` vary theirs). With `--torch-seed K` instead, the server's
        initial models are drawn right after `torch.manual_seed(K)`: K 0 is the draw
        `pfllib.py pfllib` starts PFLlib from (main.py seeds torch with 0, then builds the
        model), so both libraries start from one model (for servers that build their models
        first, as `GroupServer` does).
    variant --peer htfllib|pfllib --algo A --seed S KEY=JSON... [compare options]
        the compare row's rayfl config with dotted overrides, e.g. `eval.protocol='"after_fit"'`
        to score at the peer's evaluation point.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import htfllib  # noqa: E402
import pfllib  # noqa: E402


def shifted_init(offset: int) -> None:
    """Seed the initial-weight streams with seed + 1000 * offset (the engine's, in-process)."""
    import rayfl.engine.server as server
    import rayfl.engine.worker as worker
    from rayfl.seeding import Purpose, words

    def shifted(purpose: Any, seed: int, round_idx: int | None = None, client: int | None = None):
        if purpose in (Purpose.INIT, Purpose.SERVER):
            seed = seed + 1000 * offset
        return words(purpose, seed, round_idx, client)

    worker.words = shifted  # type: ignore[assignment]
    server.words = shifted  # type: ignore[assignment]


def peer_init(seed: int, torch_seed: int) -> None:
    """Draw the server's initial models after `torch.manual_seed(torch_seed)` (in-process)."""
    import rayfl.engine.server as server
    from rayfl.seeding import Purpose, seed_of, words

    initial = words(Purpose.SERVER, seed)  # the stream ServerRunner seeds torch from

    def seeded(stream: tuple[int, ...]) -> int:
        return torch_seed if stream == initial else seed_of(stream)

    server.seed_of = seeded  # type: ignore[assignment]


def run(raw: dict[str, Any], work: Path) -> list[float]:
    from rayfl.config import build_config
    from rayfl.engine.loop import Simulation

    sim = Simulation(build_config(raw), Path(tempfile.mkdtemp(prefix="diag-", dir=work)) / "rayfl")
    sim.run()
    return [h["personal/acc"] for h in sim.result.history if "personal/acc" in h]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["init", "variant"])
    ap.add_argument("--peer", choices=["htfllib", "pfllib"], required=True)
    ap.add_argument("--algo", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offset", type=int, default=0, help="init: the initial draw's offset")
    ap.add_argument("--torch-seed", type=int, help="init: the server's draw after manual_seed(K)")
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--family", default="cnn5", help="htfllib rows")
    ap.add_argument("--arch", default="cnn5", help="pfllib rows")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--train-samples", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--params", default="{}")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--out", type=Path)
    ap.add_argument("overrides", nargs="*", help="variant: dotted.key=JSON")
    a = ap.parse_intermixed_args()  # overrides may follow the options
    a.num_classes, a.side = 100, 16  # htfllib.rayfl_config reads them for synthetic data only
    peer = htfllib if a.peer == "htfllib" else pfllib
    raw = peer.rayfl_config(a)
    for item in a.overrides:
        key, value = item.split("=", 1)
        *path, last = key.split(".")
        node = raw
        for part in path:
            node = node.setdefault(part, {})
        node[last] = json.loads(value)
    if a.torch_seed is not None and a.cmd != "init":
        ap.error("--torch-seed is an option of init")
    if a.torch_seed is not None:
        peer_init(a.seed, a.torch_seed)
    elif a.cmd == "init":
        shifted_init(a.offset)
    row = {
        "algo": a.algo,
        "peer": a.peer,
        "partition_seed": a.seed,
        "rayfl_init_offset": a.offset if a.cmd == "init" else 0,
        **({"rayfl_init_torch_seed": a.torch_seed} if a.torch_seed is not None else {}),
        "overrides": a.overrides,
        "rayfl": run(raw, a.work),
        "config": raw,
        "command": "python3 experiments/peers/diagnose.py " + " ".join(sys.argv[1:]),
    }
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    print(json.dumps({k: row[k] for k in ("algo", "partition_seed", "overrides", "rayfl")}))


if __name__ == "__main__":
    main()
