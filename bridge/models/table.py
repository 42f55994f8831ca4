"""Loaded models, each owned by the connection that loaded it (bridge.owned) and held against
the sessions' pool budget (--max-pool-bytes) for as long as it is loaded."""

from __future__ import annotations

from typing import Callable

from protocol import shown_value

from ..errors import OpError, allocation
from ..owned import OwnedTable
from ..sessions import SessionTable, StateLayout
from ..tensors import wire_name
from .runtime import Model


def unknown_model(model_id: str, field: str) -> OpError:
    return OpError("unknown_model", f"{field}: no model {shown_value(model_id)} is loaded for this connection",
                   {"field": field, "model": model_id})


class LoadedModel:
    """A model as the server holds it: its runtime, its id, and the layout of its sessions' state."""

    __slots__ = ("id", "name", "model", "layout", "held_bytes")

    def __init__(self, model_id: str, name: str | None, model: Model, held_bytes: int):
        self.id = model_id
        self.name = name
        self.model = model
        # What the load held against the pool: given back as it was taken, whatever the
        # weights' own count comes to.
        self.held_bytes = held_bytes
        self.layout = StateLayout("model", model.config.state_parts(), model=model_id)

    def describe(self) -> dict:
        c = self.model.config
        described = {"model": self.id, "arch": c.arch, "layers": c.n_layer, "d_model": c.d_model,
                     "state_bytes_per_row": self.layout.row_bytes, "weight_bytes": self.model.nbytes,
                     "dtype": wire_name(self.model.dtype)}  # as model_load takes it
        if c.vocab_size is not None:
            described["vocab_size"] = c.vocab_size
        described["outputs"] = ["logits", "hidden"] if c.has_logits else ["hidden"]
        if self.name is not None:
            described["name"] = self.name
        return described


class ModelTable(OwnedTable[LoadedModel]):
    def __init__(self, sessions: SessionTable, *, max_models: int):
        super().__init__(unknown_model)
        self.sessions = sessions
        # A count apart from the bytes: a tiny model costs the host more than the weights it
        # holds against the pool.
        self.max_models = max_models

    def load(self, owner: str, load: Callable[[Callable[[int], None]], Model], name: str | None) -> LoadedModel:
        """`load(hold)` builds the model, calling `hold(nbytes)` before it allocates the weights;
        the bytes stay held until the model is freed, and are given back if the load fails."""
        with self._lock:
            self._refuse_past(self.max_models, "model_load", "models", "--max-models")
        held = []

        def hold(nbytes: int) -> None:
            self.sessions.hold("models", nbytes, "model_load")
            held.append(nbytes)

        try:
            with allocation("model_load"):
                model = load(hold)
            with self._lock:
                self._refuse_past(self.max_models, "model_load", "models", "--max-models")
                _, loaded = self._add(owner, lambda model_id: LoadedModel(model_id, name, model, sum(held)))
        except BaseException:
            for nbytes in held:
                self.sessions.unhold("models", nbytes)
            raise
        return loaded

    def free(self, owner: str, model_id: str, field: str) -> None:
        """Free a model no session uses any more."""
        loaded = self.get(owner, model_id, field)
        open_sessions = self.sessions.of_model(loaded.id)
        if open_sessions:
            got = f"a model {open_sessions} open sessions use" if open_sessions > 1 else "a model an open session uses"
            raise OpError("invalid_argument",
                          f"{field}: expected a model no open session uses, got {got} (close them first)",
                          {"field": field, "expected": "a model no open session uses", "got": got})
        self.remove(owner, model_id, field)

    def _released(self, loaded: LoadedModel) -> None:
        self.sessions.unhold("models", loaded.held_bytes)
