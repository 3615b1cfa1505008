"""What the health actions do, as the ``[health]`` config section gives it: every action off by default.

Kept apart from the runner so each action module can import it without importing the others.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class ActionSettings:
    slurm: bool = False
    slurm_node: str = ""  # default: the short hostname, as slurmd names itself
    scontrol: str = "scontrol"
    kubernetes: bool = False
    kube_events: bool = False  # a core/v1 Event on the node for each change of the verdict
    kube_taint: bool = False  # gpumon.io/unhealthy=<rule>:NoSchedule while unhealthy
    node_name: str = ""  # default: env NODE_NAME (the downward API's spec.nodeName)
    kube_api: str = ""  # default: in-cluster, https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    kube_token_file: str = f"{SERVICE_ACCOUNT}/token"
    kube_ca_file: str = f"{SERVICE_ACCOUNT}/ca.crt"
    hook: str = ""  # an executable given the verdict as JSON on stdin
    azure_ghr: bool = False  # file Guest Health Reports (Impact Reporting API) for unhealthy findings
    azure_ghr_client_id: str = ""  # a user-assigned managed identity; empty: the system-assigned one
    azure_ghr_dry_run: bool = False  # log the requests instead of sending them
    azure_ghr_arm: str = "https://management.azure.com"
    azure_ghr_rate_limit: int = 5  # reports per impact category ...
    azure_ghr_rate_window: float = 86400.0  # ... within this many seconds
    imds_url: str = "http://169.254.169.254"  # [azure] imds_url: the one shared IMDS client
    imds_timeout: float = 0.5
    timeout: float = 10.0
    backoff_initial: float = 1.0
    backoff_max: float = 300.0

    def slurm_node_name(self) -> str:
        return self.slurm_node or socket.gethostname().split(".")[0]

    def kube_node_name(self) -> str:
        return self.node_name or os.environ.get("NODE_NAME", "")

    def kube_api_url(self) -> str:
        """The API server: as configured, or the in-cluster address every pod is given."""
        if self.kube_api:
            return self.kube_api.rstrip("/")
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
        if not host:
            return ""
        if ":" in host:  # an IPv6 service address
            host = f"[{host}]"
        return f"https://{host}:{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"
