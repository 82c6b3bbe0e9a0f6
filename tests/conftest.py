"""Test-wide settings. Under CI (CI=true) property tests replay a fixed
sequence of examples, so a red build is reproducible; locally they explore."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else "dev")
