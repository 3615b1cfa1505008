"""Who this host is, learnt in one place: the identity provider refreshes IMDS compute metadata and
the KVP pool's physical host, and the loop stamps the answer on every Snapshot (``Snapshot.identity``)."""

from gpumon.identity.provider import ASK_AGAIN, REFRESH, IdentityProvider, azure_settings
from gpumon.imds import IMDS_URL
from gpumon.model import AzureInstance, HostIdentity

__all__ = ["ASK_AGAIN", "IMDS_URL", "REFRESH", "AzureInstance", "HostIdentity", "IdentityProvider",
           "azure_settings"]
