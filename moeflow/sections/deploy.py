"""`deploy:` section — Ray Serve application options."""

from pydantic import Field

from moeflow.sections import Section


class DeploySection(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    num_replicas: int = Field(default=1, ge=1)
    max_ongoing_requests: int = Field(default=32, ge=1)
