"""GPU tests are marked ``@pytest.mark.cuda`` and skip themselves where no GPU is visible."""

import os

import pytest
import torch

# Arms the cuda backend's tuning hooks (read once, at the first kernel call of the process): the
# split tests force split counts with ASTR_DECODE_SPLITS and turn the in-cluster merge off with
# ASTR_DECODE_CLUSTER_MERGE=0; the prefill tests pick the prefill kernel with ASTR_PREFILL_WGMMA
# (1 wgmma where it runs, 0 mma.sync). With none of them set the hooks change nothing.
os.environ.setdefault("ASTR_TUNE_KERNELS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
