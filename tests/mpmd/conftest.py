"""Fixtures of the MPMD tests (the pieces themselves live in `mpmd_cases`)."""

import pytest
from mpmd_cases import run_case as _run_case


@pytest.fixture(scope="session")
def run_case():
    """`run_case(name, n, v, remat) -> Case`, each configuration compiled and run once."""
    return _run_case
