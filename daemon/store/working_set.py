"""The expert cache's working set, kept across restarts so that a restart does not start cold.

What is kept: per MoE layer, the experts its dynamic tier holds, the most recently used
first (`ExpertCache.working_set`), and the pinned tier's experts, the most used first.
The usage counts say which experts a model's traffic uses over thousands of tokens; the
working set is what the cache held when the session ended, so that a restart resumes
where the session stopped (a conversation resumed, an agent's next turn): measured, a
restarted daemon's prompt hits equal those of one never restarted (bench/restart_hit_rate.py;
for an unrelated prompt the most used experts did as well or better). Steps not counted
as usage (a tuner's check prompt, its built-in workload) leave it as traffic left it until
traffic comes back (`StreamingExpertProvider.working_set`).

File: ``<state_dir>/experts-<fingerprint[:16]>.json``, a state file of kind "experts"
(daemon/store/state.py: the versioned envelope keyed to the model's fingerprint, atomic
writes, the lock; a corrupt or foreign file is set aside with a warning, never read
again). Its payload:

    {"layers": [[expert, ...], ...],   one list per MoE layer in model order, the most
                                       recently used first, distinct ids in [0, E)
     "pins": [[layer_index, expert], ...]}   the pinned tier, the most used first;
                                       layer_index counts MoE layers (0..L-1)

A payload that does not fit the model (layer count, ids, repeats) is corrupt: set aside.
Written with every flush of the usage state (daemon/service/background.py, each minute,
and at shutdown: daemon/store/session.py); read once when the cache is built. After a
kill -9 before the first flush there is none, and the warm start falls back to the
usage counts (or, without those either, the cache starts cold).
"""
from __future__ import annotations

from dataclasses import dataclass

from daemon.store.state import StateStore
from scheduler.usage import max_state_file_bytes

KIND = "experts"


@dataclass(frozen=True)
class WorkingSet:
    """layers: per MoE layer (model order), the dynamic tier's experts, the most recently
    used first. pins: (MoE layer index, expert) of the pinned tier, the most used first."""

    layers: tuple[tuple[int, ...], ...]
    pins: tuple[tuple[int, int], ...] = ()

    def to_payload(self) -> dict:
        return {"layers": [list(row) for row in self.layers], "pins": [list(p) for p in self.pins]}

    @classmethod
    def from_payload(cls, payload: dict, n_layers: int, num_experts: int) -> WorkingSet:
        """The working set of a state file's payload for a model of `n_layers` MoE layers of
        `num_experts` experts. Raises ValueError naming the field that does not fit."""
        layers = payload.get("layers")
        if not isinstance(layers, list) or len(layers) != n_layers:
            raise ValueError(f"layers: expected a list of {n_layers} MoE layers")
        rows = []
        for i, row in enumerate(layers):
            if not isinstance(row, list):
                raise ValueError(f"layers[{i}] is not a list")
            rows.append(_expert_ids(row, num_experts, f"layers[{i}]"))
            if len(set(rows[-1])) != len(row):
                raise ValueError(f"layers[{i}] repeats an expert")
        pins = payload.get("pins", [])
        if not isinstance(pins, list):
            raise ValueError("pins is not a list")
        out = []
        for j, pin in enumerate(pins):
            if not (isinstance(pin, list) and len(pin) == 2):
                raise ValueError(f"pins[{j}] is not [layer_index, expert]")
            (layer,) = _expert_ids(pin[:1], n_layers, f"pins[{j}] layer_index")
            (expert,) = _expert_ids(pin[1:], num_experts, f"pins[{j}] expert")
            out.append((layer, expert))
        if len(set(out)) != len(out):
            raise ValueError("pins repeats an expert")
        return cls(tuple(rows), tuple(out))


def _expert_ids(values: list, bound: int, field: str) -> tuple[int, ...]:
    bad = [v for v in values if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < bound)]
    if bad:
        raise ValueError(f"{field}: {bad[0]!r} is not an id in [0, {bound})")
    return tuple(values)


def working_set_store(state_dir, fingerprint: str, n_layers: int, num_experts: int) -> StateStore:
    """The StateStore of the working-set file of a model (same directory as its usage file;
    the same bound on what is read). Raises OSError as StateStore does."""
    return StateStore(state_dir, fingerprint, kind=KIND, max_bytes=max_state_file_bytes(n_layers, num_experts))


def load_working_set(store, n_layers: int, num_experts: int) -> WorkingSet | None:
    """The saved working set, or None (no file, or one set aside: corrupt, foreign, or not
    fitting this model). store: a daemon.store.state.StateStore of kind "experts"."""
    def parse(payload: dict) -> WorkingSet:
        return WorkingSet.from_payload(payload, n_layers, num_experts)

    payload = store.load(check=parse)
    return None if payload is None else parse(payload)


def save_working_set(store, working_set: WorkingSet) -> None:
    """Replace the saved working set (the latest writer's word: two daemons serving one
    model each save their own cache). Raises OSError (StateReadOnlyError included)."""
    store.save(lambda _current: working_set.to_payload())
