"""Storage: the slot bank and its swaps, the page layout, the CUDA-VMM backing, the RAM complement's
host rows and exchanges, and the slot tables that say which expert sits in which row.
Imports none of the other rooms; ``layer``, ``worker_ext``, ``cache`` and ``cpu_experts`` call it."""
