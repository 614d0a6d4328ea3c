"""NVMe-over-Fabrics namespaces as disk-tier devices: sysfs resolution and health, nvme-cli, device plans.

kvstore does not implement the fabric: the kernel's initiator turns a connected
namespace into a block device, and this package finds that device (by subsystem
NQN and NSID or UUID, never by a name that changes between boots), watches its
controllers, and drives `nvme connect`/`disconnect` from the same config.
"""
