"""A table of named entries that every reader consults: the methods (`methods.py`) and the cost
objectives (`plan/objectives.py`). Registering a name again replaces its entry (a notebook re-run);
an unknown name is refused with the names there are."""
from __future__ import annotations

from typing import Generic, TypeVar

from specbench.types import SpecbenchError

Entry = TypeVar("Entry")


class Registry(dict, Generic[Entry]):
    def __init__(self, what: str):
        super().__init__()
        self.what = what  # "method", "objective": how a refusal names an entry

    def register(self, entry: Entry) -> Entry:
        self[entry.name] = entry
        return entry

    def lookup(self, name: str) -> Entry:
        try:
            return self[name]
        except KeyError:
            raise SpecbenchError(f"unknown {self.what} {name!r}; choose one of {tuple(self)}") from None
