"""Run-directory tests: one torch thread, as in tests/trainer (spinning OpenMP threads slow tiny runs on a
shared machine)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
