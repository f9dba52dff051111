from tests.server.conftest import artifacts  # noqa: F401  # the same tiny served models
