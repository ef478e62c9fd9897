# A pytest plugin for running the numba-cuda test suite as shipped in its wheel. The wheel's
# test classes ask for a class fixture that numba-cuda's repository defines in its top-level
# conftest.py, which the wheel does not carry; this supplies it (FileCheck reproducers off).
import pytest


@pytest.fixture(scope="class")
def initialize_from_pytest_config(request):
    request.cls._dump_failed_filechecks = False
