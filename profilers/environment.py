"""The environment report (`tpu-agent doctor`, profile.json's `environment`): versions, devices, paths, the peak
used for MFU and the problems found. Versioned on its own."""

from __future__ import annotations

from pydantic import BaseModel, Field

ENVIRONMENT_SCHEMA_VERSION = 1


class JaxDevice(BaseModel):
    id: int
    platform: str
    device_kind: str
    process_index: int


class Environment(BaseModel):
    schema_version: int = ENVIRONMENT_SCHEMA_VERSION
    tpu_agent_version: str
    python_version: str
    python_executable: str
    os: str
    machine: str
    cpu_count: int | None
    torch_version: str | None
    torch_tpu_device: bool | None = Field(
        description="torch's PrivateUse1 backend is registered as `tpu` (None: torch did not import)"
    )
    jax_version: str | None
    jaxlib_version: str | None
    jax_default_backend: str | None
    jax_devices: list[JaxDevice]
    torch_tpu_importable: bool = Field(description="Google's TorchTPU (`torch_tpu`) can be imported")
    anthropic_api_key_set: bool
    cache_dir: str
    runs_dir: str
    peak_flops_per_s: float | None = Field(
        None, description="the device's peak FLOP/s for MFU: a TPU's datasheet figure, else the cached calibration"
    )
    peak_source: str | None = Field(None, description="where the peak comes from; None: not calibrated yet")
    problems: list[str] = Field(default_factory=list)
