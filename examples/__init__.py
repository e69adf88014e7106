"""User-facing examples of prefect-ml's contracts, each run by the test suite."""
