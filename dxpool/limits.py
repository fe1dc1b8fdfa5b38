"""The documented upper bounds on what a request may carry.

Every number and text a caller sends is checked against one of these before anything is
read or written, by the broker (``dxpool.broker.nodes.validation``) and, where the same value
passes through them, by the Python client and the CLI. They keep records small enough for
etcd, transactions inside etcd's operation limit, loops in placement short, and keep
values that no real pool has (a GPU with 2^63 MiB) from being stored at all.

=======================  =============  ==================================================
limit                    value          why
=======================  =============  ==================================================
``MAX_GPUS_PER_NODE``    64             one compose transaction stays under 128 operations
``MAX_TXN_OPS``          128            etcd's default --max-txn-ops (compares, successes and
                                        failures each); bounds every transaction dxpool builds
``MAX_GPUS_PER_BOX``     64             a box's create and delete are one transaction each
``MAX_GPU_MEMORY_MIB``   16 TiB in MiB  far above any GPU made; anything larger is a typo
``MAX_LATENCY_NS``       10 s           a latency bound above that bounds nothing
``MAX_DURATION_NS``      366 days       any duration the request grammar reads
``MAX_HOST_SLOTS``       256            proxy slots of one host (PCIe buses behind a port)
``MAX_HOST_CPUS``        65536          CPU cores of one host, far above any server
``MAX_HOST_MEMORY_MIB``  1 PiB in MiB   memory of one host, far above any server
``MAX_PAGE_SIZE``        1000           one List response stays well under 4 MiB
``MAX_PAGE_TOKEN``       1024           next_page_token values are far shorter
``MAX_TEXT``             256            free text: reasons, endpoints, tenants
``MAX_QUOTA``            1,000,000      a tenant limit (GPUs, nodes) above any pool's size
``MAX_QUOTA_MODELS``     64             per-model limits of one tenant quota
``MAX_STATUS_ENTRIES``   512            a host's status: every desired GPU plus as many
                                        left over on its hardware (twice its most slots)
``MAX_ROUND_TRIPS``      1024           a host's round-trip samples, one per box it reaches
``MAX_STATUS_TEXT``      1024           an agent's message or health reason for one GPU
``MAX_PRIORITY``         1000           a node's priority (0 lowest); room for classes
``MAX_QUEUE_TIMEOUT_S``  7 days         how long a queued request may be told to wait
``MAX_GRACE_S``          3600           a preemption notice's grace period
``MAX_GANG_MEMBERS``     4096           members of one gang (chunked over transactions)
``MAX_EXCLUDED_HOSTS``   128            hosts one NodeSpec excludes: the largest spec stays
                                        within ComposeNode's request limit
=======================  =============  ==================================================
"""

from __future__ import annotations

MAX_GPUS_PER_NODE = 64
MAX_GPUS_PER_BOX = 64
MAX_TXN_OPS = 128
MAX_GPU_MEMORY_MIB = 16 * 1024 * 1024
MAX_LATENCY_NS = 10_000_000_000
MAX_DURATION_NS = 366 * 24 * 3600 * 1_000_000_000
MAX_HOST_SLOTS = 256
MAX_HOST_CPUS = 65536
MAX_HOST_MEMORY_MIB = 1024 * 1024 * 1024
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_TOKEN = 1024
MAX_TEXT = 256
MAX_LOCATION_PART = 63
MAX_TENANT = 63
MAX_LABELS = 32
MAX_LABEL_KEY = 63
MAX_LABEL_VALUE = 256
MAX_MODEL_LENGTH = 64
MAX_PCI_ID = 16
MAX_QUOTA = 1_000_000
MAX_QUOTA_MODELS = 64
MAX_STATUS_ENTRIES = 2 * MAX_HOST_SLOTS
MAX_ROUND_TRIPS = 1024
MAX_STATUS_TEXT = 1024
MAX_PRIORITY = 1000
MAX_QUEUE_TIMEOUT_S = 7 * 24 * 3600
MAX_GRACE_S = 3600
MAX_GANG_MEMBERS = 4096
MAX_EXCLUDED_HOSTS = 128
