"""A GPU system's figures the planner reads: links inside and across hosts, memory bandwidth,
GPUs per host (`systems.json`), and the device's dense peaks (`lm.hardware.peaks`)."""

from __future__ import annotations

import dataclasses
import json

from lm.hardware import data_file
from lm.hardware.peaks import PEAK_FLOPS


@dataclasses.dataclass(frozen=True)
class System:
    """A target's figures the cost model reads (`lm/hardware/systems.json`)."""

    name: str
    device_kind: str  # the key into lm.hardware.peaks.PEAK_FLOPS
    gpus_per_host: int
    nvlink_bytes_per_s: float
    nvlink_latency_s: float
    network_bytes_per_s: float
    network_latency_s: float
    hbm_bytes_per_s: float  # device memory bandwidth

    @classmethod
    def load(cls, name: str) -> System:
        table = json.loads(data_file("systems.json").read_text())
        entry = {k: v for k, v in table[name].items() if not k.startswith("_")}
        return cls(name=name, **entry)

    def peak(self, dtype: str) -> float:
        return PEAK_FLOPS[(self.device_kind, dtype)]
