"""The option groups several sinks share, declared once so that they are named (and explained) the
same in every section: TLS files, backoff, the spool and the Azure credential.

A sink splices a group into its :class:`~gpumon.config.SectionSchema` and declares the same field
names on its settings dataclass (the schema checks they agree). A key that had another name in one
sink keeps it as a deprecated alias (``aliases=``): a config using it still works, with one warning.
"""

from __future__ import annotations

from collections.abc import Callable

from gpumon.config import Option, readable_file_check
from gpumon.sinks.azure_identity import CREDENTIALS

__all__ = ["azure_credential_options", "backoff_options", "spool_options", "tls_options"]


def tls_options(peer: str, *, client: bool = True, fallback: str = "", ca_aliases: tuple[str, ...] = (),
                cert_aliases: tuple[str, ...] = (), key_aliases: tuple[str, ...] = (),
                check: Callable[[str], str | None] = readable_file_check) -> tuple[Option, ...]:
    """``ca_file`` (and with ``client``, ``cert_file`` and ``key_file`` for mutual TLS): the PEM files
    the connection to ``peer`` uses. ``fallback``: what an empty value falls back to before the
    system's trust store (the OTLP sink's ``OTEL_EXPORTER_OTLP_CERTIFICATE``)."""
    empty = f"empty: {fallback}, else the system's" if fallback else "empty means the system's"
    options = [Option("ca_file", str, "", f"PEM file of CAs that verify the {peer}'s certificate (a private "
                      f"CA); {empty}.", check=check, aliases=ca_aliases)]
    if client:
        options += [
            Option("cert_file", str, "", "Client certificate (PEM) for mutual TLS.", check=check,
                   aliases=cert_aliases),
            Option("key_file", str, "", "Client private key (PEM) for mutual TLS.", check=check,
                   aliases=key_aliases),
        ]
    return tuple(options)


def backoff_options(initial: float = 1.0, maximum: float = 60.0) -> tuple[Option, ...]:
    """``backoff_initial`` and ``backoff_max``: the waits between retries (:class:`gpumon.backoff.Backoff`)."""
    return (
        Option("backoff_initial", float, initial, "Seconds before the first retry after a failed send; "
               "doubles (with jitter) up to backoff_max.", min=0.01, max=600.0),
        Option("backoff_max", float, maximum, "Longest wait between retries, in seconds.", min=0.01, max=3600.0),
    )


def spool_options(sink: str, items: str) -> tuple[Option, ...]:
    """``spool_dir`` and ``spool_max_bytes``: where the sink's on-disk spool lives and how large it may
    grow; ``items``: what a record of it is, in words (requests, rows)."""
    return (
        Option("spool_dir", str, "", f"Spool directory; empty means <state_dir>/spool/{sink}."),
        Option("spool_max_bytes", int, 256 << 20, f"Spool size cap; past it the oldest {items} are dropped "
               "and counted.", min=65536),
    )


def azure_credential_options(section: str, when: str = "") -> tuple[Option, ...]:
    """``credential``, ``client_id``, ``tenant_id``, ``client_secret`` and ``audience``: how the sink
    gets an Entra ID token (:func:`gpumon.sinks.azure_identity.make_credential`). ``when``: the
    condition under which a token is asked for at all, as a phrase (``With auth = azure: ``)."""
    variable = f"GPUMON_{section.upper()}_CLIENT_SECRET"
    return (
        Option("credential", str, "managed_identity",
               f"{when}How to get a token: `managed_identity` (VM/VMSS, system-assigned or the user-assigned "
               "`client_id`), `workload_identity` (AKS), `service_principal` (tenant_id, client_id, "
               "client_secret) or `default` (azure-identity's chain).", choices=CREDENTIALS),
        Option("client_id", str, "", "Client id of a user-assigned identity or of the service principal."),
        Option("tenant_id", str, "", "Entra tenant id (service principal; workload identity reads it "
               "from AZURE_TENANT_ID when empty)."),
        Option("client_secret", str, "", f"Service principal secret. Prefer {variable} over the file; it is "
               "never logged or printed.", secret=True),
        Option("audience", str, "https://monitor.azure.com",
               "Token audience: https://monitor.azure.us or https://monitor.azure.cn in sovereign clouds."),
    )
