"""A suite whose engine is not installed in this venv is collected as one skipped item per module,
saying why, instead of failing to import (so `python -m pytest` at the root collects everywhere)."""
from __future__ import annotations

import pytest


class _Missing(pytest.Item):
    def runtest(self):
        pytest.skip(self.parent.reason)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}: {self.parent.reason}"


class MissingEngineModule(pytest.File):
    reason = ""

    def collect(self):
        yield _Missing.from_parent(self, name="suite")


def skipped_module(module_path, parent, reason: str):
    """For a conftest's `pytest_pycollect_makemodule`: the test module, not imported, skipped with `reason`."""
    module = MissingEngineModule.from_parent(parent, path=module_path)
    module.reason = reason
    return module
