"""The one place an Entra ID credential is made from a sink's options (azure-identity, lazily).

Both Azure Monitor sinks authenticate the same ways: the Logs Ingestion sink (``azure_monitor``) and
remote write to an Azure Monitor workspace (``remote_write`` with ``auth = "azure"``).
"""

from __future__ import annotations

from typing import Any, Protocol

from gpumon.config import ConfigError

CREDENTIALS = ("managed_identity", "workload_identity", "service_principal", "default")


class CredentialSettings(Protocol):
    """The options of a sink's settings that name its credential (both sinks' settings have them)."""

    @property
    def credential(self) -> str: ...
    @property
    def client_id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def client_secret(self) -> str: ...


def make_credential(opt: CredentialSettings, section: str) -> Any:
    """The azure-identity credential named by ``opt.credential``; ``section`` names the config
    section in errors (``"[azure_monitor]"``)."""
    import azure.identity as identity

    kind = opt.credential
    client_id = opt.client_id or None
    tenant_id = opt.tenant_id or None
    if kind == "managed_identity":
        return identity.ManagedIdentityCredential(client_id=client_id)
    if kind == "workload_identity":
        kwargs = {k: v for k, v in (("client_id", client_id), ("tenant_id", tenant_id)) if v}
        try:
            return identity.WorkloadIdentityCredential(**kwargs)
        except ValueError as exc:
            raise ConfigError(section, "credential", f"workload_identity: {exc} (is the pod labelled "
                              "azure.workload.identity/use=true?)") from None
    if kind == "service_principal":
        for key in ("tenant_id", "client_id", "client_secret"):
            if not getattr(opt, key):
                raise ConfigError(section, key, "is required with credential = service_principal")
        return identity.ClientSecretCredential(opt.tenant_id, opt.client_id, opt.client_secret)
    return identity.DefaultAzureCredential(managed_identity_client_id=client_id)
