"""Value tables kept off the accelerator: in host memory ("cpu") or memory-mapped from the checkpoint ("disk").

`from_pretrained(path, memory_offload="cpu" | "disk")` attaches these stores to every memory layer (see
`UltraMemPreTrainedModel.from_pretrained`); `model.set_value_store("cpu")` or
`set_value_store("disk", directory=...)` (the tables written there, then mapped) offloads a model already in memory.
Each step reads only the selected rows on the host, pools them and moves the (tokens, E, Dv) result to the
model's device, in a background thread during the skip-layer window. `write_random_checkpoint` streams a
full-size random checkpoint of any UltraMem preset to disk without holding its tables in memory.
"""

from ..value_stores import ValueStores
from .safetensors_file import OffloadCheckpointError, SafetensorsCheckpoint
from .stores import DiskValueStore, HostValueStore, OffloadedValueStore

OFFLOAD_STORES: dict[str, type[OffloadedValueStore]] = {"cpu": HostValueStore, "disk": DiskValueStore}
for _name, _store in OFFLOAD_STORES.items():
    ValueStores.register(_name, _store)

__all__ = [
    "OFFLOAD_STORES",
    "DiskValueStore",
    "HostValueStore",
    "OffloadCheckpointError",
    "OffloadedValueStore",
    "SafetensorsCheckpoint",
]
