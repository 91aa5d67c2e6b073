"""etcd access: the client front (failover, retries), its settings, and a private etcd server."""

from elastictrain.etcd.client import EtcdClient, connect, import_etcd3
from elastictrain.etcd.conf import Endpoint, EtcdSettings, parse_endpoints
from elastictrain.etcd.server import EtcdServer, EtcdServerOptions, find_etcd_binary, free_port

__all__ = [
    "Endpoint",
    "EtcdClient",
    "EtcdServer",
    "EtcdServerOptions",
    "EtcdSettings",
    "connect",
    "find_etcd_binary",
    "free_port",
    "import_etcd3",
    "parse_endpoints",
]
