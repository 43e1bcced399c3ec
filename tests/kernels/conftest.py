"""Fixtures shared by the kernel tests."""

import pytest

from astrai.extension import ops  # loads the library, registers the ops


@pytest.fixture
def tuning():
    """Sets the kernel tuning for one test (a comma-separated string, see plan.h), automatic
    again afterwards."""

    def set_tuning(*parts):
        ops.set_kernel_tuning(",".join(p for p in parts if p))

    yield set_tuning
    ops.set_kernel_tuning("")
